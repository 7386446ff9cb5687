"""The sweep file (WORKDIR/sweep.json): the sweep's identity, which (cell, repeat) ran and how, in what order,
and which engine group is up right now. Written atomically after every change, so a sweep killed at any point
continues with exactly the cells it is missing; a run stored in the registry just before a kill is adopted back
(found by the sweep's tag and id) rather than measured twice."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.fileio import write_atomic
from specscope.sweep.spec import SweepSpec

STATE_FILE = "sweep.json"
VERSION = 1


def slot(cell_key: str, repeat: int) -> str:
    return f"{cell_key} #{repeat + 1}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class SweepState:
    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    @classmethod
    def open(cls, workdir, spec: SweepSpec | None, name: str | None) -> "SweepState":
        """The sweep in `workdir`: the stored one (spec None, or the same spec), or a new one (spec given)."""
        path = Path(workdir).expanduser() / STATE_FILE
        if path.exists():
            try:
                data = json.loads(path.read_text())
                stored = data["spec"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SpecscopeError(f"{path} is not a sweep file ({type(e).__name__}); use another --workdir") \
                    from None
            if spec is not None and spec.identity() != stored:
                what = next(k for k in stored if stored[k] != spec.identity().get(k))
                raise SpecscopeError(f"--workdir {workdir} holds another sweep (its {what.replace('_', ' ')} "
                                     f"differs); run `specscope sweep -w {workdir}` alone to continue it, or give "
                                     f"a new --workdir")
            return cls(path, data)
        if spec is None:
            raise SpecscopeError(f"no sweep in --workdir {workdir}: give the axes and the engine's launch command "
                                 f"after --, e.g. --flag steps=1,3 -- specscope serve --port {{port}}")
        data = {"version": VERSION, "id": uuid.uuid4().hex[:10], "name": name or path.parent.name or "sweep",
                "created": _now(), "spec": spec.identity(), "done": {}, "failed": {}, "order": [], "running": None}
        state = cls(path, data)
        state.save()
        return state

    # ---- reading ----------------------------------------------------------------------------------------------
    @property
    def spec(self) -> SweepSpec:
        return SweepSpec.from_identity(self.data["spec"])

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def name(self) -> str:
        return self.data["name"]

    def outcome(self, cell_key: str, repeat: int) -> dict | None:
        k = slot(cell_key, repeat)
        return self.data["done"].get(k) or self.data["failed"].get(k)

    def missing(self, retry_failed: bool = False) -> list[tuple[str, int]]:
        """The schedule's (cell, repeat) still to run, in schedule order."""
        out = []
        for key, r in self.spec.schedule():
            k = slot(key, r)
            if k in self.data["done"] or (k in self.data["failed"] and not retry_failed):
                continue
            out.append((key, r))
        return out

    # ---- writing ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=1, default=str) + "\n", "sweep file", make_parents=True)

    def started(self, cell_key: str, repeat: int) -> None:
        self.data["order"].append({"cell": cell_key, "repeat": repeat, "started": _now()})
        self.data["running"] = {"cell": cell_key, "repeat": repeat, "pgid": None}
        self.save()

    def engine_up(self, pgid: int) -> None:
        """The engine's process group, kept until it is stopped: after a kill, whoever looks can check it is gone."""
        if self.data["running"] is not None:
            self.data["running"]["pgid"] = pgid
            self.save()

    def finished(self, cell_key: str, repeat: int, outcome: dict) -> None:
        k = slot(cell_key, repeat)
        self.data["failed"].pop(k, None)
        self.data["done" if outcome["status"] == "ok" else "failed"][k] = dict(outcome, finished=_now())
        self.data["running"] = None
        self.save()

    def interrupted(self) -> None:
        """Stopped mid-cell (Ctrl-C, SIGTERM): the cell stays missing; the engine is already stopped."""
        run = self.data.get("running")
        if run is not None:
            self.data.setdefault("interrupted", []).append(dict(run, at=_now()))
            self.data["running"] = None
            self.save()

    def adopt(self, db=None) -> int:
        """Runs of this sweep the registry holds but the file does not (stored just before a kill); returns how
        many were taken in."""
        from specscope.registry import open_registry

        taken = 0
        try:
            with open_registry(db, create=False) as reg:
                for row in reg.list_runs(tag=f"sweep:{self.name}"):
                    rec = reg.get_run(row["id"], samples=False)
                    sw = rec.get("sweep") or {}
                    if sw.get("id") != self.id:
                        continue
                    k = slot(sw.get("cell"), int(sw.get("repeat", -1)))
                    if k not in self.data["done"]:
                        self.data["done"][k] = {"status": "ok", "run_id": rec["id"], "adopted": True}
                        self.data["failed"].pop(k, None)
                        taken += 1
        except SpecscopeError:
            return 0            # no registry yet: nothing to adopt
        if taken:
            self.save()
        return taken
