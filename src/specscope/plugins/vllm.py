"""specscope's vLLM general plugin: per-step phase timing inside vLLM, always on, no vLLM file changed.

Enable it in the server's environment:

    SPECSCOPE_PHASES=/tmp/vllm-phases.jsonl python -m vllm.entrypoints.openai.api_server ...

vLLM loads every `vllm.general_plugins` entry point in each of its processes (`VLLM_PLUGINS` selects them); without
SPECSCOPE_PHASES this one does nothing (SPECSCOPE_CAPTURE turns on its capture mode: plugins/capture.py; on a CPU build it always gives vLLM's synthetic
rejection sampling the loop that build lacks: plugins/synthetic.py).
Enabled, in the worker it
- installs a timer behind vLLM's own phase scopes (`record_function_or_nullcontext` in `vllm/v1/utils.py`, the
  hook VLLM_CUSTOM_SCOPES_FOR_PROFILING uses; torch-profiler / NVTX annotations still happen when those are on):
  `forward` and `postprocess` (the logits) -> verify (decode when the step verifies no drafts), `draft` -> draft,
  `sample` -> accept, `preprocess` / `bookkeep` / ... -> commit, each kept as a sub-phase (verify.forward,
  commit.preprocess, ...), the rest -> other — the table `specscope ingest` uses for vLLM's own traces;
- wraps the model runner's `execute_model` / `sample_tokens` to know each step's kind and, from the scheduled draft
  tokens and the sampled tokens, the per-request acceptance (vLLM's own counting: accepted = sampled - 1);
- writes `plugins/steps.py`'s JSONL (`specscope ingest FILE`) and prints the `Target verify: X ms/cyc ( Y%)`
  report every SPECSCOPE_PHASES_EVERY seconds (default 10) and at exit;
- opens a short torch-profiler window every SPECSCOPE_WINDOW_EVERY seconds (`plugins/windows.py`: 4 steps every
  30 s by default) and splits those steps' phases into components by `engines/vllm.py`'s op table for this version
  (attention, MoE experts, GEMMs, LM head, collectives, sampling, elementwise, host gap), and for a MoE target counts
  the distinct experts each step routed to (the router's capture hook).
Settings: SPECSCOPE_PHASES_TIMER = auto | cuda_events | sync | perf_counter (auto: CUDA events read after the step
on GPUs, never a host sync; perf_counter on CPU). Tested on the vLLM versions in TESTED; on others it stays off and
says so in one line (SPECSCOPE_PHASES_ANY_VERSION=1 tries anyway).
"""

from __future__ import annotations

import logging
import os
from time import perf_counter_ns

from specscope.engines.vllm import FORWARD, SCOPE_PHASE, SCOPE_PREFIX, SINGLE, TESTED  # stdlib only
from specscope.jsonio import dtype_name

ENV_PATH, ENV_EVERY, ENV_TIMER, ENV_ANY = ("SPECSCOPE_PHASES", "SPECSCOPE_PHASES_EVERY", "SPECSCOPE_PHASES_TIMER",
                                           "SPECSCOPE_PHASES_ANY_VERSION")

log = logging.getLogger("specscope.plugins.vllm")
_state: dict = {"installed": False, "recorder": None}


def register() -> None:
    """vLLM's entry point (`vllm.general_plugins`); called once per vLLM process. Its capture mode (hidden states
    for drafter training, SPECSCOPE_CAPTURE) is plugins/capture.py, behind the same entry point."""
    from specscope.plugins import capture, synthetic

    synthetic.register(TESTED)
    capture.register(supported_version)
    path = os.environ.get(ENV_PATH)
    if not path or _state["installed"]:
        return
    version = supported_version("phases")
    if version is not None:
        _install(path, version)


