"""`specscope bisect` on the stand-in engine (tests/sweep_engine.py, a real HTTP server process launched per cell,
its steps through the real step recorder at declared costs): a regression the test plants (verify 3x dearer from
build K on, a build being an environment variable's value) found at its boundary, within the launch bound; probes
whose engine fails to start skipped, the boundary found around them, no engine left running; ends that differ by
nothing beyond launch noise stopped in one line; bad input refused in one line before anything is written.

Launch count rule (docs/sweep.md): both ends `--repeats` times each (2 here: the noise), then one launch per probe,
at most ⌈log2(n − 1)⌉ probes for n values (plus one per skipped probe); ⌈log2(n − 1)⌉ ≤ log2(n) + 1."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from cli_util import cli, one_error_line

HERE = Path(__file__).parent
STAND_IN = [sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}", "--steps", "2"]
WORKLOAD = ["--num-prompts", "3", "--output-len", "16", "--phases-from", "plugin", "--no-progress"]


@pytest.fixture(autouse=True)
def _quick_settle(monkeypatch):
    import specscope.sweep.cell as cell

    monkeypatch.setattr(cell, "SETTLE_S", 0.2)      # the stand-in writes each step as it ends


def _bisect(capsys, wd, *args):
    code, out, err = cli(capsys, "bisect", "-w", wd, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def _runs(tag):
    from specscope.registry import open_registry

    with open_registry() as reg:
        return [reg.get_run(r["id"], samples=False) for r in reg.list_runs(tag=tag)]


def test_the_planted_regression_is_found_at_its_boundary(tmp_path, capsys):
    n, k = 9, 5                                     # builds 0..8, verify slowed from build 5 on
    wd = tmp_path / "builds"
    args = ["--metric", "verify", "--env", "BUILD=" + ",".join(map(str, range(n))), *WORKLOAD,
            "--serve-cmd", " ".join(STAND_IN + ["--slow-from", str(k)])]
    res = _bisect(capsys, wd, *args)
    assert res["status"] == "found" and res["metric"] == "phase.verify"
    assert (res["last_good"], res["first_bad"]) == (str(k - 1), str(k))
    assert res["ends"]["verdict"] == "worse" and res["ends"]["change"] == pytest.approx(2.0, abs=1e-3)
    probes = res["probes"]
    assert all(p["side"] == ("bad" if int(p["value"]) >= k else "good") for p in probes)
    assert all(p["share"] == pytest.approx(1.0 if int(p["value"]) >= k else 0.0, abs=1e-3) for p in probes)
    # the count rule: 2 x 2 launches at the ends, one per probe, at most ceil(log2(n - 1)) probes
    assert len(probes) <= math.ceil(math.log2(n - 1)) <= math.log2(n) + 1
    assert res["launches"] == res["launched_now"] == 2 * 2 + len(probes) <= res["most_launches"] == 7
    # every launch one registry run of the sweep, carrying its build
    runs = _runs("sweep:builds")
    assert len(runs) == res["launches"]
    assert sorted(r["env"]["vars"]["BUILD"] for r in runs) == sorted(["0", "0", str(n - 1), str(n - 1)] +
                                                                      [p["value"] for p in probes])
    # compare's attribution at the boundary: the verify moved, and the build (the axis) is among its likely causes
    # (the machine's load average, which differs between any two launches here, may rank above it)
    att = res["attribution"]
    assert (att["from"], att["to"]) == (f"BUILD={k - 1}", f"BUILD={k}")
    verify = next(r for r in att["rows"] if r["metric"] == "phase.verify")
    assert verify["verdict"] == "worse" and att["axis_settings"] == ["env.vars.BUILD"]
    assert att["likely_causes"][att["axis_rank"] - 1]["key"] == "env.vars.BUILD"
    assert "verify +200%" in att["summary"]

    # run again: the answer from the stored runs, nothing launched; the terminal words say the same
    code, out, err = cli(capsys, "bisect", "-w", wd, *args)
    assert code == 0, err
    assert f"first bad: BUILD={k}    last good: BUILD={k - 1}" in out and ", 0 now" in out
    assert f"compare BUILD={k - 1} → BUILD={k}:" in out and "env.vars.BUILD (the axis)" in out
    assert len(_runs("sweep:builds")) == res["launches"]
    # another metric over the same launches: τ does not move with the verify's cost, so there is nothing to find
    tau = _bisect(capsys, wd, "--metric", "tau")
    assert tau["status"] == "no change" and tau["launched_now"] == 0 and tau["first_bad"] is None


def test_a_probe_goes_to_the_end_it_lies_nearer(tmp_path, capsys):
    """A small step before the regression (verify 1.5x from build 1, 3x from build 3): build 2 leaves the launch
    noise against build 0 but lies a quarter of the way to the bad end, so it is good, and the boundary is the
    large step's (the rule: a probe is bad at half the ends' change or more)."""
    wd = tmp_path / "drift"
    res = _bisect(capsys, wd, "--metric", "verify", "--env", "BUILD=0,1,2,3,4", *WORKLOAD, "--serve-cmd",
                  " ".join(STAND_IN + ["--slow-from", "3", "--drift-from", "1", "--drift-factor", "1.5"]))
    assert res["status"] == "found" and (res["last_good"], res["first_bad"]) == ("2", "3"), res
    first, second = res["probes"]
    assert (first["value"], first["side"], second["value"], second["side"]) == ("2", "good", "3", "bad")
    # the step is called a change against the good end, yet it carries a quarter of the ends' change
    assert first["judgement"]["verdict"] == "worse" and first["judgement"]["change"] > res["noise"]
    assert first["share"] == pytest.approx(0.25, abs=0.01) and second["share"] == pytest.approx(1.0, abs=0.01)


def _running(marker: str) -> list[int]:
    """Pids of the processes (zombies aside) whose command line holds `marker`, read from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue                                # not a process, or gone meanwhile
        if marker in cmd and state != "Z":
            out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="processes are read from Linux's /proc")
