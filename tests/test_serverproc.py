"""A server specscope starts never outlives it, however specscope ends (kill -9 mid-start included), with every
process the server started (a worker in its group, a daemon in a new session); a launch never shares its files with
a live engine of an earlier one; a failed start is named by the root cause in its log. Real processes throughout:
the stand-in engine (tests/serverproc_engine.py) behaves as a starting vLLM does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specscope.serverproc import ServerFailed, ServerProcess, free_port

ENGINE = Path(__file__).with_name("serverproc_engine.py")
# specscope in a process of its own, which the test kills: it starts the engine and waits for it to serve
PARENT = """
import json, sys
from pathlib import Path
from specscope.serverproc import ServerProcess
a = json.loads(sys.argv[1])
sp = ServerProcess(a["argv"], a["env"], Path(a["log"]), a["url"], startup_s=600, stop_s=1)
sp.start()
print(sp.pgid, flush=True)
sp.wait_healthy()
print("healthy", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def _engine(tmp_path: Path, name: str, *extra: str):
    port = free_port()
    pids = tmp_path / f"{name}.pids.json"
    return [sys.executable, str(ENGINE), "--port", str(port), "--pids", str(pids), *extra], \
        f"http://127.0.0.1:{port}", pids


def _pids(path: Path) -> dict:
    for _ in range(300):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError("the stand-in engine never wrote its pids")


@pytest.fixture(autouse=True)
def _leave_nothing(tmp_path):
    yield
    for f in tmp_path.glob("*.pids.json"):     # whatever a failing run left behind
        for pid in json.loads(f.read_text()).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_and_kill_parent(tmp_path: Path, log: Path, start_s: str = "15") -> tuple[dict, str]:
    """specscope (a real process) starts the engine, which takes `start_s` to serve; kill -9 of specscope once it
    has started the engine and the engine's tree exists. The tree's pids and the engine's URL."""
    argv, url, pids_file = _engine(tmp_path, "a", "--start-s", start_s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps({"argv": argv, "env": env, "log": str(log),
                                                                          "url": url})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip().isdigit(), parent.communicate()[1]     # start() returned
        pids = _pids(pids_file)
    finally:
        parent.kill()
        parent.wait()
    return pids, url


def test_kill_9_of_specscope_mid_start_leaves_no_engine(tmp_path):
    pids, url = _start_and_kill_parent(tmp_path, tmp_path / "engine.log")
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        assert not _answers(url), "the engine of a dead specscope finished starting and serves"
        time.sleep(0.2)
    assert not [name for name, p in pids.items() if _alive(p)], pids
    assert not _answers(url)


def test_a_rerun_never_shares_the_files_of_a_live_engine(tmp_path):
    log = tmp_path / "engine.log"
    old, _ = _start_and_kill_parent(tmp_path, log)
    argv, url, _ = _engine(tmp_path, "b", "--start-s", "0")
    with ServerProcess(argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, log, url, startup_s=120, stop_s=5) as sp:
        while f"tick {sp.pgid}" not in log.read_text(errors="replace"):
            time.sleep(0.05)
        assert not [name for name, p in old.items() if _alive(p)], old
        assert f"tick {old['engine']}" not in log.read_text(errors="replace")


def test_a_launch_dir_in_use_by_a_running_specscope_is_refused(tmp_path):
    log = tmp_path / "engine.log"
    argv, url, pids_file = _engine(tmp_path, "a", "--start-s", "0")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with ServerProcess(argv, env, log, url, startup_s=120, stop_s=5):
        argv2, url2, _ = _engine(tmp_path, "b", "--start-s", "0")
        second = ServerProcess(argv2, env, log, url2, startup_s=120, stop_s=5)
        with pytest.raises(ServerFailed, match=f"{tmp_path} is in use by the engine .*stop that run or use "
                                               f"another directory"):
            try:
                second.start()
            finally:
                second.stop()
        assert _answers(url)
    pids = _pids(pids_file)
    assert not [name for name, p in pids.items() if _alive(p)], pids


def test_a_stop_ends_the_daemon_the_engine_started_in_a_new_session(tmp_path):
    argv, url, pids_file = _engine(tmp_path, "a", "--start-s", "0")
    with ServerProcess(argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "engine.log", url,
                       startup_s=120, stop_s=5):
        assert _answers(url)
    pids = _pids(pids_file)
    assert not [name for name, p in pids.items() if _alive(p)], pids
    assert not (tmp_path / "engine.log.pid").exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="vLLM's CPU all-reduce segments live in /dev/shm")
def test_a_stop_removes_the_shared_memory_the_engine_left_and_no_live_one(tmp_path):
    """vLLM's CPU all-reduce leaves its /dev/shm segments behind a stopped launch (8-16 MiB each, a sweep's fill a
    container's 64 MiB): with vLLM's leftovers (what every vLLM launch of specscope's passes), a stop removes those
    that appeared during the launch and no process maps; a segment another live process maps stays."""
    from specscope.engines.vllm import shm_leftovers

    tag = f"{os.getpid()}-{tmp_path.name}"
    mine, theirs = f"vllm_dist_test-{tag}-cpushm_0", f"vllm_dist_test-{tag}-live"
    argv, url, pids_file = _engine(tmp_path, "a", "--start-s", "0", "--shm", mine)
    holder = None
    try:
        with ServerProcess(argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_path / "engine.log", url,
                           startup_s=120, stop_s=5, leftovers=shm_leftovers):
            holder = subprocess.Popen([sys.executable, str(ENGINE), "--port", "0", "--pids",
                                       str(tmp_path / "holder.pids"), "--start-s", "300", "--shm", theirs])
            deadline = time.monotonic() + 30
            while not all(Path(f"/dev/shm/{n}").exists() for n in (mine, theirs)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert Path(f"/dev/shm/{mine}").exists() and Path(f"/dev/shm/{theirs}").exists()
        assert not Path(f"/dev/shm/{mine}").exists()
        assert Path(f"/dev/shm/{theirs}").exists()      # mapped by a process still running: not ours to remove
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
            held = tmp_path / "holder.pids"
            for pid in (_pids(held).values() if held.exists() else ()):     # its worker and daemon
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        for n in (mine, theirs):
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)


def test_a_failed_start_is_named_by_its_root_cause_line(tmp_path):
    argv, url, _ = _engine(tmp_path, "a", "--fail")
    log = tmp_path / "engine.log"
    with pytest.raises(ServerFailed) as e:
        with ServerProcess(argv, dict(os.environ), log, url, startup_s=120, stop_s=5):
            pass
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the server exited with status 1 while starting: RuntimeError: Not "
                                              "enough allowed NUMA nodes to bind threads of 2 CPUWorkers.")
    assert msg.endswith(f"bind threads manually. (log: {log})")
    # the capture's launch reads the same log the same way
    from specscope.train.capture import VLLMLaunch

    v = VLLMLaunch(tmp_path, [], tmp_path / "in", log, 128)
    assert v.why().startswith("RuntimeError: Not enough allowed NUMA nodes")


def test_an_argparse_refusal_is_named_by_its_error_line_not_its_usage(tmp_path):
    """vLLM refusing a flag prints argparse's usage block, whose option lists hold words such as 'error,'
    ({critical,debug,error,info,...}), then `prog: error: ...`: the cause is that last line."""
    from specscope.serverproc import log_cause

    log = tmp_path / "vllm.log"
    log.write_text("INFO 12-04 22:00:00 [__init__.py:1] starting\n"
                   "usage: api_server.py [-h] [--host HOST]\n"
                   "                     [--uvicorn-log-level {critical,debug,error,info,trace,warning}]\n"
                   "                     [model_tag]\n"
                   "api_server.py: error: unrecognized arguments: --no-such-flag\n")
    assert log_cause(log) == "api_server.py: error: unrecognized arguments: --no-such-flag"
