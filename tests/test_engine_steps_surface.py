"""An engine's verify-cost surface at pinned acceptance (issue 47 item 3): a sweep's `engine_surface` run, the
steps of several launches of one engine pooled (n = 1 from plain launches, n > 1 from speculative ones), read by
EngineCosts; `tune --verify-curve` and `breakeven --verify-curve` pricing from it with acceptance from elsewhere;
the best draft tokens per batch size in vLLM's own form (`num_speculative_tokens_per_batch_size`); the refusals."""

import json

import pytest

from cli_util import cli, one_error_line
from specscope.economics.engine_steps import EngineCosts, engine_surface, surface_from_steps
from specscope.errors import SpecscopeError
from specscope.registry import make_record, store_record

# The synthetic engine, every step of a point alike (its median and mean are the value): the target forward
# T(B, n) = 10 + c·B·n ms, a speculative step drafts k = n - 1 tokens for all B requests in 0.5·k + 0.1·B ms and
# spends 1 ms on the rest; a plain step's rest is 0.5 ms.
WIDTHS, BATCHES, LEVELS = (2, 3, 4, 5), (1, 2, 4, 8), "1,2,4,8"
RATES = [0.8, 0.7, 0.6, 0.5]       # the drafter's conditional acceptance per position (its own run's)


def T(B, n, c=0.5):
    return 10 + c * B * n


def D(B, n):
    return 0.5 * (n - 1) + 0.1 * B


def _rows(c=0.5, widths=WIDTHS, batches=BATCHES, plain=True):
    rows = []
    for B in batches:
        if plain:
            rows += [{"kind": "decode", "reqs": B, "drafted": [0] * B, "ms": {"decode": T(B, 1, c)},
                      "total_ms": T(B, 1, c) + 0.5}] * 5
        for n in widths:
            rows += [{"kind": "verify", "reqs": B, "drafted": [n - 1] * B,
                      "ms": {"verify": T(B, n, c), "draft": D(B, n)}, "total_ms": T(B, n, c) + D(B, n) + 1.0}] * 5
    return rows


