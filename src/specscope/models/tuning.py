"""Tuning the row kernels (models/rowgemm.py): the panel width (per weight shape) and the register tile (per row
count) only change speed, never the result; `tuned_plan` measures them once per shape on this machine (cold
weights, as in a real forward) and keeps the choice in a JSON file named by a machine fingerprint; a corrupt or
stale file is re-measured, and a choice made while other processes took the CPUs is this run's only (not cached)."""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from pathlib import Path

import torch

from specscope import cachedir
from specscope.cpuload import ContentionMeter
from specscope.models import rowgemm
from specscope.models.rowgemm import TUNE_ROWS

TUNE_RULE = "relative-2"   # in the tuning cache's name: a new choice rule re-measures
_lock = threading.Lock()
_this_run: dict[str, dict] = {}     # plans measured under load: kept for this process, never cached


def fingerprint() -> str:
    """What the timings depend on: CPU model and flags, thread count, torch, kernel source."""
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    except OSError:
        pass
    parts = [model, platform.machine(), ",".join(sorted(rowgemm.cpu_flags())), str(os.cpu_count()),
             str(rowgemm.threads()), torch.__version__, rowgemm._source_hash(), str(rowgemm.isa()),
             TUNE_RULE]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _tune_rel() -> str:
    return f"kernels/linear-tune-{fingerprint()}.json"


def tune_file() -> Path:
    """The tuning cache in the cache root (read and written through cachedir's checks)."""
    return cachedir.cache_dir() / _tune_rel()


def default_plan(out: int, k: int) -> dict:
    """Untuned: the library's first panel width, its smallest tile for few rows and its largest for many."""
    rowgemm.library()
    nb = next(iter(rowgemm.VARIANTS))
    rbs = rowgemm.VARIANTS[nb]
    return {"nb": nb, "rb": {str(n): (min(rbs) if n <= 6 else max(rbs)) for n in TUNE_ROWS}}


def rb_for(plan: dict, n: int) -> int:
    """Register tile for n rows: the plan's entry for the nearest tuned row count at or above n."""
    rbs = plan["rb"]
    for m in TUNE_ROWS:
        if n <= m:
            return rbs[str(m)]
    return rbs[str(TUNE_ROWS[-1])]


def _valid_plan(p) -> bool:
    try:
        variants = rowgemm.VARIANTS
        return p["nb"] in variants and all(p["rb"][str(n)] in variants[p["nb"]] for n in TUNE_ROWS)
    except (KeyError, TypeError):
        return False


def _check_cache(data) -> dict:
    if not isinstance(data, dict) or not isinstance(data.get("plans"), dict):
        raise ValueError("not a tuning cache: no 'plans' object")
    return data


def _read_cache(rel: str) -> dict:
    return cachedir.load_json(rel, _check_cache, "linear tuning plans", "re-measuring") or {"plans": {}}


def measure(out: int, k: int, rows=TUNE_ROWS, rounds: int = 3, cold_bytes: int = 96 << 20,
            fmt: str = "f32") -> dict:
    """Seconds per call for every (panel, tile, rows), with the weights cold (copies that overflow the L3)."""
    copies = max(1, min(64, cold_bytes // (out * k * (4 if fmt == "f32" else 2))))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, k, generator=g)
    packs = {nb: [rowgemm.pack(w, nb, fmt=fmt) for _ in range(copies)] for nb in rowgemm.VARIANTS}
    xs = {n: torch.randn(n, k, generator=g) for n in rows}
    ys = {n: torch.empty(n, out) for n in rows}
    best: dict = {}
    for _ in range(rounds):
        for nb, rbs in rowgemm.VARIANTS.items():
            for rb in rbs:
                for n in rows:
                    t = time.perf_counter()
                    for p in packs[nb]:
                        rowgemm.gemm(xs[n], p, nb, out, None, rb, ys[n], fmt)
                    dt = (time.perf_counter() - t) / copies
                    key = (nb, rb, n)
                    best[key] = min(best.get(key, float("inf")), dt)
    return best


def choose(best: dict, rows=TUNE_ROWS) -> dict:
    """Panel width with the lowest total *relative* time over row counts (each at its best tile, divided by the
    best any panel achieves at that count), then the best tile per count. Relative, so every row count weighs the
    same: an absolute sum is decided by the 32-64-row prefill calls, while decode, verify and tree drafting (1-16
    rows) are what a generation repeats (on AVX2, 8-wide panels verify 4 rows at the cost of 1; 16-wide cost +15%)."""
    def at(nb, n):
        return min(best[(nb, rb, n)] for rb in rowgemm.VARIANTS[nb])

    floor = {n: min(at(nb, n) for nb in rowgemm.VARIANTS) for n in rows}

    def total(nb):
        return sum(at(nb, n) / floor[n] for n in rows)

    nb = min(rowgemm.VARIANTS, key=total)
    return {"nb": nb, "rb": {str(n): min(rowgemm.VARIANTS[nb], key=lambda rb: best[(nb, rb, n)]) for n in rows},
            "us": {str(n): round(min(best[(nb, rb, n)] for rb in rowgemm.VARIANTS[nb]) * 1e6, 1) for n in rows}}


def tuned_plan(out: int, k: int, tune: bool | None = None, fmt: str = "f32") -> dict:
    """The cached plan for an [out, in=k] weight packed as `fmt` on this machine; measured (and cached) on first
    sight.

    tune=False (or SPECSCOPE_LINEAR_TUNE=0) skips measuring and uses the default plan (same results, maybe
    slower)."""
    if tune is None:
        tune = os.environ.get("SPECSCOPE_LINEAR_TUNE", "1") != "0"
    if not tune:
        return default_plan(out, k)
    key = f"{out}x{k}" if fmt in ("f32", "bf16") else f"{out}x{k}/{fmt}"   # bf16 weights stream as f32's plan
    path = _tune_rel()
    with _lock:
        data = _read_cache(path)
        plan = data["plans"].get(key)
        if _valid_plan(plan):
            return plan
        if key in _this_run:
            return _this_run[key]
        with ContentionMeter() as load:
            plan = choose(measure(out, k, fmt=fmt) if fmt == "bf16a" else measure(out, k))
        if load.result is not None and load.result.loaded:
            # tiles timed beside other work are that work's choice, not this machine's: this run's only
            cachedir.warn(f"the row kernels' tiles were chosen while {load.result.words()}: used by this run only, "
                          f"not cached; chosen again next run", key="tuning under load")
            _this_run[key] = plan
            return plan
        data = _read_cache(path)            # another process may have added shapes meanwhile
        data["plans"][key] = plan
        data["fingerprint"] = fingerprint()
        data["threads"] = rowgemm.threads()
        cachedir.store_json(path, data, "linear tuning plans")
        return plan
