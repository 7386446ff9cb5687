"""The watchdog between specscope and a server it starts (serverproc.py): the server's parent, so that the server's
whole process tree ends when specscope does, however specscope ends (kill -9 included, mid-start included).

    python -I watchdog.py GRACE_S -- ARGV...

stdin is the lifeline from specscope: a line ("stop GRACE_S") or its end asks for the stop; its end comes from the
kernel when specscope dies in any way. stdout says the server's pid (its process group) once started, or
`error: ...`. stderr is the server's log (the server writes its stdout and stderr there). The watchdog exits once
nothing of the tree runs, with the server's own status (a signal that killed the server kills the watchdog too).

Why a process of its own, and not PR_SET_PDEATHSIG on the server alone: a signal from the kernel reaches only the
server's first process, which may ignore or defer it while it loads (vLLM finished starting and served under PID 1),
and never reaches its workers or a child started in a new session. The watchdog is a child subreaper, so every
process the server starts stays below it (an orphan reparents here, not to PID 1) and "the tree" is simply its
descendants in /proc, setsid children included: nothing of it can leave. It has its own session (no terminal signal
reaches it), it also notices specscope's death by its parent changing (a forked copy of specscope could hold the
lifeline open), and if the watchdog itself is SIGKILLed, the server dies with it (PR_SET_PDEATHSIG). Stdlib only,
run with -I: it needs nothing of specscope's environment.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import NamedTuple

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
KILL_S = 30.0           # SIGKILL rounds before giving up on a process that does not die (uninterruptible I/O)


class Proc(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    start: int          # clock ticks after boot: with the pid, names one process (pids are reused)


def proc_table() -> dict[int, Proc] | None:
    """Every process, from /proc; None where there is no /proc (not Linux)."""
    if not os.path.isdir("/proc"):
        return None
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ... starttime(22nd)": comm may hold spaces and ')', so split after the last ')'
        f = stat[stat.rfind(")") + 2:].split()
        if len(f) > 19:
            out[int(name)] = Proc(f[0], int(f[1]), int(f[2]), int(f[19]))
    return out


def running(p: Proc | None) -> bool:
    """Alive and not a zombie (dead, waiting to be reaped)."""
    return p is not None and p.state not in ("Z", "X")


def descendants(root: int, table: dict[int, Proc]) -> list[int]:
    kids: dict[int, list[int]] = {}
    for pid, p in table.items():
        kids.setdefault(p.ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _prctl(option: int, arg: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(option, arg)
    except (OSError, AttributeError):       # not Linux
        pass


class Watch:
    def __init__(self, grace_s: float):
        self.grace_s, self.me, self.owner = grace_s, os.getpid(), os.getppid()
        self.exited: dict[int, int] = {}    # pid -> exit code (negative: the signal), of children reaped here
        self.stop = False

    def reap(self) -> None:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = os.waitstatus_to_exitcode(st)

    def wait(self, engine: int) -> None:
        """Until the engine exits, specscope dies or asks for the stop (the grace it sends replaces ours)."""
        while engine not in self.exited and not self.stop and os.getppid() == self.owner:
            try:
                ready = select.select([0], [], [], 0.2)[0]
            except InterruptedError:
                ready = []
            if ready:
                words = os.read(0, 256).split()
                if len(words) > 1:
                    self.grace_s = float(words[1])
                return
            self.reap()

    def end_tree(self, pgid: int) -> None:
        """SIGINT to the engine's group (vLLM and uvicorn shut down cleanly on it), the grace for the group to
        go, then SIGKILL to every descendant until none runs."""
        _killpg(pgid, signal.SIGINT)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self._group_runs(pgid):
            self.reap()
            time.sleep(0.05)
        deadline = time.monotonic() + KILL_S
        while time.monotonic() < deadline:
            _killpg(pgid, signal.SIGKILL)
            table = proc_table()
            left = [p for p in descendants(self.me, table) if running(table.get(p))] if table is not None else []
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.reap()
            if not left and not self._group_runs(pgid):
                return
            time.sleep(0.02)

    @staticmethod
    def _group_runs(pgid: int) -> bool:
        table = proc_table()
        if table is None:
            try:
                os.killpg(pgid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        return any(p.pgrp == pgid and running(p) for p in table.values())


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with(parent: int) -> None:
    """In the engine, before exec: SIGKILL when the watchdog dies (only a SIGKILL of the watchdog leaves it so)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:          # the watchdog died before the line above took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    grace_s, cmd = float(argv[0]), argv[2:]
    w = Watch(grace_s)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: setattr(w, "stop", True))
    try:
        engine = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=2, stderr=2, start_new_session=True,
                                  preexec_fn=lambda: _die_with(w.me))
    except OSError as e:
        print(f"error: {e.strerror or e}", flush=True)
        return 127
    print(engine.pid, flush=True)
    w.wait(engine.pid)
    w.end_tree(engine.pid)
    while engine.pid not in w.exited:       # reaped in end_tree unless it was stuck; then wait for it here
        w.reap()
        time.sleep(0.05)
    code = engine.returncode = w.exited[engine.pid]
    if code < 0:                            # the same death for whoever waits on us: "killed by SIGKILL"
        signal.signal(-code, signal.SIG_DFL)
        os.kill(w.me, -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
