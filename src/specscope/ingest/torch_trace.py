"""vLLM's own torch-profiler trace (`*.pt.trace.json[.gz]`, a Chrome trace) -> one cycle per decode step, split into
specscope's phases.

What vLLM v1 writes (checked against 0.32: v1/worker/gpu_worker.py annotate_profile, gpu_model_runner.py, utils.py
record_function_or_nullcontext) when its torch profiler records CPU activity:

* one `user_annotation` per engine step, around the worker's `execute_model` only:
  `execute_context_C(T)_generation_G(U)` — C requests in prefill ("context": no output token yet; chunked-prefill
  chunks included) with T scheduled tokens in all, and G decode requests with U scheduled tokens in all (a decode
  request schedules 1 token + the draft tokens it verifies). With `detailed_trace_annotation` the form is
  `execute_N_context_C(sqT sk.. sqsq.. sqsk..)_generation_G(sqU sk.. ...)` (no spaces).
* with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 only, `gpu_model_runner: <scope>` record_function scopes on the same
  thread: preprocess, forward, postprocess inside execute_model; then, in `sample_tokens`, which the engine calls
  after execute_model has returned (so outside the step annotation): sample, draft, bookkeep, eplb,
  ModelRunnerOutput (+ AsyncGPUModelRunnerOutput, set_async_sampled_token_ids with async scheduling).

A cycle runs from its step annotation's start to the end of the last scope before the next step: the worker's time
for the step. The time between steps (the engine core's scheduling, IPC and output processing, not on this thread) is
left out of the cycle and reported as `between_steps_ms`.

Phases: forward and postprocess (`compute_logits`, the target's LM head, which specscope's own verify includes) ->
`verify` when the step verifies drafts (U > G), else `decode`; draft -> `draft`; sample (the rejection sampler) ->
`accept`; preprocess, bookkeep, eplb, ModelRunnerOutput, ... -> `commit`; what no scope covers -> `other`. vLLM's
scope names are kept as sub-phases where a phase has several (`verify.forward`, `commit.preprocess`, ...).
Prefill, mixed prefill + decode, empty and cut-off steps are counted and left out.

Times: the scopes are CPU-side, the host wall clock of the worker thread. On a GPU the host launches work
asynchronously, so a scope's CPU time is launch time plus whatever synchronisation happens in it; a trace that also
holds GPU kernels (cat "kernel", linked to their launch by `args.correlation`) is timed by the kernels instead: a
phase is the device time of the kernels its scope launched, the cycle is the step's host window or its kernels' time
if longer, and `other` is the rest (the CPU-side split is kept as `cpu_phases`).

A torch trace has no acceptance counts: τ (and so tok/s) is left out of a speculative trace.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import math
import re
import sys
import zlib
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.ingest.base import MAX_EXAMPLES, FormatParser
from specscope.ingest.lines import histogram, stats
from specscope.profile.cycle import PHASE_LABELS, TOP_PHASES, quantile

FORMAT = "torch-trace"
FIX = "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1"
SCOPE = "gpu_model_runner: "
_COUNTS = r"\((?:sq)?(\d+)(?:sk\d+sqsq\d+sqsk\d+)?\)"
STEP = re.compile(r"execute_(?:\d+_)?context_(\d+)" + _COUNTS + r"_generation_(\d+)" + _COUNTS)
FORWARD = "<forward>"     # verify or decode, decided per step
# in the order vLLM runs them (sub-phases are listed in this order)
SCOPE_PHASE = {"preprocess": "commit", "forward": FORWARD, "postprocess": FORWARD, "sample": "accept", "draft": "draft",
               "bookkeep": "commit", "eplb": "commit", "ModelRunnerOutput": "commit",
               "AsyncGPUModelRunnerOutput": "commit", "set_async_sampled_token_ids": "commit"}
_RUN_ORDER = list(SCOPE_PHASE)
# phases made of one scope get no sub-phase (it would repeat the phase)
SINGLE = {"draft", "accept"}
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
READ_CHUNK = 1 << 20
SNIFF_BYTES = 1 << 16

TIMES = {"torch_profiler_cpu_scopes": "CPU-side: the worker thread's wall clock inside vLLM's gpu_model_runner scopes "
                                     "(the torch profiler's user_annotation events)",
         "gpu_kernels_by_launching_scope": "device time of the GPU kernels each scope launched (linked by correlation "
                                           "id); cycle and other from the worker's host window; CPU-side times in "
                                           "cpu_phases"}
STEPS, SCOPES, KERNELS = "steps", "scopes", "kernels"
PREFILL = "prefill step (requests without an output token yet): not a decode cycle"
MIXED = "mixed prefill + decode step: its time is not one decode cycle"
EMPTY = "empty step (no token scheduled)"
CUT = "cut off: no forward or sample scope in the step (the trace starts or ends inside it?)"


# ---- detection and reading ----------------------------------------------------------------------------------------
def _looks_like(head: bytes) -> bool:
    """A Chrome trace document (a JSON object with traceEvents / Kineto's schemaVersion) rather than log lines."""
    if head[:2] == b"\x1f\x8b":
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, SNIFF_BYTES)
        except zlib.error:
            return False
    text = head.lstrip()
    return text[:1] == b"{" and (b'"traceEvents"' in text or b'"schemaVersion"' in text[:200])


