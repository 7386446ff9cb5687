"""Parsers for engine logs and scrapes, on samples built from the documented formats (reference §5), including
corrupted, truncated and interleaved lines; and the registry runs they become."""

import gzip
import subprocess
import sys
import json
import os

import pytest

from specscope.errors import SpecscopeError
from specscope.ingest.core import MAX_LINE, ingest_file

SG_ARGS = ("[2025-10-22 10:27:50] server_args=ServerArgs(model_path='meta-llama/Llama-3.1-8B-Instruct', "
           "dtype='auto', tp_size=2, speculative_algorithm='EAGLE3', speculative_draft_model_path='org/eagle3', "
           "speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, "
           "disable_cuda_graph=False, decode_log_interval=40)")


def sg_decode(t, running, tput, accept=None, rate=None, sep=".", graph=True, queue=0):
    acc = f"accept len: {accept:.2f}, " if accept is not None else ""
    acc += f"accept rate: {rate:.2f}, " if rate is not None else ""
    return (f"[2025-10-22 10:{t // 60:02d}:{t % 60:02d} TP0] Decode batch{sep} #running-req: {running}, "
            f"#token: {100 + t}, token usage: 0.01, {acc}cuda graph: {graph}, gen throughput (token/s): {tput:.2f}, "
            f"#queue-req: {queue},")


def write(tmp_path, name, lines, newline_at_end=True):
    p = tmp_path / name
    p.write_text("\n".join(lines) + ("\n" if newline_at_end else ""))
    return p


def test_sglang_decode_variants_weighting_and_recomputed_acceptance(tmp_path):
    lines = [SG_ARGS,
             "[2025-10-22 10:27:56 TP0] Prefill batch. #new-seq: 2, #new-token: 60, #cached-token: 20, "
             "token usage: 0.00, #running-req: 0, #queue-req: 0,",
             sg_decode(0, 1, 100.0, accept=2.0, rate=0.33),            # older versions: "Decode batch."
             sg_decode(1, 3, 300.0, accept=3.0, rate=0.67, sep=","),   # newer: "Decode batch,"
             sg_decode(2, 0, 0.5, accept=1.0, rate=0.0),               # idle interval: left out
             'INFO:     127.0.0.1:5000 - "POST /generate HTTP/1.1" 200 OK']
    s = ingest_file(write(tmp_path, "sg.log", lines), record=False)
    r, c = s["results"], s["config"]
    assert s["format"] == "sglang"
    assert c["model"] == "meta-llama/Llama-3.1-8B-Instruct" and c["draft"] == "org/eagle3"
    assert (c["steps"], c["topk"], c["draft_tokens"], c["tp_size"]) == (3, 1, 4, 2)
    # τ weighted by running requests (verifies per interval): (2*1 + 3*3) / 4
    assert r["accept_length"] == pytest.approx(11 / 4)
    assert r["accept_length_unweighted"] == pytest.approx(2.5)
    # acceptance per draft token from τ and the 3 draft tokens per verify, not SGLang's own `accept rate`
    assert r["draft_acceptance_rate"] == pytest.approx((11 / 4 - 1) / 3)
    assert r["reported_accept_rate_mean"] == pytest.approx(0.5)
    assert r["tok_per_s"] == pytest.approx(200.0) and r["idle_lines"] == 1
    assert r["batch_size"]["max"] == 3 and r["batch_size_hist"] == {"1": 1, "3": 1}
    assert r["decode_ms_per_token"] == pytest.approx(10.0)  # batch-1 lines only
    assert r["cuda_graph"] is True
    assert r["prefill"]["new_tokens"] == 60 and r["prefill"]["cache_hit_rate"] == pytest.approx(0.25)
    assert r["duration_s"] == 2.0
    assert s["results"]["ingest"]["recognised"]["sglang"] == 5 and s["results"]["ingest"]["other"] == 1
    assert r["ingest"]["malformed"] == 0


def test_sglang_without_accept_len_is_a_plain_run(tmp_path):
    s = ingest_file(write(tmp_path, "plain.log", [sg_decode(i, 1, 80.0, graph=False) for i in range(4)]),
                    record=False)
    r = s["results"]
    assert "accept_length" not in r and r["tok_per_s"] == pytest.approx(80.0) and r["cuda_graph"] is False


