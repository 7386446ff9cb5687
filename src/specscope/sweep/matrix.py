"""The sweep's answer, one document (the terminal table, --json and the HTML page are all drawn from it):

* the matrix: rows × columns of the axes; per cell verify ms/cycle and its share, draft ms, τ and tok/s, each the
  mean over the repeats with their spread (sample standard deviation), and the cell's break-even τ with whether
  it pays (`economics.breakeven` on the cell's runs against the baseline of its environment);
* per axis, what `compare` says: for each slice (the other axes held at one value) the axis's first value
  against each other one, compared by `registry.compare.compare_runs` — its rows, intervals and verdicts, its
  likely causes. The repeats of a cell are pooled (their cycles and prompts end to end) for the comparison, and
  each repeat pair is compared too: a change is called when compare calls it on the pooled cells, no repeat
  pair points the other way, and it is larger than that metric's launch-to-launch noise — the largest change
  between two repeats of one cell anywhere in the sweep; for a time (a phase, ms/cycle, tok/s) at least the
  whole launch's (a launch that runs slow runs slow in every phase, and a few repeat pairs understate one phase's
  spread: on the 2-core CPU draft and verify moved 14 % together between two NCCL_PROTO cells, which change
  nothing, while their own repeats had spread 10-11 % and the cycle's 32 %). compare's intervals cover the noise
  within a run; two
  launches of one setting can land tens of percent apart on a shared machine, which only repeats show (and the
  ABBA order turns a drift into repeat pairs that disagree). A phase compare would not name (under its 3 % share
  floor, or "other") is listed with its change but does not make an axis "changed".
"""

from __future__ import annotations

import itertools
import statistics

from specscope.errors import SpecscopeError
from specscope.sweep.spec import Cell, SweepSpec
from specscope.sweep.hostspeed import spread as host_spread
from specscope.sweep.pool import pooled, sample_counts, value_of
from specscope.sweep.state import SweepState, slot
from specscope.sweep.surface import surface_entries

CELL_FIELDS = {"verify_ms": ("phases", "verify", "mean_ms"), "verify_share": ("phases", "verify", "share"),
               "draft_ms": ("phases", "draft", "mean_ms"), "tau": ("accept_length",), "tok_per_s": ("tok_per_s",)}
BASE_FIELDS = {"decode_ms": ("decode_ms_per_token",), "tok_per_s": ("tok_per_s",)}


def _stat(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": round(statistics.fmean(vals), 4), "sd": round(statistics.stdev(vals), 4) if len(vals) > 1
            else None, "n": len(vals)}


def load_runs(state: SweepState, db=None) -> dict[tuple[str, int], dict]:
    """(cell key, repeat) -> the stored run, for every done slot of the sweep file."""
    from specscope.registry import open_registry

    out = {}
    done = state.data["done"]
    if not done:
        return out
    with open_registry(db, create=False) as reg:
        for key, r in state.spec.schedule():
            o = done.get(slot(key, r))
            if o is None:
                continue
            try:
                out[(key, r)] = reg.get_run(o["run_id"])
            except SpecscopeError:
                pass            # deleted from the registry since: the slot reads as missing
    return out


# ---- cells ------------------------------------------------------------------------------------------------------
def _breakeven(recs: list[dict], base: list[dict] | None, label: str, base_label: str) -> dict | None:
    from specscope.economics.breakeven import BreakevenInputs, breakeven, inputs_from_runs

    if not recs or not (recs[0].get("results") or {}).get("drafted_tokens"):
        return None         # plain decoding, or no phases: no cycle to price
    if not base:
        return {"error": "no baseline run: add --baseline-without FLAG (e.g. speculative-config) or --baseline-run"}
    try:
        inp = inputs_from_runs(pooled(recs, label), pooled(base, base_label), BreakevenInputs())
        res = breakeven(inp)
    except SpecscopeError as e:
        return {"error": str(e)}
    need, tau = res["break_even_accept_length"], inp.measured_accept_length
    return {"break_even_tau": round(need, 4), "tau": None if tau is None else round(tau, 4),
            "pays": None if tau is None else tau >= need, "max_tau": res["max_accept_length"],
            "cycle_ms": round(res["cycle_ms"], 4), "decode_ms": round(inp.decode_ms, 4),
            "speedup": None if res.get("speedup") is None else round(res["speedup"], 4)}


