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

import gzip
import hashlib
import json
import math
import re
import sys
import zlib
from pathlib import Path

from specscope.engines.vllm import SCOPE_PREFIX as SCOPE
from specscope.errors import SpecscopeError
from specscope.ingest.base import MAX_EXAMPLES, FormatParser
from specscope.ingest.trace_cycles import KERNELS, SCOPES, STEPS, TraceEvents, trace_run
# re-exported: the report lines the CLI reads
from specscope.ingest.trace_cycles import phase_lines, summarise  # noqa: F401

FORMAT = "torch-trace"
FIX = "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1"
_COUNTS = r"\((?:sq)?(\d+)(?:sk\d+sqsq\d+sqsk\d+)?\)"
STEP = re.compile(r"execute_(?:\d+_)?context_(\d+)" + _COUNTS + r"_generation_(\d+)" + _COUNTS)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
READ_CHUNK = 1 << 20
SNIFF_BYTES = 1 << 16


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


# ---- the trace ----------------------------------------------------------------------------------------------------
def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _args(ev: dict) -> dict:
    a = ev.get("args")
    return a if isinstance(a, dict) else {}


def _id(v):
    """pid / tid / correlation as a dict key (a malformed trace may hold lists there)."""
    return v if isinstance(v, (int, str)) or v is None else json.dumps(v, default=str)


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
        ev = TraceEvents()
        for i, e in enumerate(doc["traceEvents"]):
            if not isinstance(e, dict):
                self.other += 1
                continue
            cat = e.get("cat")
            if cat == "user_annotation" and isinstance(e.get("name"), str):
                self._annotation(e, i, ev)
            elif cat in LAUNCH_CATS:
                corr, ts = _id(_args(e).get("correlation")), _num(e.get("ts"))
                if corr is not None and ts is not None:
                    ev.launches[corr] = (ts, _id(e.get("pid")), _id(e.get("tid")))
                self.other += 1
            elif cat in GPU_CATS:
                corr, dur = _id(_args(e).get("correlation")), _num(e.get("dur"))
                self.saw(KERNELS)
                if dur is None or dur < 0:
                    self.skip(KERNELS, "no numeric dur")
                else:
                    ev.kernels.append((corr, dur / 1e3))
                self.recognised += 1
            elif isinstance(cat, str) and cat.lower() == "overhead":
                ts, dur = _num(e.get("ts")), _num(e.get("dur"))
                if ts is not None and dur is not None:
                    ev.overhead.append((ts, dur))
                self.other += 1
            else:
                if cat == "cpu_op" and _num(e.get("ts")) is not None:
                    ev.cpu_ops.append(e["ts"])
                    dur = _num(e.get("dur"))
                    if dur and dur > 0 and isinstance(e.get("name"), str):
                        ev.ops.setdefault((_id(e.get("pid")), _id(e.get("tid"))), []).append(
                            (e["ts"], e["ts"] + dur, e["name"]))
                self.other += 1
        self._check(doc, ev, path)
        self.out = trace_run(doc, ev, self, path)

    def _annotation(self, e: dict, i: int, ev: TraceEvents) -> None:
        """A step annotation or a gpu_model_runner scope, kept by thread; any other user annotation is counted."""
        name = e["name"]
        is_step = name.startswith("execute_") and "_context_" in name
        is_scope = name.startswith(SCOPE)
        if not (is_step or is_scope):
            ev.other_annotations += 1
            self.other += 1
            return
        kind = STEPS if is_step else SCOPES
        ts, dur = _num(e.get("ts")), _num(e.get("dur"))
        if ts is None or dur is None or dur < 0:
            self._bad(kind, i, "no numeric ts / dur", e)
            return
        key = (_id(e.get("pid")), _id(e.get("tid")))
        if is_step:
            m = STEP.fullmatch(name)
            if not m:
                self._bad(kind, i, "step annotation does not parse", e)
                return
            c, t, g, u = (int(x) for x in m.groups())
            ev.steps.setdefault(key, []).append((ts, ts + dur, c, t, g, u, name))
        else:
            ev.scopes.setdefault(key, []).append((ts, ts + dur, name[len(SCOPE):]))
        self.saw(kind)
        self.recognised += 1
        self.data_lines += 1

    # -- what kind of trace is it ------------------------------------------------------------------------------------
    def _check(self, doc, ev: TraceEvents, path) -> None:
        vllm = doc.get("vllm_version") is not None
        steps, scopes, n_other_ua = ev.steps, ev.scopes, ev.other_annotations
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
            if vllm and not ev.cpu_ops and not n_other_ua:
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