def supported_version(mode: str) -> str | None:
    """This vLLM's version when the plugin is tested on it (or SPECSCOPE_PHASES_ANY_VERSION=1); else None, said in
    one line: hooks into another version's internals could fail mid-serve."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    if version in TESTED or os.environ.get(ENV_ANY) == "1":
        return version
    log.warning("specscope %s plugin: tested on vLLM %s, this is %s; not enabled (set %s=1 to try)",
                mode, ", ".join(TESTED), version, ENV_ANY)
    return None


def _install(path: str, version: str) -> None:
    import vllm.v1.utils as vutils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    inner = vutils._PROFILER_FUNC or _inner_scope()   # keep torch-profiler / NVTX annotations when they are on
    vutils._PROFILER_FUNC = _phase_scope(inner)

    from vllm.v1.worker.gpu_worker import Worker

    execute_model, sample_tokens = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    Worker.shutdown = _reported_at_shutdown(Worker.shutdown)
    Worker.profile = _windows_paused_while_profiling(Worker.profile)
    try:        # vLLM 0.29 / 0.30: the CPU worker runs its own torch profiler (CPUWorker.profile)
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:
        CPUWorker = None
    if CPUWorker is not None and "profile" in vars(CPUWorker):
        CPUWorker.profile = _windows_paused_while_profiling(CPUWorker.profile)
    GPUModelRunner.execute_model = _execute_model_timed(execute_model, path, version)
    GPUModelRunner.sample_tokens = _sample_tokens_timed(sample_tokens)
    _state["installed"] = True


def _phase_scope(inner):
    """vLLM's scope hook: each `gpu_model_runner: ...` scope this table knows times its phase (and sub-phase) in the
    recorder as well as entering `inner`, vLLM's own annotation."""
    def scope(name: str):
        rec = _state["recorder"]
        if rec is None or rec.kind is None or not name.startswith(SCOPE_PREFIX):
            return inner(name)
        part = name[len(SCOPE_PREFIX):]
        top = SCOPE_PHASE.get(part)
        if top is None:
            return inner(name)          # a scope this table does not know: its time stays in "other"
        top = rec.kind if top == FORWARD else top
        return _Both(inner(name), rec.engine_scope(top, part, sub=top not in SINGLE))

    return scope


# the wrappers time their own work too (perf_counter_ns around it): the plugin's overhead, reported per step
def _execute_model_timed(execute_model, path: str, version: str):
    """The model runner's execute_model, beginning each step in the recorder (made at the first step) with its kind;
    a step that ends here (no sample_tokens) is ended here too."""
    def execute_model_timed(self, scheduler_output, *args, **kwargs):
        t0 = perf_counter_ns()
        rec = _state["recorder"] or _start(self, path, version)
        kind, drafts = step_kind(scheduler_output)
        rec.begin_step(kind, sum(1 + d for d in drafts.values()))
        _state["drafts"] = drafts
        rec.overhead_ns += perf_counter_ns() - t0
        out = execute_model(self, scheduler_output, *args, **kwargs)
        if out is not None:      # the step ended here (pooling, pipeline stage, empty step): no sample_tokens
            t1 = perf_counter_ns()
            rec.end_step(*per_request(out, drafts))
            rec.overhead_ns += perf_counter_ns() - t1
        return out

    execute_model_timed.__wrapped__ = execute_model
    return execute_model_timed


