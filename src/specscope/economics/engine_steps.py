"""A serving engine's own verify cost by batch size, from its step records (the vLLM plugin's JSONL,
`plugins/steps.py`, read by `specscope ingest`).

Per step the plugin records its phase times, the requests in it (B) and the draft tokens each request verified, so
each step is one point of the surface T(B, n): B sequences each verifying n = 1 + drafts tokens in one target
forward. The forward is the step's `verify` phase when it verified drafts, else `decode` (the plugin maps vLLM's
forward and logits scopes onto these, as specscope's own verify includes the logits). Grouped by (B, n), the median
forward is T(B, n), stored in the layout `verify_curve.surface_results` writes, so `VerifySurface` reads it like a
measured surface. Each point also keeps its step count and the medians of the step's drafting (`draft_ms`) and of
the rest of the step (`rest_ms`: sampling, bookkeeping, host time no scope covers): per step, for all B requests,
because the engine drafts and samples the whole batch at once.

The steps carry no context length: a point holds the engine's own mix of contexts (stored as context 0).
"""

from __future__ import annotations

import math
import statistics

from specscope.economics.verify_curve import fit_piecewise, summarize, surface_results

SOURCE = "engine steps"
MIN_STEPS = 5           # steps per (B, n) point: fewer give a median that one slow step can move
TOLERANCE_MS = 1e-3     # phases are rounded to 5 decimals: their sum may pass the step's total by that much
SHOWN = 6               # dropped points named in a warning


def _point_of(row: dict):
    """((B, n), (forward, draft, rest) ms) of one step record, or why it is no point of the surface."""
    kind = row.get("kind")
    if kind not in ("verify", "decode"):
        return "not a decode or verify step"
    drafted, B = row.get("drafted") or [], row.get("reqs")
    if not drafted or len(drafted) != B:
        return "its per-request draft counts do not match its requests"
    if len(set(drafted)) != 1:
        return "its requests verified different numbers of tokens"
    n = 1 + drafted[0]
    if (n > 1) != (kind == "verify"):
        return "its kind disagrees with its draft counts"
    ms = row.get("ms") or {}
    fwd, draft, total = ms.get(kind), ms.get("draft", 0.0), row.get("total_ms")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (fwd, draft, total)) or fwd <= 0:
        return "no target forward time"
    rest = total - fwd - draft
    if rest < -TOLERANCE_MS:
        return "its phases add up to more than the step"
    return (B, n), (float(fwd), float(draft), max(0.0, rest))


def surface_from_steps(rows, min_steps: int = MIN_STEPS) -> tuple[dict | None, list[str]]:
    """(results["surface"] or None, warnings) from step records as `ingest.plugin_steps` parses them."""
    groups: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    skipped: dict[str, int] = {}
    for r in rows:
        got = _point_of(r)
        if isinstance(got, str):
            skipped[got] = skipped.get(got, 0) + 1
            continue
        groups.setdefault(got[0], []).append(got[1])
    warnings = []
    if skipped:
        warnings.append(f"{sum(skipped.values())} step(s) left out of the verify surface: "
                        + ", ".join(f"{why} ({k})" for why, k in sorted(skipped.items(), key=lambda x: -x[1])))
    points, dropped = [], []
    for (B, n), ts in sorted(groups.items()):
        if len(ts) < min_steps:
            dropped.append(f"batch {B} × {n} token(s) ({len(ts)} step(s))")
            continue
        # medians (what T is); the means beside them are what wall-clock throughput is made of (tune --stat mean)
        points.append({"batch": B, "context": 0, "tokens": n, **summarize([t[0] for t in ts]),
                       "mean_ms": statistics.fmean(t[0] for t in ts), "steps": len(ts),
                       "draft_ms": statistics.median(t[1] for t in ts),
                       "draft_mean_ms": statistics.fmean(t[1] for t in ts),
                       "rest_ms": statistics.median(t[2] for t in ts),
                       "rest_mean_ms": statistics.fmean(t[2] for t in ts)})
    if dropped:
        more = f", and {len(dropped) - SHOWN} more" if len(dropped) > SHOWN else ""
        warnings.append(f"{len(dropped)} (batch, tokens) point(s) with fewer than {min_steps} steps left out of the "
                        f"verify surface: {', '.join(dropped[:SHOWN])}{more}")
    if not points:
        if groups:
            warnings.append(f"no verify surface: no (batch, tokens) point has {min_steps} steps")
        return None, warnings
    return surface_results(_surface(points, min_steps)), warnings


def _surface(points: list[dict], min_steps: int) -> dict:
    fits = {}
    for B in sorted({p["batch"] for p in points}):
        pts = [p for p in points if p["batch"] == B]
        fits[str(B)] = {"0": fit_piecewise([p["tokens"] for p in pts], [p["median_ms"] for p in pts]).to_dict()}
    return {"context": None, "region": None, "batches": sorted({p["batch"] for p in points}),
            "tokens": sorted({p["tokens"] for p in points}), "points": points, "fits": fits, "source": SOURCE,
            "min_steps": min_steps}
