"""A sweep's joined engine surface: the engine's own verify cost T(B, n) at the batch sizes its --max-concurrency
levels made and the draft tokens its num_speculative_tokens axis set, with n = 1 from the plain baseline cells
(--baseline-without speculative-config). The measured steps (every repeat's steps.measured.jsonl) of the cells that
differ only in that axis are pooled, parsed as `specscope ingest` parses the plugin's JSONL, and made into one
surface by `economics.engine_steps.surface_from_steps`; it is stored as ONE run (kind "engine_surface") per
combination of the other axes, once all of those cells are done, for `tune --verify-curve ID` and
`breakeven --verify-curve ID` to read. Its id is kept in the sweep file (a rerun of the sweep stores no second
one; a cell run again makes it again)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.sweep.spec import Axis, Cell, SweepSpec, _scalar, flag_value, json_of_flag, shown

AXIS_KEY = "num_speculative_tokens"
# not tagged sweep:NAME: `compare --tag sweep:NAME` and the sweep's own listings read the measured runs, and a surface
# pooled from them is no run of one configuration
KIND, TAG = "engine_surface", "engine-surface"
# the engine's settings the surface belongs to, kept where every speculative cell agrees on them
SHARED = ("engine", "engine_version", "model", "model_hash", "served_model", "method", "draft", "draft_hash",
          "tensor_parallel_size", "dtype", "timer", "max_num_seqs", "async_scheduling")
# how acceptance was pinned (vLLM's synthetic rejection sampling): from the runs, else from the launch command
SYNTHETIC = ("rejection_sample_method", "synthetic_acceptance_length", "synthetic_acceptance_rates")


@dataclass(frozen=True)
class Group:
    """The cells one surface pools: the axis's cells at one combination of the other axes, and its baseline."""
    at: tuple                # ((axis name, value), ...) of the other axes
    cells: tuple             # the speculative cells, in the axis's order
    baseline: Cell | None    # plain decoding at the same combination (n = 1), None without one

    @property
    def key(self) -> str:
        return ", ".join(f"{n}={shown(v)}" for n, v in self.at) or "all"

    def slots(self, repeats: int) -> list[tuple[str, int]]:
        cells = list(self.cells) + ([self.baseline] if self.baseline else [])
        return [(c.key, r) for c in cells for r in range(repeats)]


def surface_axis(spec: SweepSpec) -> Axis | None:
    """The axis over speculative-config.num_speculative_tokens, where the plugin's steps are read; else None."""
    if spec.resolved_phases() != "plugin":
        return None
    return next((a for a in spec.axes if a.kind == "json" and a.config_key == AXIS_KEY), None)


def groups(spec: SweepSpec) -> list[Group]:
    axis = surface_axis(spec)
    if axis is None:
        return []
    others = [a for a in spec.axes if a is not axis]
    plain = axis.flag in spec.baseline_without        # the baseline drops the speculative config: plain steps
    kept = [a for a in spec.axes if a.flag not in spec.baseline_without]
    out = []
    for combo in itertools.product(*(a.values for a in others)):
        at = dict(zip([a.name for a in others], combo))
        cells = tuple(Cell(tuple((a.name, v if a is axis else at[a.name]) for a in spec.axes)) for v in axis.values)
        base = Cell(tuple((a.name, at[a.name]) for a in kept), baseline=True) if plain else None
        out.append(Group(tuple(at.items()), cells, base))
    return out


def group_keys(spec: SweepSpec) -> set[str]:
    return {g.key for g in groups(spec)}


# ---- the pooled steps -----------------------------------------------------------------------------------------
def step_rows(path: Path) -> list[dict]:
    """The step records of one measured steps file, as `specscope ingest` parses them (a torn line left out, as
    ingest leaves it); the steps of its last configuration, as ingest keeps them."""
    from specscope.ingest.base import Malformed
    from specscope.ingest.plugin_steps import StepsParser

    p = StepsParser()
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            p.feed(line, i)
        except Malformed:
            continue
    if not p.headers:
        return []
    last = p.headers[-1].get("config")
    return [r for h, rows in zip(p.headers, p.rows) if h.get("config") == last for r in rows]


def _plain(row: dict) -> bool:
    return not any(row.get("drafted") or [])