def cell_entry(state: SweepState, cell: Cell, runs: dict, base: tuple[str, list] | None) -> dict:
    spec = state.spec
    recs = [runs[(cell.key, r)] for r in range(spec.repeats) if (cell.key, r) in runs]
    failed = [r for r in range(spec.repeats) if slot(cell.key, r) in state.data["failed"]]
    out = {"key": cell.key, "values": dict(cell.values), "runs": [r["id"] for r in recs], "n": len(recs),
           "failed": len(failed), "missing": spec.repeats - len(recs) - len(failed)}
    out["status"] = ("missing" if not recs and not failed else "failed" if not recs else
                     "ok" if len(recs) == spec.repeats else "partial")
    if failed:
        first = state.data["failed"][slot(cell.key, failed[0])]
        out["reason"] = first["reason"]
    fields = BASE_FIELDS if cell.baseline else CELL_FIELDS
    for name, path in fields.items():
        out[name] = _stat([value_of(r, path) for r in recs])
    out["samples"] = sample_counts(recs)
    out["components"] = _components(recs)
    if not cell.baseline:
        out["breakeven"] = (_breakeven(recs, base[1] if base else None, cell.key, base[0] if base else "")
                            if not out["samples"]["failed_requests"] else {"error": FAILED_WHY})
    return out


FAILED_WHY = "requests failed in the cell: its numbers are shown, not judged"


def _components(recs: list[dict]) -> dict:
    """What the cell's verify (or decode) spent its time on: each component's mean ms per profiled step over the
    repeats' plugin windows (why-verify.md); {} when no window ran."""
    from specscope.profile.components import pooled as pooled_components     # not sweep.pool's pooled (runs)

    out = {}
    for phase in ("verify", "decode"):
        buckets = [kb for r in recs for kb in ((r.get("results") or {}).get("components") or {}).items()]
        got = pooled_components(buckets, phase)
        if got is not None:
            out[phase] = {"ms": {c: round(ms, 4) for c, ms in got[0].items()}, "tokens": round(got[1], 2),
                          "steps": got[2]}
    return out


def launch_spread(recs: list[dict]) -> list[dict]:
    """Launches of the same cell compared with each other by compare_runs (the first repeat against each later
    one): per metric, how far apart two launches of one setting land and whether compare calls that different.
    Changes between cells smaller than this are not resolved by the repeats, whatever one launch's interval says."""
    from specscope.registry.compare import compare_runs

    out = []
    for other in recs[1:]:
        for row in compare_runs([recs[0], other])["rows"]:
            ch = row["changes"][1] or {}
            if ch.get("change") is not None:
                out.append({"metric": row["metric"], "change": round(ch["change"], 4),
                            "verdict": row["verdicts"][1]})
    return out


# the whole launch's speed: the cycle-level times (a phase's band is at least the largest of these)
LAUNCH_TIMES = ("cycle_ms", "ms_per_token", "tok_per_s", "decode_tok_per_s")


def timed(metric: str) -> bool:
    return metric in LAUNCH_TIMES or metric.startswith("phase.")


def own_noise(pairs: list[dict]) -> dict[str, float]:
    """metric -> the largest |change| between two launches of one cell (launch_spread's pairs, all cells)."""
    out: dict[str, float] = {}
    for p in pairs:
        out[p["metric"]] = max(out.get(p["metric"], 0.0), abs(p["change"]))
    return out


def launch_noise(pairs: list[dict]) -> dict[str, float]:
    """metric -> the band a change between cells must leave to be called: its own launch-to-launch spread, and
    for a time at least the whole launch's (the largest spread of the cycle-level times)."""
    own = own_noise(pairs)
    whole = max((own[m] for m in LAUNCH_TIMES if m in own), default=0.0)
    return {m: max(v, whole) if timed(m) else v for m, v in own.items()}


# what a sweep's resolving power is stated for, in this order: the phase the seed's regression was in first
RESOLVES = (("phase.verify", "verify"), ("cycle_ms", "ms/cycle"), ("accept_length", "τ"), ("tok_per_s", "tok/s"))


