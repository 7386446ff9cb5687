"""This host's prices for speculative/budget.py: a verify forward's cost by rows, in plain decode steps, measured
with the verify-curve machinery at one context and cached per host, model, dtype and threads."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from specscope.economics.verify_curve import measure_curve
from specscope.models import rowgemm
from specscope.models.hub import cache_dir
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


def prices_path(target) -> Path:
    """Where this host's prices for `target` live: keyed by what the timings depend on (the model's shape, its
    device and dtype, the CPU, threads, kernels and torch, as the linear tuning cache is)."""
    dev = target.device
    host = rowgemm.fingerprint() if dev.type == "cpu" else (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type)
    parts = [repr(target.config), str(dev), str(target.dtype), host, torch.__version__]
    return cache_dir() / "prices" / (hashlib.sha256("|".join(parts).encode()).hexdigest()[:16] + ".json")


def host_prices(target, note=None) -> Prices:
    """This host's prices for `target`: measured once (a few seconds), then read from the cache dir."""
    path = prices_path(target)
    try:
        return Prices.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if note:
        note("measuring this host's verify cost by rows (once; cached)")
    p = measure_prices(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(p.to_dict(), f)
        os.replace(tmp, path)
    except OSError:
        pass                     # an unwritable cache: measured again next time
    return p
