"""The in-engine step recorder (plugins/steps.py) and its JSONL's way back through `ingest` — engine-neutral parts of
the vLLM plugin; the plugin inside a real vLLM is tested by tests/engines (make test-engines)."""

import io
import json
import random
import time

import pytest

from specscope.errors import SpecscopeError
from specscope.ingest.core import ingest_file
from specscope.plugins.steps import StepRecorder
from specscope.profile.cycle import CycleProfiler
from specscope.registry import open_registry


def _run_steps(rec, steps, sleep=0.0005):
    """Drive the recorder like an engine: (kind, drafted per request, accepted per request) per step."""
    for kind, drafted, accepted in steps:
        rec.begin_step(kind)
        with rec.scope("commit"), rec.scope("commit.preprocess"):
            time.sleep(sleep / 5)
        with rec.scope("forward"):
            time.sleep(sleep)
        with rec.scope("accept"):
            pass
        if kind == "verify":
            with rec.scope("draft"):
                time.sleep(sleep / 2)
        rec.end_step(drafted, accepted)


def _steps(n=40, k=3, seed=0, batch=1):
    rng = random.Random(seed)
    out = [("prefill", [], None)]
    for _ in range(n):
        acc = [min(int(rng.expovariate(0.8)), k) for _ in range(batch)]
        out.append(("verify", [k] * batch, acc))
    return out


def test_totals_survive_a_worker_killed_before_its_final_report(tmp_path):
    """Each interval ends with the totals so far, so a server stopped by a signal (its worker never reaching the
    exit report) still yields the plugin's overhead and the untimed steps."""
    path = tmp_path / "steps.jsonl"
    rec = StepRecorder(path, "vllm", "0.32.0", {"method": "eagle3", "num_speculative_tokens": 3}, every_s=1e9,
                       out=io.StringIO())
    _run_steps(rec, _steps())
    rec.overhead_ns = 41_000         # the vLLM wrappers' own time (they add to it): 1 us per step
    rec.flush()                      # an interval's report; no close(): the worker was killed
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[-1]["end"] is False and rows[-1]["steps"] == 40
    res = ingest_file(path, record=False)["results"]
    assert res["plugin_overhead"]["us_per_step"] == 1.0 and 0 < res["plugin_overhead"]["share"] < 1
    assert res["steps_untimed"] == {"prefill": 1}
    rec._file.close()
    rec._file = None                 # atexit's close() then writes nothing more to the checked file
    with open(path, "a") as f:       # a later totals line that is not the plugin's shape: named, not stored
        f.write('{"end": false, "steps": 41, "untimed_steps": 3, "overhead": "lots"}\n')
    s = ingest_file(path, record=False)
    assert "plugin_overhead" not in s["results"] and s["results"]["steps_untimed"] is None
    assert any("unreadable overhead" in w for w in s["results"]["ingest"]["warnings"])


def test_recorder_jsonl_round_trip_counts_like_vllm(tmp_path):
    path = tmp_path / "steps.jsonl"
    out = io.StringIO()
    rec = StepRecorder(path, "vllm", "0.32.0", {"method": "eagle3", "num_speculative_tokens": 3}, every_s=1e9,
                       out=out)
    steps = _steps()
    _run_steps(rec, steps)
    rec.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("specscope phases (vllm 0.32.0, eagle3 k=3, 40 steps")
    assert any(ln.startswith("Target verify: ") and "ms/cyc (" in ln for ln in lines)
    assert any(ln.startswith("  commit.preprocess: ") for ln in lines)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0]["specscope_steps"] == 1 and rows[-1]["end"] is True
    assert rows[-1]["untimed_steps"] == {"prefill": 1}
    timed = [r for r in rows if "i" in r]
    assert len(timed) == 40
    assert all(r["total_ms"] >= sum(v for k, v in r["ms"].items() if "." not in k) - 1e-3 for r in timed)

    s = ingest_file(path, db=tmp_path / "r.db")
    res = s["results"]
    drafts = [(d, a) for _, ds, acc in steps[1:] for d, a in zip(ds, acc)]
    assert res["spec_decode"]["num_drafts"] == len(drafts)
    assert res["accepted_tokens"] == sum(a for _, a in drafts)
    assert res["per_position_acceptance"] == [round(sum(1 for _, a in drafts if a > i) / len(drafts), 4)
                                              for i in range(3)]
    assert res["accept_length"] == round(1 + sum(a for _, a in drafts) / len(drafts), 4)
    assert set(res["phases"]) >= {"verify", "draft", "accept", "commit", "commit.preprocess", "other"}
    with open_registry(tmp_path / "r.db") as reg:
        run = reg.get_run(s["run_id"])
    assert run["config"]["engine"] == "vllm" and run["config"]["num_speculative_tokens"] == 3
    assert len(run["samples"]["cycle_total_ms"]) == 40
    assert run["env"].get("python") or run["env"].get("error")     # the engine machine's fingerprint


