"""A sweep cell's repeats as one record for `compare` and `breakeven`: their per-cycle and per-prompt samples end
to end, the phases summarised over all cycles, tok/s and τ the mean of the repeats', their profiled steps'
components merged bucket by bucket."""

from __future__ import annotations

import statistics


def value_of(rec: dict, path: tuple):
    v = rec.get("results") or {}
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def sample_counts(recs: list[dict]) -> dict:
    """What a cell's numbers rest on: its runs, their timed cycles, the requests sent and how many of them failed
    (bench-serve's counts, kept in each run's record)."""
    failed = sum(int(value_of(r, ("failed",)) or 0) for r in recs)
    return {"runs": len(recs), "cycles": sum(int(value_of(r, ("cycles",)) or 0) for r in recs),
            "requests": sum(int(value_of(r, ("serve", "completed")) or 0) for r in recs) + failed,
            "failed_requests": failed}


def pooled(recs: list[dict], label: str) -> dict:
    """One record of a cell's repeats: their cycles and per-prompt samples end to end (what `compare` tests), the
    phases summarised over all cycles, tok/s and τ the mean of the repeats'."""
    from specscope.profile.cycle import CycleProfiler
    from specscope.registry.records import results_from_summary

    samples, results = {}, {}
    timed = [r for r in recs if (r.get("samples") or {}).get("cycle_total_ms")]
    if timed:
        phases = list(dict.fromkeys(p for r in timed for p in r["samples"].get("cycle_ms") or {}))
        cm, total, acc, nd = {p: [] for p in phases}, [], [], []
        for r in timed:
            s = r["samples"]
            n = len(s["cycle_total_ms"])
            for p in phases:
                cm[p] += list((s.get("cycle_ms") or {}).get(p) or [0.0] * n)
            total += list(s["cycle_total_ms"])
            acc += list(s.get("accept_lengths") or [1] * n)
            nd += list(s.get("num_draft") or [0] * n)
        samples = {"cycle_ms": cm, "cycle_total_ms": total, "accept_lengths": acc, "num_draft": nd}
        results = results_from_summary(CycleProfiler.from_samples(samples).summary())
    if all((r.get("samples") or {}).get("per_prompt") for r in recs):
        samples["per_prompt"] = [p for r in recs for p in r["samples"]["per_prompt"]]
    for key in ("tok_per_s", "accept_length"):
        vals = [value_of(r, (key,)) for r in recs]
        if all(v is not None for v in vals):
            results[key] = statistics.fmean(vals)
    stored = [(r.get("results") or {}).get("components") for r in recs]
    if any(stored):                     # the repeats' profiled steps, for compare's component split
        from specscope.profile.components import merged

        results["components"] = merged(stored)
    first = recs[0]
    return {"id": label, "name": label, "kind": first.get("kind"), "config": dict(first.get("config") or {}),
            "env": first.get("env") or {}, "results": results, "samples": samples}