def pooled_rows(spec: SweepSpec, workdir: Path, g: Group) -> tuple[list[dict], list[str]]:
    """The group's step rows: its speculative cells' steps that verified drafts, and the baseline's plain steps
    (a speculative engine's draft-less steps, e.g. the first after a prefill, are not plain decoding: with a
    baseline they are left out); without a baseline, every step of the speculative cells."""
    from specscope.sweep.cell import MEASURED_STEPS, cell_dir

    rows, missing = [], []
    for key, r in g.slots(spec.repeats):
        path = cell_dir(spec, workdir, key, r) / MEASURED_STEPS
        try:
            got = step_rows(path)
        except OSError:
            missing.append(f"{key} #{r + 1}")
            continue
        base = g.baseline is not None and key == g.baseline.key
        rows += [x for x in got if _plain(x)] if base else [x for x in got if not (g.baseline and _plain(x))]
    why = [f"no measured steps for {', '.join(missing)} (their files in {workdir}/cells are gone)"] if missing else []
    return rows, why


# ---- the stored run -------------------------------------------------------------------------------------------
def _agreed(runs: list[dict], key: str):
    vals = [(r.get("config") or {}).get(key) for r in runs]
    return vals[0] if vals and vals[0] is not None and all(v == vals[0] for v in vals) else None


def _from_command(spec: SweepSpec, key: str):
    """A key of the launch command's --speculative-config (its JSON object, or vLLM's dotted spelling)."""
    try:
        obj = json_of_flag(spec.command, "--speculative-config", "engine surface")
    except SpecscopeError:
        return None
    if obj is not None:
        return obj.get(key)
    text = flag_value(spec.command, f"--speculative-config.{key}")
    return None if text is None else _scalar(text)


def surface_config(spec: SweepSpec, g: Group, runs: list[dict], name: str, workload_levels: list[int]) -> dict:
    """The cells' shared config: the engine and model, the speculative method and draft, parallelism, dtype, how
    acceptance was pinned; the axis's values joined, the other axes' values, the sweep and the cell runs."""
    axis = surface_axis(spec)
    specs = [r for r in runs if not (r.get("sweep") or {}).get("baseline")]
    cfg = {k: v for k in SHARED if (v := _agreed(specs, k)) is not None}
    for k in SYNTHETIC:
        v = _agreed(specs, k)
        v = _from_command(spec, k) if v is None else v
        if v is not None:
            cfg[k] = v
    cfg.update({a.config_key: dict(g.at)[a.name] for a in spec.axes if a.kind != "env" and a.name in dict(g.at)})
    cfg.update({AXIS_KEY: list(axis.values), "concurrency_levels": list(workload_levels), "sweep": name,
                "runs": [r["id"] for r in runs]})
    return cfg


def _stored_before(reg, state, g: Group, run_ids: list[str]) -> str | None:
    """A surface of these very cell runs the registry holds though the sweep file does not name it (stored just
    before a kill): taken back, not stored twice."""
    for row in reg.list_runs(kind=KIND, tag=f"{TAG}:{state.name}"):
        rec = reg.get_run(row["id"], samples=False)
        sw = rec.get("sweep") or {}
        if sw.get("id") == state.id and sw.get("surface") == g.key and rec["config"].get("runs") == run_ids:
            return rec["id"]
    return None


def build_surface(state, g: Group, run_ids: list[str], db=None) -> dict:
    """Store the group's surface run (or find it stored); the sweep file's entry: run id (None: no surface, the
    warnings say why), the cell runs, batch sizes, tokens and the warnings of surface_from_steps."""
    from specscope.economics.engine_steps import surface_from_steps
    from specscope.registry import make_record, open_registry
    from specscope.sweep.workload import concurrency_levels

    spec = state.spec
    rows, warnings = pooled_rows(spec, state.path.parent, g)
    surface, why = surface_from_steps(rows)
    warnings += why
    entry = {"run_id": None, "runs": run_ids, "batches": [], "tokens": [], "steps": len(rows), "warnings": warnings}
    if surface is None:
        if not rows:
            warnings.append("no verify surface: the cells wrote no step records")
        return entry
    entry.update(batches=surface["batches"], tokens=surface["tokens"])
    with open_registry(db) as reg:
        runs = [reg.get_run(i, samples=False) for i in run_ids]
        entry["experts"] = experts_touched(runs, surface)
        entry["run_id"] = _stored_before(reg, state, g, run_ids)
        if entry["run_id"] is None:
            levels = concurrency_levels(spec.workload["max_concurrency"])
            rec = make_record(KIND, f"sweep {state.name}: engine surface" + (f" at {g.key}" if g.at else ""),
                              config=surface_config(spec, g, runs, state.name, levels),
                              results={"surface": surface, "surface_steps": len(rows), "surface_warnings": warnings,
                                       "experts_touched": entry["experts"]},
                              tags=[TAG, f"{TAG}:{state.name}"], env=dict(runs[0].get("env") or {}),
                              sweep={"id": state.id, "name": state.name, "surface": g.key, "at": dict(g.at),
                                     "axis": AXIS_KEY})
            entry["run_id"] = reg.add_run(rec)
    return entry


