"""Per-step phase timing inside a serving engine's worker process, engine-neutral.

An engine adapter (`plugins/vllm.py`; an SGLang one would be another small file) calls, per engine step:

    rec.begin_step(kind, tokens)         # "verify" (draft tokens verified), "decode"; others are only counted
    with rec.engine_scope("forward", "postprocess"): ...   # an engine scope (vLLM's "postprocess") timed as a
                                         # phase ("forward": the verify or decode) and sub-phase, and annotated for
                                         # the profiler window when the step is profiled
    rec.end_step(drafted, accepted)      # per request: draft tokens verified and accepted this step

and the recorder keeps a `CycleProfiler` (CUDA events read after the step on GPUs, perf_counter on CPU), writes
one JSONL line per decode/verify step (read back by `specscope ingest`), and every `every_s` seconds prints the
seed's report for the steps since the last one (`Target verify: X ms/cyc ( Y%)`, τ, per-position acceptance), and
under it what the profiled steps' phases spent their time on (`plugins/windows.py`: components, experts touched).
Prefill and mixed prefill+decode steps are counted, not timed: a cycle is one decode or verify step.

File format (`specscope ingest` recognises it by the header's "specscope_steps" key):
    {"specscope_steps": 1, "engine": ..., "engine_version": ..., "config": {...}, "timer": ..., "started": ...}
    {"i": 0, "kind": "verify", "ms": {"verify": 58.1, "draft": 13.0, ...}, "total_ms": 83.9,
     "reqs": 1, "drafted": [3], "accepted": [2]}
    {"i": 40, ..., "win": 1}                         # a step a profiler window watched
    {"window": [{"i": 40, "kind": "verify", "tokens": 4, "measured": {"verify": 41.2, ...},
                 "phases": {"verify": {"gemm": 22.1, "attention": 3.0, "host_gap": 9.9, ...}, ...},
                 "experts": {"distinct": 9.1, "of": 32, "bytes": ..., "per_layer": [...]}}, ...],
     "unknown": {"op name": µs}, "note": null}         # each window's steps split into components
    {"env": {...}}                                   # the fingerprint, once, after the first report
    {"end": true, "steps": ..., "untimed_steps": {"prefill": ..., "mixed": ...}}
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from specscope.profile.cycle import CycleProfiler

from specscope.profile.components import Bucket, bucket_key
from specscope.profile.components import lines as component_lines

FORMAT_VERSION = 1
TIMERS = ("auto", "cuda_events", "sync", "perf_counter")


class StepRecorder:
    def __init__(self, path: str | os.PathLike, engine: str, engine_version: str, config: dict,
                 device: str = "cpu", timer: str = "auto", every_s: float = 10.0, out=None, windows=None):
        if timer not in TIMERS:
            raise ValueError(f"timer {timer!r}: use one of {', '.join(TIMERS)}")
        self.path = Path(path)
        self.engine, self.engine_version, self.config = engine, engine_version, dict(config)
        self.device = str(device)
        cuda = self.device.startswith("cuda")
        if timer == "auto":
            timer = "cuda_events" if cuda else "perf_counter"
        if timer in ("cuda_events", "sync") and not cuda:
            timer = "perf_counter"
        self.timer = timer
        self.every_s = float(every_s)
        self.out = out or sys.stdout
        self._lock = threading.Lock()
        self._prof = self._new_profiler()
        self._null = contextlib.nullcontext()
        self._step = None              # kind of the step being timed, or None
        self._rows: list[dict] = []    # this interval's steps
        self._written = 0              # of which are in the file
        self._n = 0
        self._skipped: dict[str, int] = {}   # kind -> steps counted, not timed (prefill, mixed, idle)
        self._last = time.monotonic()
        self._file = None
        self._env_written = False
        self._closed = False
        self.overhead_ns = 0           # the adapter's own host time (its wrappers, this recorder), all steps
        self._steps_ns = 0.0           # wall time of the timed steps, ns
        self.windows = windows         # plugins/windows.Windows, or None: no profiler windows
        self._win = False              # the step being timed is in a profiler window
        self._tokens = 0               # tokens the step being timed runs through the target
        self.buckets: dict[str, Bucket] = {}    # components of all windows so far, by step bucket
        atexit.register(self.close)

    def _new_profiler(self) -> CycleProfiler:
        dev = self.device if self.timer in ("cuda_events", "sync") else "cpu"
        return CycleProfiler(dev, sync=self.timer == "sync")

    # ---- hot path (the engine's step) ------------------------------------------------------------------------
    def begin_step(self, kind: str, tokens: int = 0) -> None:
        if kind not in ("verify", "decode"):
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            self._step = None
            return
        self._step, self._tokens = kind, int(tokens)
        self._win = self.windows is not None and self.windows.begin(self._n)
        self._prof._start_cycle()

    @property
    def kind(self) -> str | None:
        """"verify" or "decode" while such a step is timed, else None."""
        return self._step

    def scope(self, phase: str):
        """The profiler's context manager for `phase` while a decode/verify step is timed, else a no-op.
        "forward" names the target forward: the verify of a speculative step, else decode."""
        if self._step is None:
            return self._null
        if phase == "forward":
            phase = self._step
        return self._prof.phase(phase)

    def engine_scope(self, phase: str, part: str, sub: bool = True) -> "_Scopes":
        """One of the engine's own scopes (`part`, e.g. vLLM's "postprocess") timed as `phase` (and as the sub-phase
        `phase.part` when `sub`), inside the profiler window's annotation of it when the step is profiled.
        The annotation holds the timers, not the reverse: a profiled annotation costs ~10 µs to enter and leave,
        which must land neither in the measured phase nor in its components (stamped inside the annotation)."""
        if self._step is None:
            return _Scopes(())
        top = self._step if phase == "forward" else phase
        inner = (self._prof.phase(top),) + ((self._prof.phase(f"{top}.{part}"),) if sub else ())
        return _Scopes(((self.windows.scope(top, part),) if self._win else ()) + inner)

    def end_step(self, drafted: list[int], accepted: list[int] | None) -> None:
        """Per request of the step: `drafted[i]` draft tokens verified, `accepted[i]` of them accepted (None:
        unknown, e.g. the sampled tokens are not on the host yet)."""
        if self._step is None:
            return
        kind, drafted = self._step, list(drafted)
        self._step = None
        acc = list(accepted) if accepted is not None else None
        reqs = max(len(drafted), len(acc or []), 1)
        if acc is not None and drafted and len(acc) == len(drafted):
            # the profiler's per-cycle view is per sequence: a batched step adds its mean tokens per request
            tokens = round(sum(a + 1 for a in acc) / reqs)
            first = [i < acc[0] for i in range(drafted[0])] if reqs == 1 else None
            self._prof.end_cycle(tokens, accepted=first, num_draft=max(drafted) if reqs > 1 else drafted[0])
        else:
            self._prof.end_cycle(1)
        row = {"i": self._n, "kind": kind, "reqs": reqs, "drafted": drafted, "accepted": acc}
        self._rows.append(row)
        if self._win:
            row["win"] = 1
            self._window_step(kind)
        self._n += 1
        if self.timer != "cuda_events":
            self._write(block=True)        # times are known now: a killed engine loses nothing already stepped
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def _window_step(self, kind: str) -> None:
        """A profiled step ended: its phases as this recorder timed them go with it (the components' check)."""
        self._win = False
        got = self._prof.cycle(len(self._rows) - 1, block=True)
        measured = {k: round(v, 5) for k, v in got[0].items() if "." not in k} if got else None
        steps = self.windows.end(self._n, kind, self._tokens, measured)
        if steps is not None:
            self._window_done(steps)

    def pause_windows(self, paused: bool) -> None:
        """The engine's own profiler starts (True) or stops (False): close an open window first, open none
        meanwhile."""
        if self.windows is None:
            return
        with self._lock:
            steps = self.windows.close() if paused else None
            self.windows.paused = paused
            self._win = False
        if steps:
            self._window_done(steps)

    def _window_done(self, steps: list[dict]) -> None:
        for st in steps:
            key = bucket_key(st["kind"], st["tokens"])
            self.buckets.setdefault(key, Bucket()).add(st["phases"], st["measured"], st.get("experts"),
                                                        st.get("scopes"))
        unknown = {k: round(v, 1) for k, v in sorted(self.windows.unknown.items(), key=lambda kv: -kv[1])[:20]}
        line = {"window": steps, "unknown": unknown, "note": self.windows.classifier.note,
                "cost_ms": round(self.windows.cost_ns / 1e6, 3)}      # all windows so far: opening, closing, split
        self._open().write(json.dumps(line, separators=(",", ":")) + "\n")

    # ---- file and reports ----------------------------------------------------------------------------------
    def _write(self, block: bool) -> None:
        """Append the steps whose times are known (CUDA events: finished ones; all of them when block)."""
        f = self._open()
        while self._written < len(self._rows):
            got = self._prof.cycle(self._written, block)
            if got is None:
                break
            row = self._rows[self._written]
            row["ms"], row["total_ms"] = {k: round(v, 5) for k, v in got[0].items()}, round(got[1], 5)
            self._steps_ns += got[1] * 1e6
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            self._written += 1
        f.flush()

    def flush(self, final: bool = False) -> None:
        """Write this interval's steps, print their report, start the next interval (bounded memory: a server
        runs for weeks)."""
        with self._lock:
            self._last = time.monotonic()
            if self._rows:
                self._write(block=True)
                f = self._open()
                if not self._env_written:
                    self._env_written = True
                    f.write(json.dumps({"env": _fingerprint()}, separators=(",", ":")) + "\n")
                self._print(self._prof)
                self._prof, self._rows, self._written = self._new_profiler(), [], 0
            if self._file is not None and (final or self._n):
                # the totals so far after every interval ("end": false), not only at exit: a server stopped by a
                # signal often ends its worker before the final report
                self._file.write(json.dumps({"end": bool(final), "steps": self._n, "untimed_steps": self._skipped,
                                             "overhead": self.overhead()}) + "\n")
            if self._file is not None:
                self._file.flush()

    def overhead(self) -> dict:
        """The adapter's own host time per step and as a share of the timed steps' wall time (all steps so far;
        the phase scopes' own cost is the profiler's, reported in its lines)."""
        n = self._n + sum(self._skipped.values())
        return {"us_per_step": round(self.overhead_ns / 1e3 / n, 2) if n else 0.0,
                "share": round(self.overhead_ns / self._steps_ns, 6) if self._steps_ns else None}

    def _print(self, prof: CycleProfiler) -> None:
        head = (f"specscope phases ({self.engine} {self.engine_version}, {self.config.get('method') or 'no spec'}"
                + (f" k={self.config['num_speculative_tokens']}" if self.config.get("num_speculative_tokens") else "")
                + f", {prof.cycles} steps, timer {self.timer}):")
        oh = self.overhead()
        tail = (f"Plugin overhead: {oh['us_per_step']:.1f} us/step"
                + (f" ({oh['share'] * 100:.3f}% of step time)" if oh["share"] is not None else ""))
        comps = component_lines({k: b.mean() for k, b in self.buckets.items()}, unknown=self.windows.unknown,
                                note=self.windows.classifier.note) if self.buckets else []
        print("\n".join([head] + prof.lines() + comps + [tail]), file=self.out, flush=True)

    def _open(self):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            header = {"specscope_steps": FORMAT_VERSION, "engine": self.engine, "engine_version": self.engine_version,
                      "config": self.config, "timer": self.timer, "device": self.device, "pid": os.getpid(),
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            self._file.write(json.dumps(header) + "\n")
        return self._file

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            steps = self.windows.close() if self.windows is not None else None
            if steps:
                self._window_done(steps)
            self.flush(final=True)
        finally:
            if self._file is not None:
                self._file.close()


class _Scopes:
    """Enter context managers in order, leave them in reverse."""

    __slots__ = ("cms",)

    def __init__(self, cms: tuple):
        self.cms = cms

    def __enter__(self):
        for cm in self.cms:
            cm.__enter__()
        return self

    def __exit__(self, *exc):
        for cm in reversed(self.cms):
            cm.__exit__(*exc)
        return False


def _fingerprint() -> dict:
    """The engine machine's fingerprint (GPU, clocks, PCIe, driver, NCCL_*, libraries); never fails the engine."""
    try:
        from specscope.registry.fingerprint import collect

        return collect()
    except Exception as e:  # noqa: BLE001 - a fingerprint is worth less than the engine it runs in
        return {"error": f"{type(e).__name__}: {e}"}
