"""A server process specscope starts (vLLM, SGLang, `specscope serve`): its own session and process group, its
output in a log file, ready once `/health` answers, and always stopped with its whole group (engine core and
workers included), also on Ctrl-C, SIGTERM or an exception. One lifecycle for every launcher: `benchserve.launch`
(vLLM for tests and benches), `sweep` (any command, one per cell) and `train.capture` (vLLM computing features).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from specscope.errors import SpecscopeError

LOG_TAIL = 20          # log lines a failure keeps


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
    proc = Path("/proc")
    if not proc.is_dir():      # not Linux: signal 0 says whether any member exists
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


class ServerProcess:
    """`start()`, `wait_healthy()`, `stop()`; a context manager that starts, waits and always stops."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, url: str, startup_s: float = 600.0,
                 stop_s: float = 30.0):
        self.argv, self.env, self.log_path, self.url = list(argv), dict(env), Path(log_path), url
        self.startup_s, self.stop_s = startup_s, stop_s
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        try:
            # a new session: the server's workers share its group, and a terminal's Ctrl-C reaches only us, so
            # we stop the server in order instead of the terminal killing it mid-write
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        except OSError as e:
            self._log.close()
            raise ServerFailed(f"cannot start {self.argv[0]!r}: {e.strerror or e}") from None

    def wait_healthy(self, on_wait=None, every_s: float = 30.0) -> float:
        """Seconds until /health answered 200; ServerFailed (with the log's tail) if the server exits first or
        the startup timeout passes. `on_wait(seconds)` is called every `every_s` while it loads."""
        t0 = last = time.monotonic()
        while time.monotonic() - t0 < self.startup_s:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server {self.exit_words()} while starting", self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if on_wait is not None and time.monotonic() - last >= every_s:
                last = time.monotonic()
                on_wait(last - t0)
            time.sleep(0.25)
        raise ServerFailed(f"the server did not answer {self.url}/health within {self.startup_s:.0f} s",
                           self.log_tail())

    def stop(self) -> None:
        """SIGINT to the group (vLLM and uvicorn shut down cleanly on it: the plugin writes its last steps), then
        SIGKILL to whatever of the group is left after the grace time; returns once no member runs."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        deadline = time.monotonic() + self.stop_s
        if self.proc.poll() is None or live_members(pgid):
            _signal_group(pgid, signal.SIGINT)
        while live_members(pgid) and time.monotonic() < deadline:
            self.proc.poll()            # reap the leader as soon as it exits
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        end = time.monotonic() + 10
        while live_members(pgid) and time.monotonic() < end:
            time.sleep(0.05)
        if self._log is not None and not self._log.closed:
            self._log.close()

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


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when specscope dies, even by SIGKILL (no cleanup of ours runs
    then), so a server never outlives its launcher; it stops its own workers on SIGTERM. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
