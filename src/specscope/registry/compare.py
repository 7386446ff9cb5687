"""`specscope compare`: runs side by side, a noise-aware verdict per metric, what differs, and why it likely moved.

The first run is the reference; every other run is compared against it:

* rows (`rows.py`): tok/s, ms/token, τ, ms/cycle and each phase's ms/cycle with the relative change, its
  bootstrap interval and a verdict (`stats.py`), intervals Bonferroni-corrected over the rows;
* config / env differences, only keys that differ (volatile fields such as the timestamp left out);
* attribution: the change in ms/token split exactly into each phase's share plus acceptance (τ),
  Δ(cyc/τ) = Σ_p (b_p − a_p)/τ_b + cyc_a·(1/τ_b − 1/τ_a); a phase that moved out of proportion to the others;
  and the differing settings ranked as likely causes (`causes.py`).

`matrix()` lays runs out along one or two keys (an env var × steps, say) with a metric per cell.
"""

from __future__ import annotations

import math

import json
import statistics

from specscope.errors import SpecscopeError
from specscope.registry import causes, stats
from specscope.registry.fingerprint import VOLATILE, flatten, load_warning
from specscope.registry.labels import BOTH_ZERO, FROM_ZERO, moved_words
from specscope.registry.labels import ms_per_token as _ms_tok
from specscope.registry.rows import metric_defs, same_prompts

OOP_MIN_SHARE = 0.03       # phases below 3 % of a cycle are too small to call "out of proportion"
JUDGED = ("better", "worse", "no significant change")
HOW_TO_JUDGE = ("record runs that keep per-cycle samples (specscope generate / bench / bench-serve), or repeat each "
                "setup a few times (ingest every log, tag them) and compare the repeats with --by to see the "
                "run-to-run spread")


# ---- differences --------------------------------------------------------------------------------------------
def _flat_settings(rec: dict) -> dict:
    out = {f"config.{k}": v for k, v in flatten(rec.get("config") or {}).items()}
    env = flatten(rec.get("env") or {})
    for k, v in env.items():
        if not any(k == vol or k.startswith(vol + ".") for vol in VOLATILE):
            out[f"env.{k}"] = v
    return out


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def settings_diff(runs: list[dict]) -> dict[str, list]:
    """{flat key: [value per run]} for keys whose values are not all equal (a missing key counts as None)."""
    flats = [_flat_settings(r) for r in runs]
    keys = sorted(set().union(*flats))
    return {k: [f.get(k) for f in flats] for k in keys if not all(_same(f.get(k), flats[0].get(k)) for f in flats)}


