"""A server process specscope starts (vLLM, SGLang, `specscope serve`): its own session and process group, its
output in a log file, ready once `/health` answers, and always stopped with its whole process tree (engine core,
workers, a child in a new session), also on Ctrl-C, SIGTERM, an exception or a kill -9 of specscope: it runs under a
watchdog (watchdog.py) that ends the tree when specscope ends. A launch's log is never shared with a live engine of
an earlier launch (its pid file says who holds it). A failed start is named by the root-cause line of its log. One
lifecycle for every launcher: `benchserve.launch` (vLLM for tests and benches), `sweep` (any command, one per cell)
and `train.capture` (vLLM computing features).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specscope.errors import SpecscopeError
from specscope.watchdog import proc_table, running

LOG_TAIL = 20          # log lines a failure keeps
CAUSE_SCAN = 400       # log lines searched for the root cause of a failed start
WATCHDOG = Path(__file__).with_name("watchdog.py")
ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b[:,]|\berror[:,]", re.IGNORECASE)
# error lines that only point elsewhere for the cause (vLLM's "Engine core initialization failed. See root cause
# above", a worker's "failed to start", pydantic's "1 validation error for X" above its "Value error, ..." line)
WRAPPER = re.compile(r"root cause|see (the )?(stack trace|above|log)|initiali[sz]ation failed|failed to start"
                     r"|\d+ validation errors? for|^Traceback|^For further information", re.IGNORECASE)
# a logger's level field, at the start (after vLLM's process tag) or between spaces: not an error line
NOT_ERROR = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(INFO|WARNING|WARN|DEBUG)\b| (INFO|WARNING|DEBUG) ")
# argparse's usage block above its "prog: error: ..." line: option lists such as {critical,debug,error,info}
USAGE = re.compile(r"^\s*(usage:|\[)")
# vLLM's "(EngineCore_DP0 pid=7) ERROR 12-01 10:00:00 [core.py:708] " before the words that matter
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?((ERROR|CRITICAL)\s+[\d-]+ [\d:.]+\s+\[[^\]]*\]\s*)?")


class ServerFailed(SpecscopeError):
    """The server did not start, died, or never answered /health; `log_tail` holds its last log lines."""

    exit_code = 1

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run (zombies, already dead and waiting to be reaped, are not)."""
    table = proc_table()
    if table is None:          # not Linux: signal 0 says whether any member exists
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    return [pid for pid, p in table.items() if p.pgrp == pgid and running(p)]


def root_cause(lines: list[str]) -> str | None:
    """The line of a failed server's log that says why: the first error line of its last `CAUSE_SCAN` lines that
    is not a wrapper pointing elsewhere (the root cause comes first, its wrappers after), without vLLM's logger
    prefix; None when no line reads as an error."""
    for ln in lines[-CAUSE_SCAN:]:
        words = LOG_PREFIX.sub("", ln.strip()).split(" [type=", 1)[0].strip()
        if ERROR_LINE.search(words) and not NOT_ERROR.search(ln) and not WRAPPER.search(words) \
                and not USAGE.match(ln):
            return words if len(words) <= 300 else words[:297] + "..."
    return None


def log_cause(path: Path) -> str:
    """Why the server whose log is `path` stopped: its root-cause line, else the log's last line."""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    cause = root_cause(lines) or (lines[-1].strip() if lines else "(empty log)")
    return cause if len(cause) <= 300 else cause[:297] + "..."


