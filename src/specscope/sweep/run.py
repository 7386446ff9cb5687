"""The sweep loop: the missing (cell, repeat)s in ABBA order, each through `cell.run_cell`, the sweep file
updated after each, progress with rate and time left on stderr; Ctrl-C / SIGTERM stop the running engine (its
whole process group) before the sweep exits, and leave that cell missing for the next invocation."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from specscope.sweep.cell import Context, run_cell
from specscope.sweep.state import SweepState
from specscope.sweep.surface import store_surfaces
from specscope.sweep.workload import build_workload


@contextmanager
def interruptible():
    """The first SIGINT / SIGTERM raises KeyboardInterrupt; later ones are only noted, so the engine's shutdown that
    the first one started is not itself cut short (a second Ctrl-C would otherwise leave the engine running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise KeyboardInterrupt
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_sweep(state: SweepState, *, db=None, startup_s: float = 600.0, workload_s: float = 1800.0,
              stop_s: float = 30.0, max_cells: int | None = None, retry_failed: bool = False,
              progress: bool = True, json_mode: bool = False, workload=None) -> dict:
    """Run what the sweep is missing (at most max_cells of it), then store the engine surfaces whose cells are all
    done (sweep.surface); returns {"ran", "failed", "left", "adopted", "surfaces" (made now)}.
    `workload`: the sweep's workload already built (the command builds it before it writes anything)."""
    from specscope.progress import Progress

    adopted = state.adopt(db)
    spec = state.spec
    todo = state.missing(retry_failed)
    if max_cells is not None:
        todo = todo[:max_cells]
    total = len(spec.schedule())
    if not todo:
        return {"ran": 0, "failed": 0, "left": len(state.missing(retry_failed)), "adopted": adopted,
                "surfaces": store_surfaces(state, db)}
    ctx = Context(spec, workload or build_workload(spec.workload), state.path.parent, state.id, state.name, db,
                  startup_s, workload_s, stop_s, on_start=state.engine_up)
    cells = {c.key: c for c in spec.cells()}
    done_before = total - len(state.missing(retry_failed))
    bar = Progress(f"sweep {state.name}", done_before + len(todo), "cell", start=done_before, json_mode=json_mode,
                   enabled=progress, every_s=0.0)
    ran = failed = 0
    try:
        with interruptible():
            for key, r in todo:
                outcome = run_slot(state, ctx, cells[key], r)
                ran += 1
                failed += outcome["status"] != "ok"
                line = cell_line(key, r, outcome)
                if not json_mode or outcome["status"] != "ok":
                    bar.note(line)
                bar.advance(info=f"{failed} failed" if failed else "")
    finally:
        bar.close()
    return {"ran": ran, "failed": failed, "left": len(state.missing(retry_failed)), "adopted": adopted,
            "surfaces": store_surfaces(state, db)}


def run_slot(state: SweepState, ctx: Context, cell, repeat: int) -> dict:
    """One (cell, repeat) launched and its outcome written to the sweep file; stopped mid-way (Ctrl-C, or the
    cell's files could not be written: a full disk), the slot is left missing and the exception passes on."""
    state.started(cell.key, repeat)
    try:
        outcome = run_cell(ctx, cell, repeat)
    except BaseException:
        _note_interrupted(state)
        raise
    state.finished(cell.key, repeat, outcome)
    return outcome


def _note_interrupted(state: SweepState) -> None:
    """The running cell back to missing, if the sweep file can still be written: on a full disk it cannot, and
    the file keeps its last whole version (the cell reads as missing all the same, `running` aside)."""
    from specscope.errors import SpecscopeError

    try:
        state.interrupted()
    except SpecscopeError:
        pass


def cell_line(key: str, repeat: int, outcome: dict) -> str:
    head = f"{key} #{repeat + 1}"
    if outcome["status"] == "ok":
        return f"{head}: run {outcome['run_id']} ({outcome['seconds']:.0f} s)"
    return f"{head}: failed: {outcome['reason']}"