def test_batched_steps_count_per_request(tmp_path):
    path = tmp_path / "b.jsonl"
    rec = StepRecorder(path, "vllm", "0.32.0", {}, every_s=1e9, out=io.StringIO())
    steps = _steps(n=20, batch=3, seed=2)
    _run_steps(rec, steps, sleep=0.0002)
    rec.close()
    res = ingest_file(path, record=False)["results"]
    drafts = [(d, a) for _, ds, acc in steps[1:] for d, a in zip(ds, acc)]
    assert res["spec_decode"]["num_drafts"] == 60
    assert res["spec_decode"]["num_accepted_tokens_per_pos"] == [sum(1 for _, a in drafts if a > i)
                                                                  for i in range(3)]
    assert res["batch"]["max_requests_per_step"] == 3
    # conditional per request (drafted at i, accepted at i - 1), not from the per-step mean the profiler sees
    reach = [sum(1 for d, a in drafts if d > i and a >= i) for i in range(3)]
    assert res["per_position_acceptance_conditional"] == [
        round(sum(1 for _, a in drafts if a > i) / r, 4) if r else None for i, r in enumerate(reach)]


def test_plain_decode_steps_are_decode_not_verify(tmp_path):
    path = tmp_path / "d.jsonl"
    rec = StepRecorder(path, "vllm", "0.32.0", {}, every_s=1e9, out=io.StringIO())
    _run_steps(rec, [("decode", [0], [0])] * 10)
    rec.close()
    res = ingest_file(path, record=False)["results"]
    assert "decode" in res["phases"] and "verify" not in res["phases"]
    assert res["accept_length"] == 1.0


def test_interval_reports_bound_memory_and_keep_every_step(tmp_path):
    path = tmp_path / "i.jsonl"
    out = io.StringIO()
    rec = StepRecorder(path, "vllm", "0.32.0", {}, every_s=0.0, out=out)   # a report after every step
    _run_steps(rec, _steps(n=5)[1:], sleep=0.0)
    assert len(rec._rows) == 0                     # nothing held between reports
    rec.close()
    assert out.getvalue().count("specscope phases") == 5
    assert sum(1 for x in path.read_text().splitlines() if '"i":' in x) == 5


def test_from_samples_reproduces_the_summary():
    prof = CycleProfiler()
    for a in (1, 3, 2, 4, 1):
        with prof.phase("draft"):
            time.sleep(0.0002)
        with prof.phase("verify"):
            time.sleep(0.0005)
        prof.end_cycle(a, num_draft=3)
    again = CycleProfiler.from_samples(prof.samples(), accepted=prof._accepted)
    a, b = prof.summary(), again.summary()
    for key in ("cycles", "tokens", "accept_length", "per_position_acceptance", "accept_length_hist"):
        assert a[key] == b[key], key
    # samples() keeps 5 decimals of a ms: the 4-decimal means may round one unit apart
    assert b["tok_per_s"] == pytest.approx(a["tok_per_s"], rel=1e-5)
    assert set(a["phases"]) == set(b["phases"])
    for name, ph in a["phases"].items():
        for stat in ("mean_ms", "median_ms", "p90_ms", "share"):
            assert b["phases"][name][stat] == pytest.approx(ph[stat], abs=2e-4), (name, stat)
    with pytest.raises(SpecscopeError, match="disagree"):
        CycleProfiler.from_samples({"cycle_ms": {"verify": [1.0]}, "cycle_total_ms": [1.0, 2.0]})


@pytest.mark.parametrize("bad", ['{"i":0,"kind":"verify","ms":{"verify":-1},"total_ms":3,"drafted":[3],"accepted":[1]}',
                                 '{"i":0,"kind":"verify","ms":{"verify":1},"total_ms":3,"drafted":[3],"accepted":[5]}',
                                 '{"i":0,"kind":"verify","ms":{"verify":1},"total_ms":3,"drafted":[3],"acc',
                                 # JSON readers take these; none is a time or a count the recorder writes
                                 '{"kind":"verify","ms":{"verify":1},"total_ms":NaN,"drafted":[3],"accepted":[1]}',
                                 '{"kind":"verify","ms":{"verify":Infinity},"total_ms":3,"drafted":[3],"accepted":[1]}',
                                 '{"kind":"verify","ms":{"verify":1},"total_ms":3,"drafted":[true],"accepted":[1]}',
                                 '{"kind":"verify","ms":{"verify":1},"total_ms":3,"drafted":[3],"reqs":4}'])
