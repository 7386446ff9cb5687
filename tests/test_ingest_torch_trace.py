"""vLLM torch-profiler traces -> per-phase cycle timing (`specscope ingest X.pt.trace.json.gz`).

The fixture is a real trace (vLLM 0.32.0 on CPU, SmolLM2-135M fp32, EAGLE-3 chain of 3, one chat request of 32
tokens, VLLM_CUSTOM_SCOPES_FOR_PROFILING=1) with its ~105k cpu_op events dropped; its `specscope_fixture` key says so.
Expected figures are recomputed here from the raw events by a separate, simpler route (and one is checked against
vLLM's own key_averages table of the same run), so a wrong window, mapping or statistic fails."""

import copy
import gzip
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_util import cli, one_error_line
from specscope.ingest.core import ingest_file

FIXTURE = Path(__file__).parent / "data" / "torch_traces" / "vllm-eagle3-k3.trimmed.pt.trace.json.gz"
DECODE_STEP = "execute_context_0(0)_generation_1(4)"     # 0 prefill requests; 1 decode request, 1 + 3 draft tokens
SCOPE = "gpu_model_runner: "


def load() -> dict:
    return json.loads(gzip.decompress(FIXTURE.read_bytes()))


def save(tmp_path, doc, name="t.pt.trace.json.gz") -> Path:
    p = tmp_path / name
    data = json.dumps(doc).encode()
    p.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return p


