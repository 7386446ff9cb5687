"""`specscope sweep`'s state and what a cell's result holds, against the stand-in engine (tests/sweep_engine.py, a
real HTTP server on loopback): a damaged sweep file is one error naming it; a refused command writes no state; one
sweep process per workdir; a cell's files that cannot be written stop the sweep in one line with the engine gone;
failed requests are part of a cell's result (stored, marked in the matrix and in compare, never judged); without
repeats a change is shown as measured and not called."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_util import cli, one_error_line

from specscope.serverproc import live_members

HERE = Path(__file__).parent
STAND_IN = [sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}"]
SMALL = ["--num-prompts", "3", "--output-len", "8", "--phases-from", "plugin"]


def _sweep(capsys, wd, *args, engine=STAND_IN):
    return cli(capsys, "sweep", "-w", wd, "--env", "X=a,b", "--repeats", "1", *SMALL, "--no-progress",
               "--serve-cmd", " ".join(engine), *args)


def _state(wd) -> dict:
    return json.loads((Path(wd) / "sweep.json").read_text())


# ---- a damaged sweep file ---------------------------------------------------------------------------------------
def _drop(*path):
    def f(d):
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return f


def _set(value, *path):
    def f(d):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return f


DAMAGE = {
    "no version": _drop("version"),
    "version true": _set(True, "version"),
    "no spec": _drop("spec"),
    "no done": _drop("done"),
    "done a list": _set([], "done"),
    "no failed": _drop("failed"),
    "failed reason a number": _set({"X=a #1": {"reason": 5}}, "failed"),
    "done without a run id": _set({"X=a #1": {"status": "ok"}}, "done"),
    "done for no cell": _set({"Y=q #1": {"status": "ok", "run_id": "abc"}}, "done"),
    "order a dict": _set({}, "order"),
    "order with a text repeat": _set([{"cell": "X=a", "repeat": "0"}], "order"),
    "running names no cell": _set({"cell": "nope", "repeat": 0, "pgid": None}, "running"),
    "no running": _drop("running"),
    "repeats as text": _set("2", "spec", "repeats"),
    "repeats zero": _set(0, "spec", "repeats"),
    "no axes": _set([], "spec", "axes"),
    "axis values as text": _set("ab", "spec", "axes", 0, "values"),
    "axis without its kind": _drop("spec", "axes", 0, "kind"),
    "a flag axis without its flag": _set("flag", "spec", "axes", 0, "kind"),
    "command as text": _set("python x", "spec", "command"),
    "no workload seed": _drop("spec", "workload", "seed"),
    "workload seed -1": _set(-1, "spec", "workload", "seed"),
    "workload prompts as text": _set("3", "spec", "workload", "num_prompts"),
    "workload rate 0": _set(0, "spec", "workload", "request_rate"),
    "not an object": lambda d: d.clear() or d.update({"__list__": True}),
    "surfaces a list": _set([], "surfaces"),
    "a surface of no group": _set({"X=a": {"run_id": "abc", "runs": ["abc"], "batches": [1], "tokens": [1],
                                          "steps": 5, "warnings": []}}, "surfaces"),
}


@pytest.fixture
def stored(tmp_path, capsys):
    """A sweep file as `sweep --max-cells 0` writes it (no engine started)."""
    wd = tmp_path / "w"
    code, _, err = _sweep(capsys, wd, "--max-cells", "0")
    assert code == 0, err
    return wd


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_sweep_file_is_one_line_naming_it(stored, capsys, case):
    data = _state(stored)
    DAMAGE[case](data)
    text = "[]" if data.get("__list__") else json.dumps(data)
    (stored / "sweep.json").write_text(text)
    for again in ((), ("--env", "X=a,b", "--repeats", "1", *SMALL, "--serve-cmd", " ".join(STAND_IN))):
        t0 = time.monotonic()
        code, _, err = cli(capsys, "sweep", "-w", stored, "--no-progress", *again)
        line = one_error_line(code, err)
        assert str(stored / "sweep.json") in line and "remove it" in line, line
        assert time.monotonic() - t0 < 3
    assert (stored / "sweep.json").read_text() == text           # left as it was


def test_a_truncated_sweep_file_is_one_line(stored, capsys):
    raw = (stored / "sweep.json").read_text()
    (stored / "sweep.json").write_text(raw[:len(raw) // 2])
    line = one_error_line(*cli(capsys, "sweep", "-w", stored)[::2])
    assert str(stored / "sweep.json") in line and "remove it" in line


# ---- a refused command writes no state --------------------------------------------------------------------------
@pytest.mark.parametrize("bad,needle", [
    (["--tokenizer", "/nonexistent"], "--tokenizer"),
    (["--dataset-name", "custom", "--dataset-path", "{bad}"], "no prompt found"),
    (["--seed", "-1", "--request-rate", "5"], "--seed"),
])
def test_a_refused_sweep_writes_no_state_and_the_corrected_one_runs(tmp_path, capsys, bad, needle):
    (tmp_path / "bad.jsonl").write_text('{"prompt": 5}\n')
    wd = tmp_path / "w"
    t0 = time.monotonic()
    code, _, err = _sweep(capsys, wd, *[a.replace("{bad}", str(tmp_path / "bad.jsonl")) for a in bad])
    assert needle in one_error_line(code, err) and time.monotonic() - t0 < 3
    assert not wd.exists()                      # no sweep file, no engine's cell directory
    code, _, err = _sweep(capsys, wd, "--max-cells", "0")
    assert code == 0, err


# ---- one process per workdir -----------------------------------------------------------------------------------
def test_a_second_sweep_on_the_same_workdir_is_refused_naming_the_first(tmp_path, capsys):
    wd = tmp_path / "w"
    args = ["--env", "X=a,b", "--repeats", "1", "--num-prompts", "40", "--output-len", "64", "--phases-from",
            "plugin", "--serve-cmd", " ".join(STAND_IN + ["--verify-ms", "20"])]
    first = subprocess.Popen([sys.executable, "-m", "specscope", "sweep", "-w", str(wd), "--no-progress", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pgid = None
        for _ in range(300):
            run = (_state(wd).get("running") or {}) if (wd / "sweep.json").exists() else {}
            if run.get("pgid"):
                pgid = run["pgid"]
                break
            time.sleep(0.1)
        assert pgid, first.stderr.read() if first.poll() is not None else "the first sweep never started an engine"
        code, _, err = cli(capsys, "sweep", "-w", wd, "--no-progress", "--max-cells", "1", *args)
        line = one_error_line(code, err)
        assert "in use by another sweep" in line and f"pid {first.pid}" in line
        assert [o["cell"] for o in _state(wd)["order"]] == ["X=a"]          # no second engine for its slot
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert not live_members(pgid)
    code, _, err = cli(capsys, "sweep", "-w", wd, "--max-cells", "0")       # the lock went with its process
    assert code == 0, err


# ---- a cell's files that cannot be written ------------------------------------------------------------------------
def test_cell_files_that_cannot_be_written_stop_the_sweep_in_one_line(stored, capsys):
    (stored / "cells").write_text("a file where the cells' directory goes")
    line = one_error_line(*cli(capsys, "sweep", "-w", stored, "--no-progress")[::2])
    assert str(stored / "cells") in line
    st = _state(stored)
    assert st["running"] is None and not st["done"] and not st["failed"]


def test_a_full_disk_mid_cell_is_one_line_and_nothing_half_written(stored, capsys, monkeypatch):
    """ENOSPC when the cell's files are written (after its engine ran): one line, the engine gone, no file of the
    cell's written in part, the sweep file whole and the cell missing."""
    import specscope.fileio as fileio

    real = os.fsync

    def full(fd):
        if "/cells/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", full)
    line = one_error_line(*cli(capsys, "sweep", "-w", stored, "--no-progress")[::2])
    assert "no space left on the device" in line.lower()
    st = _state(stored)
    assert st["running"] is None and not st["done"] and st["interrupted"][0]["cell"] == "X=a"
    assert not live_members(st["interrupted"][0]["pgid"])
    cell = stored / "cells" / "00-r1"
    assert not (cell / "bench.json").exists() and not [p for p in cell.iterdir() if p.name.endswith(".tmp")]