def test_bad_step_lines_are_malformed_not_stored(tmp_path, bad):
    path = tmp_path / "bad.jsonl"
    good = '{"i":1,"kind":"verify","ms":{"verify":2.0},"total_ms":3.0,"drafted":[3],"accepted":[1],"reqs":1}'
    path.write_text('{"specscope_steps": 1, "engine": "vllm", "config": {}}\n' + bad + "\n" + good + "\n")
    s = ingest_file(path, record=False)
    assert s["results"]["ingest"]["malformed"] == 1
    assert s["results"]["cycles"] == 1
    json.dumps(s["results"], allow_nan=False)


# ------------------------------------------------------------------------------------------------ the engine's surface
# Step files written line by line, as the recorder writes them, with times chosen so every median is known exactly:
# the target forward T(B, n) = 10 + 0.5·B·n ms, a speculative step drafts for 3 + 0.5·B ms (the whole batch at once)
# and spends 2 ms on the rest, a plain step 1 ms.

JITTER = (0.0, 0.2, -0.2, 0.2, -0.2, 0.0)     # around T: the median and mean of 6 (and of 5) are T itself


def T(B, n):
    return 10 + 0.5 * B * n


def _step_line(i, B, n, jitter=0.0, accepted=None):
    kind = "verify" if n > 1 else "decode"
    fwd, draft, rest = T(B, n) + jitter, (3 + 0.5 * B if n > 1 else 0.0), (2.0 if n > 1 else 1.0)
    ms = {f"{kind}.forward": round(fwd * 0.9, 5), kind: fwd, "accept": 0.5, "commit": rest - 0.5}
    if draft:
        ms["draft"] = draft
    acc = accepted if accepted is not None else [(i + b) % n for b in range(B)]
    return json.dumps({"i": i, "kind": kind, "reqs": B, "drafted": [n - 1] * B, "accepted": acc, "ms": ms,
                       "total_ms": fwd + draft + rest})


def _step_file(path, counts, n, extra=()):
    """counts: {B: steps} of n tokens per request (n = 1: plain decoding), then `extra` lines as they are."""
    cfg = {"engine": "vllm", "model": "m"}
    if n > 1:
        cfg.update(method="eagle3", num_speculative_tokens=n - 1, steps=n - 1, draft="d")
    lines = [json.dumps({"specscope_steps": 1, "engine": "vllm", "engine_version": "0.32.0", "config": cfg,
                         "timer": "perf_counter", "device": "cpu"})]
    for B, k in counts.items():
        lines += [_step_line(len(lines), B, n, JITTER[j % len(JITTER)]) for j in range(k)]
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return path


def _ingested(tmp_path, name, counts, n, extra=()):
    s = ingest_file(_step_file(tmp_path / name, counts, n, extra), db=tmp_path / "r.db")
    with open_registry(tmp_path / "r.db") as reg:
        return reg.get_run(s["run_id"])


def test_engine_surface_from_batched_steps(tmp_path):
    from specscope.economics.verify_curve import VerifySurface

    run = _ingested(tmp_path, "spec.jsonl", {1: 6, 2: 6, 4: 5, 8: 6, 16: 3}, 4)
    surf = run["results"]["surface"]
    # the layout verify-curve --batch stores, each point with its step count
    assert {"context", "region", "batches", "tokens", "points", "fits"} <= set(surf)
    assert surf["source"] == "engine steps"
    assert surf["batches"] == [1, 2, 4, 8] and surf["tokens"] == [4]
    by = {(p["batch"], p["tokens"]): p for p in surf["points"]}
    assert {B: by[(B, 4)]["steps"] for B in (1, 2, 4, 8)} == {1: 6, 2: 6, 4: 5, 8: 6}
    for B in (1, 2, 4, 8):
        assert by[(B, 4)]["median_ms"] == pytest.approx(T(B, 4))
        assert by[(B, 4)]["draft_ms"] == pytest.approx(3 + 0.5 * B) and by[(B, 4)]["rest_ms"] == pytest.approx(2.0)
    # batch 16 had 3 steps: dropped, and said so
    warnings = run["results"]["ingest"]["warnings"]
    assert any("fewer than 5 steps" in w and "batch 16 × 4 token(s) (3 step(s))" in w for w in warnings), warnings
    # read back as any surface is: the medians, linear in B between them, nothing outside
    s = VerifySurface.from_run(run)
    assert s.batches == [1, 2, 4, 8] and s(8, 4, 0) == pytest.approx(T(8, 4))
    assert s(6, 4, 0) == pytest.approx((T(4, 4) + T(8, 4)) / 2)
    with pytest.raises(SpecscopeError, match="outside"):
        s(16, 4, 0)
    curve, same = VerifySurface.curve_and_surface(run)
    assert curve(4, 0) == pytest.approx(T(1, 4)) and same.batches == s.batches