# ---- comparison ---------------------------------------------------------------------------------------------
def compare_runs(runs: list[dict], alpha: float = 0.05, min_effect: float = 0.02) -> dict:
    if len(runs) < 2:
        raise SpecscopeError("compare needs at least two runs")
    defs = metric_defs(runs)
    tested = sum(1 for d in defs if any(d["samples"](r) for r in runs))
    level = 1 - alpha / max(tested, 1)
    names = [run_name(r, i) for i, r in enumerate(runs)]
    rows = []
    for d in defs:
        ref_s = d["samples"](runs[0])
        values = [_value(d, r) for r in runs]
        row = {"metric": d["key"], "label": d["label"], "better": "higher" if d["higher"] else "lower",
               "unit": d["unit"], "values": [_round(v) for v in values], "present": [_is_num(v) for v in values],
               "samples": [_n_samples(d, r) for r in runs], "changes": [None], "verdicts": [None]}
        ref_zero = _is_num(values[0]) and abs(values[0]) < d["floor"](runs[0])
        for i, r in enumerate(runs[1:], 1):
            va, vb = values[0], values[i]
            s = d["samples"](r)
            if ref_zero and _is_num(vb):
                # a percentage of a base within noise of 0 is no finding (0.009 -> 14.02 ms is not +157377 %)
                both = abs(vb) < d["floor"](r)
                row["changes"].append({"change": None, "lo": None, "hi": None, "from_zero": True, "both_zero": both,
                                       "delta": _round(vb - va, 5), "reason": "reference below the noise floor"})
                row["verdicts"].append(BOTH_ZERO if both else FROM_ZERO)
                continue
            if ref_s and s and d.get("paired") and same_prompts(runs[0], r):
                ch = stats.paired_ratio_change(ref_s[0], s[0], level=level)
            elif ref_s and s:
                ch = stats.ratio_change(*ref_s, *s, level=level)
            else:
                change = (vb / va - 1) if _is_num(va) and _is_num(vb) and va else None
                ch = {"change": change, "lo": None, "hi": None, "reason": "no per-cycle samples"}
            # a zero reference makes the ratio NaN/inf: no number (JSON has none for it), the verdict says why
            row["changes"].append({k: (None if not math.isfinite(v) else _round(v, 5)) if isinstance(v, float) else v
                                   for k, v in ch.items()})
            row["verdicts"].append(stats.verdict(ch, d["higher"], min_effect) if ch["change"] is not None
                                   else _missing(row["present"][0], row["present"][i], names[0], names[i]))
        rows.append(row)
    diff = settings_diff(runs)
    attributions = [_attribute(runs[0], runs[i], rows, i) for i in range(1, len(runs))]
    return {
        "runs": [{"id": r.get("id"), "name": r.get("name"), "kind": r.get("kind"), "created_at": r.get("created_at")}
                 for r in runs],
        "reference": runs[0].get("id"),
        "confidence": round(level, 5),
        "min_effect": min_effect,
        "rows": rows,
        "config_diff": {k: v for k, v in diff.items() if k.startswith("config.")},
        "env_diff": {k: v for k, v in diff.items() if k.startswith("env.")},
        "attribution": attributions,
        # "were these runs comparable?": a run timed on an oversubscribed machine is not
        "load_warnings": {r.get("id") or f"#{i}": w for i, r in enumerate(runs)
                          if (w := load_warning(r.get("env")))},
    }


def run_name(rec: dict, i: int) -> str:
    """How a run is named in verdicts: its id, else its place (#0 = the reference), as `compare` heads columns."""
    return rec.get("id") or f"#{i}"


def _n_samples(d: dict, rec: dict) -> int | None:
    """How many samples (cycles, prompts) a row's value rests on in this run; None for a point value."""
    s = d["samples"](rec)
    return len(s[0]) if s else None


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _missing(in_ref: bool, in_run: bool, ref: str, run: str) -> str:
    """The verdict of a row that cannot be compared: which run lacks it (a metric only one kind of run has, e.g.
    acceptance in a speculative run against a plain one), or a zero reference."""
    if in_ref and in_run:
        return "n/a (zero reference)"
    if in_ref or in_run:
        return f"only in {ref if in_ref else run}"
    return NOT_MEASURED


ONLY_IN = "only in "
NOT_MEASURED = "not measured in either run"


def one_sided(rows: list[dict]) -> tuple[list[dict], dict[str, list[str]]]:
    """(rows compared in at least one pair, {run name: labels of the rows only that run has}): tables list the
    one-sided rows once, grouped by run, instead of a row of "only in ..." each."""
    kept, only = [], {}
    for row in rows:
        vs = [v for v in row["verdicts"][1:] if v]
        if vs and all(v.startswith(ONLY_IN) for v in vs) and len(set(vs)) == 1:
            only.setdefault(vs[0][len(ONLY_IN):], []).append(row["label"])
        else:
            kept.append(row)
    return kept, only


