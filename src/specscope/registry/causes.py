"""Ranking the settings that differ between two runs as likely causes of a change.

score = prior × relevance × magnitude

* **prior** (this table, first matching pattern wins): how often a difference in that setting moves decode speed
  at all, from experience with GPU/CPU inference (a different GPU or SM clock almost always does; a different
  kernel version rarely does).
* **relevance**: whether the setting's known reach matches the *shape* of the change. Each entry lists the phases
  it tends to hit ("all" = every phase about equally, "tau" = acceptance). When one phase moved out of proportion
  (e.g. verify +53 % while decode +8 %), settings that hit that phase score 1.0, uniform settings 0.5, others 0.25.
  When τ changed but timings did not, acceptance-affecting settings score 1.0, others 0.3. When all phases moved
  together, uniform settings score 1.0, phase-specific ones 0.7 if they touch a changed phase, else 0.3.
* **magnitude**: for numbers, small relative differences count less (a clock read 1980 vs 1965 MHz is jitter):
  min(1, 0.5 + 5 × |relative difference|); 1 for everything else.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

ALL = frozenset({"all"})
DRAFTING = frozenset({"draft", "verify", "tau"})

# (pattern over flattened keys, prior, phases affected, why)
PRIORS: list[tuple[str, float, frozenset, str]] = [
    ("config.device", 1.0, ALL, "different device"),
    ("config.model_hash", 1.0, ALL, "different target weights"),
    ("config.model", 0.9, ALL, "different target model"),
    ("config.dtype", 0.95, ALL | {"tau"}, "dtype sets every matmul's cost (and rounding can flip near-tie argmaxes)"),
    ("config.engine", 1.0, ALL | {"tau"}, "different engine"),
    ("config.engine_version", 0.8, ALL | {"tau"}, "different engine version"),
    ("config.draft_hash", 0.95, frozenset({"draft", "tau"}), "different drafter weights"),
    ("config.draft", 0.9, frozenset({"draft", "tau"}), "different drafter"),
    ("config.steps", 0.9, DRAFTING, "draft depth: more draft steps, a longer verify, a different τ"),
    ("config.topk", 0.85, DRAFTING, "tree branching: more verified tokens per cycle"),
    ("config.draft_tokens", 0.85, DRAFTING, "tokens verified per cycle"),
    ("config.threads", 0.85, ALL, "CPU threads for torch"),
    ("config.sampling.*", 0.6, frozenset({"tau", "accept"}), "sampling settings change acceptance"),
    ("config.prompt_set_hash", 0.8, frozenset({"tau"}), "different prompts: acceptance depends on content"),
    ("config.prompt_set", 0.75, frozenset({"tau"}), "different prompts: acceptance depends on content"),
    ("config.max_new_tokens", 0.4, frozenset({"verify", "decode", "tau"}), "longer outputs: attention grows"),
    ("config.*", 0.4, ALL, "configuration differs"),
    ("env.gpu.name", 1.0, ALL, "different GPU"),
    ("env.gpu.sm_clock_max_mhz", 0.9, ALL, "lower maximum SM clock slows every kernel"),
    ("env.gpu.app_sm_clock_mhz", 0.85, ALL, "application clocks cap the SM clock"),
    ("env.gpu.mem_clock_max_mhz", 0.85, ALL, "memory clock bounds bandwidth-bound decode"),
    ("env.gpu.mem_clock_mhz", 0.6, ALL, "memory clock when the run was recorded"),
    ("env.gpu.sm_clock_mhz", 0.6, ALL, "SM clock when the run was recorded"),
    ("env.gpu.throttle_reasons", 0.8, ALL, "the GPU reported clock throttling"),
    ("env.gpu.power_limit_w", 0.75, ALL, "power limit caps sustained clocks"),
    ("env.gpu.mig_mode", 0.8, ALL, "MIG partitions the GPU"),
    ("env.gpu.count", 0.6, ALL, "different number of GPUs"),
    ("env.gpu.driver_version", 0.55, ALL, "different NVIDIA driver"),
    ("env.gpu.cuda_driver_version", 0.5, ALL, "different CUDA driver"),
    ("env.gpu.pcie_*", 0.5, frozenset({"other", "commit", "accept"}),
     "host-device link: copies and launch latency between phases"),
    ("env.gpu.*", 0.3, ALL, "GPU state differs"),
    ("env.torch.nccl", 0.6, frozenset({"verify"}), "different NCCL: collective latency in each forward"),
    ("env.torch.cuda_runtime", 0.55, ALL, "different CUDA runtime"),
    ("env.torch.threads", 0.85, ALL, "torch intra-op threads"),
    ("env.torch.*", 0.4, ALL, "torch build differs"),
    ("env.vars.NCCL_*", 0.75, frozenset({"verify"}),
     "NCCL settings change all-reduce latency; multi-token verify (larger messages) reacts more than decode"),
    ("env.vars.VLLM_CPU_OMP_THREADS_BIND", 0.95, ALL,
     "vLLM's CPU build: the cores each tensor-parallel rank's threads bind to (ranks sharing a core spin in every "
     "all-reduce)"),
    ("env.vars.VLLM_CPU_*", 0.7, ALL, "vLLM CPU build settings (threads, KV cache space)"),
    ("env.vars.CUDA_LAUNCH_BLOCKING", 0.9, ALL, "synchronous kernel launches"),
    ("env.vars.CUDA_*", 0.5, ALL, "CUDA environment differs"),
    ("env.vars.OMP_*", 0.7, ALL, "OpenMP thread pool settings"),
    ("env.vars.MKL_*", 0.6, ALL, "MKL settings"),
    ("env.vars.PYTORCH_*", 0.5, ALL, "PyTorch environment differs"),
    ("env.vars.TORCH_*", 0.5, ALL, "PyTorch environment differs"),
    ("env.cpu.row_kernels", 0.9, ALL, "different CPU row kernels (instruction set, or SPECSCOPE_KERNELS)"),
    ("env.cpu.simd", 0.85, ALL, "different vector extensions (e.g. AVX-512 hidden by a hypervisor)"),
    ("env.cpu.model", 0.9, ALL, "different CPU"),
    ("env.cpu.cores_usable", 0.7, ALL, "different usable CPU cores"),
    ("env.cpu.cgroup_cpu_quota", 0.7, ALL, "different CPU quota"),
    ("env.cpu.load_1m", 0.7, ALL, "other processes competing for the CPU (load average when recorded)"),
    ("env.cpu.*", 0.5, ALL, "CPU differs"),
    ("env.packages.torch", 0.7, ALL, "different torch version"),
    ("env.packages.specscope", 0.55, ALL, "different specscope version"),
    ("env.git.commit", 0.55, ALL, "different specscope commit"),
    ("env.git.dirty", 0.45, ALL, "uncommitted changes in the checkout"),
    ("env.packages.*", 0.35, ALL, "different package version"),
    ("env.host_reference.gbps", 0.9, ALL, "the host's own speed differed (a fixed memory read on the compute cores "
                                          "around the launch: a shared machine's drift)"),
    ("env.host_reference.*", 0.05, ALL, "the host reference's single readings"),
    ("env.placement.*", 0.6, ALL, "where the engine's threads, its server and the client ran (sweep --pin)"),
    ("env.host", 0.5, ALL, "different machine"),
    ("env.memory.*", 0.3, ALL, "different memory size"),
    ("env.os.kernel", 0.35, ALL, "different kernel"),
    ("env.*", 0.3, ALL, "environment differs"),
    ("*", 0.2, ALL, "differs"),
]


def prior_for(key: str) -> tuple[float, frozenset, str]:
    for pat, prior, affects, why in PRIORS:
        if fnmatchcase(key, pat):
            return prior, affects, why
    return 0.2, ALL, "differs"   # pragma: no cover - "*" matches everything


def _magnitude(a, b) -> float:
    if isinstance(a, bool) or isinstance(b, bool):
        return 1.0
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and max(abs(a), abs(b)) > 0:
        rel = abs(a - b) / max(abs(a), abs(b))
        return min(1.0, 0.5 + 5 * rel)
    return 1.0


def relevance(affects: frozenset, shape: dict) -> float:
    """`shape`: {"out_of_proportion": phase|None, "tau_changed": bool, "changed_phases": set}."""
    oop = shape.get("out_of_proportion")
    changed = shape.get("changed_phases") or set()
    if oop:
        base = oop.split(".")[0].split(" ")[0]
        if base in affects:
            return 1.0
        return 0.5 if "all" in affects else 0.25
    if shape.get("tau_changed") and not changed:
        return 1.0 if "tau" in affects else 0.3
    if changed:
        if "all" in affects:
            return 1.0
        return 0.7 if affects & changed else 0.3
    return 0.5


SPECSCOPE_MODES = {"baseline", "speculative"}   # config.engine of specscope's own runs


def _engine_why(a, b) -> str:
    """config.engine holds specscope's mode (baseline / speculative) or a production engine (sglang, vllm)."""
    pair = {a, b}
    if pair == SPECSCOPE_MODES:
        return "speculative decoding on vs off (specscope baseline / speculative)"
    if pair <= SPECSCOPE_MODES | {None}:
        return "one run's engine mode is unknown"
    if pair & SPECSCOPE_MODES:
        return f"different inference engines ({a} vs {b}): a specscope run against a production engine's"
    return f"different inference engines ({a} vs {b}): scheduler, kernels and metric definitions all differ"


def rank(diffs: dict[str, tuple], shape: dict) -> list[dict]:
    """diffs: {flat key: (value in A, value in B)} -> ranked [{key, a, b, score, prior, why}]."""
    out = []
    for key, (a, b) in diffs.items():
        prior, affects, why = prior_for(key)
        if key == "config.engine":
            why = _engine_why(a, b)
        score = prior * relevance(affects, shape) * _magnitude(a, b)
        out.append({"key": key, "a": a, "b": b, "score": round(score, 3), "prior": prior, "why": why})
    out.sort(key=lambda d: (-d["score"], d["key"]))
    return out