def test_sglang_corrupted_truncated_and_interleaved_lines_are_counted(tmp_path):
    good = sg_decode(0, 1, 100.0, accept=2.0)
    lines = [good,
             good[:70] + sg_decode(1, 1, 100.0, accept=4.0),   # a writer cut off by another: both records seen
             good.replace("accept len: 2.00", "accept len: 2.x"),  # corrupt value
             good.replace("#running-req: 1", "#running-req: \x00\x01"),
             "\udcff garbage \x00 bytes",
             good[:90]]                                          # truncated last line, no newline
    p = tmp_path / "bad.log"
    p.write_bytes("\n".join(lines).encode("utf-8", errors="surrogateescape"))
    s = ingest_file(p, record=False)
    i = s["results"]["ingest"]
    assert i["lines"] == 6 and i["recognised"]["sglang"] == 2
    assert i["malformed"] == 4 and i["other"] == 1
    assert i["unterminated_last_line"] is True
    reasons = " | ".join(e["reason"] for e in i["malformed_examples"])
    assert "truncated" in reasons and "not a number" in reasons
    assert [e["line"] for e in i["malformed_examples"]] == [2, 3, 4, 6]
    assert s["results"]["accept_length"] == pytest.approx(3.0)  # the two intact records: (2 + 4) / 2


VLLM_CONFIG = ("INFO 10-22 10:20:00 [core.py:70] Initializing a V1 LLM engine (v0.10.1) with config: "
               "model='meta-llama/Llama-3.1-8B-Instruct', speculative_config=SpeculativeConfig(method='eagle3', "
               "model='org/eagle3', num_spec_tokens=3), dtype=torch.bfloat16, enforce_eager=False, seed=0")
NEW = ("(APIServer pid=7) INFO 10-22 10:27:{s:02d} [metrics.py:100] SpecDecoding metrics: Mean acceptance length: "
       "{al:.2f}, Accepted throughput: 8.90 tokens/s, Drafted throughput: 97.50 tokens/s, Accepted: {a} tokens, "
       "Drafted: {d} tokens, Per-position acceptance rate: {pp}, Avg Draft acceptance rate: {r:.1f}%")
OLD = ("INFO 10-22 10:27:{s:02d} [metrics.py:100] SpecDecoding metrics: Draft acceptance rate: {r:.1f}%, "
       "Mean acceptance length: {al:.2f}, Accepted: {a} tokens, Drafted: {d} tokens, "
       "Per-position acceptance rate: {pp}")
TPUT = ("INFO 10-22 10:27:{s:02d} [loggers.py:123] Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation "
        "throughput: {g:.1f} tokens/s, Running: {n} reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%, "
        "Prefix cache hit rate: 0.0%")


def vllm_spec(fmt, s, drafts, per_pos):
    k = len(per_pos)
    acc = [round(p * drafts) for p in per_pos]
    a, d = sum(acc), drafts * k
    return fmt.format(s=s, al=1 + a / drafts, a=a, d=d, pp=", ".join(f"{p:.3f}" for p in per_pos), r=100 * a / d)


@pytest.mark.parametrize("fmt", [NEW, OLD], ids=["new-order", "old-order"])
def test_vllm_both_field_orders_recompute_tau_from_counts(tmp_path, fmt):
    lines = [VLLM_CONFIG, vllm_spec(fmt, 0, 100, [0.8, 0.6, 0.4]), TPUT.format(s=5, g=40.0, n=1),
             vllm_spec(fmt, 10, 300, [0.6, 0.3, 0.1]), TPUT.format(s=15, g=90.0, n=2),
             TPUT.format(s=25, g=0.0, n=0)]
    s = ingest_file(write(tmp_path, "v.log", lines), record=False)
    r, c = s["results"], s["config"]
    assert s["format"] == "vllm" and c["engine_version"] == "0.10.1" and c["draft"] == "org/eagle3"
    assert c["steps"] == 3 and c["draft_tokens"] == 4
    # drafts = Drafted / 3; pooled τ = 1 + (180 + 300) / 400
    assert r["num_drafts"] == pytest.approx(400)
    assert r["accept_length"] == pytest.approx(1 + 480 / 400)
    assert r["per_position_acceptance"] == pytest.approx([(80 + 180) / 400, (60 + 90) / 400, (40 + 30) / 400])
    assert sum(r["per_position_acceptance"]) == pytest.approx(r["accept_length"] - 1)
    assert r["draft_acceptance_rate"] == pytest.approx(480 / 1200)
    assert r["tok_per_s"] == pytest.approx(65.0) and r["batch_size"]["max"] == 2 and r["idle_lines"] == 1
    assert r["decode_ms_per_token"] == pytest.approx(25.0)
    assert r["cuda_graph"] is True and r["duration_s"] == 25.0
    assert not r["ingest"]["warnings"]