def raw_cycles(doc, step_name=DECODE_STEP) -> list[dict]:
    """Per decode step, straight from the events: a step's scopes are those that start before the next step does;
    the cycle ends with its last scope (sample_tokens runs after the step annotation closes)."""
    ua = sorted((e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    steps = [e for e in ua if e["name"].startswith("execute_")]
    rows = []
    for k, s in enumerate(steps):
        if s["name"] != step_name:
            continue
        nxt = steps[k + 1]["ts"] if k + 1 < len(steps) else float("inf")
        sc = {e["name"][len(SCOPE):]: e for e in ua if e["name"].startswith(SCOPE) and s["ts"] <= e["ts"] < nxt}

        def ms(*names):
            return sum(sc[n]["dur"] for n in names if n in sc) / 1e3

        end = max([s["ts"] + s["dur"]] + [e["ts"] + e["dur"] for e in sc.values()])
        total = (end - s["ts"]) / 1e3
        row = {"verify": ms("forward", "postprocess"), "draft": ms("draft"), "accept": ms("sample"),
               "commit": ms("preprocess", "bookkeep", "eplb", "ModelRunnerOutput"),
               "verify.forward": ms("forward"), "commit.preprocess": ms("preprocess")}
        row["other"] = total - sum(row[p] for p in ("verify", "draft", "accept", "commit"))
        row["total"] = total
        rows.append(row)
    return rows


def slowed(doc, factor) -> dict:
    """A copy whose forward scopes last `factor` times longer, everything after each pushed back to make room."""
    doc = copy.deepcopy(doc)
    ua = sorted((e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    shift, step = 0.0, None
    for e in ua:
        e["ts"] += shift
        if e["name"].startswith("execute_"):
            step = e
        if e["name"] == SCOPE + "forward":
            extra = e["dur"] * (factor - 1)
            e["dur"] += extra
            step["dur"] += extra
            shift += extra
    return doc


def no_runs(capsys) -> bool:
    code, out, err = cli(capsys, "runs", "list", "--json")
    return code in (0, None) and json.loads(out) == []


# ---- the figures ----------------------------------------------------------------------------------------------------

def test_phases_match_the_raw_events(capsys):
    rows = raw_cycles(load())
    assert len(rows) == 21
    code, out, err = cli(capsys, "ingest", FIXTURE, "--json")
    assert code in (0, None), err
    run = json.loads(out)["runs"][0]
    r, c = run["results"], run["config"]
    assert run["format"] == "torch-trace" and run["engine"] == "vllm"
    assert c == {"engine": "vllm", "engine_version": "0.32.0", "device": "cpu", "steps": 3, "draft_tokens": 4,
                 "batch": 1, "world_size": 1}
    assert r["cycles"] == 21 and r["profiler"]["timer"] == "torch_profiler_cpu_scopes"
    assert r["profiler"]["times"].startswith("CPU-side")
    total = sum(row["total"] for row in rows)
    for p in ("verify", "draft", "accept", "commit", "other", "verify.forward", "commit.preprocess"):
        col = [row[p] for row in rows]
        got = r["phases"][p]
        assert got["mean_ms"] == pytest.approx(np.mean(col), abs=1e-3), p
        assert got["median_ms"] == pytest.approx(np.median(col), abs=1e-3), p
        assert got["p90_ms"] == pytest.approx(np.quantile(col, 0.9), abs=1e-3), p
        assert got["share"] == pytest.approx(sum(col) / total, abs=1e-4), p
    assert "decode" not in r["phases"]      # every step verified drafts
    assert r["cycle_ms"]["mean_ms"] == pytest.approx(np.mean([row["total"] for row in rows]), abs=1e-3)
    # the top-level phases add up to the cycle; sub-phases are nested in theirs
    top = sum(v["mean_ms"] for k, v in r["phases"].items() if "." not in k)
    assert top == pytest.approx(r["cycle_ms"]["mean_ms"], abs=1e-3)
    # vLLM's own key_averages table of this run (rank0.profiler_out.txt): forward, 22 calls, CPU total 2.618 s,
    # of which the prefill step's forward took 219.90 ms
    assert r["phases"]["verify.forward"]["mean_ms"] == pytest.approx((2618.0 - 219.905) / 21, abs=0.5 / 21 + 1e-3)
    # the samples `compare` reads, in CycleProfiler.samples() shapes
    shown = json.loads(cli(capsys, "runs", "show", run["run_id"], "--samples", "--json")[1])
    assert shown["results"] == r
    s = shown["samples"]
    assert len(s["cycle_total_ms"]) == 21 and all(len(v) == 21 for v in s["cycle_ms"].values())
    assert s["cycle_ms"]["verify"] == pytest.approx([row["verify"] for row in rows], abs=1e-4)
    assert "accept_lengths" not in s
    # no acceptance counts in a trace: τ and tok/s stay unknown, and the record says so
    assert "accept_length" not in r and "tok_per_s" not in r
    warnings = " ".join(r["ingest"]["warnings"])
    assert "no acceptance counts" in warnings and "/metrics" in warnings
    assert "bench/vllm_live.py" in warnings and "between steps" in warnings
    assert r["between_steps_ms"]["n"] == 20


def test_prefill_empty_and_mixed_steps_are_counted_and_left_out(tmp_path):
    doc = load()
    steps = sorted((e for e in doc["traceEvents"] if e.get("name", "").startswith("execute_")), key=lambda e: e["ts"])
    steps[5]["name"] = "execute_context_1(7)_generation_1(4)"                         # a request joins mid-decode
    steps[6]["name"] = "execute_9_context_0(sq0sk0sqsq0sqsk0)_generation_1(sq4sk60sqsq16sqsk240)"   # detailed form
    steps[7]["name"] = "execute_context_0(0)_generation_x(4)"                         # cut short / corrupt
    s = ingest_file(save(tmp_path, doc), record=False)
    k = s["results"]["ingest"]["kinds"]["torch-trace steps"]
    assert k["read"] == 23 and k["used"] == 19
    assert k["skipped"] == {"empty step (no token scheduled)": 1,
                            "prefill step (requests without an output token yet): not a decode cycle": 1,
                            "mixed prefill + decode step: its time is not one decode cycle": 1,
                            "malformed (corrupt, truncated or interleaved; see malformed_examples)": 1}
    assert s["results"]["ingest"]["malformed"] == 1 and s["results"]["ingest"]["malformed_examples"][0]["reason"] \
        == "step annotation does not parse"
    # the mixed step's scopes are left out with it; the corrupt step's scopes join the step before (as vLLM's
    # table would: nothing marks where they belong)
    assert s["results"]["cycles"] == 19
    assert s["config"]["steps"] == 3


def test_a_plain_decoding_trace_is_a_baseline(tmp_path, capsys):
    doc = load()
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != SCOPE + "draft"]
    for e in doc["traceEvents"]:
        if e.get("name") == DECODE_STEP:
            e["name"] = "execute_context_0(0)_generation_1(1)"
    rows = raw_cycles(doc, "execute_context_0(0)_generation_1(1)")
    plain = save(tmp_path, doc, "plain.pt.trace.json.gz")
    code, out, err = cli(capsys, "ingest", plain, "--json")
    r, c = json.loads(out)["runs"][0]["results"], json.loads(out)["runs"][0]["config"]
    assert "verify" not in r["phases"] and "draft" not in r["phases"] and "steps" not in c
    mean = np.mean([row["total"] for row in rows])
    assert r["phases"]["decode"]["mean_ms"] == pytest.approx(np.mean([row["verify"] for row in rows]), abs=1e-3)
    # one token per decode request per step: τ = 1 exactly, so ms/token is the cycle
    assert r["accept_length"] == 1.0 and r["decode_ms_per_token"] == pytest.approx(mean, abs=1e-3)
    assert r["tok_per_s"] == pytest.approx(1e3 / mean, rel=1e-4)
    # ... and serves `breakeven --run` as the baseline of the speculative trace
    cli(capsys, "ingest", FIXTURE)
    code, out, err = cli(capsys, "breakeven", "--run", "last", "--baseline-run", "last~1", "--json")
    assert code in (0, None), err
    be = json.loads(out)
    spec = raw_cycles(load())
    cyc = np.mean([row["total"] for row in spec])
    assert be["cycle_ms"] == pytest.approx(cyc, abs=1e-2)
    assert be["break_even_accept_length"] == pytest.approx(cyc / mean, rel=1e-3)
    assert be["max_accept_length"] == 4.0


def test_breakeven_needs_the_decode_time_a_trace_cannot_hold(capsys):
    cli(capsys, "ingest", FIXTURE)
    code, out, err = cli(capsys, "breakeven", "--run", "last")
    assert "plain decode time per token" in one_error_line(code, err) and "--decode-ms" in err
    code, out, err = cli(capsys, "breakeven", "--run", "last", "--decode-ms", "60", "--json")
    assert code in (0, None), err
    rows = raw_cycles(load())
    cyc = np.mean([row["total"] for row in rows])
    be = json.loads(out)
    assert be["cycle_ms"] == pytest.approx(cyc, abs=1e-2)       # draft + verify + (accept + commit + other)
    assert be["break_even_accept_length"] == pytest.approx(cyc / 60, rel=1e-4)
    assert "speedup" not in be                                   # no τ, no tok/s: nothing measured to compare


def test_compare_names_verify_when_the_forward_slows_down(tmp_path, capsys):
    ids = []
    for p in (FIXTURE, save(tmp_path, slowed(load(), 1.3), "slow.pt.trace.json.gz")):
        code, out, err = cli(capsys, "ingest", p, "--json")
        ids.append(json.loads(out)["runs"][0]["run_id"])
    code, out, err = cli(capsys, "compare", *ids, "--json")
    assert code in (0, None), err
    cmp = json.loads(out)
    verdicts = {row["metric"]: row["verdicts"][1] for row in cmp["rows"]}
    assert verdicts["phase.verify"] == "worse" and verdicts["phase.verify.forward"] == "worse"
    assert verdicts["cycle_ms"] == "worse"
    for p in ("phase.draft", "phase.accept", "phase.verify.postprocess"):
        assert verdicts[p] == "no significant change", p
    att = cmp["attribution"][0]
    assert att["explains"] == "verify" and att["judgeable"] is True
    change = next(r for r in cmp["rows"] if r["metric"] == "phase.verify.forward")["changes"][1]["change"]
    assert change == pytest.approx(0.3, abs=1e-3)
    # without τ compare splits the change per cycle (τ taken as 1): all of it is the forward's 30 %
    extra = 0.3 * np.mean([row["verify.forward"] for row in raw_cycles(load())])
    verify = next(c for c in att["contributions"] if c["phase"] == "verify")
    assert verify["delta_ms_per_token"] == pytest.approx(extra, abs=2e-3)
    assert att["delta_ms_per_token"] == pytest.approx(extra, abs=2e-3)


def test_text_output_is_the_profile_report_and_reads_back(tmp_path, capsys):
    code, out, err = cli(capsys, "ingest", FIXTURE, "--no-record")
    assert code in (0, None), err
    rows = raw_cycles(load())
    total = sum(row["total"] for row in rows)
    v = [row["verify"] for row in rows]
    assert f"  Target verify: {np.mean(v):.2f} ms/cyc ({sum(v) / total * 100:5.1f}%)" in out.splitlines()
    assert "    verify.forward: " in out and "Cycles: 21, " in out
    assert "torch-trace steps" in err and "prefill step" in err
    # specscope's own profile-line reader takes the printed lines back
    log = tmp_path / "printed.txt"
    log.write_text(out)
    back = ingest_file(log, engine="specscope", record=False)["results"]["phases"]
    assert back["verify"]["mean_ms"] == pytest.approx(np.mean(v), abs=0.005)
    assert back["verify.forward"]["mean_ms"] == pytest.approx(np.mean([row["verify.forward"] for row in rows]),
                                                              abs=0.005)


def test_report_shows_the_trace_run(tmp_path, capsys):
    cli(capsys, "ingest", FIXTURE)
    code, out, err = cli(capsys, "report", "last", "-o", tmp_path / "r.html")
    assert code in (0, None), err
    assert "Target verify" in (tmp_path / "r.html").read_text()


# ---- GPU traces: kernels timed by the scope that launched them -----------------------------------------------------

def test_gpu_kernels_are_timed_by_their_launching_scope(tmp_path):
    doc = load()
    doc["deviceProperties"] = [{"id": 0, "name": "NVIDIA H200"}]
    extra, corr = [], iter(range(1, 10**6))
    ua = sorted((e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    for e in ua:
        kernels = {SCOPE + "forward": 50.0, SCOPE + "draft": 10.0, SCOPE + "sample": 0.5}.get(e["name"])
        if kernels is None:
            continue
        c = next(corr)
        extra.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": e["pid"], "tid": e["tid"],
                      "ts": e["ts"] + 1, "dur": 5, "args": {"correlation": c}})
        for half in (0, 1):   # a graph launch: two kernels, one correlation id
            extra.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": e["ts"] + 50 + half,
                          "dur": kernels * 1e3 / 2, "args": {"correlation": c, "stream": 7}})
        # Kineto's GPU-side copy of the annotation: not a CPU scope
        extra.append({"ph": "X", "cat": "gpu_user_annotation", "name": e["name"], "pid": 0, "tid": 7,
                      "ts": e["ts"] + 50, "dur": kernels * 1e3})
    extra.append({"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": ua[0]["ts"], "dur": 9,
                  "args": {"correlation": 999999}})
    # the profiler's own cost where Kineto records it: one CUPTI buffer request inside a decode cycle, one before
    fwd = [e for e in ua if e["name"] == SCOPE + "forward"]
    extra += [{"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0,
               "ts": fwd[3]["ts"] + 10, "dur": 2100.0},
              {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0,
               "ts": ua[0]["ts"] - 100, "dur": 500.0}]
    doc["traceEvents"] += extra
    s = ingest_file(save(tmp_path, doc), record=False)
    r = s["results"]
    oh = r["profiler"]["overhead"]
    assert oh["events"] == 2 and oh["ms_per_cycle"] == pytest.approx(2.1 / 21, abs=1e-5)
    assert any("overhead events" in w for w in r["ingest"]["warnings"])
    assert r["profiler"]["timer"] == "gpu_kernels_by_launching_scope" and s["config"]["device"] == "cuda"
    ph = r["phases"]
    assert ph["verify"]["mean_ms"] == pytest.approx(50.0) and ph["verify.forward"]["mean_ms"] == pytest.approx(50.0)
    assert ph["draft"]["mean_ms"] == pytest.approx(10.0) and ph["accept"]["mean_ms"] == pytest.approx(0.5)
    rows = raw_cycles(load())
    assert r["cycle_ms"]["mean_ms"] == pytest.approx(np.mean([row["total"] for row in rows]), abs=1e-3)
    assert ph["other"]["mean_ms"] == pytest.approx(np.mean([row["total"] for row in rows]) - 60.5, abs=1e-3)
    # the CPU-side split is kept beside it
    assert r["cpu_phases"]["verify"]["mean_ms"] == pytest.approx(np.mean([row["verify"] for row in rows]), abs=1e-3)
    k = r["ingest"]["kinds"]["torch-trace kernels"]
    # forward, sample and draft of 22 steps launched 2 kernels each (+ the orphan); the prefill step's are in no cycle
    assert k["read"] == 2 * 3 * 22 + 1
    assert k["skipped"] == {"no launch event with its correlation id": 1,
                            "launched outside the timed cycles (prefill, between steps, ...)": 6}
    assert r["gpu"]["attributed"] == 2 * 21 * 3


# ---- bad input: one clear error, nothing stored ------------------------------------------------------------------

def test_truncated_gzip(tmp_path, capsys):
    p = tmp_path / "cut.pt.trace.json.gz"
    p.write_bytes(FIXTURE.read_bytes()[:2000])
    code, out, err = cli(capsys, "ingest", p)
    assert "cannot read the trace" in one_error_line(code, err)
    assert no_runs(capsys)


def test_truncated_json_in_whole_gzip(tmp_path, capsys):
    p = tmp_path / "cut.pt.trace.json.gz"
    p.write_bytes(gzip.compress(gzip.decompress(FIXTURE.read_bytes())[:20000]))
    code, out, err = cli(capsys, "ingest", p)
    assert "not a complete JSON document" in one_error_line(code, err)
    assert no_runs(capsys)


def test_json_without_trace_events(tmp_path, capsys):
    p = save(tmp_path, {"schemaVersion": 1, "vllm_version": "0.32.0"}, "x.pt.trace.json")
    code, out, err = cli(capsys, "ingest", p)
    assert "without a traceEvents list" in one_error_line(code, err)
    assert no_runs(capsys)


def test_trace_without_the_custom_scopes_names_the_fix(tmp_path, capsys):
    doc = load()
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith(SCOPE)]
    code, out, err = cli(capsys, "ingest", save(tmp_path, doc))
    line = one_error_line(code, err)
    assert "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1" in line and "23 step annotations" in line
    assert no_runs(capsys)


