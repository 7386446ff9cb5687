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

