"""The host's own speed around each launch: a fixed memory-bound read (64 MiB of fp32 summed, what a decode step's
weight reads are like), timed on the launch's compute cores right before the engine starts and right after it
stops, so it never competes with the engine.

Why: on a shared VM the host's speed drifts by itself. On the 2-core EPYC VM of docs/sweep.md an LM-head-sized
GEMV pinned to one idle core ran up to 36 % slower within 40 s, and launches of one setting drifted 15 % over ten
minutes; placement and warm-up cannot take that out of a launch. A launch that ran slow while this reference ran
slow is the host's, and `compare` can say so (registry/causes.py ranks a differing reference like a GPU clock).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

MIB = 64
SECONDS = 0.5           # reads for this long (~180 on that VM); their median is the host's speed then: one read
                        # (~3 ms) swings ±20 % with a neighbour's burst, the median of half a second a few %


def reference_gbps(cores=None) -> float | None:
    """GB/s of the reference read on `cores` (this thread moved there for it, then back); None where a thread's
    cores cannot be set (the reading would not be of the compute cores)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    old = os.sched_getaffinity(0)
    a = np.ones(MIB * 2**20 // 4, dtype=np.float32)
    try:
        if cores:
            os.sched_setaffinity(0, set(cores))
        a.sum()                                     # pages touched, caches warm before the timed reads
        times, t_end = [], time.perf_counter() + SECONDS
        while time.perf_counter() < t_end:
            times.append(_timed(a))
    finally:
        os.sched_setaffinity(0, old)
    return round(a.nbytes / statistics.median(times) / 1e9, 3)


def _timed(a) -> float:
    t = time.perf_counter()
    a.sum()
    return time.perf_counter() - t


def host_reference(before: float | None, after: float | None, cores) -> dict:
    """What a run keeps: the readings before and after its launch, their mean (`gbps`, what compare's causes
    weigh), the cores read on ([]: wherever the OS put the reading)."""
    got = [v for v in (before, after) if v]
    return {"gbps": round(sum(got) / len(got), 3) if got else None, "before_gbps": before, "after_gbps": after,
            "cores": list(cores), "mib": MIB}


def spread(runs: list[dict]) -> dict | None:
    """Over a sweep's runs: the reference's slowest and fastest readings and how far apart (the host's own drift
    during the sweep); None when no run carries one."""
    refs = [(r.get("env") or {}).get("host_reference") or {} for r in runs]
    vals = [v for h in refs for v in (h.get("before_gbps"), h.get("after_gbps")) if isinstance(v, (int, float)) and v > 0]
    if not vals:
        return None
    return {"min_gbps": min(vals), "max_gbps": max(vals), "change": round(max(vals) / min(vals) - 1, 4),
            "readings": len(vals), "mib": MIB}