def test_the_recorder_writes_steps_the_surface_reads(tmp_path):
    """Steps driven through the recorder itself (no time asserted): one point per (requests, tokens), counted."""
    path = tmp_path / "rec.jsonl"
    rec = StepRecorder(path, "vllm", "0.32.0", {"method": "eagle3", "num_speculative_tokens": 3}, every_s=1e9,
                       out=io.StringIO())
    _run_steps(rec, _steps(n=6, batch=1) + _steps(n=7, batch=3)[1:] + [("decode", [0, 0], [0, 0])] * 5,
               sleep=0.0002)
    rec.close()
    surf = ingest_file(path, record=False)["results"]["surface"]
    assert sorted((p["batch"], p["tokens"], p["steps"]) for p in surf["points"]) == [(1, 4, 6), (2, 1, 5), (3, 4, 7)]
    assert all(p["median_ms"] > 0 for p in surf["points"])


def test_tune_and_breakeven_price_the_engine_by_batch_size(tmp_path, capsys):
    from cli_util import cli, one_error_line

    db = tmp_path / "r.db"
    spec = _ingested(tmp_path, "spec.jsonl", {1: 6, 2: 6, 4: 6, 8: 6}, 4)["id"]
    plain = _ingested(tmp_path, "plain.jsonl", {1: 6, 2: 6, 4: 6, 8: 6, 16: 6}, 1)["id"]
    code, out, err = cli(capsys, "tune", "--run", spec, "--baseline-run", plain, "--json", "--db", db)
    assert code == 0, err
    r = json.loads(out)
    assert r["engine_surface"] == {"source": "engine steps", "run": spec, "baseline_run": plain,
                                   "batches": [1, 2, 4, 8], "tokens": [1, 4], "stat": "mean"}
    assert [c["batch"] for c in r["concurrency"]] == [1, 2, 4, 8] and r["concurrency_not_predicted"] == [16]
    for c in r["concurrency"]:
        B, s = c["batch"], c["steps"]
        # the engine's own steps at B: forward linear in n between n = 1 and 4, the batch's drafting scaled by
        # depth from the run's 3 steps, the rest of the step per sequence; plain: forward + its 1 ms rest
        assert c["verify_ms"] == pytest.approx(T(B, 1) + (T(B, 4) - T(B, 1)) * s / 3)
        assert c["draft_ms"] == pytest.approx((3 + 0.5 * B) * s / 3)
        assert c["other_ms"] == pytest.approx(2.0 / B) and c["decode_ms"] == pytest.approx(T(B, 1) + 1.0)
        assert c["speedup"] == pytest.approx(c["tau"] * c["decode_ms"] / (c["verify_ms"] + c["draft_ms"]
                                                                          + B * c["other_ms"]))
    from specscope.economics.tune import crossover
    assert r["crossover"] == crossover([c["batch"] for c in r["concurrency"]], [c["speedup"] for c in r["concurrency"]])
    code, out, err = cli(capsys, "tune", "--run", spec, "--baseline-run", plain, "--db", db)
    assert code == 0 and "costs by batch size from the engine's own steps" in out
    assert "concurrency 16 cannot be predicted outside them" in out

    code, out, err = cli(capsys, "breakeven", "--run", spec, "--baseline-run", plain, "--batch", 8, "--json",
                         "--db", db)
    assert code == 0, err
    b = json.loads(out)
    # verify T(8, 4) = 26; the plain step 14 + 1; cycle 26 + 7 drafting (the batch's) + 8 × 2/8 rest = 35
    assert b["verify_ms"] == pytest.approx(26.0) and b["decode_ms"] == pytest.approx(15.0)
    assert b["cycle_ms"] == pytest.approx(35.0) and b["break_even_accept_length"] == pytest.approx(35 / 15)
    line = one_error_line(*cli(capsys, "breakeven", "--run", spec, "--baseline-run", plain, "--batch", 16,
                               "--db", db)[::2])
    assert "cover batch sizes 1, 2, 4, 8: batch 16 cannot be predicted outside them" in line