def _surface_run(c=0.5, engine="vllm", model="m", pinned=True, **kw) -> str:
    surf, _ = surface_from_steps(_rows(c, **kw))
    cfg = {"engine": engine, "model": model, "method": "eagle3", "draft": "d-surface",
           "num_speculative_tokens": [n - 1 for n in WIDTHS], "sweep": "s", "runs": ["r1", "r2"]}
    if pinned:
        cfg.update(rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    return store_record(make_record("engine_surface", "sweep s: engine surface", config=cfg,
                                    results={"surface": surf}, tags=["sweep", "sweep:s", "engine-surface"], env={}))


def _phases(**ms):
    return {k: {"mean_ms": v, "median_ms": v, "p90_ms": v, "share": 0.0} for k, v in ms.items()}


def _drafter_run(engine="vllm", model="m") -> str:
    """A vLLM plugin run of the drafter (its acceptance per position; no baseline, no steps of its own)."""
    return store_record(make_record(
        "ingest", "plugin steps", env={},
        config={"engine": engine, "model": model, "method": "eagle3", "draft": "/drafters/d", "steps": 3,
                "num_speculative_tokens": 3},
        results={"per_position_acceptance_conditional": RATES, "accept_length": 2.7,
                 "phases": _phases(draft=2.0, verify=12.0, other=1.0)}))


def _specscope_run(model="m") -> str:
    """The drafter's chain measured in specscope's own engine, no baseline recorded."""
    return store_record(make_record(
        "speculative", "spec", env={}, config={"model": model, "draft": "d", "steps": 3, "topk": 1, "draft_tokens": 4},
        results={"per_position_acceptance_conditional": RATES, "accept_length": 2.7, "verify_tokens_mean": 4.0,
                 "phases": _phases(draft=3.0, verify=10.0, other=1.0)}))


def _tau(s):
    tau, p = 1.0, 1.0
    for r in RATES[:s]:
        p *= r
        tau += p
    return tau


def _best_k(B, c):
    """The best chain depth at B on the synthetic engine, 0 when none beats plain decoding (the test's own sums)."""
    decode = T(B, 1, c) + 0.5
    speed = {s: _tau(s) * decode / (T(B, s + 1, c) + D(B, s + 1) + 1.0) for s in range(1, 5)}
    s = max(speed, key=speed.get)
    return s if speed[s] > 1 else 0


def _get(rid):
    from specscope.registry import open_registry

    with open_registry(None, create=False) as reg:
        return reg.get_run(rid, samples=False)


# ------------------------------------------------------------------------------------------------ EngineCosts

def test_an_engine_surface_run_prices_plain_and_speculative_steps_by_batch_size():
    run = _get(_surface_run())
    assert engine_surface(run) is not None
    costs, why = EngineCosts.from_runs(run, None)
    assert why is None and costs.batches == list(BATCHES) and costs.tokens == [1, *WIDTHS]
    for B in BATCHES:
        assert costs.decode(B) == pytest.approx(T(B, 1) + 0.5)        # its own n = 1 points: the plain steps
        assert costs.verify(4, B) == pytest.approx(T(B, 4))
        # drafting per chain width, as measured (every width at every batch size), linear between and past them
        assert costs.drafting(B, 3) == pytest.approx(D(B, 3))
        assert costs.drafting(B, 3.5) == pytest.approx((D(B, 3) + D(B, 4)) / 2)
        assert costs.drafting(B, 7) == pytest.approx(D(B, 7))
        assert costs.other_per_seq(B) == pytest.approx(1.0 / B)
    assert costs.drafting(3, 4) == pytest.approx((D(2, 4) + D(4, 4)) / 2)
    assert "engine surface run" in costs.describe()
    assert any("pinned acceptance (rejection_sample_method synthetic, synthetic_acceptance_length 2.5)" in n
               and "not used" in n for n in costs.notes())
    assert costs.summary()["kind"] == "engine_surface" and costs.summary()["engine"] == "vllm"
    from specscope.economics.verify_curve import VerifySurface     # read as any surface is, too

    assert VerifySurface.from_run(run)(8, 3, 0) == pytest.approx(T(8, 3))


# ------------------------------------------------------------------------------------------------ tune

def _tune(capsys, *args):
    code, out, err = cli(capsys, "tune", *args, "--max-concurrency", LEVELS, "--json")
    assert code == 0, err
    return json.loads(out)


def test_tune_prices_from_the_engine_surface_and_prints_vllms_schedule(capsys):
    run, surf = _drafter_run(), _surface_run()
    r = _tune(capsys, "--run", run, "--verify-curve", surf)
    assert r["verify_curve"] == surf and r["engine_surface"]["run"] == surf and r["baseline_run"] is None
    assert r["acceptance"]["source"] == f"run {run}: per-position acceptance"     # never the surface's pinned one
    assert any("pinned acceptance" in n for n in r["cost_notes"])
    conc = r["concurrency"]
    assert [c["batch"] for c in conc] == list(BATCHES) and r["concurrency_not_predicted"] == []
    for c in conc:
        B, s = c["batch"], c["steps"]
        assert c["topk"] == 1        # vLLM's EAGLE-3 drafts chains
        assert c["verify_ms"] == pytest.approx(T(B, s + 1)) and c["draft_ms"] == pytest.approx(D(B, s + 1))
        assert c["decode_ms"] == pytest.approx(T(B, 1) + 0.5) and c["other_ms"] == pytest.approx(1.0 / B)
        assert c["tau"] == pytest.approx(_tau(s))
        assert (s if c["speedup"] > 1 else 0) == _best_k(B, 0.5)
    ks = [_best_k(B, 0.5) for B in BATCHES]
    assert ks == [3, 3, 3, 2]
    form = r["engine_config"]
    assert form["speculative_config"] == {"method": "eagle3", "model": "/drafters/d", "num_speculative_tokens": 3,
                                          "num_speculative_tokens_per_batch_size": [[1, 7, 3], [8, 8, 2]]}
    assert form["flag"] == "--speculative-config '" + json.dumps(form["speculative_config"]) + "'"

    # a steeper forward (the same engine on a slower machine): deep chains stop paying as the batch grows
    steep = _surface_run(c=5.0)
    r2 = _tune(capsys, "--run", run, "--verify-curve", steep)
    ks2 = [_best_k(B, 5.0) for B in BATCHES]
    assert [c["steps"] if c["speedup"] > 1 else 0 for c in r2["concurrency"]] == ks2 != ks
    assert ks2[-1] == 0
    sched = r2["engine_config"]["speculative_config"]["num_speculative_tokens_per_batch_size"]
    assert sched[-1] == [8, 8, 0] and sched[0][0] == 1

    # the drafter measured in specscope's own engine: its acceptance, vLLM's costs, the surface's drafter named
    r3 = _tune(capsys, "--run", _specscope_run(), "--verify-curve", surf)
    assert [c["steps"] for c in r3["concurrency"]] == [c["steps"] for c in conc]
    assert r3["engine_config"]["speculative_config"]["model"] == "d-surface"

    code, out, err = cli(capsys, "tune", "--run", run, "--verify-curve", surf, "--max-concurrency", LEVELS)
    assert code == 0, err
    lines = out.splitlines()
    assert "note: costs by batch size from the steps of engine surface run" in out
    assert any(ln.startswith("note: run ") and "pinned acceptance" in ln for ln in lines)
    assert form["flag"] in lines         # one line, to paste as it is


def test_tune_says_when_speculation_pays_at_no_level(capsys):
    run, surf = _drafter_run(), _surface_run(c=40.0)
    r = _tune(capsys, "--run", run, "--verify-curve", surf)
    assert all(c["speedup"] <= 1 for c in r["concurrency"])
    assert r["engine_config"]["speculative_config"] is None
    out = cli(capsys, "tune", "--run", run, "--verify-curve", surf, "--max-concurrency", LEVELS)[1]
    assert "vLLM: speculation is predicted not to pay at any concurrency level" in out
    assert "--speculative-config '" not in out


# ------------------------------------------------------------------------------------------------ breakeven

def test_breakeven_gives_the_tau_needed_at_a_batch_size_from_the_surface(capsys):
    surf = _surface_run()
    code, out, err = cli(capsys, "breakeven", "--verify-curve", surf, "--batch", 4, "--steps", 3, "--json")
    assert code == 0, err
    b = json.loads(out)
    cycle = T(4, 4) + D(4, 4) + 1.0
    assert b["verify_ms"] == pytest.approx(T(4, 4)) and b["decode_ms"] == pytest.approx(T(4, 1) + 0.5)
    assert b["cycle_ms"] == pytest.approx(cycle)
    assert b["break_even_accept_length"] == pytest.approx(cycle / (T(4, 1) + 0.5))
    assert "speedup" not in b and b["engine_surface"]["run"] == surf
    # --verify-tokens alone: a chain of n - 1
    same = json.loads(cli(capsys, "breakeven", "--verify-curve", surf, "--batch", 4, "--verify-tokens", 4,
                          "--json")[1])
    assert same["break_even_accept_length"] == pytest.approx(b["break_even_accept_length"])
    assert same["max_accept_length"] == 4.0
    # neither: one per width the surface measured
    per = json.loads(cli(capsys, "breakeven", "--verify-curve", surf, "--batch", 8, "--json")[1])
    assert [x["verify_tokens"] for x in per["by_tokens"]] == list(WIDTHS)
    for x in per["by_tokens"]:
        n = x["verify_tokens"]
        assert x["break_even_accept_length"] == pytest.approx((T(8, n) + D(8, n) + 1.0) / (T(8, 1) + 0.5))
    code, out, err = cli(capsys, "breakeven", "--verify-curve", surf, "--batch", 4, "--steps", 3)
    assert code == 0 and "note: costs by batch size from the steps of engine surface run" in out
    assert "pinned acceptance" in out
    # with a drafter's run: also what its τ achieves at that batch size
    run = _drafter_run()
    b2 = json.loads(cli(capsys, "breakeven", "--run", run, "--verify-curve", surf, "--batch", 4, "--json")[1])
    assert b2["cycle_ms"] == pytest.approx(cycle) and b2["speedup"] == pytest.approx(2.7 * (T(4, 1) + 0.5) / cycle)


# ------------------------------------------------------------------------------------------------ vLLM's form

def _dense(ranges, top, upto):
    """vLLM's lookup (vllm/v1/spec_decode/dynamic/utils.py), its validation mirrored: batch size -> k."""
    assert ranges and ranges[0][0] == 1
    prev = 0
    for start, end, k in ranges:
        assert 0 < start <= end and k >= 0 and start > prev
        prev = end
    out = {}
    for b in range(1, upto + 1):
        k = next((k for s, e, k in ranges if s <= b <= e), None)
        out[b] = min(top, k if k is not None else ranges[-1][2])      # past the last range: the last k
    return out


def test_vllm_schedule_merges_levels_and_keeps_zeros():
    from specscope.engines.vllm import draft_schedule

    s = draft_schedule([(1, 3), (2, 3), (4, 2), (8, 2), (16, 0)])
    assert s.ranges == ((1, 3, 3), (4, 15, 2), (16, 16, 0)) and s.num_speculative_tokens == 3
    assert _dense([list(r) for r in s.ranges], 3, 40) == {b: 3 if b < 4 else 2 if b < 16 else 0
                                                          for b in range(1, 41)}
    # levels in any order, starting above 1: the first level's k covers the batch sizes below it
    s = draft_schedule([(8, 1), (2, 4)])
    assert s.ranges == ((1, 7, 4), (8, 8, 1)) and s.num_speculative_tokens == 4
    assert draft_schedule([(1, 2)]).config({"method": "eagle3"}) == {
        "method": "eagle3", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 1, 2]]}
    # a 0 between levels that speculate stays its own range
    assert draft_schedule([(1, 2), (2, 0), (4, 2)]).ranges == ((1, 1, 2), (2, 3, 0), (4, 4, 2))
    assert draft_schedule([(1, 0), (4, 0)]) is None          # nowhere worth it: no config at all
    for bad, what in (([], "no concurrency level"), ([(0, 1)], "batch level"), ([(2, -1)], "draft token count"),
                      ([(2, 1), (2, 3)], "repeat"), ([(1.5, 1)], "batch level"), ([(1, True)], "draft token")):
        with pytest.raises(SpecscopeError, match=what):
            draft_schedule(bad)


