"""The sweep file (WORKDIR/sweep.json): the sweep's identity, which (cell, repeat) ran and how, in what order,
and which engine group is up right now. Written atomically after every change, so a sweep killed at any point
continues with exactly the cells it is missing; a run stored in the registry just before a kill is adopted back
(found by the sweep's tag and id) rather than measured twice. Read only through `read_state`, which checks every
field (a damaged file is one error naming it, never a crash later), and used by one process at a time
(`WorkdirLock`: two sweeps on one workdir would launch two engines and fill the same slots twice)."""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.fileio import why, write_atomic
from specscope.sweep.spec import SweepSpec
from specscope.sweep.statecheck import Damaged, check_state, slot

STATE_FILE, LOCK_FILE = "sweep.json", "sweep.lock"
VERSION = 1


def read_state(path: Path) -> dict:
    """The sweep file at `path`, every field checked (statecheck); damaged or unreadable: one error naming it."""
    from specscope.jsonio import loads

    fix = f"remove it (or the whole {path.parent}) to start that sweep over, or use another -w"
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecscopeError(f"cannot read the sweep file {path} ({why(e)}); {fix}") from None
    try:
        data = loads(raw, f"the sweep file {path}")
        check_state(data, VERSION)
    except Damaged as e:
        raise SpecscopeError(f"the sweep file {path} is damaged ({e}); {fix}") from None
    except SpecscopeError as e:
        raise SpecscopeError(f"{e}; {fix}") from None
    return data


class WorkdirLock:
    """One sweep process per workdir: an exclusive lock on WORKDIR/sweep.lock, held while the process lives (the
    kernel drops it when the process dies, however it dies), holding the owner's pid for the refusal."""

    def __init__(self, workdir: Path):
        self.path, self.fd = Path(workdir) / LOCK_FILE, None

    def acquire(self) -> "WorkdirLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SpecscopeError(f"cannot use --workdir {self.path.parent} ({why(e)}); pick another -w") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SpecscopeError(f"--workdir {self.path.parent} is in use by another sweep (pid {holder}); wait for "
                                 f"it to finish or stop it, or use another -w") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)         # closing drops the lock; the file stays (unlinking it would race a waiter)
            self.fd = None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class SweepState:
    def __init__(self, path: Path, data: dict, lock: WorkdirLock | None = None):
        self.path, self.data, self.lock = path, data, lock

    @staticmethod
    def _stored(path: Path, spec: SweepSpec | None, workdir) -> dict | None:
        """The sweep file's data (None: there is none), refused when it is damaged or holds another sweep."""
        if not os.path.lexists(path):
            if spec is None:
                raise SpecscopeError(f"no sweep in --workdir {workdir}: give the axes and the engine's launch "
                                     f"command after --, e.g. --flag steps=1,3 -- specscope serve --port {{port}}")
            return None
        data = read_state(path)
        stored = data["spec"]
        if spec is not None and spec.identity() != stored:
            what = next((k for k in stored if stored[k] != spec.identity().get(k)), "settings")
            raise SpecscopeError(f"--workdir {workdir} holds another sweep (its {what.replace('_', ' ')} "
                                 f"differs); run `specscope sweep -w {workdir}` alone to continue it, or give "
                                 f"a new --workdir")
        return data

    @classmethod
    def open(cls, workdir, spec: SweepSpec | None, name: str | None) -> "SweepState":
        """The sweep in `workdir`: the stored one (spec None, or the same spec), or a new one (spec given). Holds
        the workdir's lock until `close()` (read under it: another process may have run cells meanwhile)."""
        path = Path(workdir).expanduser() / STATE_FILE
        cls._stored(path, spec, workdir)            # refused before the lock file is made
        lock = WorkdirLock(path.parent).acquire()
        try:
            data = cls._stored(path, spec, workdir)
            if data is not None:
                return cls(path, data, lock)
            data = {"version": VERSION, "id": uuid.uuid4().hex[:10], "name": name or path.parent.name or "sweep",
                    "created": _now(), "spec": spec.identity(), "done": {}, "failed": {}, "order": [],
                    "running": None}
            state = cls(path, data, lock)
            state.save()
            return state
        except BaseException:
            lock.release()
            raise

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
                    if sw.get("id") != self.id or "cell" not in sw:      # not a cell's run: the engine surface
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
