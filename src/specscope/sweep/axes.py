"""What `compare` says about each axis of a sweep (see `sweep.matrix` for the rule): per slice, the axis's first
value against each other value, the headline rows (tok/s, τ, ms/cycle, each top-level phase) with change,
interval and verdict, and compare's likely causes — whether the top one is a setting the axis itself changed."""

from __future__ import annotations

import itertools

from specscope.sweep.pool import sample_counts
from specscope.sweep.spec import Axis, Cell, SweepSpec, shown

CHANGED = ("better", "worse")
NOT_CALLED = "not called"      # compare calls it within one run, but no repeats measured the noise between launches
HEADLINE = ("tok_per_s", "decode_tok_per_s", "ms_per_token", "accept_length", "cycle_ms")


def headline(metric: str) -> bool:
    """The rows an axis is judged on: sub-phases (verify.forward, ...) stay in `compare`'s own table."""
    return metric in HEADLINE or (metric.startswith("phase.") and "." not in metric[6:])


def _row_of(cmp: dict, metric: str) -> dict | None:
    return next((r for r in cmp["rows"] if r["metric"] == metric), None)


def _small(metric: str, a: dict, b: dict) -> bool:
    """A phase compare would not name as the one that moved (registry.compare's floor: under OOP_MIN_SHARE of the
    cycle in both runs, or "other", the step's unscoped host time): its change is listed, not called."""
    from specscope.registry.compare import OOP_MIN_SHARE

    if not metric.startswith("phase."):
        return False
    p = metric[6:]
    share = max(((x.get("results") or {}).get("phases") or {}).get(p, {}).get("share", 0.0) for x in (a, b))
    return p == "other" or share < OOP_MIN_SHARE


def _judge(row: dict, pairs: list, small: bool, noise: float | None) -> dict:
    """One headline row: compare's verdict on the pooled cells, kept only if no repeat pair points the other way
    and the change leaves the metric's launch-to-launch noise (`noise`; None: no repeats measured it, and a change
    is then shown as measured and not called)."""
    v, ch = row["verdicts"][1], row["changes"][1] or {}
    reps = [(rep, _row_of(c, row["metric"])) for rep, c in pairs]
    changes = [((r["changes"][1] or {}).get("change") if r else None) for _, r in reps]
    out = {"metric": row["metric"], "label": row["label"], "values": row["values"], "change": ch.get("change"),
           "lo": ch.get("lo"), "hi": ch.get("hi"), "pooled": v, "repeat_changes": changes,
           "repeats": [r["verdicts"][1] if r else None for _, r in reps], "verdict": v, "small": small}
    if v in CHANGED and any(c is None or c * ch["change"] <= 0 for c in changes):
        out["verdict"] = "no significant change"
        out["note"] = "the repeats point different ways: " + ", ".join(
            f"#{rep + 1} {'?' if c is None else f'{c * 100:+.1f}%'}" for (rep, _), c in zip(reps, changes))
    elif v in CHANGED and noise is None:
        out["verdict"] = NOT_CALLED
        out["note"] = "no launch-to-launch noise to judge it against (one repeat): measured, not called"
    elif v in CHANGED and abs(ch["change"]) <= noise:
        out["verdict"] = "no significant change"
        out["note"] = (f"within launch-to-launch noise: two launches of one cell differ by up to "
                       f"{noise * 100:.0f}% here")
    return out


def compare_cells(ref: list[dict], other: list[dict], ref_label: str, other_label: str,
                  noise: dict[str, float] | None = None, keep=headline, causes: int | None = 5) -> dict:
    """compare_runs on the pooled cells and on each repeat pair; rows judged as sweep.matrix says (`noise`: metric
    -> launch-to-launch noise, sweep.matrix.launch_noise); `keep(metric)`: the rows judged (bisect's one metric may
    be a sub-phase); `causes`: how many of compare's likely causes to keep (None: all)."""
    from specscope.registry.compare import compare_runs, settings_diff
    from specscope.sweep.pool import pooled

    a, b = pooled(ref, ref_label), pooled(other, other_label)
    main = compare_runs([a, b])
    ra = {r["sweep"]["repeat"]: r for r in ref}
    rb = {r["sweep"]["repeat"]: r for r in other}
    pairs = [(rep, compare_runs([ra[rep], rb[rep]])) for rep in sorted(set(ra) & set(rb))]
    rows = [_judge(row, pairs, _small(row["metric"], a, b), (noise or {}).get(row["metric"]))
            for row in main["rows"] if keep(row["metric"])]
    att = main["attribution"][0]
    return {"rows": rows, "summary": att["summary"], "components": att.get("components"),
            "likely_causes": att["likely_causes"][:causes],
            "settings": sorted(settings_diff([a, b])), "confidence": main["confidence"],
            "min_effect": main["min_effect"]}