# ------------------------------------------------------------------------------------------------ refusals

def test_what_an_engine_surface_cannot_price_is_refused_in_one_line(capsys):
    run, surf = _drafter_run(), _surface_run()
    line = one_error_line(*cli(capsys, "tune", "--run", run, "--verify-curve", surf, "--max-concurrency",
                               "16,32")[::2])
    assert "cover batch sizes 1, 2, 4, 8: concurrency 16, 32 cannot be predicted" in line
    assert "--max-concurrency including 32" in line
    line = one_error_line(*cli(capsys, "breakeven", "--verify-curve", surf, "--batch", 16, "--steps", 3)[::2])
    assert "batch 16 cannot be predicted outside them" in line
    other = _surface_run(model="other-model")
    line = one_error_line(*cli(capsys, "tune", "--run", run, "--verify-curve", other)[::2])
    assert f"--verify-curve {other} was measured on target other-model and run {run} on m" in line
    line = one_error_line(*cli(capsys, "breakeven", "--run", run, "--verify-curve", other, "--batch", 2)[::2])
    assert "other-model" in line and " on m:" in line
    sg = _drafter_run(engine="sglang")
    line = one_error_line(*cli(capsys, "tune", "--run", sg, "--verify-curve", surf)[::2])
    assert "holds vllm's costs" in line and "measured in sglang" in line
    no_plain = _surface_run(plain=False)
    for cmd in (["tune", "--run", run], ["breakeven", "--steps", 3]):
        line = one_error_line(*cli(capsys, *cmd, "--verify-curve", no_plain)[::2])
        assert "no plain decoding steps (n = 1)" in line and "--baseline-without speculative-config" in line
    line = one_error_line(*cli(capsys, "tune", "--run", surf, "--verify-curve", surf)[::2])
    assert "is an engine surface" in line and "pass it as --verify-curve" in line
    line = one_error_line(*cli(capsys, "breakeven", "--run", surf, "--batch", 2)[::2])
    assert "is an engine surface" in line
    for flag in (["--save-policy", "p.json"], ["--validate", "1"]):
        line = one_error_line(*cli(capsys, "tune", "--run", _specscope_run(), "--verify-curve", surf, *flag)[::2])
        assert flag[0] in line and "vllm's steps" in line


def test_a_specscope_run_of_the_same_target_reads_a_vllm_surface():
    from specscope.economics.engine_steps import check_same_target

    surf = {"id": "s", "config": {"engine": "vllm", "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    mine = {"id": "r", "config": {"model": "/cache/models/smollm2-135m", "model_name": "smollm2-135m"}}
    check_same_target(surf, mine)        # a known name's hub id, no engine named: the drafter's acceptance carries
    with pytest.raises(SpecscopeError, match="measured on target"):
        check_same_target(surf, {"id": "r", "config": {"model_name": "qwen3-0.6b"}})
    # content hashes, where both have one, decide
    check_same_target({"config": {"model": "a", "model_hash": "h"}}, {"config": {"model": "b", "model_hash": "h"}})
    with pytest.raises(SpecscopeError, match="measured on target"):
        check_same_target({"config": {"model": "a", "model_hash": "h"}}, {"config": {"model": "a", "model_hash": "g"}})
