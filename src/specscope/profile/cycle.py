"""Per-cycle phase timing for baseline and speculative decoding.

A *cycle* is one verify round (speculative) or one decode step (baseline). Engines wrap the parts of a cycle in
`with prof.phase(name):` and close it with `prof.end_cycle(accept_length, accepted, num_draft)`.

Timing: on CPU `perf_counter_ns` stamps; on CUDA a pair of CUDA events per phase, recorded on the current stream
and read back lazily (no synchronisation in the hot path unless `sync=True`, which synchronises at every phase
boundary and times with the wall clock instead: host launch overhead included, the GPU queue drained).

A hybrid drafter also says which source proposed each accepted token (`end_cycle(..., sources=[...])`, e.g.
"eagle3", "ngram" or "both"), reported per source and per position.

A cycle runs from its first phase's start to `end_cycle`; time between its phases that no phase covers is added
to "other", so the phases of a cycle add up to its wall time and tok/s = tokens / sum of cycle times. Engines wrap
their loop bookkeeping (stop checks, streaming callbacks) in "other" themselves. Time between `end_cycle` and the
next phase is not counted, so one profiler can span several generations (prefills stay out of the cycles).
Sub-phases ("draft.step0", ...) are nested in their parent and are not counted twice.
"""

from __future__ import annotations

import math
import time
from collections import deque

from specscope.errors import SpecscopeError

# display order and labels; anything else is shown after these with its own name
PHASE_LABELS = {
    "draft": "Draft",
    "verify": "Target verify",
    "accept": "Accept",
    "commit": "Commit",
    "decode": "Target decode",
    "other": "Other",
}
TOP_PHASES = tuple(PHASE_LABELS)


def _valid_name(name: str) -> bool:
    """A top phase, or a sub-phase `<top>.<part>` (draft.step0, commit.preprocess: an engine's own scope names)."""
    if name in PHASE_LABELS:
        return True
    top, dot, part = name.partition(".")
    return bool(dot) and top in PHASE_LABELS and part.replace("_", "").isalnum()


class _Phase:
    """Reusable context manager for one phase name (allocation-free in the hot path)."""

    __slots__ = ("prof", "name", "top", "t0", "ev0")

    def __init__(self, prof, name):
        self.prof, self.name, self.top = prof, name, "." not in name
        self.t0 = 0
        self.ev0 = None

    def __enter__(self):
        p = self.prof
        if p._cycle_t0 is None:
            p._start_cycle()
        if p._cuda:
            if p.sync:
                p._torch.cuda.synchronize(p.device)
                self.t0 = time.perf_counter_ns()
            else:
                self.ev0 = p._event()
        else:
            self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        p = self.prof
        if p._cuda and not p.sync:
            ev1 = p._event()
            p._pending.append((self.name, self.top, self.ev0, ev1))
        else:
            if p._cuda:
                p._torch.cuda.synchronize(p.device)
            dt = (time.perf_counter_ns() - self.t0) * 1e-6
            cur = p._cur
            cur[self.name] = cur.get(self.name, 0.0) + dt
        p._calls += 1
        return False