def _sample_tokens_timed(sample_tokens):
    """The model runner's sample_tokens, ending the step in the recorder with its per-request acceptance."""
    def sample_tokens_timed(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        rec = _state["recorder"]
        if rec is not None:
            t1 = perf_counter_ns()
            rec.end_step(*per_request(out, _state.get("drafts") or {}))
            rec.overhead_ns += perf_counter_ns() - t1
        return out

    sample_tokens_timed.__wrapped__ = sample_tokens
    return sample_tokens_timed


def _reported_at_shutdown(shutdown):
    """The worker's shutdown, closing (and so reporting) the recorder first."""
    def shutdown_reported(self, *args, **kwargs):
        # worker processes end with os._exit (multiprocessing): atexit never runs there, so report here
        if _state["recorder"] is not None:
            _state["recorder"].close()
        return shutdown(self, *args, **kwargs)

    shutdown_reported.__wrapped__ = shutdown
    return shutdown_reported


def _windows_paused_while_profiling(profile):
    """The worker's profile (vLLM's /start_profile, /stop_profile): specscope's profiler windows close before it
    starts and stay shut until it stops (torch runs one profiler at a time)."""
    def profile_paused(self, is_start: bool = True, *args, **kwargs):
        rec = _state["recorder"]
        if rec is not None and is_start:
            rec.pause_windows(True)
        try:
            return profile(self, is_start, *args, **kwargs)
        finally:
            if rec is not None and not is_start:
                rec.pause_windows(False)

    profile_paused.__wrapped__ = profile
    return profile_paused


def _inner_scope():
    import contextlib

    import vllm.envs as envs

    if envs.VLLM_CUSTOM_SCOPES_FOR_PROFILING:
        from torch.profiler import record_function

        return record_function
    if envs.VLLM_NVTX_SCOPES_FOR_PROFILING:
        import nvtx

        return nvtx.annotate
    return lambda name: contextlib.nullcontext()


class _Both:
    """Enter vLLM's own annotation, then specscope's (the recorder's engine scope)."""

    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()
        return self

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        return self.a.__exit__(*exc)


def _start(runner, path: str, version: str):
    """The recorder, made at the worker's first step (only the worker process gets here)."""
    from specscope.plugins.steps import StepRecorder

    rank = _rank()
    if rank:
        root, ext = os.path.splitext(path)
        path = f"{root}.rank{rank}{ext}"
    device = str(getattr(runner, "device", "cpu"))
    rec = StepRecorder(path, "vllm", version, run_config(runner), device=device,
                       timer=os.environ.get(ENV_TIMER, "auto"), every_s=float(os.environ.get(ENV_EVERY, "10")),
                       windows=_windows(runner, version, device))
    _state["recorder"] = rec
    return rec


def _rank() -> int:
    """This worker's rank in vLLM's world (tensor x pipeline parallel), so each rank writes its own steps file: vLLM
    0.32's workers set no RANK / LOCAL_RANK, and two ranks appending to one file read as one engine to ingest."""
    try:
        from vllm.distributed import get_world_group

        return int(get_world_group().rank)
    except Exception:  # noqa: BLE001 - no world group (a runner outside vLLM's workers): the launcher's variables
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _windows(runner, version: str, device: str):
    """The profiler windows of this worker: the op table of this vLLM version, the experts counter of a MoE."""
    from specscope.engines.vllm import op_table
    from specscope.plugins.windows import ExpertCounter, Windows, moe_routers
    from specscope.profile.components import Classifier

    rules, note = op_table(version)
    try:
        windows = Windows(Classifier(rules, note), cuda=device.startswith("cuda"))
    except ValueError as e:          # a bad SPECSCOPE_WINDOW_* value: one line, the engine serves on
        log.warning("specscope phases: %s", e)
        return None
    if not windows.enabled:
        return None
    try:
        moe = moe_routers(runner.get_model())
    except Exception as e:  # noqa: BLE001 - a model whose MoE layers we cannot read is profiled without experts
        log.warning("specscope phases: MoE experts not counted (%s: %s)", type(e).__name__, e)
        moe = None
    if moe is not None:
        windows.experts = ExpertCounter(*moe)
    return windows


def run_config(runner) -> dict:
    """What the record's config holds: the model, dtype, parallelism and the speculative settings."""
    cfg = {"engine": "vllm"}
    mc = getattr(runner, "model_config", None)
    if mc is not None:
        cfg["model"] = getattr(mc, "model", None)
        cfg["dtype"] = dtype_name(getattr(mc, "dtype", "")) or None
    pc = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    if pc is not None:
        cfg["tensor_parallel_size"] = getattr(pc, "tensor_parallel_size", None)
    sc = getattr(runner, "speculative_config", None)
    if sc is not None:
        cfg["method"] = getattr(sc, "method", None)
        cfg["num_speculative_tokens"] = getattr(sc, "num_speculative_tokens", None)
        cfg["steps"] = cfg["num_speculative_tokens"]
        draft = getattr(getattr(sc, "draft_model_config", None), "model", None)
        if draft:
            cfg["draft"] = draft
    sched = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
    if sched is not None:
        cfg["max_num_seqs"] = getattr(sched, "max_num_seqs", None)
        cfg["async_scheduling"] = getattr(sched, "async_scheduling", None)
    return {k: v for k, v in cfg.items() if v is not None}


def step_kind(so) -> tuple[str, dict[str, int]]:
    """("verify" | "decode" | "prefill" | "mixed" | "idle", {request: draft tokens}) of one SchedulerOutput: a
    decode step schedules 1 token per request, a verify step 1 + its draft tokens; anything more is a prefill."""
    spec = so.scheduled_spec_decode_tokens or {}
    counts = so.num_scheduled_tokens or {}
    drafts, prefill = {}, 0
    for req_id, n in counts.items():
        slots = spec.get(req_id, ())
        if n == 1 + len(slots):
            drafts[req_id] = sum(1 for t in slots if t >= 0)     # -1: a draft slot vLLM could not fill
        else:
            prefill += 1
    if prefill:
        return ("mixed" if drafts else "prefill"), {}
    if not drafts:
        return "idle", {}
    return ("verify" if any(drafts.values()) else "decode"), drafts


def per_request(out, drafts: dict[str, int]) -> tuple[list[int], list[int] | None]:
    """(draft tokens, accepted draft tokens) per request of the step's output, in its order; accepted by vLLM's
    count (tokens sampled - 1), None when the sampled tokens are not on the host yet (async scheduling)."""
    ids = getattr(out, "sampled_token_ids", None)
    req_ids = getattr(out, "req_ids", None)
    if req_ids is None:
        return list(drafts.values()), None
    drafted = [drafts.get(r, 0) for r in req_ids]
    if not isinstance(ids, list) or len(ids) != len(req_ids):
        return drafted, None
    return drafted, [min(max(len(t) - 1, 0), d) for t, d in zip(ids, drafted)]