def test_an_engine_run_at_batch_one_cannot_predict_past_it(tmp_path, capsys):
    from cli_util import cli, one_error_line

    db = tmp_path / "r.db"
    spec = _ingested(tmp_path, "spec1.jsonl", {1: 6}, 4)["id"]
    plain = _ingested(tmp_path, "plain1.jsonl", {1: 6}, 1)["id"]
    code, out, err = cli(capsys, "tune", "--run", spec, "--baseline-run", plain, "--db", db)
    assert code == 0 and "Traceback" not in err, err
    said = [ln for ln in out.splitlines() if "cannot be predicted" in ln]
    assert len(said) == 1 and "cover batch size 1 only: concurrency 2, 4, 8, 16 cannot be predicted past batch 1" \
        in said[0]
    r = json.loads(cli(capsys, "tune", "--run", spec, "--baseline-run", plain, "--json", "--db", db)[1])
    assert [c["batch"] for c in r["concurrency"]] == [1] and r["concurrency_not_predicted"] == [2, 4, 8, 16]
    assert r["concurrency"][0]["decode_ms"] == pytest.approx(T(1, 1) + 1.0)
    line = one_error_line(*cli(capsys, "breakeven", "--run", spec, "--baseline-run", plain, "--batch", 2,
                               "--db", db)[::2])
    assert "past batch 1" in line
    # without plain steps the engine cannot price plain decoding by batch size: said in one line, batch 1 as before
    code, out, err = cli(capsys, "tune", "--run", spec, "--decode-ms", 10, "--db", db)
    assert code == 0 and "hold no plain decoding steps: pass --baseline-run" in out, err


def test_garbage_step_rows_are_left_out_and_never_stored(tmp_path):
    good = {2: 6, 4: 6}
    bad = [
        # malformed: not a step the recorder writes; the whole line is refused
        '{"i":90,"kind":"verify","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"verify":12},"total_ms":NaN}',
        '{"i":91,"kind":"verify","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"verify":Infinity},"total_ms":20}',
        '{"i":92,"kind":"verify","reqs":5,"drafted":[3,3],"accepted":[1,1],"ms":{"verify":12},"total_ms":20}',
        '{"i":93,"kind":"verify","reqs":2,"drafted":[3,true],"accepted":[1,1],"ms":{"verify":12},"total_ms":20}',
        '{"i":94,"kind":"verify","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"verify":-1},"total_ms":20}',
        # steps, but no point of the surface: timed like the real ones at batch 2, so a wrong median would show
        '{"i":95,"kind":"verify","reqs":2,"drafted":[3,1],"accepted":[1,1],"ms":{"verify":500},"total_ms":600}',
        '{"i":96,"kind":"verify","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"draft":5},"total_ms":600}',
        '{"i":97,"kind":"verify","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"verify":500},"total_ms":20}',
        '{"i":98,"kind":"decode","reqs":2,"drafted":[3,3],"accepted":[1,1],"ms":{"decode":500},"total_ms":600}',
    ]
    run = _ingested(tmp_path, "g.jsonl", good, 4, bad)
    info = run["results"]["ingest"]
    assert info["malformed"] == 5
    warn = next(w for w in info["warnings"] if "left out of the verify surface" in w)
    assert warn.startswith("4 step(s)") and "different numbers of tokens (1)" in warn
    assert "no target forward time (1)" in warn and "more than the step (1)" in warn and "kind disagrees" in warn
    surf = run["results"]["surface"]
    assert [(p["batch"], p["tokens"], p["steps"]) for p in surf["points"]] == [(2, 4, 6), (4, 4, 6)]
    assert [p["median_ms"] for p in surf["points"]] == pytest.approx([T(2, 4), T(4, 4)])
    # nothing that is not a number reached the registry
    json.dumps(run["results"], allow_nan=False)
    json.dumps(run["samples"], allow_nan=False)
    assert run["results"]["cycles"] == 12 + 4


def test_no_surface_when_no_point_has_enough_steps(tmp_path):
    s = ingest_file(_step_file(tmp_path / "few.jsonl", {1: 2, 2: 4}, 4), record=False)["results"]
    assert "surface" not in s
    assert any("no verify surface: no (batch, tokens) point has 5 steps" in w for w in s["ingest"]["warnings"])
