"""`specscope sweep` against real engines that are cheap here: `specscope serve` on a tiny random model (2 × 2 cells
× 2 repeats, killed with SIGTERM after its first cell and resumed), and tests/sweep_engine.py, a stand-in whose
steps go through specscope's real step recorder at costs it declares (the vLLM plugin's path: phases, break-even,
compare's verdicts).
Failed starts keep the engine's last log lines; Ctrl-C during a start kills the engine's whole group. The real
vLLM sweep is tests/engines/test_sweep.py (`make test-engines`)."""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_util import cli, one_error_line
from tiny import make_hf_model, make_tiny_tokenizer

from specscope.serverproc import live_members
from specscope.sweep.spec import SweepSpec, parse_env_axis, parse_flag_axis

HERE = Path(__file__).parent
STAND_IN = [sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_sweep")
    make_hf_model(d, "llama", vocab=101, layers=2, max_position_embeddings=1024)
    make_tiny_tokenizer(d, 101)
    return d


def _doc(capsys, wd, *extra):
    code, out, err = cli(capsys, "sweep", "-w", wd, "--json", "--no-progress", *extra)
    assert code in (0, 1), err
    return json.loads(out), err


def _state(wd) -> dict:
    return json.loads((Path(wd) / "sweep.json").read_text())


def _cells(doc):
    return [c for line in doc["matrix"]["cells"] for c in line]


def _agree(doc, table: str, page_html: str):
    """Every cell's numbers, formatted from the JSON here, are in the terminal table and the HTML page, in the same
    cell (each table row's lines in column order)."""
    page = html.unescape(page_html)
    rows = re.findall(r"<tr><td>(.*?)</td>(.*?)</tr>", page)
    heads = [f"{doc['matrix']['rows']['axis']}={v}" for v in doc["matrix"]["rows"]["values"]]
    for head, line in zip(heads, doc["matrix"]["cells"]):
        html_cells = next(re.findall(r"<td class=n>(.*?)</td>", r[1]) for r in rows if r[0] == head)
        for c, got in zip(line, html_cells):
            want = [f"{c['tok_per_s']['mean']:.1f} ±{c['tok_per_s']['sd']:.1f} tok/s"]
            if c.get("tau"):
                want.append(f"τ {c['tau']['mean']:.2f} ±{c['tau']['sd']:.2f}")
            if c.get("verify_ms"):
                want.append(f"verify {c['verify_ms']['mean']:.1f} ±{c['verify_ms']['sd']:.1f} ms "
                            f"({c['verify_share']['mean'] * 100:.0f}%)")
            for w in want:
                assert w in got.split("<br>"), (w, got)
        # the terminal: the row's first physical line starts with its head, and each cell's lines run across
        first = next(i for i, ln in enumerate(table.splitlines()) if ln.strip().startswith(head))
        block = table.splitlines()[first:first + 8]
        for k in range(len(_lines_of(line[0]))):
            pattern = r".*".join(re.escape(_lines_of(c)[k]) for c in line if k < len(_lines_of(c)))
            assert any(re.search(pattern, b) for b in block), (pattern, block)


def _lines_of(cell):
    from specscope.sweep.render import cell_lines

    return cell_lines(cell)


# ---- the cells, their order and their commands -----------------------------------------------------------------
def test_cells_run_abba_and_each_gets_its_command():
    cmd = ["vllm", "--model", "M", "--tensor-parallel-size=1", "--speculative-config",
           '{"method": "eagle3", "num_speculative_tokens": 3}', "--port", "8000"]
    spec = SweepSpec(cmd, [parse_flag_axis("speculative-config.num_speculative_tokens=1,3"),
                           parse_flag_axis("--tensor-parallel-size=1,2"), parse_env_axis("NCCL_PROTO=LL,Simple")],
                     repeats=3, baseline_without=["--speculative-config"])
    spec.check()
    keys = [c.key for c in spec.cells()]
    assert len(keys) == 8 + 4 and keys[0] == "num_speculative_tokens=1, tensor-parallel-size=1, NCCL_PROTO=LL"
    assert keys[-1] == "baseline, tensor-parallel-size=2, NCCL_PROTO=Simple"
    assert spec.schedule() == [(k, 0) for k in keys] + [(k, 1) for k in keys[::-1]] + [(k, 2) for k in keys]
    cell = spec.cells()[7]                  # steps 3, TP 2, Simple
    argv = spec.argv(cell, 1234)
    assert argv[argv.index("--speculative-config") + 1] == '{"method": "eagle3", "num_speculative_tokens": 3}'
    assert "--tensor-parallel-size=2" in argv and argv[-2:] == ["--port", "1234"]
    assert spec.env(cell) == {"NCCL_PROTO": "Simple"}
    base = spec.argv(spec.cells()[-1], 99)
    assert "--speculative-config" not in base and base == ["vllm", "--model", "M", "--tensor-parallel-size=2",
                                                            "--port", "99"]
    dotted = SweepSpec(["x", "--speculative-config.num_speculative_tokens", "3", "--p", "{port}"],
                       [parse_flag_axis("speculative-config.num_speculative_tokens=1,2")], 1)
    assert dotted.argv(dotted.cells()[0], 5) == ["x", "--speculative-config.num_speculative_tokens", "1", "--p", "5"]
    assert parse_flag_axis("steps=1,true,x").values == (1, True, "x")
    assert parse_flag_axis("steps=1,3").key == "config.steps" and parse_env_axis("OMP_PROC_BIND=a,b").key == \
        "env.OMP_PROC_BIND"


@pytest.mark.parametrize("args,needle", [
    (["--flag", "steps"], "--flag takes FLAG=VALUE"),
    (["--flag", "steps=1,1"], "repeats a value"),
    (["--env", "1X=a,b"], "--env takes NAME=VALUE"),
    (["--flag", "port=1,2"], "the sweep sets --port itself"),
    (["--flag", "steps=1,2", "--flag", "steps=3,4"], "given twice"),
    (["--flag", "speculative-config.num_speculative_tokens=1,3"], "has no --speculative-config"),
    (["--flag", "steps=1,2", "--baseline-without", "draft"], "--baseline-without draft: the launch command has no"),
    ([], "at least one axis"),
])
def test_bad_sweeps_are_one_error_line(tmp_path, capsys, args, needle):
    code, _, err = cli(capsys, "sweep", "-w", tmp_path / "w", *args, "--serve-cmd", "engine --port {port}")
    assert needle in one_error_line(code, err)
    assert not (tmp_path / "w" / "sweep.json").exists()


def test_a_workdir_names_one_sweep(tmp_path, capsys):
    code, _, err = cli(capsys, "sweep", "-w", tmp_path, "--num-prompts", "3")
    assert "give the engine's launch command too" in one_error_line(code, err)
    code, _, err = cli(capsys, "sweep", "-w", tmp_path)
    assert "no sweep in --workdir" in one_error_line(code, err)


# ---- failed starts, the cell limit, Ctrl-C ------------------------------------------------------------------------
def test_a_failed_start_keeps_the_engines_last_lines_and_the_sweep_goes_on(tmp_path, capsys):
    wd = tmp_path / "w"
    args = ["--flag", "verify-ms=2,-1", "--repeats", "1", "--num-prompts", "3", "--output-len", "8",
            "--phases-from", "plugin", "--serve-cmd", " ".join(STAND_IN)]
    doc, _ = _doc(capsys, wd, *args, "--max-cells", "1")        # stopped after one cell: the rest is missing
    assert doc["progress"] == {"slots": 2, "done": 1, "failed": 0, "missing": 1}
    assert _doc(capsys, wd, "--max-cells", "0")[0]["progress"]["missing"] == 1       # 0: only the matrix
    code, out, err = cli(capsys, "sweep", "-w", wd, "--no-progress")       # continues with the missing cell
    assert code == 0, err
    ok, bad = _cells(json.loads(cli(capsys, "sweep", "-w", wd, "--json")[1]))
    assert ok["status"] == "ok" and bad["status"] == "failed" and "exited with status 3" in bad["reason"]
    assert "ValueError: the model does not fit (stand-in failure)" in out        # the engine's last words
    st = _state(wd)
    (fail,) = st["failed"].values()
    assert "the model does not fit" in fail["log_tail"] and "--verify-ms -1" in fail["command"]
    assert not live_members(fail["pgid"]) and st["running"] is None
    code, _, err = cli(capsys, "sweep", "-w", tmp_path / "all", "--env", "X=a,b", "--repeats", "1",
                       "--serve-cmd", " ".join(STAND_IN + ["--fail"]), "--no-progress")
    assert code == 1 and "every run failed (2)" in err and "exited with status 3" in err


def test_ctrl_c_during_a_start_kills_the_engines_whole_group(tmp_path):
    # an engine that ignores SIGINT, with a child in its group: the sweep must still leave nothing running
    engine = ("import signal, subprocess, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "subprocess.Popen(['sleep', '300']); print('loading', flush=True); time.sleep(300)")
    wd = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "specscope", "sweep", "-w", str(wd), "--env", "X=a,b",
                             "--stop-timeout", "1", "--serve-cmd", f"{sys.executable} -c \"{engine}\" {{port}}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pgid = None
    for _ in range(300):
        run = (_state(wd).get("running") or {}) if (wd / "sweep.json").exists() else {}
        if run.get("pgid") and len(live_members(run["pgid"])) == 2:
            pgid = run["pgid"]
            break
        time.sleep(0.1)
    assert pgid, proc.stderr.read() if proc.poll() is not None else "the engine never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert live_members(pgid) == []
    st = _state(wd)
    assert st["running"] is None and not st["done"] and not st["failed"] and st["interrupted"][0]["pgid"] == pgid


# ---- the plugin's path: phases, break-even, compare's verdicts ------------------------------------------------
def test_plugin_steps_give_phases_breakeven_and_verdicts(tmp_path, capsys, monkeypatch):
    import specscope.sweep.cell as cell

    monkeypatch.setattr(cell, "SETTLE_S", 0.2)      # the stand-in writes each step as it ends
    wd = tmp_path / "w"
    doc, _ = _doc(capsys, wd, "--flag", "steps=1,3", "--repeats", "2", "--baseline-without", "steps",
                  "--num-prompts", "5", "--output-len", "24", "--phases-from", "plugin",
                  "--serve-cmd", " ".join(STAND_IN + ["--steps", "1"]))
    one, three = _cells(doc)
    for c in (one, three):
        assert c["n"] == 2 and c["verify_ms"]["mean"] > 0 and c["draft_ms"]["mean"] > 0 and c["tau"]["mean"] > 1
        be = c["breakeven"]
        assert be["decode_ms"] > 0 and 1 < be["break_even_tau"] and be["pays"] == (be["tau"] >= be["break_even_tau"])
    # the stand-in's declared costs, carried through the recorder, ingest and the pooled cells exactly: no clock
    from sweep_engine import DRAFT_MS_PER_STEP, verify_ms

    for c, k in ((one, 1), (three, 3)):
        assert c["draft_ms"]["mean"] == pytest.approx(DRAFT_MS_PER_STEP * k, abs=1e-4)
        assert c["verify_ms"]["mean"] == pytest.approx(verify_ms(2.0, k), abs=1e-4)
    (steps,) = doc["axes"]
    rows = {r["metric"]: r for r in steps["slices"][0]["rows"]}
    assert steps["verdict"] == "changed" and rows["phase.verify"]["verdict"] == "worse"
    assert rows["phase.draft"]["verdict"] == "worse" and rows["phase.draft"]["repeats"] == ["worse", "worse"]
    assert steps["slices"][0]["cause"] == "config.steps" and steps["slices"][0]["cause_is_axis"]
    # the warm-up's steps are not in the run: the measured file starts after them
    d = wd / "cells" / "00-r1"
    steps_all = sum(1 for ln in (d / "steps.jsonl").read_text().splitlines() if ln.startswith('{"i":'))
    measured = sum(1 for ln in (d / "steps.measured.jsonl").read_text().splitlines() if ln.startswith('{"i":'))
    from specscope.registry import open_registry

    with open_registry() as reg:
        run = reg.get_run(one["runs"][0])
    assert run["results"]["cycles"] == measured < steps_all and run["kind"] == "ingest"
    assert run["config"]["steps"] == 1 and "env" not in run["config"] and run["sweep"]["cell"] == "steps=1"


# ---- a real engine: specscope serve ---------------------------------------------------------------------------
def test_sweep_of_a_real_engine_killed_and_resumed(tiny, tmp_path, capsys):
    wd = tmp_path / "w"
    serve = (f"{sys.executable} -m specscope serve --model {tiny} --device cpu --dtype fp32 --threads 1 "
             f"--draft ngram --spec-policy always --port {{port}}")   # every run drafts: every cell has a τ
    args = ["--flag", "steps=1,3", "--env", "NCCL_PROTO=LL,Simple", "--repeats", "2", "--num-prompts", "5",
            "--output-len", "8", "--ignore-eos", "--serve-cmd", serve]
    proc = subprocess.Popen([sys.executable, "-m", "specscope", "sweep", "-w", str(wd), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    pgid = None
    for _ in range(1200):
        st = _state(wd) if (wd / "sweep.json").exists() else {"done": {}}
        if len(st["done"]) == 1 and (st.get("running") or {}).get("pgid"):
            pgid = st["running"]["pgid"]
            break
        time.sleep(0.1)
    assert pgid, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)            # killed after its first cell, the second one's engine starting
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and not live_members(pgid), err
    first = next(iter(_state(wd)["done"].values()))["run_id"]

    code, table, err = cli(capsys, "sweep", "-w", wd)          # resumes: the 7 missing runs
    assert code == 0 and "sweep w: 8/8 cell" in err, err
    doc, _ = _doc(capsys, wd)                                   # nothing left: the same document again
    st = _state(wd)
    keys = [c["key"] for c in _cells(doc)]
    last_starts = list(dict.fromkeys((o["cell"], o["repeat"]) for o in reversed(st["order"])))[::-1]
    assert last_starts == [(k, 0) for k in keys] + [(k, 1) for k in keys[::-1]]       # ABBA
    assert all(c["n"] == 2 and c["status"] == "ok" for c in _cells(doc)) and first in _cells(doc)[0]["runs"]
    assert all(not live_members(o["pgid"]) for o in st["done"].values())
    from specscope.registry import open_registry

    with open_registry() as reg:
        runs = [reg.get_run(r["id"], samples=False) for r in reg.list_runs(tag="sweep:w")]
    assert sorted((r["sweep"]["cell"], r["sweep"]["repeat"]) for r in runs) == sorted((k, r) for k in keys
                                                                                      for r in (0, 1))
    assert {(r["config"]["steps"], r["env"]["vars"]["NCCL_PROTO"]) for r in runs} == {(1, "LL"), (1, "Simple"),
                                                                                      (3, "LL"), (3, "Simple")}
    assert doc == _doc(capsys, wd)[0]
    _agree(doc, table, (wd / "sweep.html").read_text())
    # what compare says per axis, and compare --by over the same runs gives the same matrix
    assert {a["axis"] for a in doc["axes"]} == {"steps", "NCCL_PROTO"}
    assert all(s["verdict"] in ("changed", "no significant change") for a in doc["axes"] for s in a["slices"])
    code, out, _ = cli(capsys, "compare", "--by", "env.NCCL_PROTO,config.steps", "--tag", "sweep:w", "--json")
    m = json.loads(out)
    for i, nccl in enumerate(m["rows"]):
        for j, steps in enumerate(m["cols"]):
            cell = next(c for c in _cells(doc) if c["values"] == {"steps": int(steps), "NCCL_PROTO": nccl})
            assert m["cells"][i][j]["value"] == pytest.approx(cell["tok_per_s"]["mean"], abs=1e-3)


def test_a_phase_is_judged_against_the_whole_launchs_noise_too():
    """Launches vary as a whole: a phase whose own repeats spread 10 % is still judged against the 32 % the cycle
    spread (two NCCL_PROTO cells, which change nothing, once moved draft and verify 14 % together); τ and the
    acceptance rates, not times, keep their own (here none)."""
    from specscope.sweep.matrix import launch_noise, own_noise

    pairs = [{"metric": "phase.verify", "change": 0.10}, {"metric": "phase.verify", "change": -0.06},
             {"metric": "cycle_ms", "change": -0.32}, {"metric": "tok_per_s", "change": 0.24},
             {"metric": "accept_length", "change": 0.0}, {"metric": "phase.draft", "change": 0.40}]
    band = launch_noise(pairs)
    assert band == {"phase.verify": 0.32, "cycle_ms": 0.32, "tok_per_s": 0.32, "accept_length": 0.0,
                    "phase.draft": 0.40}
    assert own_noise(pairs)["phase.verify"] == 0.10


def test_a_change_inside_the_launch_to_launch_noise_is_not_called():
    """compare calls +20 % on the pooled cells and both repeat pairs agree, but two launches of one cell differ by
    30 % in this sweep: not called. The same change past the band is."""
    from specscope.sweep.axes import _judge

    def row(change):
        return {"metric": "phase.verify", "label": "Target verify ms/cyc", "values": [10.0, 10.0 * (1 + change)],
                "verdicts": [None, "worse"], "changes": [None, {"change": change, "lo": change / 2, "hi": change * 2}]}

    pairs = [(0, {"rows": [row(0.18)]}), (1, {"rows": [row(0.22)]})]
    inside = _judge(row(0.20), pairs, small=False, noise=0.30)
    assert inside["verdict"] == "no significant change" and "30%" in inside["note"]
    assert _judge(row(0.20), pairs, small=False, noise=0.10)["verdict"] == "worse"
    unjudged = _judge(row(0.20), pairs, small=False, noise=None)      # no repeats: measured, never called
    assert unjudged["verdict"] == "not called" and unjudged["pooled"] == "worse" and unjudged["change"] == 0.20
