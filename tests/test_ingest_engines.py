"""Engine figures by the engines' own definitions, on fixtures in each engine's exact line format
(tests/data/engine_logs/, each file's header names its source). Every expected number is computed by hand here
from the fixture's counts, and checked in what `specscope ingest --json` prints and what `runs show --json` reads
back from the registry."""

import json
from pathlib import Path

import pytest

from cli_util import cli
from specscope.ingest.core import ingest_file

LOGS = Path(__file__).parent / "data" / "engine_logs"


def ingest_and_show(capsys, path):
    """(the run as `ingest --json` reports it, the same run from `runs show --json`)."""
    code, out, err = cli(capsys, "ingest", path, "--json")
    assert code in (0, None), err
    run = json.loads(out)["runs"][0]
    code, out, err = cli(capsys, "runs", "show", run["run_id"], "--json")
    assert code in (0, None), err
    shown = json.loads(out)
    assert shown["results"] == run["results"]                       # stored as reported
    assert {k: v for k, v in shown["config"].items() if not k.endswith("_hash")} == run["config"]
    return run, shown


def both(run, shown):
    return [run["results"], shown["results"]]


def write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# ---- vLLM ---------------------------------------------------------------------------------------------------------

def test_vllm_v0_tau_from_emitted_tokens_per_k_segment(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "vllm_v0_k_restart.log")
    # k = 3: cumulative counts of the last line (13311 draft, 10616 emitted); k = 5 after the restart: (4000, 2200)
    d3, e3, d5, e5 = 13311 / 3, 10616, 4000 / 5, 2200
    for r in both(run, shown):
        seg = {s["k"]: s for s in r["segments"]}
        assert seg[3]["accept_length"] == pytest.approx(e3 / d3)            # 2.393, not 1 + 8547/4437 = 2.926
        assert round(seg[3]["accept_length"], 3) == 2.393
        assert seg[5]["accept_length"] == pytest.approx(e5 / d5)            # 2.75 <= k + 1
        assert r["accept_length"] == pytest.approx((e3 + e5) / (d3 + d5))
        assert r["num_drafts"] == pytest.approx(d3 + d5)
        assert r["accepted_tokens"] == pytest.approx(e3 + e5 - d3 - d5)     # the accepted prefix
        assert r["draft_acceptance_rate"] == pytest.approx((e3 + e5 - d3 - d5) / (13311 + 4000))
        assert r["system_efficiency"] == pytest.approx((e3 + e5) / (d3 * 4 + d5 * 6))
        assert r["v0_reported_acceptance_rate"] == pytest.approx((8547 + 1500) / (13311 + 4000))
        assert r["tok_per_s"] == pytest.approx((64.8 + 71.5 + 80.4) / 3) and r["idle_lines"] == 1
    ing = run["results"]["ingest"]
    assert any("k=3 from line 7, k=5 from line 13" in w for w in ing["warnings"])
    assert run["config"]["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert run["config"]["engine_version"] == "0.6.3"


def test_vllm_v0_single_line_from_the_issue_thread(tmp_path):
    line = ("INFO 10-16 19:05:47 metrics.py:367] Speculative metrics: Draft acceptance rate: 0.642, System efficiency: "
            "0.598, Number of speculative tokens: 3, Number of accepted tokens: 8547, Number of draft tokens: 13311, "
            "Number of emitted tokens: 10616.")
    r = ingest_file(write(tmp_path, "v0.log", [line]), record=False)["results"]
    assert r["accept_length"] == pytest.approx(10616 / (13311 / 3)) and round(r["accept_length"], 3) == 2.393
    assert r["accept_length"] == pytest.approx(0.598 * 4, abs=0.002)        # system efficiency × (k + 1)
    # nothing accepted: τ = 1 exactly (vllm-project/vllm issue #8620's line), also with the 0.4-era "tokens tokens"
    zero = ("INFO 09-19 10:00:00 metrics.py:345] Speculative metrics: Draft acceptance rate: 0.000, System efficiency: "
            "0.250, Number of speculative tokens: 3, Number of accepted tokens: 0, Number of draft tokens tokens: 483, "
            "Number of emitted tokens tokens: 161.")
    assert ingest_file(write(tmp_path, "z.log", [zero]), record=False)["results"]["accept_length"] == 1.0


def test_vllm_v1_both_forms_in_one_log(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "vllm_v1_two_forms.log")
    # no config line: k = 3 from the per-position list (the only k in the log), also for the first-form lines
    drafts = 300 / 3 + 150 / 3 + 300 / 3
    for r in both(run, shown):
        assert r["num_drafts"] == pytest.approx(drafts)
        assert r["accept_length"] == pytest.approx(1 + (180 + 60 + 150) / drafts)
        assert r["draft_acceptance_rate"] == pytest.approx((180 + 60 + 150) / (300 + 150 + 300))
        assert r["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.3])  # only the last line has the list
        assert r["tok_per_s"] == pytest.approx((80 + 60 + 70) / 3)
    kinds = run["results"]["ingest"]["kinds"]
    v1 = kinds["vllm SpecDecoding metrics (V1)"]
    assert v1["read"] == 3 and v1["used"] == 3
    assert v1["partial"] == {"k taken from the other lines (the log has one k)": 2}
    assert run["results"]["ingest"]["malformed"] == 0


def test_vllm_early_v1_lines_without_k(tmp_path, capsys):
    run, shown = ingest_and_show(capsys, LOGS / "vllm_v1_early_no_k.log")
    for r in both(run, shown):
        assert "accept_length" not in r                      # unknown, not guessed
        assert r["draft_acceptance_rate"] == pytest.approx((150 + 60) / (240 + 120))
    ing = run["results"]["ingest"]
    assert ing["malformed"] == 0                             # a complete real format, not "truncated?"
    assert any("τ is unknown" in w for w in ing["warnings"])
    assert ing["kinds"]["vllm Speculative metrics (early V1, no k)"]["read"] == 2
    # with the engine-config line the same lines give τ
    cfg = ("INFO 03-20 14:59:00 [core.py:58] Initializing a V1 LLM engine (v0.8.1) with config: "
           "model='meta-llama/Llama-3.1-8B-Instruct', speculative_config=SpeculativeConfig(method='eagle', "
           "model='yuhuili/EAGLE-LLaMA3.1-Instruct-8B', num_spec_tokens=3), dtype=torch.bfloat16, enforce_eager=False")
    p = write(tmp_path, "with_cfg.log", [cfg] + (LOGS / "vllm_v1_early_no_k.log").read_text().splitlines())
    r = ingest_file(p, record=False)["results"]
    assert r["accept_length"] == pytest.approx(1 + 210 / (360 / 3))


def test_vllm_data_parallel_engines_are_summed(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "vllm_v1_dp.log")
    drafts = {"0": 300 / 3 + 180 / 3, "1": 150 / 3}
    for r in both(run, shown):
        # tok/s: per logging tick the engines add up (120 + 90, then 100 + 0); the idle first tick is left out
        assert r["tok_per_s"] == pytest.approx(((120 + 90) + 100) / 2)
        assert r["batch_size"]["max"] == 3 and r["decode_ms_per_token"] == pytest.approx(1000 / 100)
        assert r["accept_length"] == pytest.approx(1 + (180 + 60 + 90) / (drafts["0"] + drafts["1"]))
        assert r["per_position_acceptance"] == pytest.approx(
            [(0.8 * 100 + 0.6 * 50 + 0.7 * 60) / 210, (0.6 * 100 + 0.4 * 50 + 0.5 * 60) / 210,
             (0.4 * 100 + 0.2 * 50 + 0.3 * 60) / 210])
        assert r["per_engine"]["0"]["accept_length"] == pytest.approx(1 + 270 / drafts["0"])
        assert r["per_engine"]["1"]["accept_length"] == pytest.approx(1 + 60 / drafts["1"])
        assert r["per_engine"]["0"]["tok_per_s"] == pytest.approx(110) and r["data_parallel_engines"] == 2
    assert run["config"]["model"] == "Qwen/Qwen3-8B" and run["config"]["draft"] == "AngelSlim/Qwen3-8B_eagle3"
    assert run["config"]["engine_version"] == "0.10.1.1"


def test_vllm_per_position_pooled_over_drafts_that_had_the_position(tmp_path):
    cfg = ("(EngineCore_DP0 pid=9) INFO 06-01 10:00:00 [core.py:74] Initializing a V1 LLM engine (v0.9.2) with "
           "config: model='m', speculative_config=SpeculativeConfig(method='eagle3', model='d', num_spec_tokens={k})")
    spec = ("(APIServer pid=7) INFO 06-01 10:{m:02d}:00 [metrics.py:86] SpecDecoding metrics: Mean acceptance length: "
            "{al:.2f}, Accepted throughput: 1.00 tokens/s, Drafted throughput: 1.00 tokens/s, Accepted: {a} tokens, "
            "Drafted: {d} tokens, Per-position acceptance rate: {pp}, Avg Draft acceptance rate: {r:.1f}%")

    def line(m, drafts, rates):
        acc = round(sum(rates) * drafts)
        return spec.format(m=m, al=1 + acc / drafts, a=acc, d=drafts * len(rates), r=100 * acc / (drafts * len(rates)),
                           pp=", ".join(f"{x:.3f}" for x in rates))

    k3 = [0.8, 0.6, 0.4]
    k5 = [0.8, 0.6, 0.5, 0.3, 0.2]
    lines = [cfg.format(k=3), line(1, 900, k3), cfg.format(k=5), line(30, 100, k5)]
    r = ingest_file(write(tmp_path, "k.log", lines), record=False)
    res = r["results"]
    # position 5 exists only in the 100 k=5 drafts: 0.2, not 0.2 * 100 / 1000 = 0.02
    assert res["per_position_acceptance"][4] == pytest.approx(0.2)
    assert res["per_position_acceptance"][0] == pytest.approx(0.8)
    assert res["per_position_acceptance"][2] == pytest.approx((0.4 * 900 + 0.5 * 100) / 1000)
    seg = {s["k"]: s for s in res["segments"]}
    assert seg[3]["accept_length"] == pytest.approx(1 + 1.8) and seg[5]["accept_length"] == pytest.approx(1 + 2.4)
    assert res["accept_length"] <= 5 + 1 and any("changes in this log" in w for w in res["ingest"]["warnings"])


# ---- SGLang -------------------------------------------------------------------------------------------------------

def test_sglang_dp_ranks_idle_gap_and_weighted_tau(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "sglang_eagle3_dp.log")
    w_tau = (3.0 * 4 + 2.0 * 3 + 2.5 * 2 + 3.0 * 3 + 2.0 * 1) / (4 + 3 + 2 + 3 + 1)
    for r in both(run, shown):
        assert r["accept_length"] == pytest.approx(w_tau)
        assert r["accept_length_unweighted"] == pytest.approx((3.0 + 2.0 + 2.5 + 3.0 + 2.0) / 5)
        assert r["draft_acceptance_rate"] == pytest.approx((w_tau - 1) / (4 - 1))
        # per DP rank the mean of its busy lines (the 1.20 tok/s idle gap and the idle line out), summed
        assert r["tok_per_s_per_dp_rank"] == {"DP0": pytest.approx((400 + 220) / 2), "DP1": pytest.approx(300.0)}
        assert r["tok_per_s"] == pytest.approx(310 + 300)
        assert r["idle_gap_lines"] == 1 and r["idle_lines"] == 1
        assert r["duration_s"] == 102.0
    assert run["config"]["model"] == "meta-llama/Llama-3.1-8B-Instruct" and run["config"]["dp_size"] == 2
    decode = run["results"]["ingest"]["kinds"]["sglang decode"]
    assert decode["read"] == 6 and decode["used"] == 5
    assert decode["skipped"] == {"idle: no running request": 1}
    assert any(k.startswith("idle gap") for k in decode["partial"])


def test_sglang_undated_lines_across_midnight_with_an_idle_gap(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "sglang_undated_idle.log")
    for r in both(run, shown):
        assert r["tok_per_s"] == pytest.approx((440 + 460 + 240 + 236) / 4)   # not the 0.39 tok/s interval
        assert r["duration_s"] == 10 + 2 * 60 + 35                            # 23:59:50 -> 00:02:35
        assert r["decode_ms_per_token"] == pytest.approx(1000 / ((240 + 236) / 2))
        assert r["prefill"]["new_tokens"] == 512
    assert run["results"]["ingest"]["malformed"] == 0


def test_sglang_python_logging_stamps_npu_graph_and_full_token(tmp_path):
    # Ascend build (sgl-project/sglang PR #30047): "#full token", "npu graph"; then Python logging's default stamp
    npu = ("[2026-07-04 05:01:{s:02d} TP0] Decode batch, #running-req: 40, #full token: 350592, full token usage: 0.74, "
           "mamba num: 160, mamba usage: 0.80, accept len: {al:.2f}, accept rate: 0.71, npu graph: True, "
           "gen throughput (token/s): {g:.2f}, #queue-req: 0")
    py = ("2026-07-04 05:01:{s:02d},512 - sglang.srt.managers.scheduler - INFO - Decode batch. #running-req: 40, "
          "#token: 350592, token usage: 0.74, accept len: {al:.2f}, cuda graph: False, gen throughput (token/s): "
          "{g:.2f}, #queue-req: 0")
    r = ingest_file(write(tmp_path, "npu.log", [npu.format(s=33, al=3.13, g=155.34), npu.format(s=36, al=3.56, g=160.0),
                                                py.format(s=45, al=3.0, g=150.0)]), record=False)["results"]
    assert r["ingest"]["malformed"] == 0 and r["decode_lines"] == 3
    assert r["cuda_graph"] == "mixed" and r["cuda_graph_share"] == pytest.approx(2 / 3)
    assert r["duration_s"] == 12.0                                # the Python-logging line kept its time
    assert r["accept_length"] == pytest.approx((3.13 + 3.56 + 3.0) / 3)


def test_sglang_log_spanning_months_is_flagged(tmp_path):
    a = ("[2024-03-01 10:00:00 TP0] Decode batch. #running-req: 1, #token: 10, token usage: 0.00, accept len: 2.00, "
         "gen throughput (token/s): 100.00, #queue-req: 0")
    b = a.replace("2024-03-01", "2025-09-01")
    r = ingest_file(write(tmp_path, "long.log", [a, b]), record=False)["results"]
    assert r["duration_s"] == pytest.approx(549 * 86400)
    assert any("span 549.0 days" in w for w in r["ingest"]["warnings"])


# ---- Prometheus ---------------------------------------------------------------------------------------------------

def test_prometheus_mixed_scrape_keeps_both_engines(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "prometheus_mixed.prom")
    for r in both(run, shown):
        # vLLM: deltas over the two scrapes, summed over the two engines
        assert r["num_drafts"] == (1400 - 1000) + (700 - 500)
        assert r["num_accepted_tokens"] == (2600 - 1800) + (900 - 600)
        assert r["accept_length"] == pytest.approx(1 + 1100 / 600)
        assert r["per_position_acceptance"] == pytest.approx([(300 + 140) / 600, (250 + 100) / 600, (250 + 60) / 600])
        sg = r["other_engines"]["sglang"]
        # SGLang: leader-rank series only (not the tp_rank 1 copy, not the draft engine), summed over 4 DP ranks
        assert sg["tok_per_s"] == pytest.approx(((80 + 70 + 90 + 60) + (100 + 60 + 120 + 80)) / 2)
        s1 = (3.0 * 2 + 2.5 * 2 + 3.2 * 3 + 2.0 * 1) / 8
        s2 = (2.8 * 2 + 2.0 * 1 + 3.0 * 3 + 2.5 * 2) / 8
        assert sg["accept_length"] == pytest.approx((s1 + s2) / 2) and sg["dp_ranks"] == 4
    ing = run["results"]["ingest"]
    assert any("several engines" in w and "sglang" in w for w in ing["warnings"])
    k = ing["kinds"]["prometheus sglang samples"]
    assert k["read"] == 28 and k["skipped"] == {"SGLang: a copy from a non-leader rank (tp/pp/ep rank ≠ 0)": 2,
                                                "SGLang: the draft engine's own series": 2}
    assert run["config"]["model"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_prometheus_web_ui_table_with_position_gaps(capsys):
    run, shown = ingest_and_show(capsys, LOGS / "prometheus_webui_table.txt")
    for r in both(run, shown):
        assert r["num_drafts"] == 110 + 90 and r["accept_length"] == pytest.approx(1 + (132 + 99) / 200)
        # positions 0, 3, 4 stay where they are; 1 and 2 are unknown, not shifted
        assert r["per_position_acceptance"] == [pytest.approx(105 / 200), None, None, pytest.approx(35 / 200),
                                                pytest.approx(18 / 200)]
        assert r["window"] == "lifetime"
    assert run["results"]["ingest"]["malformed"] == 0
    assert run["config"]["model"] == "/home/models/Qwen3-0.6B"


def test_prometheus_without_accepted_counter_leaves_tau_unknown(tmp_path):
    p = write(tmp_path, "no_acc.prom", ['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100',
                                        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300'])
    r = ingest_file(p, record=False)["results"]
    assert r["num_drafts"] == 100 and "accept_length" not in r and "draft_acceptance_rate" not in r


# ---- the report, compare, runs list -------------------------------------------------------------------------------

def test_text_report_names_lines_used_skipped_and_why(capsys):
    code, out, err = cli(capsys, "ingest", LOGS / "sglang_eagle3_dp.log", "--no-record")
    assert code in (0, None)
    assert "plain mean 2.500" in out and "weighted by running requests" in out
    assert "idle: no running request" in err and "sglang decode" in err and "no format recognised it" in err


def test_progress_is_reported_on_large_files(tmp_path, monkeypatch, capsys):
    import specscope.ingest.core as core

    monkeypatch.setattr(core, "PROGRESS_EVERY", 2)
    seen = []
    ingest_file(LOGS / "vllm_v1_dp.log", record=False, progress=seen.append)
    assert seen and seen == sorted(seen) and seen[-1] <= (LOGS / "vllm_v1_dp.log").stat().st_size
    # --progress forces the bar (by default only on a terminal, for files over 16 MB); the figures are unchanged
    code, out, err = cli(capsys, "ingest", LOGS / "vllm_v1_dp.log", "--no-record", "--progress", "--json")
    assert code in (0, None) and json.loads(out)["runs"][0]["results"]["tok_per_s"] == pytest.approx(155.0)


def test_compare_ingested_runs_is_not_judged_without_samples(capsys):
    ids = []
    for f in ("sglang_eagle3_dp.log", "vllm_v1_dp.log"):
        code, out, err = cli(capsys, "ingest", LOGS / f, "--json")
        ids.append(json.loads(out)["runs"][0]["run_id"])
    code, out, err = cli(capsys, "compare", *ids, "--json")
    att = json.loads(out)["attribution"][0]
    assert att["judgeable"] is False and att["summary"].startswith("cannot be judged from these data")
    assert "tok/s" in att["summary"] and "how_to_judge" in att
    engine = next(c for c in att["likely_causes"] if c["key"] == "config.engine")
    assert engine["why"].startswith("different inference engines (sglang vs vllm)")
    code, out, err = cli(capsys, "compare", *ids)
    assert "cannot be judged from these data" in out and "no significant change" not in out
    assert "baseline / speculative" not in out


def test_runs_list_shows_the_model_the_log_names(capsys):
    for f in ("vllm_v1_dp.log", "prometheus_webui_table.txt"):
        cli(capsys, "ingest", LOGS / f)
    code, out, err = cli(capsys, "runs", "list", "--json")
    assert {r["model"] for r in json.loads(out)} == {"Qwen/Qwen3-8B", "/home/models/Qwen3-0.6B"}
    code, out, err = cli(capsys, "runs", "list")
    assert "Qwen3-8B" in out and "Qwen3-0.6B" in out


def test_vllm_model_from_the_non_default_args_line(tmp_path):
    # `vllm serve` (v0.10+) logs its CLI arguments before the engine starts (vllm/entrypoints/utils.py)
    args = ("(APIServer pid=1) INFO 08-04 20:40:11 [utils.py:326] non-default args: {'model_tag': 'Qwen/Qwen3-8B', "
            "'model': 'Qwen/Qwen3-8B', 'speculative_config': {'method': 'eagle3', 'model': 'AngelSlim/Qwen3-8B_eagle3', "
            "'num_speculative_tokens': 4}}")
    spec = ("(APIServer pid=1) INFO 08-04 20:51:08 [metrics.py:120] SpecDecoding metrics: Draft acceptance rate: 50.0%, "
            "Accepted: 200 tokens, Drafted: 400 tokens")
    s = ingest_file(write(tmp_path, "serve.log", [args, spec]), record=False)
    assert s["config"]["model"] == "Qwen/Qwen3-8B" and s["config"]["draft"] == "AngelSlim/Qwen3-8B_eagle3"
    assert s["config"]["steps"] == 4 and s["results"]["accept_length"] == pytest.approx(1 + 200 / (400 / 4))