def test_trace_of_another_program(tmp_path, capsys):
    doc = {"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0},
        {"ph": "X", "cat": "user_annotation", "name": "train_step", "pid": 1, "tid": 1, "ts": 0.0, "dur": 50.0}]}
    code, out, err = cli(capsys, "ingest", save(tmp_path, doc, "other.json"))     # found by its first bytes
    line = one_error_line(code, err)
    assert "not vLLM's" in line and "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1" in line
    assert no_runs(capsys)


def test_only_prefill_is_no_cycle(tmp_path, capsys):
    doc = load()
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != DECODE_STEP]
    code, out, err = cli(capsys, "ingest", save(tmp_path, doc))
    assert "no decode step to time" in one_error_line(code, err)
    assert no_runs(capsys)


def test_a_malformed_scope_is_counted_not_fatal(tmp_path):
    doc = load()
    bad = next(e for e in doc["traceEvents"] if e.get("name") == SCOPE + "bookkeep")
    bad["dur"] = "12x"
    s = ingest_file(save(tmp_path, doc), record=False)
    i = s["results"]["ingest"]
    assert i["malformed"] == 1 and i["kinds"]["torch-trace scopes"]["skipped"].get(
        "malformed (corrupt, truncated or interleaved; see malformed_examples)") == 1
    assert s["results"]["cycles"] == 21


# ---- detection -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [True, False])
def test_standard_input_and_plain_json_names_are_detected(tmp_path, monkeypatch, compressed):
    data = gzip.decompress(FIXTURE.read_bytes())
    p = tmp_path / "trace.json"
    p.write_bytes(data)
    assert ingest_file(p, record=False)["format"] == "torch-trace"
    raw = gzip.compress(data) if compressed else data
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(raw))))
    s = ingest_file("-", record=False)
    assert s["format"] == "torch-trace" and s["results"]["cycles"] == 21
