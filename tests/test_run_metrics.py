"""RunMetrics: what a run measured, one typed record from its producers (SpecStats + the profiler) to its readers
(economics, compare, the report, --json), stored under the keys registries have always held."""

import json
import sqlite3

from cli_util import cli
from specscope.economics.breakeven import BreakevenInputs, inputs_from_runs
from specscope.economics.tune import AcceptanceModel, CostModel, HybridModel
from specscope.profile import CycleProfiler
from specscope.registry import make_record, open_registry
from specscope.registry import metrics as metrics_mod
from specscope.registry.compare import compare_runs
from specscope.registry.db import MIGRATIONS
from specscope.registry.metrics import Metric, RunMetrics
from specscope.report.build import build_report
from specscope.speculative.stats import SpecStats

PHASES = {"draft": {"mean_ms": 4.0, "median_ms": 3.9}, "draft.step0": {"mean_ms": 2.0},
          "draft.step1": {"mean_ms": 1.5}, "verify": {"mean_ms": 20.0}, "accept": {"mean_ms": 0.5},
          "commit": {"mean_ms": 0.4}, "other": {"mean_ms": 0.3}}
RANKS = {"accepted": [[60, 10], [30, 5]], "offered": [[100, 90], [70, 40]], "top_path_accepted": [60, 30],
         "top_path_offered": [100, 60]}
# a speculative run's results as `specscope generate` stored them before RunMetrics (a hybrid drafter, profiled)
OLD_SPEC_RESULTS = {
    "tok_per_s": 41.5, "decode_tok_per_s": 41.5, "accept_length": 2.1, "decode_ms_per_token": 12.4, "cycles": 100,
    "tokens": 210, "cycle_ms": {"mean_ms": 25.2}, "phases": PHASES, "accept_length_hist": {"1": 40, "2": 30, "3": 30},
    "drafted_tokens": 300, "accepted_tokens": 110, "per_position_acceptance": [0.6, 0.3],
    "per_position_acceptance_conditional": [0.6, 0.5], "accepted_by_source": {"eagle3": 80, "ngram": 20, "both": 10},
    "accepted_by_source_per_position": {"eagle3": [60, 20], "ngram": [10, 10], "both": [5, 5]},
    "profiler": {"timer": "perf_counter", "overhead": None}, "seconds": 5.3, "prefill_seconds": 0.2,
    "num_tokens": 211, "prompt_tokens": 30, "stop_reason": "length", "acceptance_by_depth_rank": RANKS,
    "verify_tokens_mean": 5.5, "hybrid_cycles": {"tree,1,0,0,0": 70, "copy,0,3,4,4": 30}, "mean_context": 140.0}
OLD_BASE_RESULTS = {"tok_per_s": 70.0, "decode_tok_per_s": 70.0, "accept_length": None, "decode_ms_per_token": 14.0,
                    "cycles": 200, "tokens": 200, "cycle_ms": {"mean_ms": 14.0}, "phases": {"decode": {"mean_ms": 13.6},
                                                                                             "other": {"mean_ms": 0.4}},
                    "accept_length_hist": None, "drafted_tokens": None, "accepted_tokens": None,
                    "per_position_acceptance": [], "per_position_acceptance_conditional": [],
                    "profiler": {"timer": "perf_counter", "overhead": None}}


def _v1_registry(path):
    """A registry file as the first schema wrote it, holding a speculative run and its baseline."""
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])
    for rid, kind, cfg, res in (("base000001", "baseline", {"model": "/m"}, OLD_BASE_RESULTS),
                                ("spec000001", "generate", {"model": "/m", "steps": 2, "topk": 2, "draft_tokens": 4,
                                                            "ngram_tokens": 4, "draft": "eagle3+ngram"},
                                 OLD_SPEC_RESULTS)):
        conn.execute("INSERT INTO runs VALUES (?, '2025-01-01T00:00:00', ?, ?, ?, '{}', ?, '{}', '{}')",
                     (rid, kind, kind, json.dumps(cfg), json.dumps(res)))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()