def speed_change(res: dict, i: int = 1) -> dict | None:
    """The speed of run i against the reference, as the Compare table judges it: the decode tok/s row (the
    cycles, prefill left out) where there is one, else tok/s. {"label", "ratio", "lo", "hi", "verdict",
    "confidence"} with ratios (1.0 = the same speed; lo/hi None without samples), or None. The report's headline
    reads this, so it never calls faster what the table calls no significant change."""
    by = {r["metric"]: r for r in res["rows"]}
    row = by.get("decode_tok_per_s") or by.get("tok_per_s")
    ch = (row or {"changes": [None] * (i + 1)})["changes"][i] or {}
    if ch.get("change") is None:
        return None
    lo, hi = ch.get("lo"), ch.get("hi")
    return {"label": row["label"], "ratio": 1 + ch["change"], "lo": None if lo is None else 1 + lo,
            "hi": None if hi is None else 1 + hi, "verdict": row["verdicts"][i], "confidence": res["confidence"],
            "min_effect": res["min_effect"]}


def speed_words(sc: dict, than: str = "plain decoding", ratio: bool = True) -> str:
    """'2.01× the decode tok/s of plain decoding: faster (1.62×–2.48× at 99.72 %)', or '...: no significant
    change (the interval 0.88×–3.65× at 99.72 % includes 1×)'; ratio=False leaves out the leading '2.01× '."""
    head = (f"{sc['ratio']:.2f}× " if ratio else "") + f"the {sc['label']} of {than}"
    if sc["lo"] is None:
        return f"{head}; {sc['verdict']}: the noise is unknown, so this is not judged"
    span = f"{sc['lo']:.2f}×–{sc['hi']:.2f}× at {sc['confidence'] * 100:.2f} %"
    if sc["verdict"] == "better":
        return f"{head}: faster ({span})"
    if sc["verdict"] == "worse":
        return f"{head}: slower ({span})"
    why = (f"the interval {span} includes 1×" if sc["lo"] <= 1 <= sc["hi"]
           else f"{span}, under the {sc['min_effect'] * 100:.0f} % smallest change called")
    return f"{head}: no significant change ({why})"


def _value(d: dict, rec: dict):
    """The shown value comes from the same samples as its interval when there are samples (for a generate run
    tok/s is then decode-only: the cycles, without prefill), else from the stored result."""
    s = d["samples"](rec)
    if s and sum(s[1]):
        return sum(s[0]) / sum(s[1])
    return d["value"](rec)


def _round(v, nd=4):
    return round(v, nd) if isinstance(v, float) else v


def _changed(v: str | None) -> bool:
    return v in ("better", "worse")


def _attribute(a: dict, b: dict, rows: list[dict], i: int) -> dict:
    by = {r["metric"]: r for r in rows}
    out = {"run": b.get("id"), "against": a.get("id")}
    tok = by.get("tok_per_s")
    if tok and tok["changes"][i] and tok["changes"][i].get("change") is not None:
        out["tok_per_s_change"] = tok["changes"][i]["change"]
        out["tok_per_s_verdict"] = tok["verdicts"][i]
    contributions, total = _split_ms_per_token(a, b)
    if total is not None:
        out["delta_ms_per_token"] = total
    out["contributions"] = contributions
    changed_phases = {r["metric"][6:] for r in rows if r["metric"].startswith("phase.") and "." not in r["metric"][6:]
                      and _changed(r["verdicts"][i])}
    if by.get("baseline.decode") and _changed(by["baseline.decode"]["verdicts"][i]):
        changed_phases.add("decode")
    tau_row = by.get("accept_length")
    tau_changed = bool(tau_row and _changed(tau_row["verdicts"][i]))
    any_change = bool(changed_phases or tau_changed or any(_changed(r["verdicts"][i]) for r in rows))
    oop = _out_of_proportion(rows, i, a, b)
    out["out_of_proportion"] = oop
    judged = [r["label"] for r in rows if r["verdicts"][i] in JUDGED]
    unjudged = [r for r in rows if r["verdicts"][i] not in JUDGED and ((r["changes"][i] or {}).get("change") is not None
                                                                      or r["verdicts"][i] == FROM_ZERO)]
    out["judged"] = judged
    out["not_judged"] = [r["label"] for r in unjudged]
    out["judgeable"] = True
    if any_change:
        out["summary"] = _change_summary(out, contributions, by, i, unjudged, oop)
        moved = _components_moved(a, b, [out.get("explains"), *sorted(changed_phases)])
        if moved:
            out["components"] = moved
            out["summary"] += "; " + moved["words"]
    else:
        _no_change_summary(out, judged, unjudged, i)
    shape = {"out_of_proportion": oop["phase"] if oop else None, "tau_changed": tau_changed,
             "changed_phases": changed_phases}
    pair = settings_diff([a, b])
    out["likely_causes"] = causes.rank({k: tuple(v) for k, v in pair.items()}, shape)
    if not any_change and judged and out["likely_causes"]:
        out["note"] = "settings differ but no judged metric changed beyond noise"
    elif not judged and not any_change:
        out["note"] = "to judge: " + HOW_TO_JUDGE
    return out