def test_vllm_inconsistent_and_truncated_lines(tmp_path):
    inconsistent = vllm_spec(NEW, 0, 100, [0.5, 0.5]).replace("Mean acceptance length: 2.00",
                                                              "Mean acceptance length: 3.50")
    truncated = vllm_spec(NEW, 1, 100, [0.5, 0.5])[:150]
    lines = [inconsistent, truncated, vllm_spec(NEW, 2, 100, [0.5, 0.5]).replace("Accepted: 100", "Accepted: 900")]
    s = ingest_file(write(tmp_path, "v.log", lines), record=False)
    r = s["results"]
    assert r["accept_length"] == pytest.approx(2.0)          # from the counts, not the printed 3.50
    assert r["ingest"]["malformed"] == 2                      # cut short; more accepted than drafted
    assert any("disagree" in w for w in r["ingest"]["warnings"])


def test_vllm_v0_cumulative_counters_with_restart(tmp_path):
    line = ("INFO 10-22 10:27:{s:02d} metrics.py:351] Speculative metrics: Draft acceptance rate: 0.500, System "
            "efficiency: 0.600, Number of speculative tokens: 4, Number of accepted tokens: {a}, Number of draft "
            "tokens: {d}, Number of emitted tokens: {e}.")
    lines = [line.format(s=0, a=100, d=200, e=150), line.format(s=5, a=300, d=400, e=450),
             line.format(s=9, a=40, d=80, e=60)]  # restarted: counters began again
    r = ingest_file(write(tmp_path, "v0.log", lines), record=False)["results"]
    # V0's accepted count is per position: τ = emitted / drafts, the accepted prefix = emitted - drafts
    emitted, drafted = 450 + 60, 400 + 80
    assert r["drafted_tokens"] == drafted and r["num_drafts"] == drafted / 4
    assert r["accept_length"] == pytest.approx(emitted / (drafted / 4))
    assert r["accepted_tokens"] == emitted - drafted / 4
    assert r["v0_reported_acceptance_rate"] == pytest.approx((300 + 40) / drafted)


def test_prometheus_scrapes_vllm_deltas_sglang_gauges_and_single_scrape(tmp_path):
    scrape = ("# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
              "# TYPE vllm:spec_decode_num_drafts_total counter\n"
              'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d} {ts}\n'
              'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {dt}\n'
              'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}\n'
              'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}\n'
              'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}\n'
              'vllm:generation_tokens_total{{model_name="m"}} {g}\n'
              'python_gc_objects_collected_total{{generation="0"}} 5.0\n')
    text = (scrape.format(d=1000, dt=2000, a=1500, p0=900, p1=600, g=9000, ts=1700000000000)
            + scrape.format(d=1100, dt=2200, a=1650, p0=990, p1=660, g=9300, ts=1700000010000)
            + scrape.format(d=50, dt=100, a=60, p0=35, p1=25, g=150, ts=1700000020000)  # server restarted
            + 'vllm:spec_decode_num_drafts_total{engine="0" 17\n')
    p = tmp_path / "scrapes.prom"
    p.write_text(text)
    s = ingest_file(p, record=False)
    r = s["results"]
    assert s["format"] == "prometheus" and s["engine"] == "vllm" and r["window"] == "delta" and r["scrapes"] == 3
    assert r["num_drafts"] == 150 and r["num_accepted_tokens"] == 210 and r["accepted_per_pos"] == [125, 85]
    assert r["accept_length"] == pytest.approx(1 + 210 / 150)
    assert r["per_position_acceptance"] == pytest.approx([125 / 150, 85 / 150])
    assert r["tok_per_s"] == pytest.approx(450 / 20)
    assert r["ingest"]["malformed"] == 1 and r["ingest"]["other"] == 3  # the python_gc lines

    one = tmp_path / "one.prom"
    one.write_text(scrape.format(d=1000, dt=2000, a=1500, p0=900, p1=600, g=9000, ts=""))
    r1 = ingest_file(one, record=False)["results"]
    assert r1["window"] == "lifetime" and any("lifetime" in w for w in r1["ingest"]["warnings"])

    sg = tmp_path / "sg.prom"
    sg.write_text('sglang:spec_accept_length{tp_rank="0"} 2.0\nsglang:gen_throughput{tp_rank="0"} 100\n'
                  'sglang:spec_accept_length{tp_rank="0"} 3.0\nsglang:gen_throughput{tp_rank="0"} 200\n')
    r2 = ingest_file(sg, record=False)["results"]
    assert r2["accept_length"] == pytest.approx(2.5) and r2["tok_per_s"] == pytest.approx(150)