class ServerProcess:
    """`start()`, `wait_healthy()`, `stop()`; a context manager that starts, waits and always stops."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, url: str, startup_s: float = 600.0,
                 stop_s: float = 30.0, leftovers=None):
        self.argv, self.env, self.log_path, self.url = list(argv), dict(env), Path(log_path), url
        self.startup_s, self.stop_s = startup_s, stop_s
        self.proc: subprocess.Popen | None = None       # the watchdog, the server's parent (its status is theirs)
        self.engine_pid: int | None = None
        self._log = None
        # called at start, it returns what removes, once the server is stopped, what the engine leaves behind
        # (engines.vllm.shm_leftovers: vLLM's CPU all-reduce segments in /dev/shm)
        self.leftovers, self._tidy = leftovers, None

    @property
    def pgid(self) -> int | None:
        """The server's process group (its pid): the group SIGINT reaches on a stop."""
        return self.engine_pid

    @property
    def pid_path(self) -> Path:
        return self.log_path.with_name(self.log_path.name + ".pid")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(ln.rstrip()[:300] for ln in lines[-n:])

    def exit_words(self) -> str:
        """How it ended: 'killed by SIGKILL' (an OOM killer), or 'exited with status N'."""
        rc = self.proc.returncode if self.proc is not None else None
        if rc is not None and rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"

    def start(self) -> None:
        self._tidy = self.leftovers() if self.leftovers else None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _claim(self.pid_path, self.stop_s)
        self.log_path.unlink(missing_ok=True)   # a new file: nothing an earlier writer holds open writes into it
        self._log = open(self.log_path, "w")
        try:
            # the watchdog's own session: a terminal's Ctrl-C reaches only us, so we stop the server in order
            # instead of the terminal killing it mid-write; the engine gets a session of its own below it
            self.proc = subprocess.Popen([sys.executable, "-I", str(WATCHDOG), str(self.stop_s), "--", *self.argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         env=self.env, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise ServerFailed(f"cannot start the server's watchdog ({sys.executable}): {e.strerror or e}") from None
        said = self.proc.stdout.readline().decode(errors="replace").strip()
        if not said.isdigit():
            self.proc.wait()
            self._log.close()
            why = said.removeprefix("error: ") or f"its watchdog {self.exit_words()} (log: {self.log_path})"
            raise ServerFailed(f"cannot start {self.argv[0]!r}: {why}")
        self.engine_pid = int(said)
        _write_pids(self.pid_path, {"owner": os.getpid(), "watchdog": self.proc.pid, "engine": self.engine_pid})

    def wait_healthy(self, on_wait=None, every_s: float = 30.0) -> float:
        """Seconds until /health answered 200; ServerFailed (with the log's root-cause line and tail) if the server
        exits first or the startup timeout passes. `on_wait(seconds)` is called every `every_s` while it loads."""
        t0 = last = time.monotonic()
        while time.monotonic() - t0 < self.startup_s:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server {self.exit_words()} while starting: {log_cause(self.log_path)} "
                                   f"(log: {self.log_path})", self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if on_wait is not None and time.monotonic() - last >= every_s:
                last = time.monotonic()
                on_wait(last - t0)
            time.sleep(0.25)
        raise ServerFailed(f"the server did not answer {self.url}/health within {self.startup_s:.0f} s "
                           f"(log: {self.log_path})", self.log_tail())

    def stop(self) -> None:
        """Asks the watchdog for the stop: SIGINT to the server's group (vLLM and uvicorn shut down cleanly on it:
        the plugin writes its last steps), SIGKILL to whatever of the tree is left after the grace time; returns
        once nothing of it runs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(f"stop {self.stop_s}\n".encode())
                self.proc.stdin.close()
            except OSError:             # it is already going
                pass
            try:
                self.proc.wait(self.stop_s + 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()        # the server dies with it (its parent-death signal); then the group
                self.proc.wait()
        end = time.monotonic() + 10
        while self.engine_pid and live_members(self.engine_pid) and time.monotonic() < end:
            _signal_group(self.engine_pid, signal.SIGKILL)
            time.sleep(0.05)
        for f in (self.proc.stdin, self.proc.stdout, self._log):
            if f is not None and not f.closed:
                f.close()
        if ("watchdog", self.proc.pid) in {(k, pid) for k, pid, _ in _marks(self.pid_path)}:
            self.pid_path.unlink(missing_ok=True)
        if self._tidy is not None:
            self._tidy()

    def __enter__(self):
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


# ---- who holds a launch's files: its pid file -----------------------------------------------------------------
def _write_pids(path: Path, pids: dict) -> None:
    """Each process with its start time, so that a reused pid is not taken for it."""
    table = proc_table() or {}
    marks = {k: [pid, table[pid].start if pid in table else None] for k, pid in pids.items()}
    try:
        path.write_text(json.dumps(marks))
    except OSError:
        pass


def _marks(path: Path) -> list[tuple[str, int, int | None]]:
    """(role, pid, start time) of each process of the pid file (a damaged file names none)."""
    try:
        return [(k, int(v[0]), v[1]) for k, v in json.loads(path.read_text()).items()]
    except (OSError, ValueError, TypeError, AttributeError, IndexError, KeyError):
        return []


def _read_pids(path: Path) -> dict:
    """{"owner": pid, ...} of the processes of the pid file that still run."""
    table = proc_table()
    if table is None:
        return {k: pid for k, pid, _ in _marks(path) if _exists(pid)}
    return {k: pid for k, pid, start in _marks(path) if running(table.get(pid)) and table[pid].start == start}


def _claim(pid_path: Path, stop_s: float) -> None:
    """Before a launch writes into a directory: the engine of an earlier launch there must be gone. One whose
    specscope died is ending (its watchdog stops it): waited for; one whose specscope still runs is refused."""
    held = _read_pids(pid_path)
    engine = {k: pid for k, pid in held.items() if k != "owner"}
    if engine and "owner" in held:
        raise ServerFailed(f"{pid_path.parent} is in use by the engine (pid {engine.get('engine', '?')}) of another "
                           f"specscope (pid {held['owner']}); stop that run or use another directory")
    deadline = time.monotonic() + min(stop_s, 120) + 30
    while engine and time.monotonic() < deadline:
        time.sleep(0.1)
        engine = {k: pid for k, pid in _read_pids(pid_path).items() if k != "owner"}
    if engine:
        raise ServerFailed(f"{pid_path.parent} is in use by an engine an earlier run left (pid "
                           f"{engine.get('engine', engine.get('watchdog'))}); stop it and run again")
    pid_path.unlink(missing_ok=True)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