def is_trace(path) -> bool:
    """`*.pt.trace.json[.gz]` by name, or a file (or standard input) whose first bytes are a Chrome trace's."""
    path = Path(path)
    if str(path) == "-":
        peek = getattr(sys.stdin.buffer, "peek", None)
        return bool(peek) and _looks_like(peek(SNIFF_BYTES)[:SNIFF_BYTES])
    if path.name.lower().endswith((".pt.trace.json", ".pt.trace.json.gz")):
        return True
    try:
        with open(path, "rb") as f:
            return _looks_like(f.read(SNIFF_BYTES))
    except OSError:
        return False      # require_file reports it


def read_document(path, progress=None) -> tuple[dict, str, int]:
    """(the parsed JSON object, sha256 of the uncompressed bytes, their length); one clear error if unreadable."""
    path = Path(path)
    stdin = str(path) == "-"
    try:
        if stdin:
            raw = sys.stdin.buffer.read()
            data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        else:
            with open(path, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            with open(path, "rb") as raw_f:
                f = gzip.GzipFile(fileobj=raw_f) if gz else raw_f
                data = bytearray()
                while True:
                    chunk = f.read(READ_CHUNK)
                    if not chunk:
                        break
                    data += chunk
                    if progress is not None:
                        progress(raw_f.tell())
    except (OSError, EOFError, zlib.error) as e:
        raise SpecscopeError(f"{path}: cannot read the trace (truncated or corrupt gzip? {type(e).__name__}: {e})") \
            from None
    digest = hashlib.sha256(data).hexdigest()
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise SpecscopeError(f"{path}: not a complete JSON document ({e}); a torch trace is written in one piece when "
                             f"the profiler stops: a cut-off or still-being-written file?") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise SpecscopeError(f"{path}: JSON without a traceEvents list: not a Chrome / torch-profiler trace")
    return doc, digest, len(data)


# ---- summary statistics (as CycleProfiler.summary() computes them) ------------------------------------------------
def _order(names) -> list[str]:
    def key(name):
        top, _, sub = name.partition(".")
        return (TOP_PHASES.index(top) if top in TOP_PHASES else len(TOP_PHASES), top, bool(sub),
                _RUN_ORDER.index(sub) if sub in _RUN_ORDER else len(_RUN_ORDER), name)
    return sorted(names, key=key)


def summarise(cycle_ms: dict[str, list[float]], total_ms: list[float]) -> dict:
    """{"cycles", "cycle_ms": {mean_ms, median_ms, p90_ms}, "phases": {name: {mean_ms, median_ms, p90_ms, share}}}
    from per-cycle columns, the shapes and rounding of `CycleProfiler.summary()` (share of the summed cycle time)."""
    n, total = len(total_ms), sum(total_ms)
    phases = {}
    for name in _order(cycle_ms):
        col = cycle_ms[name]
        if name == "other" and not any(col):
            continue
        s = sorted(col)
        phases[name] = {"mean_ms": round(sum(col) / n, 4), "median_ms": round(quantile(s, 0.5), 4),
                        "p90_ms": round(quantile(s, 0.9), 4),
                        "share": round(sum(col) / total, 4) if total > 0 else 0.0}
    st = sorted(total_ms)
    cyc = {"mean_ms": round(total / n, 4) if n else 0.0, "median_ms": round(quantile(st, 0.5), 4),
           "p90_ms": round(quantile(st, 0.9), 4)}
    return {"cycles": n, "cycle_ms": cyc, "phases": phases}


def phase_lines(results: dict) -> list[str]:
    """The profile report's lines (`CycleProfiler.lines()`): 'Target verify: 95.10 ms/cyc ( 63.2%)', ..."""
    out = []
    for name, ph in (results.get("phases") or {}).items():
        label = PHASE_LABELS.get(name, ("  " + name) if "." in name else name)
        out.append(f"{label}: {ph['mean_ms']:.2f} ms/cyc ({ph['share'] * 100:5.1f}%)")
    c = results.get("cycle_ms") or {}
    if results.get("cycles"):
        tokens = f", tokens: {results['tokens']}" if results.get("tokens") is not None else ""
        out.append(f"Cycles: {results['cycles']}{tokens}, {c['mean_ms']:.2f} ms/cyc "
                   f"(median {c['median_ms']:.2f}, p90 {c['p90_ms']:.2f})")
    if results.get("accept_length") is not None and results.get("tok_per_s"):
        out.append(f"Decode: {results['tok_per_s']:.2f} tok/s ({results['decode_ms_per_token']:.2f} ms/token)")
    b = results.get("between_steps_ms")
    if b:
        out.append(f"Between steps (engine core, not in the cycles): {b['mean']:.2f} ms (median {b['median']:.2f})")
    return out


# ---- the trace ----------------------------------------------------------------------------------------------------
def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _args(ev: dict) -> dict:
    a = ev.get("args")
    return a if isinstance(a, dict) else {}


def _id(v):
    """pid / tid / correlation as a dict key (a malformed trace may hold lists there)."""
    return v if isinstance(v, (int, str)) or v is None else json.dumps(v, default=str)


def _hist(values: list[float]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in sorted(values):
        k = f"{v:g}"
        out[k] = out.get(k, 0) + 1
    return out


def _inside(stamps: list[float], windows: list[tuple]) -> int:
    """How many stamps fall inside a cycle window (any thread: the windows are the worker's steps in time)."""
    wins = sorted((a, b) for _, a, b, _ in windows)
    starts = [w[0] for w in wins]
    n = 0
    for ts in stamps:
        j = bisect.bisect_right(starts, ts) - 1
        if j >= 0 and ts <= wins[j][1]:
            n += 1
    return n


class TorchTraceParser(FormatParser):
    """Not a line parser: `parse(doc)` takes the whole document; the kinds accounting is the line parsers'."""

    name = FORMAT
    description = "vLLM torch-profiler trace (*.pt.trace.json[.gz], recorded with " + FIX + ")"

    def __init__(self):
        super().__init__()
        self.out: dict | None = None
        self.malformed_n = 0
        self.examples: list[dict] = []
        self.recognised = 0
        self.other = 0

    def _bad(self, kind: str, i: int, why: str, ev) -> None:
        self.malformed(kind)
        self.malformed_n += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"line": i, "format": FORMAT, "reason": why,
                                  "text": json.dumps(ev, default=str)[:160]})

    def parse(self, doc: dict, path) -> None:
        events = doc["traceEvents"]
        steps: dict[tuple, list] = {}    # (pid, tid) -> [(ts, end, C, T, G, U, name)]
        scopes: dict[tuple, list] = {}   # (pid, tid) -> [(ts, end, scope name)]
        launches: dict = {}              # correlation -> (ts, pid, tid)
        kernels: list = []               # (correlation, dur ms)
        overhead: list = []              # (ts, dur) of the profiler's own "overhead" events (CUPTI buffers)
        n_other_ua = 0
        cpu_ops: list[float] = []        # start stamps of recorded ops: how much the profiler recorded per cycle
        for i, ev in enumerate(events):
            if not isinstance(ev, dict):
                self.other += 1
                continue
            cat, name = ev.get("cat"), ev.get("name")
            if cat == "user_annotation" and isinstance(name, str):
                is_step = name.startswith("execute_") and "_context_" in name
                is_scope = name.startswith(SCOPE)
                if not (is_step or is_scope):
                    n_other_ua += 1
                    self.other += 1
                    continue
                kind = STEPS if is_step else SCOPES
                ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
                if ts is None or dur is None or dur < 0:
                    self._bad(kind, i, "no numeric ts / dur", ev)
                    continue
                key = (_id(ev.get("pid")), _id(ev.get("tid")))
                if is_step:
                    m = STEP.fullmatch(name)
                    if not m:
                        self._bad(kind, i, "step annotation does not parse", ev)
                        continue
                    c, t, g, u = (int(x) for x in m.groups())
                    steps.setdefault(key, []).append((ts, ts + dur, c, t, g, u, name))
                else:
                    scopes.setdefault(key, []).append((ts, ts + dur, name[len(SCOPE):]))
                self.saw(kind)
                self.recognised += 1
                self.data_lines += 1
            elif cat in LAUNCH_CATS:
                corr, ts = _id(_args(ev).get("correlation")), _num(ev.get("ts"))
                if corr is not None and ts is not None:
                    launches[corr] = (ts, _id(ev.get("pid")), _id(ev.get("tid")))
                self.other += 1
            elif cat in GPU_CATS:
                corr, dur = _id(_args(ev).get("correlation")), _num(ev.get("dur"))
                self.saw(KERNELS)
                if dur is None or dur < 0:
                    self.skip(KERNELS, "no numeric dur")
                else:
                    kernels.append((corr, dur / 1e3))
                self.recognised += 1
            elif isinstance(cat, str) and cat.lower() == "overhead":
                ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
                if ts is not None and dur is not None:
                    overhead.append((ts, dur))
                self.other += 1
            else:
                if cat == "cpu_op" and _num(ev.get("ts")) is not None:
                    cpu_ops.append(ev["ts"])
                self.other += 1
        self._check(doc, steps, scopes, n_other_ua, len(cpu_ops), path)
        self.out = self._cycles(doc, steps, scopes, launches, kernels, overhead, cpu_ops, path)

    # -- what kind of trace is it ------------------------------------------------------------------------------------
    def _check(self, doc, steps, scopes, n_other_ua, n_ops, path) -> None:
        vllm = doc.get("vllm_version") is not None
        if steps and not scopes:
            raise SpecscopeError(
                f"{path}: a vLLM trace with {sum(map(len, steps.values()))} step annotations but none of vLLM's "
                f"'{SCOPE}...' scopes, so a step cannot be split into phases: record it with {FIX} in the vLLM "
                f"server's environment (vLLM adds the scopes only then)")
        if not steps and scopes:
            raise SpecscopeError(
                f"{path}: '{SCOPE}...' scopes but no execute_context_..._generation_... step annotations to group "
                f"them by step (a trace cut from a larger one?)")
        if not steps:
            if vllm and not n_ops and not n_other_ua:
                # vLLM's API server profiles its own process too (<host>_<pid>.async_llm.*): no model runs there
                raise SpecscopeError(
                    f"{path}: vLLM's API-server trace, with no operators in it (the model runs in the engine "
                    f"process): ingest the engine's trace written beside it (rank0.*.pt.trace.json.gz)")
            if vllm:
                raise SpecscopeError(
                    f"{path}: a vLLM {doc.get('vllm_version')} trace without step annotations or scopes: record it "
                    f"with {FIX} set and the torch profiler recording CPU activity (torch_profiler_activities "
                    f"including CPU)")
            raise SpecscopeError(
                f"{path}: a Chrome trace but not vLLM's: no vllm_version, no execute_context_..._generation_... step "
                f"annotations, no '{SCOPE}' scopes ({len(doc['traceEvents'])} events, {n_other_ua} other "
                f"user annotations). `specscope ingest` reads traces of vLLM run with {FIX}")

    # -- cycles ------------------------------------------------------------------------------------------------------
    def _cycles(self, doc, steps, scopes, launches, kernels, overhead, cpu_ops, path) -> dict:
        cpu: dict[str, list[float]] = {}
        gpu: dict[str, list[float]] = {}
        windows: list[tuple] = []          # (key, start, end, forward phase) per cycle
        totals: list[float] = []
        gaps: list[float] = []
        batch: list[int] = []
        drafts: list[float] = []            # draft tokens per decode request, per verify step
        unknown: dict[str, int] = {}
        outer_by_key: dict[tuple, list] = {}
        n = 0

        def put(col: dict, name: str, v: float, i: int) -> None:
            c = col.setdefault(name, [0.0] * n)
            c += [0.0] * (i + 1 - len(c))
            c[i] += v

        for key in sorted(steps, key=str):
            st = sorted(steps[key])
            sc = sorted(scopes.get(key, []))
            # only outermost gpu_model_runner scopes: a nested one is already counted in its parent
            outer, reach = [], -math.inf
            for s in sc:
                if s[1] <= reach:
                    self.skip(SCOPES, "nested in another gpu_model_runner scope (counted in it)")
                    continue
                outer.append(s)
                reach = max(reach, s[1])
            outer_by_key[key] = outer
            starts = [s[0] for s in st]
            by_step: list[list] = [[] for _ in st]
            for s in outer:
                j = bisect.bisect_right(starts, s[0]) - 1
                if j < 0:
                    self.skip(SCOPES, "before the first step annotation")
                else:
                    by_step[j].append(s)
            for j, (ts, end, c, t, g, u, name) in enumerate(st):
                mine = by_step[j]
                reason = None
                if c and g:
                    reason = MIXED
                elif c:
                    reason = PREFILL
                elif not g:
                    reason = EMPTY
                elif not {"forward", "sample"} <= {s[2] for s in mine}:
                    reason = CUT
                if reason:
                    self.skip(STEPS, reason)
                    self.skip(SCOPES, "in a step left out (see steps)", len(mine))
                    continue
                i = len(totals)
                n = i
                fwd = "verify" if u > g else "decode"
                w_end = max([end] + [s[1] for s in mine])
                total = (w_end - ts) / 1e3
                inside = 0.0
                for s0, s1, sname in mine:
                    ms = (s1 - s0) / 1e3
                    top = SCOPE_PHASE.get(sname)
                    if top is None:
                        unknown[sname] = unknown.get(sname, 0) + 1
                        put(cpu, f"other.{sname}", ms, i)
                        continue
                    top = fwd if top == FORWARD else top
                    put(cpu, top, ms, i)
                    if top not in SINGLE:
                        put(cpu, f"{top}.{sname}", ms, i)
                    inside += ms
                put(cpu, "other", max(total - inside, 0.0), i)
                totals.append(total)
                windows.append((key, ts, w_end, fwd))
                batch.append(g)
                if u > g:
                    drafts.append(u / g - 1)
                if j + 1 < len(st) and st[j + 1][4]:     # the next step still decodes: the engine was not idle
                    gaps.append((st[j + 1][0] - w_end) / 1e3)
        n = len(totals)
        if not n:
            kinds = self.line_report().get(STEPS, {})
            why = "; ".join(f"{v} {k}" for k, v in kinds.get("skipped", {}).items())
            raise SpecscopeError(f"{path}: no decode step to time among {kinds.get('read', 0)} step(s) ({why}): "
                                 f"profile while requests are decoding")
        for col in cpu.values():
            col += [0.0] * (n - len(col))
        warnings: list[str] = []
        gpu_info = self._gpu(windows, outer_by_key, launches, kernels, gpu, warnings) if kernels else None
        if gpu_info is not None:
            for col in gpu.values():
                col += [0.0] * (n - len(col))
            cycle_ms, totals_used = self._gpu_cycles(gpu, totals)
            timer = "gpu_kernels_by_launching_scope"
        else:
            cycle_ms, totals_used = cpu, totals
            timer = "torch_profiler_cpu_scopes"
        summ = summarise(cycle_ms, totals_used)
        # ---- results
        spec = bool(drafts)
        res: dict = {"cycles": n, "cycle_ms": summ["cycle_ms"], "phases": summ["phases"]}
        if gpu_info is not None:
            res["cpu_phases"] = summarise(cpu, totals)["phases"]
            res["gpu"] = gpu_info
        single_batch = all(b == 1 for b in batch)
        if not spec:
            # plain decoding: every decode request gets exactly one token per step (per request, as τ is)
            tot = sum(totals_used)
            res.update({"accept_length": 1.0, "tokens": n, "tok_per_s": round(n / (tot / 1e3), 4),
                        "decode_tok_per_s": round(n / (tot / 1e3), 4), "decode_ms_per_token": round(tot / n, 4),
                        "accept_length_hist": {"1": n}})
        res["batch_size"] = stats(batch)
        res["batch_size_hist"] = histogram(batch)
        if spec:
            res["draft_tokens_per_request_hist"] = _hist(drafts)
            verify_n = len(drafts)
            if verify_n < n:
                warnings.append(f"{n - verify_n} of {n} decode steps verified no draft token (decode, not verify, "
                                "in those cycles): drafts left out near the context limit?")
        if gaps:
            res["between_steps_ms"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats(gaps).items()}
        span = (max(w[2] for w in windows) - min(w[1] for w in windows)) / 1e6
        res["duration_s"] = round(span, 6)
        ver = doc.get("vllm_version")
        dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
        res["trace"] = {"steps": sum(len(v) for v in steps.values()), "threads": len(steps),
                        "rank": dist.get("rank"), "world_size": dist.get("world_size")}
        ops_per_cycle = round(_inside(cpu_ops, windows) / n, 1) if cpu_ops else None
        res["profiler"] = {"timer": timer, "times": TIMES[timer], "overhead": self._overhead(overhead, windows),
                           "cpu_ops_per_cycle": ops_per_cycle}
        # ---- warnings
        steps_k = None
        if spec:
            whole = [round(d) for d in drafts if abs(d - round(d)) < 1e-9]
            if whole:
                steps_k = max(set(whole), key=whole.count)
            if len(set(drafts)) > 1:
                warnings.append("draft tokens per request vary between steps (" + ", ".join(
                    f"{k}: {v}" for k, v in res["draft_tokens_per_request_hist"].items()) + f"); steps = {steps_k}, "
                    "the most common")
            warnings.append("a torch trace holds no acceptance counts: τ, tok/s and ms/token are left out. For τ "
                            "ingest the server's /metrics scrape or the specscope vLLM plugin's JSONL from the same "
                            "run")
        if not single_batch:
            warnings.append(f"{sum(1 for b in batch if b > 1)} of {n} cycles decode several requests at once "
                            f"(batch up to {max(batch)}): a cycle's time is per step, shared by its requests")
        if unknown:
            warnings.append("scopes this reader does not know, counted under other: "
                            + ", ".join(f"{k} ({v})" for k, v in sorted(unknown.items())))
        if len(steps) > 1:
            warnings.append(f"step annotations on {len(steps)} threads; their cycles are pooled")
        if gaps:
            warnings.append(f"a cycle is the worker's time for a step (its execute_model and sample_tokens scopes); "
                            f"the {res['between_steps_ms']['median']:.2f} ms median between steps (engine core: "
                            f"scheduling, IPC, output processing) is not in it: results.between_steps_ms")
        if gpu_info is None and (doc.get("deviceProperties") or []):
            warnings.append("the trace names GPUs but holds no kernel events: the phases are CPU-side scope times "
                            "(host launch and wait time), not device time; record with CUDA activity for kernels")
        elif gpu_info is None:
            warnings.append("times are the CPU-side scopes' wall clock on the worker thread (a CPU run: that is the "
                            "compute)")
        oh = res["profiler"]["overhead"]
        if oh:
            warnings.append(f"the profiler's own overhead events (CUPTI buffer handling) take {oh['ms_per_cycle']:.3f} "
                            f"ms per cycle ({oh['share'] * 100:.2f}% of it); recording every op costs more than that")
        warnings.append("profiled steps run slower than unprofiled ones (the torch profiler records every op"
                        + (f": {ops_per_cycle:.0f} CPU ops per cycle here" if ops_per_cycle else "")
                        + "); the trace cannot measure that cost itself: bench/vllm_live.py compares profiled "
                        "and unprofiled steps")
        config = {"engine": "vllm", "engine_version": ver, "device": "cuda" if gpu_info is not None or
                  doc.get("deviceProperties") else "cpu",
                  "steps": steps_k, "draft_tokens": (steps_k + 1) if steps_k else None,
                  "batch": max(set(batch), key=batch.count), "world_size": dist.get("world_size")}
        samples = {"cycle_ms": {k: [round(v, 5) for v in cycle_ms[k]] for k in _order(cycle_ms)},
                   "cycle_total_ms": [round(v, 5) for v in totals_used]}
        if not spec:
            samples["accept_lengths"] = [1] * n
            samples["num_draft"] = [0] * n
        env = {"engine": "vllm", "engine_version": ver, "host": doc.get("host_name")}
        devs = [d for d in (doc.get("deviceProperties") or []) if isinstance(d, dict)]
        if devs:
            env["gpu"] = {"name": devs[0].get("name"), "count": len(devs)}
        return {"config": config, "results": res, "samples": samples, "warnings": warnings, "env": env}

    # -- GPU kernels -------------------------------------------------------------------------------------------------
    def _gpu(self, windows, scopes, launches, kernels, gpu, warnings) -> dict | None:
        """Each kernel to the cycle and phase whose scope launched it (its launch event has the same correlation).
        scopes: (pid, tid) -> the outermost gpu_model_runner scopes, sorted."""
        by_key: dict = {}
        for i, (key, a, b, fwd) in enumerate(windows):
            by_key.setdefault(key, []).append((a, b, i, fwd))
        used = 0
        for corr, ms in kernels:
            la = launches.get(corr) if corr is not None else None
            if la is None:
                self.skip(KERNELS, "no launch event with its correlation id")
                continue
            lts, pid, tid = la
            wins = by_key.get((pid, tid)) or []
            j = bisect.bisect_right(wins, (lts, math.inf)) - 1
            if j < 0 or lts > wins[j][1]:
                self.skip(KERNELS, "launched outside the timed cycles (prefill, between steps, ...)")
                continue
            _, _, i, fwd = wins[j]
            sc = scopes.get((pid, tid), [])
            k = bisect.bisect_right(sc, (lts, math.inf, "")) - 1
            sname = sc[k][2] if k >= 0 and sc[k][0] <= lts <= sc[k][1] else None
            top = SCOPE_PHASE.get(sname) if sname else None
            if top is None:
                name, sub = "other", (f"other.{sname}" if sname else "other.unscoped")
            else:
                name = fwd if top == FORWARD else top
                sub = None if name in SINGLE else f"{name}.{sname}"
            for nm in (name, sub):
                if nm:
                    c = gpu.setdefault(nm, [0.0] * len(windows))
                    c[i] += ms
            used += 1
        if not used:
            warnings.append(f"{len(kernels)} GPU kernel events, none linked to a timed cycle's launch: the phases are "
                            "CPU-side scope times")
            gpu.clear()
            return None
        warnings.append(f"phases are GPU kernel time by the scope that launched each kernel ({used} of {len(kernels)} "
                        "kernels; concurrent streams would be summed); the CPU-side scope times are in "
                        "results.cpu_phases")
        busy = [sum(gpu[k][i] for k in gpu if "." not in k) for i in range(len(windows))]
        return {"kernels": len(kernels), "attributed": used, "kernel_ms_per_cycle": stats(busy)}

    @staticmethod
    def _gpu_cycles(gpu: dict, host_totals: list[float]) -> tuple[dict, list[float]]:
        """Phases = kernel time (other = launches outside scopes + host time no kernel covers); the cycle is the host
        window, or the kernels' time when that is longer (the host ran ahead of the device)."""
        cols = {k: list(v) for k, v in gpu.items()}
        tops = [k for k in cols if "." not in k and k != "other"]
        totals = []
        other = cols.setdefault("other", [0.0] * len(host_totals))
        for i, host in enumerate(host_totals):
            inside = sum(cols[k][i] for k in tops)
            total = max(host, inside + other[i])
            other[i] = total - inside
            totals.append(total)
        return cols, totals

    @staticmethod
    def _overhead(overhead: list, windows: list) -> dict | None:
        if not overhead or not windows:
            return None
        inside = sum(dur for ts, dur in overhead if _inside([ts], windows)) / 1e3
        total = sum(b - a for _, a, b, _ in windows) / 1e3
        per = inside / len(windows)
        return {"events": len(overhead), "ms_per_cycle": round(per, 5),
                "share": round(inside / total, 6) if total > 0 else 0.0,
                "what": "the trace's own 'overhead' events inside the cycles (Kineto/CUPTI buffer handling)"}

    def result(self) -> dict:
        return self.out

    def has_data(self) -> bool:
        return self.out is not None


def scan_trace(path, progress=None) -> dict:
    """The accounting `core.scan` returns for line files, for one trace document (its units are events)."""
    doc, digest, nbytes = read_document(path, progress)
    p = TorchTraceParser()
    p.parse(doc, path)
    return {"lines": len(doc["traceEvents"]), "unit": "events", "recognised": {FORMAT: p.recognised},
            "malformed": p.malformed_n, "malformed_by_format": {FORMAT: p.malformed_n}, "other": p.other,
            "malformed_examples": p.examples, "unterminated_last_line": False, "overlong": 0,
            "sha256": digest, "bytes": nbytes, "parsers": [p]}