def test_specscope_profile_lines_round_trip_from_the_profiler(tmp_path):
    from specscope.profile import CycleProfiler

    prof = CycleProfiler()
    pattern = [(3, [True, True, False]), (1, [False, False, False]), (4, [True, True, True]), (2, [True, False])]
    for acc_len, accepted in pattern * 5:
        with prof.phase("draft"):
            sum(range(2000))
        with prof.phase("verify"):
            sum(range(8000))
        prof.end_cycle(acc_len, accepted, len(accepted))
    summ = prof.summary()
    text = "\n".join(["generated text here ..."] + prof.lines() + prof.lines())  # two reports: pooled
    s = ingest_file(write(tmp_path, "prof.txt", [text]), record=False)
    r = s["results"]
    assert s["format"] == "specscope" and r["reports"] == 2
    assert r["accept_length"] == pytest.approx(summ["accept_length"])
    assert r["cycles"] == 2 * summ["cycles"] and r["tokens"] == 2 * summ["tokens"]
    for ph in ("draft", "verify"):
        assert r["phases"][ph]["mean_ms"] == pytest.approx(summ["phases"][ph]["mean_ms"], abs=0.006)
    assert r["per_position_acceptance"] == pytest.approx(summ["per_position_acceptance"], abs=1e-3)
    assert s["config"]["steps"] == 3
    assert r["ingest"]["malformed"] == 0


def test_no_recognisable_line_names_the_formats_tried(tmp_path):
    p = write(tmp_path, "app.log", ["starting", "GET / 200", "done"])
    with pytest.raises(SpecscopeError) as e:
        ingest_file(p, record=False)
    msg = str(e.value)
    assert "no recognisable line in 3 line(s)" in msg
    for fmt in ("sglang", "vllm", "specscope", "prometheus"):
        assert fmt in msg
    sg = write(tmp_path, "sg.log", [sg_decode(0, 1, 100.0, accept=2.0)])
    with pytest.raises(SpecscopeError, match="formats tried: vllm"):
        ingest_file(sg, engine="vllm", record=False)
    only_bad = write(tmp_path, "cut.log", [sg_decode(0, 1, 100.0, accept=2.0)[:60]])
    with pytest.raises(SpecscopeError, match="did not parse"):
        ingest_file(only_bad, record=False)
    with pytest.raises(SpecscopeError, match="does not exist"):
        ingest_file(tmp_path / "missing.log", record=False)


def test_streaming_gzip_and_overlong_lines(tmp_path):
    p = tmp_path / "big.log.gz"
    with gzip.open(p, "wt") as f:
        f.write("x" * (MAX_LINE + 10) + "\n")  # skipped without holding it as a line
        for i in range(3000):
            f.write(sg_decode(i % 3600, 1 + i % 4, 100.0 + i % 7, accept=1.5 + (i % 3) * 0.5) + "\n")
    s = ingest_file(p, record=False)
    i = s["results"]["ingest"]
    assert i["lines"] == 3001 and i["recognised"]["sglang"] == 3000 and i["malformed"] == 1
    assert "longer than" in i["malformed_examples"][0]["reason"]
    assert s["results"]["batch_size"]["max"] == 4