def called(row: dict) -> bool:
    """A row the slice and the axis are judged on: changed, and not a phase too small to name."""
    return row["verdict"] in CHANGED and not row.get("small")


def _slice_verdict(rows: list[dict]) -> str:
    if any(called(r) for r in rows):
        return "changed"
    if any(r["verdict"] == NOT_CALLED and not r.get("small") for r in rows):
        return NOT_CALLED
    judged = any(r["verdict"] == "no significant change" for r in rows)
    return "no significant change" if judged else "not judged"


def axis_report(spec: SweepSpec, axis: Axis, by_cell: dict, noise: dict[str, float] | None = None) -> dict:
    others = [a for a in spec.axes if a is not axis]
    slices = []
    for combo in itertools.product(*(a.values for a in others)):
        at = dict(zip([a.name for a in others], combo))

        def key(v, at=at):
            return Cell(tuple((a.name, v if a is axis else at[a.name]) for a in spec.axes)).key
        ref = by_cell.get(key(axis.values[0])) or []
        for v in axis.values[1:]:
            other = by_cell.get(key(v)) or []
            s = {"at": at, "from": axis.values[0], "to": v, "runs": [len(ref), len(other)]}
            failed = sample_counts(ref)["failed_requests"] + sample_counts(other)["failed_requests"]
            if not ref or not other:
                s.update(verdict="not judged", why="a cell has no run yet", rows=[])
            elif failed:
                s.update(verdict="not judged", why=f"{failed} request(s) failed in these cells", rows=[])
            else:
                s.update(compare_cells(ref, other, key(axis.values[0]), key(v), noise))
                s["verdict"] = _slice_verdict(s["rows"])
                s["axis_settings"] = axis_settings(axis, s["settings"])
                top = (s["likely_causes"] or [{}])[0].get("key")
                s["cause"], s["cause_is_axis"] = top, top in s["axis_settings"]
            slices.append(s)
    return {"axis": axis.name, "key": axis.key, "values": list(axis.values), "verdict": _axis_verdict(slices),
            "moved": _moved(slices), "slices": slices}


def axis_settings(axis: Axis, differing: list[str]) -> list[str]:
    """The settings that differ because of the axis: the configuration keys the cells' runs disagree on (the
    engine reports what the axis set, e.g. num_speculative_tokens and steps), or the axis's own variable. Other
    environment keys that differ (the load average, ...) are the machine, not the axis."""
    if axis.kind == "env":
        return [f"env.vars.{axis.name}"]
    return [k for k in differing if k.startswith("config.")]


def _axis_verdict(slices: list[dict]) -> str:
    vs = [s["verdict"] for s in slices]
    for v in ("changed", NOT_CALLED):
        if v in vs:
            return v
    return "no significant change" if "no significant change" in vs else "not judged"


def _moved(slices: list[dict]) -> list[dict]:
    """Per metric that changed in some slice: in how many, by how much in each, and which way."""
    out = {}
    for s in slices:
        for r in s.get("rows") or []:
            if called(r):
                m = out.setdefault(r["metric"], {"metric": r["metric"], "label": r["label"], "changes": [],
                                                 "verdicts": [], "slices": 0})
                m["changes"].append(r["change"])
                m["verdicts"].append(r["verdict"])
                m["slices"] += 1
    for m in out.values():
        m["of"] = len(slices)
    return sorted(out.values(), key=lambda m: -max(abs(c or 0) for c in m["changes"]))


def slice_label(s: dict) -> str:
    return ", ".join(f"{n}={shown(v)}" for n, v in s["at"].items())