def _components_moved(a: dict, b: dict, phases: list) -> dict | None:
    """The component split of the first changed phase both runs profiled (plugin windows, vLLM traces)."""
    from specscope.profile.components import change

    ca, cb = ((r.get("results") or {}).get("components") for r in (a, b))
    if not ca or not cb:
        return None
    for ph in dict.fromkeys(p for p in phases if p and p != "acceptance (τ)"):
        moved = change(ca, cb, ph)
        if moved is not None:
            return moved
    return None


def _split_ms_per_token(a: dict, b: dict) -> tuple[list[dict], float | None]:
    """(contributions, total): the exact split of the ms/token change from a to b into each top-level phase's
    share plus acceptance (τ), largest first; ([], None) when neither run has phases."""
    pa = (a.get("results") or {}).get("phases") or {}
    pb = (b.get("results") or {}).get("phases") or {}
    ta = (a.get("results") or {}).get("accept_length") or 1.0
    tb = (b.get("results") or {}).get("accept_length") or 1.0
    top = [p for p in dict.fromkeys(list(pa) + list(pb)) if "." not in p]
    if not top:
        return [], None
    ma = {p: (pa.get(p) or {}).get("mean_ms", 0.0) for p in top}
    mb = {p: (pb.get(p) or {}).get("mean_ms", 0.0) for p in top}
    total = sum(mb.values()) / tb - sum(ma.values()) / ta
    contributions = [{"phase": p, "delta_ms_per_token": (mb[p] - ma[p]) / tb} for p in top]
    if abs(ta - tb) > 1e-9:
        contributions.append({"phase": "acceptance (τ)", "delta_ms_per_token": sum(ma.values()) * (1 / tb - 1 / ta)})
    for c in contributions:
        c["share"] = round(c["delta_ms_per_token"] / total, 4) if abs(total) > 1e-12 else None
        c["delta_ms_per_token"] = round(c["delta_ms_per_token"], 5)
    contributions.sort(key=lambda c: -abs(c["delta_ms_per_token"]))
    return contributions, round(total, 5)


def _no_change_summary(out: dict, judged: list[str], unjudged: list[dict], i: int) -> None:
    """The words of an attribution where no metric changed beyond noise: no change where some metric was judged,
    else that nothing could be (point values without samples)."""
    out["explains"] = None
    if judged:
        out["summary"] = "no significant change in any metric" if not unjudged else (
            f"no significant change in {', '.join(judged)}; {_not_judged(unjudged, i)}")
        return
    # point values without samples: a difference cannot be told from noise, and "no change" would be a claim
    out["judgeable"] = False
    zero = [r for r in unjudged if r["verdicts"][i] == FROM_ZERO]      # few, and the largest moves: all named
    moved = ", ".join(moved_words(r, i) for r in [r for r in unjudged if r not in zero][:4] + zero)
    out["summary"] = ("cannot be judged from these data: no metric has per-cycle samples, so the noise of "
                      + (f"the differences ({moved}) " if moved else "these values ") + "is unknown")
    out["how_to_judge"] = HOW_TO_JUDGE


