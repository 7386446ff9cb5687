"""A stand-in engine for tests/test_serverproc.py, as vLLM behaves while it starts: it ignores SIGTERM and SIGINT
until it serves (a launcher's death did not stop a starting vLLM), has a worker in its process group and a daemon
that left it (a double fork into a new session: its parent gone, it belongs to no one), writes a line to its log
every 0.1 s, and binds /health only after --start-s. It writes its own pid, the worker's and the daemon's to --pids
as soon as they exist. --fail: prints a vLLM-like start-up failure (the root cause, then the wrappers) and exits 1.
--shm NAME: maps a /dev/shm segment of that name and never unlinks it, as vLLM's CPU all-reduce leaves its own.

    python tests/serverproc_engine.py --port P --pids FILE [--start-s 5] [--fail] [--shm NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAILURE = """\
(APIServer pid={p}) INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.32.0
(Worker_TP0 pid={p}) ERROR 12-01 10:00:05 [multiproc_executor.py:600] WorkerProc failed to start.
(Worker_TP0 pid={p}) ERROR 12-01 10:00:05 [multiproc_executor.py:600] Traceback (most recent call last):
(Worker_TP0 pid={p}) ERROR 12-01 10:00:05 [multiproc_executor.py:600]   File "cpu_worker.py", line 80, in init_device
(Worker_TP0 pid={p}) ERROR 12-01 10:00:05 [multiproc_executor.py:600] RuntimeError: Not enough allowed NUMA nodes \
to bind threads of 2 CPUWorkers. Allowed NUMA nodes are [0]. Please try to bind threads manually.
(EngineCore_DP0 pid={p}) ERROR 12-01 10:00:06 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid={p}) ERROR 12-01 10:00:06 [core.py:708] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
(APIServer pid={p}) Traceback (most recent call last):
(APIServer pid={p})   File "api_server.py", line 1, in <module>
(APIServer pid={p}) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}
"""


def _daemon() -> int:
    """A double fork into a new session: the pid of a `sleep` whose parent has exited."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execvp("sleep", ["sleep", "300"])
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.wait()
    return pid


def _mapped_segment(name: str):
    import mmap

    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    return mmap.mmap(fd, 1 << 16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pids", required=True)
    p.add_argument("--start-s", type=float, default=5.0)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--shm", default=None)
    a = p.parse_args()
    if a.fail:
        print(FAILURE.format(p=os.getpid()), end="", flush=True)
        sys.exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if a.shm:
        held = _mapped_segment(a.shm)         # noqa: F841 (kept mapped while the engine lives)
    daemon = _daemon()
    worker = subprocess.Popen(["sleep", "300"])
    with open(a.pids, "w") as f:
        json.dump({"engine": os.getpid(), "worker": worker.pid, "daemon": daemon}, f)

    def tick():
        while True:
            print(f"tick {os.getpid()}", flush=True)
            time.sleep(0.1)

    threading.Thread(target=tick, daemon=True).start()
    time.sleep(a.start_s)
    for sig in (signal.SIGTERM, signal.SIGINT):        # serving: a stop signal ends it (its worker with it)
        signal.signal(sig, lambda *_: (worker.kill(), os._exit(0)))

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *x):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    ThreadingHTTPServer(("127.0.0.1", a.port), Health).serve_forever()


if __name__ == "__main__":
    main()
