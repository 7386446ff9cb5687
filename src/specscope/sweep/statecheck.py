"""Every field of a sweep file checked before anything uses it (`state.read_state` is the one reader): a file that
was edited, truncated or written by something else is refused in one line naming what is wrong, never a KeyError
or TypeError half-way through a resumed sweep. The settings must be exactly what the command line could have
written (each axis is parsed again from its stored values), the slots those of its own schedule."""

from __future__ import annotations

from specscope.errors import SpecscopeError
from specscope.sweep.spec import (PHASES_FROM, PIN_MODES, SweepSpec, parse_engine_axis, parse_env_axis, parse_flag_axis,
                                  shown)

SPEC_KEYS = ("command", "axes", "repeats", "workload", "phases_from", "baseline_without", "baseline_run")
AXIS_KEYS = ("name", "kind", "values", "flag", "path", "key")


class Damaged(Exception):
    """What is wrong with a sweep file, in words (the reader names the file and the fix)."""


def slot(cell_key: str, repeat: int) -> str:
    return f"{cell_key} #{repeat + 1}"


def need(ok, what: str) -> None:
    if not ok:
        raise Damaged(what)


def _int(v, lo: int, hi: int | None = None) -> bool:
    return type(v) is int and v >= lo and (hi is None or v <= hi)


def _text(v) -> bool:
    return isinstance(v, str) and bool(v)


def _axis(a) -> dict:
    """One stored axis, parsed again from its values as the command line would: the same axis or damaged."""
    need(isinstance(a, dict) and set(a) == set(AXIS_KEYS), "an axis is not an axis's fields")
    vals = a["values"]
    need(isinstance(vals, list) and vals and all(v is None or isinstance(v, (bool, int, float, str)) for v in vals),
         f"axis {a['name']!r}: its values are not a list of values")
    need(a["kind"] in ("env", "flag", "json", "engine") and isinstance(a["flag"], (str, type(None)))
         and isinstance(a["path"], list) and all(_text(k) for k in a["path"]), f"axis {a['name']!r} is malformed")
    text = ",".join(map(shown, vals))
    try:
        if a["kind"] == "env":
            again = parse_env_axis(f"{a['name']}={text}")
        elif a["kind"] == "engine":
            again = parse_engine_axis(f"{a['name']}=={text}")
        else:
            keys = "".join("." + k for k in a["path"])
            again = parse_flag_axis(f"{(a['flag'] or '')[2:]}{keys}={text}")
    except SpecscopeError as e:
        raise Damaged(f"axis {a['name']!r}: {e}") from None
    need(again.to_dict() == a, f"axis {a['name']!r} does not read back as the command line writes it")
    return a


def check_spec(d) -> SweepSpec:
    """The stored settings as a SweepSpec, or Damaged."""
    from specscope.sweep.workload import DEFAULTS, check_workload

    need(isinstance(d, dict) and set(SPEC_KEYS) <= set(d) <= set(SPEC_KEYS) | {"pin"},
         "'spec' is missing or not a sweep's settings")
    need(d.get("pin", "auto") in PIN_MODES, f"'pin' is not one of {', '.join(PIN_MODES)}")
    need(isinstance(d["command"], list) and d["command"] and all(isinstance(a, str) for a in d["command"]),
         "'command' is not a list of words")
    need(isinstance(d["axes"], list) and d["axes"], "'axes' is not a list of axes")
    for a in d["axes"]:
        _axis(a)
    need(_int(d["repeats"], 1, 100), "'repeats' is not a whole number in 1..100")
    need(isinstance(d["workload"], dict) and set(d["workload"]) == set(DEFAULTS), "'workload' lacks or adds options")
    try:
        check_workload(d["workload"])
    except SpecscopeError as e:
        raise Damaged(f"its workload: {e}") from None
    need(d["phases_from"] in PHASES_FROM[1:], f"'phases_from' is not one of {', '.join(PHASES_FROM[1:])}")
    need(isinstance(d["baseline_without"], list) and all(_text(f) and f.startswith("--") for f in
                                                         d["baseline_without"]), "'baseline_without' is malformed")
    need(d["baseline_run"] is None or _text(d["baseline_run"]), "'baseline_run' is not a run id")
    spec = SweepSpec.from_identity(d)
    try:
        spec.check()
    except SpecscopeError as e:
        raise Damaged(f"its settings: {e}") from None
    need(spec.identity() == d, "its settings do not read back as written")
    return spec


def _ref(o, cells: set, repeats: int, what: str) -> None:
    """A {"cell", "repeat", "pgid"?} entry naming one of the sweep's slots."""
    need(isinstance(o, dict) and o.get("cell") in cells and _int(o.get("repeat"), 0, repeats - 1)
         and (o.get("pgid") is None or _int(o.get("pgid"), 1)), f"{what} does not name a cell of this sweep")


def check_state(d, version: int) -> SweepSpec:
    """A whole sweep file: its identity, settings, outcomes and order; returns its spec, or Damaged."""
    need(isinstance(d, dict), "not a JSON object")
    need(_int(d.get("version"), 0) and d["version"] == version,
         f"version {d.get('version')!r}; this specscope reads version {version}")
    for k in ("id", "name", "created"):
        need(_text(d.get(k)), f"{k!r} is missing or not text")
    spec = check_spec(d.get("spec"))
    slots = {slot(k, r) for k, r in spec.schedule()}
    cells = {c.key for c in spec.cells()}
    for part in ("done", "failed"):
        need(isinstance(d.get(part), dict), f"{part!r} is missing or not an object")
        for k, o in d[part].items():
            need(k in slots and isinstance(o, dict), f"{part} holds {k!r}, not an outcome of this sweep's cells")
    for k, o in d["done"].items():
        need(o.get("status") == "ok" and _text(o.get("run_id")), f"done {k!r} has no run id")
    for k, o in d["failed"].items():
        need(isinstance(o.get("reason"), str) and all(isinstance(o.get(f), (str, type(None)))
                                                      for f in ("log_tail", "command")), f"failed {k!r} is malformed")
        need(k not in d["done"], f"{k!r} is both done and failed")
    for key in ("order", "interrupted"):
        need(isinstance(d.get(key, []), list), f"{key!r} is not a list")
        for o in d.get(key, []):
            _ref(o, cells, spec.repeats, f"an entry of {key!r}")
    _surfaces(d.get("surfaces", {}), spec)
    need("running" in d, "'running' is missing")
    if d["running"] is not None:
        _ref(d["running"], cells, spec.repeats, "'running'")
    return spec


def _surfaces(d, spec: SweepSpec) -> None:
    """The engine surfaces made (sweep.surface): each names one of the sweep's groups, its run (or none) and the
    cell runs it pooled."""
    from specscope.sweep.surface import group_keys

    need(isinstance(d, dict), "'surfaces' is not an object")
    keys = group_keys(spec)
    for k, e in d.items():
        need(k in keys and isinstance(e, dict), f"surfaces holds {k!r}, not an engine surface of this sweep")
        need(e.get("run_id") is None or _text(e.get("run_id")), f"surface {k!r}: its run id is not text")
        for f in ("runs", "batches", "tokens", "warnings"):
            need(isinstance(e.get(f), list), f"surface {k!r}: {f!r} is not a list")
        need(all(_text(r) for r in e["runs"]) and all(isinstance(w, str) for w in e["warnings"])
             and all(_int(x, 1) for x in e["batches"] + e["tokens"]) and _int(e.get("steps"), 0),
             f"surface {k!r} is malformed")