class CycleProfiler:
    """Splits every cycle into phases; see the module docstring. `summary()`, `samples()` and `lines()` report."""

    def __init__(self, device="cpu", sync: bool = False):
        self.device = str(device)
        self.sync = bool(sync)
        self._cuda = self.device.startswith("cuda")
        self._torch = None
        if self._cuda:
            import torch   # CUDA timing only: the registry imports this module and must not pull torch

            if not torch.cuda.is_available():
                raise SpecscopeError(f"profiler device {self.device!r} needs CUDA, which this torch build cannot use")
            self._torch = torch
        self._phases: dict[str, _Phase] = {}
        self._cycle_ms: dict[str, list[float]] = {}     # phase -> per-cycle ms (0.0 where absent)
        self._total_ms: list[float] = []                 # per-cycle wall (or GPU-timeline) ms
        self._accept: list[int] = []
        self._accepted: list[list[bool]] = []
        self._num_draft: list[int] = []
        self._by_source: dict[str, list[int]] = {}       # source -> accepted tokens per draft position
        self._cur: dict[str, float] = {}
        self._cycle_t0 = None                            # ns stamp or CUDA event of the current cycle's start
        self._pending: list = []                         # CUDA: (name, top, ev0, ev1) of the current cycle
        self._unresolved: deque = deque()                # CUDA: cycles waiting for their events
        self._pool: list = []
        self._calls = 0
        self._cycles = 0
        self._overhead_us = None

    @classmethod
    def from_samples(cls, samples: dict, accepted: list[list[bool]] | None = None, device: str = "cpu",
                     timer: str | None = None, overhead_us: tuple[float, float] | None = None,
                     phases_per_cycle: float = 0.0) -> "CycleProfiler":
        """A profiler rebuilt from recorded cycles (`samples()` of another process: an engine plugin's JSONL, a
        stored run), so `summary()` / `lines()` report them exactly as if they were timed here.
        `accepted`: per-cycle flags per draft position; by default a chain (the first accept_length-1 accepted)."""
        prof = cls("cpu")
        prof.device, prof.sync = str(device), timer == "sync"
        prof._cuda = timer == "cuda_events"          # only what summary() reports as the timer; nothing is timed
        total = [float(x) for x in samples.get("cycle_total_ms") or []]
        n = len(total)
        cols = samples.get("cycle_ms") or {}
        for name, col in cols.items():
            if len(col) != n:
                raise SpecscopeError(f"recorded cycles disagree: phase {name!r} has {len(col)} values, "
                                     f"cycle_total_ms {n}")
        acc = [int(a) for a in samples.get("accept_lengths") or [1] * n]
        nd = [int(d) for d in samples.get("num_draft") or [0] * n]
        if len(acc) != n or len(nd) != n:
            raise SpecscopeError(f"recorded cycles disagree: {len(acc)} accept lengths, {len(nd)} draft counts, "
                                 f"{n} cycles")
        prof._cycle_ms = {k: [float(v) for v in col] for k, col in cols.items()}
        prof._total_ms = total
        prof._accept, prof._num_draft = acc, nd
        if accepted is None:
            accepted = [[i < a - 1 for i in range(d)] for a, d in zip(acc, nd)]
        prof._accepted = [[bool(x) for x in a] for a in accepted]
        prof._cycles = n
        prof._calls = phases_per_cycle * n
        prof._overhead_us = overhead_us or (0.0, 0.0)   # what the recording process measured, if it said
        return prof

    # ---- hot path -------------------------------------------------------------------------------------------
    def phase(self, name: str) -> _Phase:
        ph = self._phases.get(name)
        if ph is None:
            if not _valid_name(name):
                raise SpecscopeError(f"unknown profiler phase {name!r}; use one of {', '.join(TOP_PHASES)} "
                                     f"or <phase>.<part> (e.g. draft.step0)")
            ph = self._phases[name] = _Phase(self, name)
        return ph

    def _event(self):
        ev = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _start_cycle(self):
        if self._cuda and not self.sync:
            self._cycle_t0 = self._event()
        else:
            if self._cuda:
                self._torch.cuda.synchronize(self.device)
            self._cycle_t0 = time.perf_counter_ns()

    def end_cycle(self, accept_length: int, accepted: list[bool] | None = None, num_draft: int = 0,
                  sources: list[str] | None = None) -> None:
        """Close the current cycle: `accept_length` tokens were produced (accepted drafts + the bonus token);
        `accepted` flags per draft position along the chosen path; `num_draft` tokens were drafted; `sources`
        names the source of each accepted draft token, in path order (hybrid drafters)."""
        if self._cycle_t0 is None:
            self._start_cycle()
        self._count(accept_length, accepted, num_draft, sources)
        if self._cuda and not self.sync:
            end = self._event()
            self._unresolved.append((self._cycle_t0, end, self._pending))
            self._pending = []
            self._cycle_t0 = None
            if len(self._unresolved) >= 256:
                self._resolve(block=False)
        else:
            if self._cuda:
                self._torch.cuda.synchronize(self.device)
            self._store((time.perf_counter_ns() - self._cycle_t0) * 1e-6, self._cur)
            self._cur = {}
            self._cycle_t0 = None

    def add_cycle(self, phases_ms: dict[str, float], accept_length: int, accepted: list[bool] | None = None,
                  num_draft: int = 0, sources: list[str] | None = None) -> None:
        """A cycle its engine timed itself (the batched engine's step laps, synchronised on CUDA): its top phases'
        ms, which add up to its wall time, and sub-phases ("draft.step0") inside them; counted like `end_cycle`."""
        self._count(accept_length, accepted, num_draft, sources)
        self._store(sum(v for k, v in phases_ms.items() if "." not in k), phases_ms)
        if self._cuda:
            self.sync = True       # what summary() reports as the timer: wall-clock laps, not CUDA events

    def _count(self, accept_length: int, accepted, num_draft: int, sources) -> None:
        if accept_length < 0:
            raise SpecscopeError(f"accept_length must be >= 0, got {accept_length}")
        if accepted is not None:
            accepted = [bool(a) for a in accepted]
            num_draft = max(num_draft, len(accepted))
        elif num_draft > 0:
            # a chain without explicit flags: the first accept_length-1 positions were accepted
            k = min(max(accept_length - 1, 0), num_draft)
            accepted = [True] * k + [False] * (num_draft - k)
        self._accept.append(int(accept_length))
        self._accepted.append(accepted or [])
        for i, name in enumerate(sources or ()):
            col = self._by_source.setdefault(str(name), [])
            col += [0] * (i + 1 - len(col))
            col[i] += 1
        self._num_draft.append(int(num_draft))
        self._cycles += 1

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _store(self, total_ms: float, per_phase: dict[str, float]) -> None:
        n = len(self._total_ms)
        inside = sum(v for k, v in per_phase.items() if "." not in k)
        per_phase = dict(per_phase)
        per_phase["other"] = per_phase.get("other", 0.0) + max(total_ms - inside, 0.0)
        for name, v in per_phase.items():
            col = self._cycle_ms.get(name)
            if col is None:
                col = self._cycle_ms[name] = [0.0] * n
            col.append(v)
        for name, col in self._cycle_ms.items():
            if len(col) == n:
                col.append(0.0)
        self._total_ms.append(max(total_ms, inside))

    def _resolve(self, block: bool = True) -> None:
        """CUDA: turn recorded events of finished cycles into milliseconds, oldest first."""
        while self._unresolved:
            start, end, pend = self._unresolved[0]
            if not block and not end.query():
                return
            end.synchronize()
            per: dict[str, float] = {}
            for name, _top, e0, e1 in pend:
                per[name] = per.get(name, 0.0) + e0.elapsed_time(e1)
                self._pool += (e0, e1)
            self._store(start.elapsed_time(end), per)
            self._unresolved.popleft()
            self._pool += (start, end)

    def _calibrate(self) -> tuple[float, float]:
        """(µs per phase enter+exit, µs per end_cycle), measured once on a scratch profiler like this one."""
        if self._overhead_us is None:
            scratch = CycleProfiler(self.device, self.sync)
            n = 2000 if not self._cuda else 500
            ph = scratch.phase("verify")
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    with ph:
                        pass
                best = min(best, (time.perf_counter_ns() - t0) / n)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                scratch.end_cycle(1)
            per_cycle_end = (time.perf_counter_ns() - t0) / n
            self._overhead_us = (best * 1e-3, per_cycle_end * 1e-3)
        return self._overhead_us

    # ---- reports --------------------------------------------------------------------------------------------
    def cycle(self, i: int, block: bool = True) -> tuple[dict[str, float], float] | None:
        """({phase: ms} without zeros, total ms) of cycle i; None while its CUDA events are pending (block=False)."""
        self._resolve(block)
        if i >= len(self._total_ms):
            return None
        return {k: col[i] for k, col in self._cycle_ms.items() if col[i]}, self._total_ms[i]

    @property
    def cycles(self) -> int:
        return self._cycles

    def samples(self) -> dict:
        """Per-cycle arrays: {"cycle_ms": {phase: [...]}, "cycle_total_ms": [...], "accept_lengths": [...],
        "num_draft": [...]}."""
        self._resolve()
        return {
            "cycle_ms": {k: [round(v, 5) for v in col] for k, col in self._ordered(self._cycle_ms).items()},
            "cycle_total_ms": [round(v, 5) for v in self._total_ms],
            "accept_lengths": list(self._accept),
            "num_draft": list(self._num_draft),
        }

    @staticmethod
    def _ordered(d: dict) -> dict:
        def key(name):
            top = name.split(".")[0]
            rank = TOP_PHASES.index(top) if top in TOP_PHASES else len(TOP_PHASES)
            sub = name[len(top):]
            num = int(sub[len(".step"):]) if sub.startswith(".step") and sub[5:].isdigit() else -1
            return (rank, top, num, name)

        return {k: d[k] for k in sorted(d, key=key)}

    def summary(self) -> dict:
        self._resolve()
        n = len(self._total_ms)
        total = sum(self._total_ms)
        mean_cycle = total / n if n else 0.0
        phases = {}
        for name, col in self._ordered(self._cycle_ms).items():
            if name == "other" and not any(col):
                continue
            s = sorted(col)
            phases[name] = {
                "mean_ms": round(sum(col) / n, 4),
                "median_ms": round(quantile(s, 0.5), 4),
                "p90_ms": round(quantile(s, 0.9), 4),
                "share": round(sum(col) / total, 4) if total > 0 else 0.0,
            }
        tokens = sum(self._accept)
        hist: dict[str, int] = {}
        for a in self._accept:
            hist[str(a)] = hist.get(str(a), 0) + 1
        hist = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        uncond, cond = self._per_position()
        drafted = sum(self._num_draft)
        st = sorted(self._total_ms)
        per_call, per_end = self._calibrate() if n else (0.0, 0.0)
        calls_per_cycle = self._calls / n if n else 0.0
        overhead_ms = (calls_per_cycle * per_call + per_end) * 1e-3
        return {
            "timer": "cuda_events" if self._cuda and not self.sync else "perf_counter",
            "device": self.device,
            "sync": self.sync,
            "cycles": n,
            "tokens": tokens,
            "seconds": round(total / 1e3, 6),
            "tok_per_s": round(tokens / (total / 1e3), 4) if total > 0 else 0.0,
            "ms_per_token": round(total / tokens, 4) if tokens else None,
            "cycle_ms": {"mean_ms": round(mean_cycle, 4), "median_ms": round(quantile(st, 0.5), 4),
                         "p90_ms": round(quantile(st, 0.9), 4)},
            "phases": phases,
            "accept_length": round(tokens / n, 4) if n else None,
            "accept_length_hist": hist,
            "drafted_tokens": drafted,
            "accepted_tokens": sum(sum(a) for a in self._accepted),
            "per_position_acceptance": uncond,
            "per_position_acceptance_conditional": cond,
            **({"accepted_by_source": {k: sum(v) for k, v in self._by_source.items()},
                "accepted_by_source_per_position": {k: list(v) for k, v in self._by_source.items()}}
               if self._by_source else {}),
            "profiler_overhead": {
                "us_per_phase": round(per_call, 3),
                "us_per_end_cycle": round(per_end, 3),
                "phases_per_cycle": round(calls_per_cycle, 2),
                "ms_per_cycle": round(overhead_ms, 5),
                "share": round(overhead_ms / mean_cycle, 6) if mean_cycle > 0 else 0.0,
            },
        }

    def _per_position(self) -> tuple[list[float], list[float | None]]:
        """Unconditional (vLLM: accepted at position i / cycles that drafted) and conditional (accepted at i /
        cycles where i was drafted and i-1 accepted)."""
        drafting = [a for a in self._accepted if a]
        if not drafting:
            return [], []
        depth = max(len(a) for a in drafting)
        uncond, cond = [], []
        for i in range(depth):
            acc = sum(1 for a in drafting if len(a) > i and a[i])
            reach = sum(1 for a in drafting if len(a) > i and (i == 0 or a[i - 1]))
            uncond.append(round(acc / len(drafting), 4))
            cond.append(round(acc / reach, 4) if reach else None)
        return uncond, cond

    def lines(self, baseline_tok_per_s: float | None = None) -> list[str]:
        """Human-readable report, one line per phase then the totals; speedup when a baseline is given."""
        s = self.summary()
        if not s["cycles"]:
            return ["Profiler: no cycles recorded"]
        out = []
        for name, ph in s["phases"].items():
            label = PHASE_LABELS.get(name, ("  " + name) if "." in name else name)
            out.append(f"{label}: {ph['mean_ms']:.2f} ms/cyc ({ph['share'] * 100:5.1f}%)")
        out.append(f"Cycles: {s['cycles']}, tokens: {s['tokens']}, {s['cycle_ms']['mean_ms']:.2f} ms/cyc "
                   f"(median {s['cycle_ms']['median_ms']:.2f}, p90 {s['cycle_ms']['p90_ms']:.2f})")
        if s["drafted_tokens"]:
            hist = " ".join(f"{k}:{v}" for k, v in s["accept_length_hist"].items())
            out.append(f"τ (accept length): {s['accept_length']:.2f}  histogram {hist}")
            out.append("Per-position acceptance (unconditional): "
                       + ", ".join(f"{x:.3f}" for x in s["per_position_acceptance"]))
            out.append("Per-position acceptance (conditional):   "
                       + ", ".join("-" if x is None else f"{x:.3f}" for x in s["per_position_acceptance_conditional"]))
        if s.get("accepted_by_source"):
            out.append(source_line(s["accepted_by_source"]))
        out.append(f"Decode: {s['tok_per_s']:.2f} tok/s ({s['ms_per_token']:.2f} ms/token)")
        if baseline_tok_per_s:
            out.append(f"Speedup vs baseline ({baseline_tok_per_s:.2f} tok/s): "
                       f"{s['tok_per_s'] / baseline_tok_per_s:.2f}x")
        oh = s["profiler_overhead"]
        out.append(f"Profiler overhead: {oh['ms_per_cycle'] * 1e3:.1f} us/cyc ({oh['share'] * 100:.3f}%)")
        return out


def source_line(by_source: dict) -> str:
    """'Accepted tokens by source: eagle3 120 (45%), ngram 80 (30%), both 67 (25%)'."""
    total = sum(by_source.values()) or 1
    names = sorted(by_source, key=lambda k: (k == "both", k))
    return "Accepted tokens by source: " + ", ".join(f"{k} {by_source[k]} ({100 * by_source[k] / total:.0f}%)"
                                                    for k in names)


def quantile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (numpy's default method); 0.0 for an empty one."""
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)