def experts_touched(runs: list[dict], surface: dict) -> list[dict]:
    """A MoE's side of the surface: per step kind and tokens the step ran through the target (B × n: a step reads
    the union of its tokens' experts, however they split into requests), the distinct experts per layer the cells'
    profiled steps routed to (the plugin's windows) and the mean ms of their MoE experts component there, beside the
    surface's median forward at that many tokens (batch 1's point where there is one). [] for a dense target or
    without windows."""
    from specscope.profile.components import merged

    fwd: dict[int, tuple[int, float]] = {}
    for p in surface.get("points") or []:
        t = p["batch"] * p["tokens"]
        if t not in fwd or p["batch"] < fwd[t][0]:
            fwd[t] = (p["batch"], p["median_ms"])
    out = []
    for key, b in merged([(r.get("results") or {}).get("components") for r in runs]).items():
        kind, _, t = key.partition("@")
        ex = b.get("experts")
        if ex and t.isdigit():
            experts_ms = (b.get("components") or {}).get(kind, {}).get("experts")
            out.append({"kind": kind, "tokens": int(t), "distinct_per_layer": ex["distinct_per_layer"],
                        "of": ex.get("of"), "bytes": ex["bytes"], "steps": ex["steps"], "experts_ms": experts_ms,
                        "forward_ms": round(fwd[int(t)][1], 4) if int(t) in fwd else None})
    return sorted(out, key=lambda d: (d["tokens"], d["kind"]))


def _done_runs(state, g: Group) -> list[str] | None:
    done = state.data["done"]
    keys = [f"{k} #{r + 1}" for k, r in g.slots(state.spec.repeats)]
    return [done[k]["run_id"] for k in keys] if all(k in done for k in keys) else None


def _still_stored(entry: dict, db) -> bool:
    if entry.get("run_id") is None:
        return True             # no surface from these runs: nothing to look for
    from specscope.registry import open_registry

    try:
        with open_registry(db, create=False) as reg:
            reg.get_run(entry["run_id"], samples=False)
        return True
    except SpecscopeError:
        return False


def store_surfaces(state, db=None) -> int:
    """Each group whose cells are all done and whose surface is not stored from exactly those runs: its surface
    made and stored, the sweep file updated. Returns how many were made now."""
    made = 0
    for g in groups(state.spec):
        run_ids = _done_runs(state, g)
        if run_ids is None:
            continue
        have = (state.data.get("surfaces") or {}).get(g.key)
        if have is not None and have["runs"] == run_ids and _still_stored(have, db):
            continue
        try:
            entry = build_surface(state, g, run_ids, db)
        except SpecscopeError as e:         # e.g. a cell's run deleted from the registry: said, the sweep goes on
            entry = {"run_id": None, "runs": run_ids, "batches": [], "tokens": [], "steps": 0,
                     "warnings": [f"no verify surface: {e}"]}
        state.data.setdefault("surfaces", {})[g.key] = entry
        state.save()
        made += 1
    return made


def commands(run_id: str, batches: list[int], tokens: list[int]) -> list[str]:
    """The commands that read a surface run."""
    b = max(batches) if batches else 1
    k = max((n - 1 for n in tokens if n > 1), default=1)
    return [f"specscope tune --run DRAFTER_RUN --verify-curve {run_id}",
            f"specscope breakeven --verify-curve {run_id} --batch {b} --steps {k}"]


def surface_entries(state) -> list[dict]:
    """The sweep document's surfaces: per group, its run (or why none yet), batch sizes × tokens, the commands."""
    stored = state.data.get("surfaces") or {}
    out = []
    for g in groups(state.spec):
        e = stored.get(g.key)
        left = sum(f"{k} #{r + 1}" not in state.data["done"] for k, r in g.slots(state.spec.repeats))
        item = {"key": g.key, "at": dict(g.at), "cells": [c.key for c in g.cells],
                "baseline": g.baseline.key if g.baseline else None, "runs_left": left}
        if e is not None and not left:
            item.update({k: e[k] for k in ("run_id", "runs", "batches", "tokens", "steps", "warnings")})
            item["experts"] = e.get("experts") or []
            if e["run_id"]:
                item["commands"] = commands(e["run_id"], e["batches"], e["tokens"])
        out.append(item)
    return out
