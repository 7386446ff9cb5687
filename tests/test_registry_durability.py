"""Registry durability: writers killed with SIGKILL leave no partial run; concurrent writer processes lose none."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from specscope.registry import open_registry

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "src")


def _child(code: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


RECORD = """
def record(name):
    return {"kind": "bench", "name": name, "tags": ["t1", "t2"], "config": {"model": "/m"},
            "env": {"vars": {}}, "results": {"tok_per_s": 1.0},
            "samples": {"cycle_ms": {"verify": [float(i) for i in range(20000)]}}}
"""
exec(RECORD)        # the same `record` here and in the children

def _consistent(reg):
    """Every run has its samples row and both tags; nothing dangles."""
    assert reg.integrity_check() == "ok"
    c = reg._conn
    runs = c.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert c.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == runs
    assert c.execute("SELECT COUNT(*) FROM tags").fetchone()[0] == 2 * runs
    for r in reg.list_runs():
        assert len(reg.get_run(r["id"])["samples"]["cycle_ms"]["verify"]) == 20000
    return runs


def test_sigkill_mid_transaction_leaves_no_partial_run(tmp_path):
    db = tmp_path / "runs.db"
    with open_registry(db) as reg:
        kept = reg.add_run(record("committed"))     # noqa: F821 - defined by exec(RECORD)
    # the child writes every row of a run through the real add_run path, then stalls before COMMIT
    p = _child(RECORD + """
import sys, time
from specscope.registry.db import Registry, open_registry
orig = Registry._insert
def stalled(self, *a):
    orig(self, *a)
    print("inserted", flush=True)
    time.sleep(120)
Registry._insert = stalled
open_registry(sys.argv[1]).add_run(record("partial"))
""", db)
    try:
        assert p.stdout.readline().strip() == "inserted", p.stderr.read()
        with open_registry(db) as reg:     # WAL: readers are not blocked by the open write transaction
            assert reg.count() == 1
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
    with open_registry(db) as reg:
        assert _consistent(reg) == 1
        assert [r["id"] for r in reg.list_runs()] == [kept]
        assert reg.add_run(record("after")) and reg.count() == 2     # noqa: F821 - the lock was released


def test_sigkill_at_random_points_of_a_write_stream(tmp_path):
    db = tmp_path / "runs.db"
    for delay in (0.9, 1.3):
        p = _child(RECORD + """
import sys
from specscope.registry import open_registry
reg = open_registry(sys.argv[1])
print("open", flush=True)
i = 0
while True:
    reg.add_run(record(f"r{i}"))
    i += 1
""", db)
        assert p.stdout.readline().strip() == "open", p.stderr.read()
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    with open_registry(db) as reg:
        assert _consistent(reg) >= 2


def test_four_concurrent_writers_lose_no_run(tmp_path):
    db = tmp_path / "fresh" / "runs.db"        # not created yet: the writers also race on creation + migration
    go = tmp_path / "go"
    n = 12
    procs = [_child(RECORD + """
import os, sys, time
from specscope.registry import open_registry
w, n, go = sys.argv[2], int(sys.argv[3]), sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.005)
for j in range(n):
    with open_registry(sys.argv[1]) as reg:     # reopen each time: exercises open + migrate under contention
        reg.add_run(record(f"{w}-{j}"))
print("done", flush=True)
""", db, w, n, go) for w in range(4)]
    time.sleep(1.0)
    go.touch()
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and out.strip() == "done", err
    with open_registry(db) as reg:
        assert _consistent(reg) == 4 * n
        names = {r["name"] for r in reg.list_runs()}
    assert names == {f"{w}-{j}" for w in range(4) for j in range(n)}
