"""Noise-aware comparison of two runs' per-cycle samples.

Every compared quantity is a ratio of sums over cycles (phase ms per cycle = Σ ms / Σ 1, tok/s = Σ tokens / Σ s,
τ = Σ accepted+1 / Σ 1), so one routine covers them all: the relative change of B against A with a percentile
*moving-block bootstrap* interval. Blocks (length ≈ n^(1/3)) of consecutive cycles are resampled because cycles
are not independent (prompt content, cache length and clocks drift through a run); resampling single cycles would
give intervals that are too narrow.

A row is called changed only if the interval excludes 0 *and* the point change is at least `min_effect`
(default 2 %): with thousands of cycles a 0.3 % drift is "significant" but not worth anyone's attention. The
interval's level is Bonferroni-corrected by the caller over the rows of a comparison.
"""

from __future__ import annotations

import math

import numpy as np

MIN_SAMPLES = 8
MIN_PAIRS = 5
N_BOOT = 4000


def _resampled_sums(num: np.ndarray, den: np.ndarray, rng, n_boot: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(num)
    b = max(1, round(n ** (1 / 3)))
    k = math.ceil(n / b)
    cn = np.concatenate([[0.0], np.cumsum(num)])
    cd = np.concatenate([[0.0], np.cumsum(den)])
    bn = cn[b:] - cn[:-b]                 # sum of the block starting at each index
    bd = cd[b:] - cd[:-b]
    starts = rng.integers(0, n - b + 1, size=(n_boot, k))
    return bn[starts].sum(1), bd[starts].sum(1)


def ratio_change(num_a, den_a, num_b, den_b, level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Relative change of Σnum/Σden from A to B: {"change", "lo", "hi"} as fractions (0.1 = +10 %), or
    {"change": ..., "lo": None, "hi": None, "reason": ...} when there are too few samples for an interval."""
    num_a, den_a = np.asarray(num_a, float), np.asarray(den_a, float)
    num_b, den_b = np.asarray(num_b, float), np.asarray(den_b, float)
    ra = num_a.sum() / den_a.sum() if den_a.sum() else float("nan")
    rb = num_b.sum() / den_b.sum() if den_b.sum() else float("nan")
    change = rb / ra - 1 if ra else float("nan")
    out = {"change": float(change), "lo": None, "hi": None}
    if min(len(num_a), len(num_b)) < MIN_SAMPLES:
        out["reason"] = f"fewer than {MIN_SAMPLES} cycles"
        return out
    if not math.isfinite(change):
        out["reason"] = "zero baseline"
        return out
    rng = np.random.default_rng(seed)
    sa_n, sa_d = _resampled_sums(num_a, den_a, rng, n_boot)
    sb_n, sb_d = _resampled_sums(num_b, den_b, rng, n_boot)
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (sb_n / sb_d) / (sa_n / sa_d) - 1
    boot = boot[np.isfinite(boot)]
    if len(boot) < n_boot // 2:
        out["reason"] = "degenerate samples"
        return out
    tail = (1 - level) / 2
    out["lo"], out["hi"] = (float(x) for x in np.quantile(boot, [tail, 1 - tail]))
    return out


def paired_ratio_change(a, b, level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Relative change of mean(b)/mean(a) for paired samples (the same prompts in both runs): prompts are
    resampled together, so prompt-to-prompt variation cancels instead of widening the interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    change = float(b.mean() / a.mean() - 1) if a.mean() else float("nan")
    out = {"change": change, "lo": None, "hi": None, "paired": True}
    if len(a) != len(b) or len(a) < MIN_PAIRS or not math.isfinite(change):
        out["reason"] = f"fewer than {MIN_PAIRS} paired prompts"
        return out
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    boot = b[idx].mean(1) / a[idx].mean(1) - 1
    tail = (1 - level) / 2
    out["lo"], out["hi"] = (float(x) for x in np.quantile(boot, [tail, 1 - tail]))
    return out


def verdict(ch: dict, higher_is_better: bool, min_effect: float = 0.02) -> str:
    """"better" / "worse" / "no significant change" / "n/a (...)" for one ratio_change result."""
    if ch.get("lo") is None:
        return f"n/a ({ch.get('reason', 'no samples')})"
    c = ch["change"]
    up = ch["lo"] > 0 and c >= min_effect
    down = ch["hi"] < 0 and c <= -min_effect
    if not (up or down):
        return "no significant change"
    return "better" if up == higher_is_better else "worse"