def test_series_stay_bounded_however_long_the_log(tmp_path):
    from specscope.ingest.lines import Series

    ser = Series(("t", "v"), cap=64)
    for i in range(10_000):
        ser.add(float(i), 1.0 if i % 2 else None)
    d = ser.to_dict()
    assert len(d["t"]) <= 64 and d["points_per_sample"] == 256
    assert d["t"][0] == pytest.approx(127.5) and all(v == 1.0 for v in d["v"])  # None-aware means


def test_ingest_cli_stores_runs_that_compare_and_breakeven_read(tmp_path):
    from specscope.cli import main
    from specscope.registry import open_registry
    from specscope.registry.db import default_db_path

    a = write(tmp_path, "a.log", [SG_ARGS] + [sg_decode(i, 1, 100.0, accept=2.5) for i in range(5)])
    b = write(tmp_path, "b.log", [SG_ARGS] + [sg_decode(i, 1, 120.0, accept=3.0) for i in range(5)])
    bad = write(tmp_path, "c.log", ["nothing"])
    with pytest.raises(SystemExit) as e:
        main(["ingest", str(a), str(b), str(bad), "--tag", "prod", "--json"])
    assert e.value.code == 2  # one file failed: a refused command stores nothing
    assert not os.path.exists(default_db_path()) or open_registry().list_runs(kind="ingest") == []
    main(["ingest", str(a), str(b), "--tag", "prod", "--json"])
    runs = open_registry().list_runs(kind="ingest")
    assert len(runs) == 2
    ids = [r["id"] for r in runs]
    rec = open_registry().get_run(ids[0])
    assert rec["kind"] == "ingest" and "prod" in rec["tags"] and rec["env"]["ingested"] is True
    assert rec["source"]["sha256"] and rec["results"]["ingest"]["format"] == "sglang"
    series = rec["samples"]["series"]  # throughput over time
    assert len(series["t_s"]) == 5 and series["gen_tok_per_s"][0] in (100.0, 120.0)
    assert _run_cli(main, ["compare", *ids, "--json"]) in (0, None)
    assert _run_cli(main, ["breakeven", "--run", ids[0], "--decode-ms", "12", "--verify-ms", "14",
                           "--draft-ms", "2", "--json"]) in (0, None)


def _run_cli(main, argv):
    try:
        main(argv)
    except SystemExit as e:
        return e.code
    return 0


def test_reference_lines_verbatim(tmp_path):
    """The two example lines of the reference (§5), exactly as printed."""
    sg = ("[2025-10-22 10:27:57 TP0] Decode batch. #running-req: 1, #token: 186, token usage: 0.00, accept len: 1.95, "
          "accept rate: 0.49, cuda graph: True, gen throughput (token/s): 178.86, #queue-req: 0,")
    r = ingest_file(write(tmp_path, "sg.log", [sg]), record=False)["results"]
    assert r["accept_length"] == 1.95 and r["tok_per_s"] == 178.86 and r["cuda_graph"] is True
    assert r["ingest"]["malformed"] == 0
    vl = ("SpecDecoding metrics: Mean acceptance length: 2.37, Accepted throughput: 8.90 tokens/s, Drafted throughput: "
          "97.50 tokens/s, Accepted: 89 tokens, Drafted: 975 tokens, Per-position acceptance rate: 0.600, 0.385, "
          "0.215, Avg Draft acceptance rate: 9.1%")
    r = ingest_file(write(tmp_path, "vl.log", [vl]), record=False)["results"]
    assert r["draft_acceptance_rate"] == pytest.approx(89 / 975)
    assert r["accept_length"] == pytest.approx(1 + 89 / (975 / 3))  # from the counts (3 positions)
    assert r["reported_mean_acceptance_length"] == 2.37
    assert any("disagree" in w for w in r["ingest"]["warnings"])  # the printed 2.37 does not match its counts


def test_ingest_reads_standard_input(tmp_path):
    lines = [sg_decode(i, 1, 100.0, accept=2.0) for i in range(3)]
    r = subprocess.run([sys.executable, "-m", "specscope", "ingest", "-", "--json", "--tag", "piped"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["runs"][0]
    assert run["source"]["file"] == "<stdin>" and run["results"]["accept_length"] == 2.0 and run["run_id"]