def test_an_old_registry_reads_into_run_metrics_and_its_readers(tmp_path):
    db = tmp_path / "old.db"
    _v1_registry(db)
    with open_registry(db) as reg:
        spec, base = reg.get_run("spec000001"), reg.get_run("base000001")
    m = RunMetrics.of(spec)
    assert m.acceptance_by_depth_rank == RANKS and m.verify_tokens_mean == 5.5 and m.accept_length == 2.1
    assert m.hybrid_cycles == {"tree,1,0,0,0": 70, "copy,0,3,4,4": 30} and m.phase_ms("draft", "median") == 3.9
    assert m.extra == {"seconds": 5.3, "prefill_seconds": 0.2, "num_tokens": 211, "prompt_tokens": 30,
                       "stop_reason": "length"}
    # written back, every stored key comes back as it was (None values included)
    assert m.to_results() == OLD_SPEC_RESULTS and RunMetrics.of(base).to_results() == OLD_BASE_RESULTS
    # economics reads the fields
    acc = AcceptanceModel.from_run(spec)
    assert acc.rates[0] == [0.6, 10 / 90] and HybridModel.from_run(spec).copy_share == 0.3
    cost = CostModel.from_runs(spec, base)
    assert cost.n0 == 5.5 and cost.context == 140.0 and cost.decode_ms == 14.0
    inp = inputs_from_runs(spec, base, BreakevenInputs())
    assert (inp.verify_ms, inp.draft_ms, inp.decode_ms, inp.measured_accept_length) == (20.0, 4.0, 14.0, 2.1)
    # compare shows the declared metrics of it
    rows = {r["metric"]: r for r in compare_runs([base, spec])["rows"]}
    assert rows["verify_tokens_mean"]["values"] == [None, 5.5]


def _stats(accept_lengths, verify_tokens_mean):
    return SpecStats("eagle3", 2, 1, 3, accept_lengths, [sum(a > 1 for a in accept_lengths), 0],
                     [len(accept_lengths)] * 2, {"accepted": [[1], [0]], "offered": [[2], [2]],
                                                 "top_path_accepted": [1, 0], "top_path_offered": [2, 2]},
                     verify_tokens_mean)


def test_measured_merges_the_spec_stats_of_every_prompt_and_keeps_the_profiles_keys():
    prof = CycleProfiler("cpu")
    prof.add_cycle({"draft": 1.0, "verify": 2.0}, 2, [True, False], 2)
    m = RunMetrics.measured(prof, [_stats([2, 1], 3.0), None, _stats([1, 1, 1, 1], 2.0)])
    assert m.verify_tokens_mean == (3.0 * 2 + 2.0 * 4) / 6
    assert m.acceptance_by_depth_rank["offered"] == [[4], [4]] and m.hybrid_cycles is None
    stored = make_record("generate", metrics=m, results={"seconds": 1.5}, env={})["results"]
    assert stored["verify_tokens_mean"] == m.verify_tokens_mean and stored["seconds"] == 1.5
    plain = make_record("baseline", profiler=CycleProfiler("cpu"), env={})["results"]
    assert plain["accept_length"] is None and "verify_tokens_mean" not in plain   # as results_from_summary wrote


def test_a_declared_metric_reaches_compare_the_report_and_json(tmp_path, capsys, monkeypatch):
    """Adding a metric: its declaration (registry/metrics.py) and a producer storing it; compare, `compare --json`
    and the report's Compare table show it without another change."""
    monkeypatch.setattr(metrics_mod, "METRICS", [*metrics_mod.METRICS,
                                                 Metric("draft_overlap", "draft overlap", higher=True, unit="share")])
    db = tmp_path / "runs.db"
    with open_registry(db) as reg:
        ids = [reg.add_run(make_record("bench", f"run {v}", config={"model": "/m"}, env={},
                                       results={"tok_per_s": 10.0 + v, "draft_overlap": v}))
               for v in (0.25, 0.5)]
        runs = [reg.get_run(i) for i in ids]
    row = {r["metric"]: r for r in compare_runs(runs)["rows"]}["draft_overlap"]
    assert row["label"] == "draft overlap" and row["values"] == [0.25, 0.5] and row["changes"][1]["change"] == 1.0
    assert "draft overlap" in build_report(runs)
    code, out, err = cli(capsys, "compare", *ids, "--json", "--db", db)
    assert code == 0, err
    rows = {r["metric"]: r for r in json.loads(out)["rows"]}
    assert rows["draft_overlap"]["values"] == [0.25, 0.5]