def _net_changed(by: dict, i: int) -> bool:
    """Is the net ms/token change beyond noise? Its own row decides; without samples for it, tok/s's does."""
    for key in ("ms_per_token", "decode_tok_per_s", "tok_per_s"):
        row = by.get(key)
        if row and row["verdicts"][i] in JUDGED:
            return _changed(row["verdicts"][i])
    return True     # neither judged: the split is of a measured difference whose noise is unknown (said below)


def _change_summary(out: dict, contributions: list[dict], by: dict, i: int, unjudged: list[dict], oop) -> str:
    """The words of an attribution where some metric changed: tok/s, then the split of the ms/token change into
    phases and acceptance. A net change within noise gets no split (a share of noise is no finding, and its
    ratios explode: -5.34 of -0.002 ms is 355453 %); the moves that cancelled are named instead."""
    total = out.get("delta_ms_per_token") or 0.0
    parts = []
    if "tok_per_s_change" in out:
        parts.append(f"tok/s {out['tok_per_s_change'] * 100:+.1f}% ({out['tok_per_s_verdict']})")
    if contributions and not _net_changed(by, i):
        for c in contributions:
            c["share"] = None
        out["explains"] = None
        moved = [c for c in contributions if _changed(_row_verdict(by, c["phase"], i))]
        msg = f"ms/token: no significant change ({_ms_tok(total)}, within noise), so it is not split"
        if moved:
            # "cancelling out" needs moves both ways; one move alone is said as what it is
            both_ways = len({c["delta_ms_per_token"] > 0 for c in moved if c["delta_ms_per_token"]}) == 2
            msg += ("; what moved, cancelling out: " if both_ways else "; what moved: ") + ", ".join(
                f"{c['phase']} {_ms_tok(c['delta_ms_per_token'])}" for c in moved)
        parts.append(msg)
    else:
        # the phase that moved most in the direction of the total change; opposite moves are named as offsets
        same = [c for c in contributions if c["delta_ms_per_token"] * total > 0]
        lead = same[0] if same else None
        out["explains"] = lead["phase"] if lead else None
        if lead and lead["share"] is not None:
            msg = (f"{lead['phase']} accounts for {_ms_tok(lead['delta_ms_per_token'])} of the {_ms_tok(total)} "
                   f"change ({lead['share'] * 100:.0f}%")
            offsets = [c for c in contributions if c["delta_ms_per_token"] * total < 0
                       and abs(c["delta_ms_per_token"]) > 0.25 * abs(total)]
            if lead["share"] > 1.005:
                # the phases do not all move together: the others made up part of it
                msg += "; over 100% because other changes went the other way"
            msg += ")"
            if offsets:
                msg += ", offset by " + ", ".join(f"{c['phase']} {_ms_tok(c['delta_ms_per_token'])}" for c in offsets)
            parts.append(msg)
    if oop:
        parts.append(oop["message"])
    if unjudged:
        parts.append(_not_judged(unjudged, i))
    return "; ".join(parts)


def _not_judged(unjudged: list[dict], i: int) -> str:
    """The rows shown as measured and not called, and why: no per-cycle samples, or a reference of ~0."""
    zero = [r for r in unjudged if (r["changes"][i] or {}).get("from_zero")]
    plain = [r for r in unjudged if r not in zero]
    out = ["not judged (no per-cycle samples): " + ", ".join(r["label"] for r in plain)] if plain else []
    if zero:
        out.append("not judged (reference ~0): " + ", ".join(moved_words(r, i) for r in zero))
    return "; ".join(out)


def _row_verdict(by: dict, phase: str, i: int) -> str | None:
    row = by.get("accept_length" if phase == "acceptance (τ)" else f"phase.{phase}")
    return row["verdicts"][i] if row else None