def test_a_probe_whose_engine_fails_to_start_is_skipped(tmp_path, capsys):
    """Builds 4 and 6 do not start (regression from 6 on): 4 is skipped and its neighbour probed; 6, skipped at the
    boundary, is named between the last good and the first bad; no engine is left running."""
    n, k, fails = 9, 6, ("4", "6")
    wd, pids = tmp_path / "skips", tmp_path / "engine.pids"
    args = ["--metric", "verify", "--env", "BUILD=" + ",".join(map(str, range(n))), *WORKLOAD, "--serve-cmd",
            " ".join(STAND_IN + ["--slow-from", str(k), "--pid-file", str(pids)] +
                     [a for v in fails for a in ("--fail-value", v)])]
    res = _bisect(capsys, wd, *args)
    assert res["status"] == "found"
    # the search halves around a skip: 4 (the middle) fails, 3 (nearest the middle, untried) goes next
    assert [(p["value"], p["side"]) for p in res["probes"]] == \
        [("4", "skipped"), ("3", "good"), ("5", "good"), ("6", "skipped"), ("7", "bad")]
    skipped = [p for p in res["probes"] if p["side"] == "skipped"]
    assert all(p["runs"] == [] and p["judgement"] is None and "the model does not fit" in p["reason"]
               for p in skipped)
    # the boundary around the skipped 6: the true first bad lies in (last good, first bad], the skip between
    assert (res["last_good"], res["first_bad"], res["skipped_between"]) == ("5", "7", ["6"])
    att = res["attribution"]
    assert (att["from"], att["to"]) == ("BUILD=5", "BUILD=7")
    # every probe one launch, skipped ones too, and the bound grows by one per skip: 4 + 3 + 2
    assert res["launches"] == res["launched_now"] == 4 + 5 == res["most_launches"]
    assert {r["env"]["vars"]["BUILD"] for r in _runs("sweep:skips")} == {"0", "3", "5", "7", "8"}
    assert len(pids.read_text().split()) == res["launches"]     # each launch's engine wrote its pid
    assert _running(str(pids)) == []

    # run again: the same answer from the sweep file, the failed values not launched again; the terminal words
    code, out, err = cli(capsys, "bisect", "-w", wd, *args)
    assert code == 0, err
    assert "first bad: BUILD=7    last good: BUILD=5" in out and ", 0 now" in out
    assert "  not judged between them (skipped): 6" in out.splitlines()
    assert re.search(r"^    probe BUILD=4: skipped \(.*the model does not fit", out, re.M), out
    assert len(pids.read_text().split()) == 9 and _running(str(pids)) == []


def test_ends_that_differ_by_nothing_beyond_launch_noise_stop_in_one_line(tmp_path, capsys):
    wd = tmp_path / "same"
    args = ["--metric", "verify", "--env", "BUILD=0,1,2,3,4,5,6,7", *WORKLOAD, "--serve-cmd", " ".join(STAND_IN)]
    res = _bisect(capsys, wd, *args)
    assert res["status"] == "no change" and res["ends"]["verdict"] == "no significant change"
    assert res["launches"] == 4 and res["probes"] == [] and res["first_bad"] is None     # the ends alone
    assert {r["sweep"]["cell"] for r in _runs("sweep:same")} == {"BUILD=0", "BUILD=7"}
    code, out, err = cli(capsys, "bisect", "-w", wd, *args)
    assert code == 0 and "no change beyond launch noise between the ends" in out.splitlines()[1], err
    assert "nothing to bisect" in out and ", 0 now" in out


@pytest.mark.parametrize("args,needle", [
    (["--metric", "speed", "--env", "BUILD=0,1"], "--metric 'speed' is not a metric bisect can follow"),
    (["--metric", "verify", "--env", "BUILD=0"], "at least 2 values"),
    (["--metric", "verify", "--env", "BUILD=0,1", "--repeats", "1"], "--repeats 1: bisect launches each end"),
    (["--metric", "verify", "--env", "BUILD=0,1", "--env", "X=a,b"], "bisect searches one ordered axis; got 2"),
    (["--metric", "verify", "--env", "BUILD=0,1", "--phases-from", "none"], "reads no per-phase timings"),
    (["--metric", "verify"], "needs at least one axis"),
    (["--metric", "verify", "--env", "BUILD=0,1", "--baseline-without", "steps"], "--baseline-without"),
    (["--env", "BUILD=0,1"], "--metric"),
])
def test_bad_bisects_are_one_error_line_and_write_nothing(tmp_path, capsys, args, needle):
    code, _, err = cli(capsys, "bisect", "-w", tmp_path / "w", *args, "--serve-cmd", " ".join(STAND_IN))
    assert needle in one_error_line(code, err)
    assert not (tmp_path / "w" / "sweep.json").exists()


def test_the_probe_bound():
    from specscope.sweep.bisect import probe_bound

    assert [probe_bound(n) for n in (2, 3, 4, 5, 9, 10, 17, 1000)] == [0, 1, 2, 2, 3, 4, 4, 10]
    assert all(probe_bound(n) <= math.log2(n) + 1 for n in range(2, 5000))