# ---- failed requests are part of a cell's result ----------------------------------------------------------------
@pytest.mark.parametrize("failing,failed", [(["--die-after", "1"], 3), (["--fail-every", "2"], 2)])
def test_failed_requests_are_stored_marked_and_not_judged(tmp_path, capsys, failing, failed):
    wd = tmp_path / "w"
    code, _, err = cli(capsys, "sweep", "-w", wd, "--flag", "steps=1,3", "--repeats", "1", "--warmup", "0",
                       "--num-prompts", "4", "--output-len", "8", "--phases-from", "plugin", "--no-progress",
                       "--serve-cmd", " ".join(STAND_IN + failing))
    assert code == 0, err
    code, out, err = cli(capsys, "sweep", "-w", wd, "--json")
    doc = json.loads(out)
    cells = [c for line in doc["matrix"]["cells"] for c in line]
    from specscope.registry import open_registry
    from specscope.sweep.render import cell_lines, text_lines

    for c in cells:
        assert c["samples"]["failed_requests"] == failed and c["samples"]["requests"] == 4
        assert f"FAILED: {failed} of 4 requests (not judged)" in cell_lines(c)
        assert "error" in c["breakeven"]
        with open_registry() as reg:
            assert reg.get_run(c["runs"][0])["results"]["failed"] == failed
    (s,) = doc["axes"][0]["slices"]
    assert s["verdict"] == "not judged" and "failed" in s["why"] and doc["axes"][0]["verdict"] == "not judged"
    assert any("request(s) failed" in ln for ln in text_lines(doc))
    code, out, err = cli(capsys, "compare", *[c["runs"][0] for c in cells])
    assert code == 0, err
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("failed requests"))
    assert row.split()[2] == str(failed)


# ---- verdicts only with the noise they are judged against ------------------------------------------------------
def test_without_repeats_changes_are_measured_not_called(tmp_path, capsys):
    wd = tmp_path / "w"
    code, table, err = cli(capsys, "sweep", "-w", wd, "--flag", "steps=1,3", "--repeats", "1", *SMALL,
                           "--serve-cmd", " ".join(STAND_IN + ["--steps", "1"]), "--no-progress")
    assert code == 0, err
    doc = json.loads(cli(capsys, "sweep", "-w", wd, "--json")[1])
    assert doc["launch_noise"] is None
    (axis,) = doc["axes"]
    rows = {r["metric"]: r for r in axis["slices"][0]["rows"]}
    assert rows["phase.draft"]["pooled"] == "worse" and rows["phase.draft"]["verdict"] == "not called"
    assert axis["verdict"] == "not called" and not any(r["verdict"] in ("better", "worse") for r in rows.values())
    assert "launch-to-launch noise below" not in table and "beyond the launch-to-launch noise" not in table
    assert "not called" in table and "(1 vs 1 run(s))" in table
    page = (wd / "sweep.html").read_text()
    assert "is larger than the metric" not in page and "not called" in page
    for c in (c for line in doc["matrix"]["cells"] for c in line):       # what each cell's numbers rest on
        assert c["samples"]["runs"] == 1 and c["samples"]["requests"] == 3 and c["samples"]["cycles"] > 0
        assert f"n: 1 run(s), {c['samples']['cycles']} cycles, 3 requests" in table