def _out_of_proportion(rows, i, a, b) -> dict | None:
    """The phase whose relative change stands apart from the others' (e.g. verify +53 % while decode +8 %)."""
    cands = []
    for r in rows:
        m = r["metric"]
        if not (m.startswith("phase.") and "." not in m[6:]) and m != "baseline.decode":
            continue
        ch = r["changes"][i]
        if not ch or ch.get("change") is None:
            continue
        if m.startswith("phase."):
            p = m[6:]
            share = max(((x.get("results") or {}).get("phases") or {}).get(p, {}).get("share", 0.0) for x in (a, b))
            if share < OOP_MIN_SHARE or p == "other":
                continue
            name = p
        else:
            name = "decode (baseline)"
        cands.append((name, ch["change"] * 100, r["verdicts"][i]))
    if len(cands) < 2:
        return None
    best = None
    for name, pct, verdict in cands:
        others = [c for c in cands if c[0] != name]
        med = statistics.median(c[1] for c in others)
        if not _changed(verdict) and not verdict.startswith("n/a"):
            continue
        gap = abs(pct - med)
        if gap >= 10 and abs(pct) >= 2 * abs(med) + 5 and (best is None or gap > best[0]):
            best = (gap, name, pct, others, med)
    if best is None:
        return None
    _, name, pct, others, med = best
    shown = ", ".join(f"{o[0]} {o[1]:+.0f}%" for o in sorted(others, key=lambda o: -abs(o[1]))[:3])
    return {"phase": name, "change_pct": round(pct, 2), "others_median_pct": round(med, 2),
            "message": f"{name} {pct:+.0f}% while {shown}"}


# ---- matrix mode --------------------------------------------------------------------------------------------
def lookup(rec: dict, key: str):
    """A setting by a short or full key: "steps", "NCCL_PROTO", "env.NCCL_PROTO", "config.steps",
    "env.gpu.sm_clock_max_mhz", "tok_per_s"."""
    flat = _flat_settings(rec) | {f"results.{k}": v for k, v in flatten(rec.get("results") or {}).items()}
    flat.update({"kind": rec.get("kind"), "name": rec.get("name")})
    short_env = f"env.vars.{key[4:]}" if key.startswith("env.") else None      # env.NCCL_PROTO
    for cand in (key, f"config.{key}", f"env.vars.{key}", f"env.{key}", f"results.{key}", short_env):
        if cand in flat:
            return flat[cand]
    hits = [k for k in flat if k.endswith("." + key)]
    return flat[hits[0]] if len(hits) == 1 else None


def matrix(runs: list[dict], keys: list[str], metric: str = "tok_per_s") -> dict:
    if not 1 <= len(keys) <= 2:
        raise SpecscopeError("--by takes one or two keys, e.g. --by NCCL_PROTO,steps")
    if not runs:
        raise SpecscopeError("compare --by needs runs")

    def label(v):
        return "-" if v is None else (json.dumps(v) if isinstance(v, (list, dict)) else str(v))

    def val(r):
        v = lookup(r, metric)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    if all(all(lookup(r, k) is None for r in runs) for k in keys):
        raise SpecscopeError(f"none of the runs has {', '.join(keys)}; keys are config fields (steps), env vars "
                             f"(NCCL_PROTO) or dotted paths (env.gpu.sm_clock_max_mhz)")
    rows, cols, cells = [], [], {}
    for r in runs:
        rv = label(lookup(r, keys[0]))
        cv = label(lookup(r, keys[1])) if len(keys) > 1 else ""
        if rv not in rows:
            rows.append(rv)
        if cv not in cols:
            cols.append(cv)
        cells.setdefault((rv, cv), []).append(r)

    def order(vs):
        try:
            return sorted(vs, key=float)
        except ValueError:
            return sorted(vs)

    rows, cols = order(rows), order(cols)
    grid = []
    for rv in rows:
        line = []
        for cv in cols:
            rs = cells.get((rv, cv), [])
            vals = [val(r) for r in rs if val(r) is not None]
            line.append({"value": round(statistics.fmean(vals), 4) if vals else None,
                         "stdev": round(statistics.stdev(vals), 4) if len(vals) > 1 else None,
                         "n": len(rs), "runs": [r.get("id") for r in rs]})
        grid.append(line)
    return {"by": keys, "metric": metric, "rows": rows, "cols": cols, "cells": grid}

