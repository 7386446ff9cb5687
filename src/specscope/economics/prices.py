"""This host's prices for speculative/budget.py: a verify forward's cost by rows, in plain decode steps, measured
with the verify-curve machinery at one context and cached per host, model, dtype and threads."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import torch

from specscope import cachedir
from specscope.cpuload import ContentionMeter, wait_quiet
from specscope.economics.verify_curve import measure_curve
from specscope.models import tuning
from specscope.models.loader import compute_dtype
from specscope.speculative.budget import Prices


def measure_prices(target, context: int = 256, rows=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16), repeats: int = 15) -> Prices:
    """Time the target's verify forward at each row count over `context` cached tokens (round-robin, medians),
    the economics module's verify-curve measurement at one context (less where the model's context is short)."""
    limit = target.config.max_position_embeddings
    rows = [n for n in rows if n < limit] or [1]
    context = max(1, min(context, limit - max(rows)))
    res = measure_curve(target, [context], rows, warmup=2, repeats=repeats)
    med = {int(p["tokens"]): float(p["median_ms"]) for p in res["points"]}
    one, ratio, top = med[min(med)], {}, 0.0
    for n in sorted(med):       # more rows never cost less: a dip is the machine's noise
        top = max(top, med[n] / med[min(med)])
        ratio[n] = top
    return Prices(ratio, one)


def _key(target) -> str:
    """What the timings depend on: the model's shape, its device and dtype, the CPU, threads, kernels and torch
    (as the linear tuning cache is keyed)."""
    dev = target.device
    host = tuning.fingerprint() if dev.type == "cpu" else (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type)
    parts = [repr(target.config), str(dev), str(compute_dtype(target)), host, torch.__version__]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _rel(key: str) -> str:
    return f"prices/{key[:16]}.json"


def prices_path(target) -> Path:
    """Where this host's prices for `target` live in the cache root (read and written through cachedir's checks)."""
    return cachedir.cache_dir() / _rel(_key(target))


def host_prices(target, note=None) -> Prices:
    """This host's prices for `target`: measured once (a few seconds), then read from the cache dir. A file that
    is damaged, of the wrong shape or measured for another model or host is measured again (one warning). Prices
    measured while other processes took the CPUs are measured again once the load drops, and when it does not,
    used for this run only (marked `loaded`, never cached), with one warning."""
    key = _key(target)

    def check(d) -> Prices:
        if not isinstance(d, dict) or d.get("key") != key:
            raise ValueError("it does not say it was measured for this model and host")
        return Prices.from_dict(d)

    cached = cachedir.load_json(_rel(key), check, "verify prices", "measuring them again")
    if cached is not None:
        return cached
    if note:
        note("measuring this host's verify cost by rows (once; cached)")
    p, load = _measure_quiet(target)
    if load is not None and load.loaded:
        cachedir.warn(f"this host's verify prices were measured while {load.words()}: used for this run only, "
                      f"not cached (they would price every later run); they are measured again next run")
        return replace(p, loaded=load.words())
    cachedir.store_json(_rel(key), {**p.to_dict(), "key": key}, "verify prices")
    return p


QUIET_WAIT_S = 10.0     # how long a measurement made under load waits for the load to drop before measuring again


def _measure_quiet(target, tries: int = 2):
    """measure_prices under a ContentionMeter, measured again (after waiting up to QUIET_WAIT_S for the load to
    drop) while other processes took the CPUs -> (prices, the last measurement's contention or None)."""
    for i in range(tries):
        with ContentionMeter() as m:
            p = measure_prices(target)
        if m.result is None or not m.result.loaded or i == tries - 1 or not wait_quiet(QUIET_WAIT_S):
            break
    return p, m.result