def _launch_noise(pairs: list[dict], by_metric: dict[str, float]) -> dict | None:
    """The sweep's headline noise figure (ms/cycle where the runs have cycles, else tok/s), every metric's band
    (by_metric), its own repeats' spread (own_by_metric), and the smallest change the repeats can call per
    headline metric (resolves: the band, which a change must leave)."""
    timed = [p for p in pairs if p["metric"] == "cycle_ms"] or [p for p in pairs if p["metric"] == "tok_per_s"]
    if not timed:
        return None
    return {"metric": timed[0]["metric"], "max_change": max(abs(p["change"]) for p in timed), "pairs": len(timed),
            "called": sum(p["verdict"] in ("better", "worse") for p in timed),
            "by_metric": {m: round(v, 4) for m, v in sorted(by_metric.items())},
            "own_by_metric": {m: round(v, 4) for m, v in sorted(own_noise(pairs).items())},
            "resolves": [{"metric": m, "label": label, "change": round(by_metric[m], 4)} for m, label in RESOLVES
                         if m in by_metric]}


def placements(runs: dict) -> list[str]:
    """How the launches' processes were placed (sweep.placement's words), each distinct one once."""
    seen = []
    for rec in runs.values():
        w = ((rec.get("env") or {}).get("placement") or {}).get("words")
        if w and w not in seen:
            seen.append(w)
    return seen


def _baseline_for(spec: SweepSpec, cell: Cell, by_cell: dict, stored: dict | None) -> tuple[str, list] | None:
    if stored is not None:
        return stored["id"], [stored]
    if not spec.baseline_without:
        return None
    kept = {a.name for a in spec.axes if a.flag not in spec.baseline_without}
    key = Cell(tuple((n, v) for n, v in cell.values if n in kept), baseline=True).key
    return key, by_cell.get(key) or []


def _columns(spec: SweepSpec) -> list[tuple]:
    return list(itertools.product(*(a.values for a in spec.axes[1:])))


def sweep_document(state: SweepState, db=None) -> dict:
    from specscope.sweep.axes import axis_report

    spec = state.spec
    runs = load_runs(state, db)
    by_cell = {c.key: [runs[(c.key, r)] for r in range(spec.repeats) if (c.key, r) in runs] for c in spec.cells()}
    stored = _stored_baseline(spec, db)
    # compare_runs once per pair; a cell whose requests failed says nothing about how launches vary
    spread = [p for recs in by_cell.values() if not sample_counts(recs)["failed_requests"]
              for p in launch_spread(recs)]
    noise = launch_noise(spread)
    cols = _columns(spec)
    grid = []
    for v0 in spec.axes[0].values:
        line = []
        for combo in cols:
            cell = Cell(tuple(zip([a.name for a in spec.axes], (v0, *combo))))
            line.append(cell_entry(state, cell, runs, _baseline_for(spec, cell, by_cell, stored)))
        grid.append(line)
    baselines = [cell_entry(state, c, runs, None) for c in spec.cells() if c.baseline]
    failures = [{"slot": k, **{f: v.get(f) for f in ("reason", "log_tail", "command", "seconds")}}
                for k, v in state.data["failed"].items()]
    schedule = spec.schedule()
    return {"sweep": {"name": state.name, "id": state.id, "workdir": str(state.path.parent),
                      "command": spec.command_text(), "axes": [a.to_dict() for a in spec.axes],
                      "repeats": spec.repeats, "workload": spec.workload, "phases_from": spec.resolved_phases(),
                      "baseline_without": spec.baseline_without, "baseline_run": spec.baseline_run,
                      "tag": f"sweep:{state.name}"},
            "progress": {"slots": len(schedule), "done": len(runs), "failed": len(state.data["failed"]),
                         "missing": len(schedule) - len(runs) - len(state.data["failed"])},
            "order": [{"cell": o["cell"], "repeat": o["repeat"]} for o in state.data["order"]],
            "matrix": {"rows": {"axis": spec.axes[0].name, "values": list(spec.axes[0].values)},
                       "cols": {"axes": [a.name for a in spec.axes[1:]], "values": [list(c) for c in cols]},
                       "cells": grid},
            "baselines": baselines, "axes": [axis_report(spec, a, by_cell, noise) for a in spec.axes],
            "launch_noise": _launch_noise(spread, noise), "placement": placements(runs),
            "host": host_spread(list(runs.values())), "engine_surfaces": surface_entries(state),
            "failures": failures}


def _stored_baseline(spec: SweepSpec, db) -> dict | None:
    if not spec.baseline_run:
        return None
    from specscope.registry import open_registry

    with open_registry(db, create=False) as reg:
        return reg.get_run(spec.baseline_run)

