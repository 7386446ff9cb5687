"""`specscope sweep --max-concurrency 1,2,4` and the sweep's joined engine surface, against the stand-in engine
(tests/sweep_engine.py: a real HTTP server per launch whose steps batch the requests in flight and go through
specscope's real step recorder at declared costs): the levels run in turn inside each launch, the run keeps each
level's numbers with the highest level's as its own, and the cells that differ only in num_speculative_tokens (with
the plain baseline for n = 1) are pooled into one stored surface per combination of the other axes, never stored
twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cli_util import cli, one_error_line

HERE = Path(__file__).parent
SPEC = {"method": "eagle3", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.5}
LEVELS = [1, 2, 4]
PROMPTS = 4


def _stand_in(requests_file: Path) -> str:
    return " ".join([sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}", "--requests-file",
                     str(requests_file), "--speculative-config", f"'{json.dumps(SPEC)}'"])


def _doc(capsys, wd):
    code, out, err = cli(capsys, "sweep", "-w", wd, "--json", "--no-progress")
    assert code == 0, err
    return json.loads(out)


def _surface_runs(reg) -> list[dict]:
    return [reg.get_run(r["id"]) for r in reg.list_runs(kind="engine_surface")]


def _launches(path: Path) -> list[list[int]]:
    """Per launch, the requests in flight as each request arrived."""
    out = []
    for ln in path.read_text().splitlines():
        if ln == "launch":
            out.append([])
        else:
            out[-1].append(int(ln))
    return out


def _sweep(capsys, tmp_path, monkeypatch, *axes, levels=LEVELS):
    """A sweep over num_speculative_tokens 1, 3 (and `axes`), each with its plain baseline, every launch at each
    concurrency level in turn; (workdir, the stand-in's requests file, the table, the arguments)."""
    import specscope.sweep.cell as cell

    monkeypatch.setattr(cell, "SETTLE_S", 0.2)      # the stand-in writes each step as it ends
    wd, requests = tmp_path / "w", tmp_path / "requests.txt"
    args = ["--flag", "speculative-config.num_speculative_tokens=1,3", *axes, "--baseline-without",
            "speculative-config", "--max-concurrency", ",".join(map(str, levels)), "--repeats", "1",
            "--num-prompts", str(PROMPTS), "--output-len", "32", "--ignore-eos", "--phases-from", "plugin",
            "--serve-cmd", _stand_in(requests)]
    code, table, err = cli(capsys, "sweep", "-w", wd, "--no-progress", *args)
    assert code == 0, err
    return wd, requests, table, args


def test_levels_run_in_turn_and_each_is_kept_and_the_surface_joins_the_cells(tmp_path, capsys, monkeypatch):
    """Two environments × num_speculative_tokens 1, 3 with their baselines, at concurrency 1, 2, 4 in every launch:
    the stand-in sees the levels in order, every run keeps each level's numbers, and one surface per environment
    holds the declared costs at every (B, n) the cells covered."""
    from sweep_engine import verify_ms

    from specscope.registry import open_registry

    wd, requests, table, _ = _sweep(capsys, tmp_path, monkeypatch, "--env", "X=a,b")
    launches = _launches(requests)
    assert len(launches) == 6
    for seen in launches:       # warm-up one at a time, then each level's requests, the levels in order
        measured = seen[-PROMPTS * len(LEVELS):]
        assert [max(measured[i * PROMPTS:(i + 1) * PROMPTS]) for i in range(len(LEVELS))] == LEVELS, seen
        assert set(seen[:-PROMPTS * len(LEVELS)]) == {1}
    doc = _doc(capsys, wd)
    with open_registry() as reg:
        for c in [c for line in doc["matrix"]["cells"] for c in line] + doc["baselines"]:
            run = reg.get_run(c["runs"][0])
            levels = run["results"]["serve_levels"]
            assert [lv["concurrency"] for lv in levels] == LEVELS
            assert all(lv["serve"]["completed"] == PROMPTS and lv["tok_per_s"] > 0 for lv in levels)
            # the run's own numbers are the highest level's
            assert run["results"]["tok_per_s"] == levels[-1]["tok_per_s"]
            assert run["results"]["serve"] == levels[-1]["serve"]
            assert run["config"]["max_concurrency"] == 4 and run["config"]["concurrency_levels"] == LEVELS
            assert len(run["samples"]["per_prompt"]) == PROMPTS
    assert json.loads((wd / "sweep.json").read_text())["spec"]["workload"]["max_concurrency"] == LEVELS
    surfaces = {s["key"]: s for s in doc["engine_surfaces"]}
    assert set(surfaces) == {"X=a", "X=b"}
    with open_registry() as reg:
        stored = {r["id"]: r for r in _surface_runs(reg)}
        assert set(stored) == {s["run_id"] for s in surfaces.values()}
        for key, s in surfaces.items():
            run = stored[s["run_id"]]
            cells = [c for line in doc["matrix"]["cells"] for c in line if c["values"]["X"] == key[2:]]
            base = next(b for b in doc["baselines"] if b["values"] == {"X": key[2:]})
            assert run["kind"] == "engine_surface" and set(run["tags"]) == {"engine-surface", "engine-surface:w"}
            cfg = run["config"]
            assert cfg["runs"] == [c["runs"][0] for c in cells] + base["runs"]
            assert cfg["num_speculative_tokens"] == [1, 3] and cfg["sweep"] == "w"
            assert cfg["rejection_sample_method"] == "synthetic" and cfg["synthetic_acceptance_length"] == 2.5
            assert cfg["engine"] == "stand-in" and cfg["method"] == "eagle3" and cfg["concurrency_levels"] == LEVELS
            assert run["sweep"]["surface"] == key and run["env"]["vars"] == {"X": key[2:]}
            surface = run["results"]["surface"]
            assert surface["source"] == "engine steps"
            points = {(p["batch"], p["tokens"]): p for p in surface["points"]}
            # every batch size the levels made at n = 2, 4 (the cells) and 1 (the baseline's plain steps)
            assert {(b, n) for b in LEVELS for n in (1, 2, 4)} <= set(points)
            for (b, n), p in points.items():        # the declared costs, exactly: the right steps in each point
                assert p["median_ms"] == pytest.approx(verify_ms(2.0, n - 1, b), abs=1e-4)
            assert s["batches"] == surface["batches"] and s["tokens"] == surface["tokens"]
            cmds = [f"specscope tune --run DRAFTER_RUN --verify-curve {s['run_id']}",
                    f"specscope breakeven --verify-curve {s['run_id']} --batch {max(s['batches'])} --steps 3"]
            assert s["commands"] == cmds
            for text in (table, (wd / "sweep.html").read_text()):
                assert f"engine surface at {key}: run {s['run_id']}" in text and all(c in text for c in cmds)


def test_a_rerun_stores_no_second_surface_and_a_rerun_cell_makes_it_again(tmp_path, capsys, monkeypatch):
    from specscope.registry import open_registry

    wd, _, _, args = _sweep(capsys, tmp_path, monkeypatch, "--env", "X=a,b", levels=[1, 2])
    before = {s["key"]: s["run_id"] for s in _doc(capsys, wd)["engine_surfaces"]}
    code, _, err = cli(capsys, "sweep", "-w", wd, "--no-progress", *args)         # the same sweep, resumed
    assert code == 0, err
    st = json.loads((wd / "sweep.json").read_text())
    # killed between storing a surface and writing the sweep file: the stored one is taken back
    del st["surfaces"]["X=a"]
    (wd / "sweep.json").write_text(json.dumps(st))
    assert {s["key"]: s["run_id"] for s in _doc(capsys, wd)["engine_surfaces"]} == before
    with open_registry() as reg:
        assert len(_surface_runs(reg)) == 2
    # a cell of X=b run again (its run deleted and its slot emptied): X=b's surface made from the new run, X=a's kept
    st = json.loads((wd / "sweep.json").read_text())
    old_run = st["done"].pop("num_speculative_tokens=3, X=b #1")["run_id"]
    (wd / "sweep.json").write_text(json.dumps(st))
    with open_registry() as reg:
        reg.delete_run(old_run)
    code, _, err = cli(capsys, "sweep", "-w", wd, "--no-progress")
    assert code == 0, err
    after = {s["key"]: s for s in _doc(capsys, wd)["engine_surfaces"]}
    assert after["X=a"]["run_id"] == before["X=a"] and after["X=b"]["run_id"] != before["X=b"]
    assert old_run not in after["X=b"]["runs"]
    with open_registry() as reg:
        assert len(_surface_runs(reg)) == 3


@pytest.mark.parametrize("value,needle", [
    ("0", "--max-concurrency takes whole numbers in 1..1024"),
    ("1,2,2", "--max-concurrency repeats 2; give each level once"),
    ("1,x", "--max-concurrency takes whole numbers"),
    ("2,2000", "--max-concurrency takes whole numbers in 1..1024"),
    ("4,", "--max-concurrency takes whole numbers"),
])
def test_bad_concurrency_levels_are_one_error_line(tmp_path, capsys, value, needle):
    code, _, err = cli(capsys, "sweep", "-w", tmp_path / "w", "--env", "X=a,b", "--max-concurrency", value,
                       "--serve-cmd", "engine --port {port}")
    assert needle in one_error_line(code, err)
    assert not (tmp_path / "w").exists()


def test_a_moe_surface_names_the_experts_its_steps_touched_beside_their_forward():
    """Experts touched per step size come from the cells' profiled steps (merged over the repeats, by the tokens a
    step ran through the target), each beside the surface's forward at that many tokens (batch 1's point first)."""
    from specscope.sweep.render import experts_lines
    from specscope.sweep.surface import experts_touched

    def run(steps, distinct):
        return {"results": {"components": {
            "verify@2": {"steps": steps, "components": {"verify": {"experts": 1.0}},
                         "experts": {"distinct_per_layer": distinct, "bytes": 1000, "of": 32, "steps": steps}},
            "verify@4": {"steps": steps, "components": {"verify": {"experts": 2.0}},
                         "experts": {"distinct_per_layer": 2 * distinct, "bytes": 2000, "of": 32, "steps": steps}}}}}

    surface = {"points": [{"batch": 1, "tokens": 2, "median_ms": 9.0}, {"batch": 2, "tokens": 2, "median_ms": 13.0},
                          {"batch": 1, "tokens": 4, "median_ms": 10.5}]}
    got = experts_touched([run(1, 6.0), run(3, 8.0), {"results": {}}], surface)
    assert got == [{"kind": "verify", "tokens": 2, "distinct_per_layer": 7.5, "of": 32, "bytes": 1000, "steps": 4,
                    "experts_ms": 1.0, "forward_ms": 9.0},
                   {"kind": "verify", "tokens": 4, "distinct_per_layer": 15.0, "of": 32, "bytes": 2000, "steps": 4,
                    "experts_ms": 2.0, "forward_ms": 10.5}]
    assert experts_lines(got) == ["  experts touched per layer (of 32): verify, 2 tokens 7.5 (experts 1.00 ms of "
                                  "forward 9.00 ms) · verify, 4 tokens 15.0 (experts 2.00 ms of forward 10.50 ms)"]
    assert experts_touched([{"results": {"components": {"verify@4": {"steps": 2, "components": {}}}}}],
                           surface) == [] and experts_lines([]) == []
