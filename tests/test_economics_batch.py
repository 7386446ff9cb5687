"""Economics by batch size: the verify surface T(B, n) (stored, read back, the old format as batch 1), the cost model
and break-even at batch B by hand, the per-concurrency tuner and its crossover on a synthetic surface, the policy
table `serve --spec-policy` reads, bad --batch values, and a real surface measured on a tiny model."""

import json
import math
from dataclasses import replace

import pytest

from cli_util import cli, one_error_line
from specscope.economics.breakeven import BreakevenInputs, at_batch, breakeven
from specscope.economics.cost import CycleCost, predicted_speedup
from specscope.economics.tune import AcceptanceModel, CostModel, by_concurrency, candidate_configs, crossover, predict
from specscope.economics.verify_curve import PiecewiseFit, VerifyCurve, VerifySurface
from specscope.errors import SpecscopeError
from tiny import make_hf_model

CTX = 100


def fit_at(B: int) -> PiecewiseFit:
    """The synthetic machine: T(B, n) = 10 ms while the forward holds at most 8 rows in all, +0.5 ms per row past
    them — per batch size, flat up to n = 8/B, then 0.5·B ms per token per sequence."""
    return PiecewiseFit(10.0, 0.5 * B, 8.0 / B, 0.0)


def T(B, n):
    return 10.0 + 0.5 * max(0.0, B * n - 8)


LEVELS = (1, 2, 4, 8, 16)


def surface_results(levels=LEVELS) -> dict:
    """results["surface"] as `verify-curve --batch` stores it (points and fits; samples live apart)."""
    pts = [{"batch": B, "context": CTX, "tokens": n, "median_ms": T(B, n), "p10_ms": T(B, n), "p90_ms": T(B, n),
            "min_ms": T(B, n), "max_ms": T(B, n)} for B in levels for n in (1, 2, 4)]
    return {"context": CTX, "region": CTX + 5, "batches": list(levels), "tokens": [1, 2, 4], "points": pts,
            "fits": {str(B): {str(CTX): fit_at(B).to_dict()} for B in levels}}


def curve_run(surface=True, levels=LEVELS) -> dict:
    res = {"fits": {str(CTX): fit_at(1).to_dict()},
           "points": [{"context": CTX, "tokens": n, "median_ms": T(1, n)} for n in (1, 2, 4)]}
    if surface:
        res["surface"] = surface_results(levels)
    return {"id": "vc1", "kind": "verify_curve", "config": {}, "results": res}


# ------------------------------------------------------------------------------------------------ the surface

def test_surface_reads_stored_points_and_interpolates_in_batch():
    s = VerifySurface.from_run(curve_run())
    assert s.batches == list(LEVELS) and s.context == CTX and s.run_id == "vc1"
    assert s(8, 2, CTX) == T(8, 2) == 14.0 and s(16, 1, CTX) == 14.0
    assert s(8, 3, CTX) == pytest.approx((T(8, 2) + T(8, 4)) / 2)     # measured points, linear between them
    assert s(3, 2, CTX) == pytest.approx((T(2, 2) + T(4, 2)) / 2)     # between batch sizes: linear in B
    with pytest.raises(SpecscopeError, match="covers batch sizes 1, 2, 4, 8, 16; batch 32 is outside"):
        s(32, 1, CTX)


def test_surface_round_trips_through_the_registry():
    from specscope.registry import make_record, open_registry, store_record

    run = curve_run()
    rid = store_record(make_record("verify_curve", "vc", config={}, results=run["results"], env={}))
    with open_registry() as reg:
        back = reg.get_run(rid, samples=False)
    a, b = VerifySurface.from_run(run), VerifySurface.from_run(back)
    assert b.batches == a.batches and b.run_id == rid
    for B in (1, 2, 3, 4, 8, 16):
        for n in (1, 2, 3, 4, 7):
            assert b(B, n, CTX) == a(B, n, CTX)


def test_old_curve_without_a_batch_axis_is_batch_one():
    run = curve_run(surface=False)
    s = VerifySurface.from_run(run)
    assert s.batches == [1]
    assert all(s(1, n, L) == VerifyCurve.from_run(run)(n, L) for n in (1, 3, 9) for L in (50, 100, 300))
    with pytest.raises(SpecscopeError, match=r"covers batch sizes 1; .*verify-curve --batch 1,2,4,8,16"):
        s(2, 1, CTX)
    with pytest.raises(SpecscopeError, match="not a verify curve"):
        VerifySurface.from_run({"id": "x", "kind": "speculative", "results": {}})
    # a surface without batch 1 takes the run's batch-1 curve for it
    s = VerifySurface.from_run(curve_run(levels=(2, 4)))
    assert s.batches == [1, 2, 4] and s(1, 4, CTX) == T(1, 4)


# ------------------------------------------------------------------------------------------------ cost at batch B

def test_cycle_cost_at_batch_by_hand():
    # 8 sequences: a plain step T(8, 1) = 20 ms; verify T(8, 4) = 36 ms; the batch's drafting 12 ms (one forward
    # per level for all eight), bookkeeping 0.5 ms per sequence
    c = CycleCost(decode_ms=20.0, draft_ms=12.0, verify_ms=36.0, other_ms=0.5, batch=8)
    assert c.cycle_ms == pytest.approx(36 + 12 + 8 * 0.5)          # 52: one verify, one drafting, eight commits
    assert c.plain_ms_per_token == pytest.approx(2.5)               # 20 / 8
    assert c.break_even_tau == pytest.approx(52 / 20)               # 2.6: B cancels
    assert c.spec_ms_per_token(3.25) == pytest.approx(52 / (8 * 3.25))   # 2.0 ms per sequence-token
    assert c.speedup(3.25) == pytest.approx(2.5 / 2.0)              # 1.25 = plain / speculative per token
    assert predicted_speedup(3.25, 20.0, 12.0, 36.0, 0.5, batch=8) == pytest.approx(1.25)
    # batch 1 is the single-sequence cycle it always was
    one = CycleCost(12.0, 2.0, 20.0, 2.0)
    assert one.cycle_ms == 24.0 and one.plain_ms_per_token == 12.0 and one.speedup(3.0) == pytest.approx(1.5)
    with pytest.raises(SpecscopeError, match="batch size"):
        CycleCost(12.0, 2.0, 20.0, 2.0, batch=0)


def test_breakeven_at_batch_from_numbers_and_a_surface():
    r = breakeven(BreakevenInputs(decode_ms=20.0, verify_ms=36.0, draft_ms=12.0, other_ms=0.5, steps=3, batch=8))
    assert r["batch"] == 8 and r["cycle_ms"] == pytest.approx(52.0)
    assert r["break_even_accept_length"] == pytest.approx(2.6) and r["plain_ms_per_token"] == pytest.approx(2.5)
    # from a surface alone: T(8, 1) = 10, a chain of 3 verifies 4 tokens, T(8, 4) = 22; the batch's drafting 1 ms
    s = VerifySurface.from_run(curve_run())
    inp = at_batch(BreakevenInputs(draft_ms=1.0, steps=3, batch=8), s)
    assert (inp.decode_ms, inp.verify_ms, inp.draft_ms) == (T(8, 1), T(8, 4), 1.0) == (10.0, 22.0, 1.0)
    assert breakeven(inp)["break_even_accept_length"] == pytest.approx((22 + 1) / 10)
    # a run's batch-1 times are scaled: decode 12 × T(8,1)/T(1,1), verify 15 × T(8,4)/T(1,4)
    # (and the drafter's forwards as the target's at 2 rows a sequence: T(8, 2)/T(1, 2) = 1.4)
    inp = BreakevenInputs(decode_ms=12.0, verify_ms=15.0, draft_ms=1.0, steps=3, batch=8,
                          sources={"decode_ms": "baseline run b", "verify_ms": "run r", "draft_ms": "run r"})
    at_batch(inp, s)
    assert inp.decode_ms == pytest.approx(12.0) and inp.verify_ms == pytest.approx(15.0 * 22 / 10)
    assert inp.draft_ms == pytest.approx(1.4)
    assert "T(8, 4)/T(1, 4)" in inp.sources["verify_ms"]
    with pytest.raises(SpecscopeError, match="measured at batch 1; pass --verify-curve"):
        at_batch(BreakevenInputs(decode_ms=12.0, verify_ms=15.0, draft_ms=1.0, steps=3, batch=8,
                                 sources={"verify_ms": "run r"}))


def _store(kind, config, results):
    from specscope.registry import make_record, store_record

    return store_record(make_record(kind, kind, config=config, results=results, env={}))


def _phases(**ms):
    return {k.replace("_", "."): {"mean_ms": v, "median_ms": v, "p90_ms": v, "share": 0.0} for k, v in ms.items()}


def _chain_runs():
    """A profiled chain (steps 3, conditional acceptance .8 .5 .5, draft 1 ms a step, verify 10 ms at 4 tokens,
    no bookkeeping), its baseline (10 ms/token) and the synthetic surface, stored."""
    base = _store("baseline", {"model": "m"}, {"decode_ms_per_token": 10.0})
    spec = _store("speculative", {"model": "m", "draft": "d", "steps": 3, "topk": 1, "draft_tokens": 4,
                                  "baseline_run": base},
                  {"per_position_acceptance_conditional": [0.8, 0.5, 0.5], "accept_length": 2.4,
                   "phases": _phases(draft=3.0, draft_step0=1.0, draft_step1=1.0, draft_step2=1.0, verify=10.0,
                                     other=1.0),
                   "verify_tokens_mean": 4.0, "mean_context": CTX})
    vc = _store("verify_curve", {}, curve_run()["results"])
    return spec, base, vc


def test_breakeven_cli_at_batch(capsys):
    spec, base, vc = _chain_runs()
    code, out, err = cli(capsys, "breakeven", "--run", spec, "--batch", 8, "--verify-curve", vc, "--json")
    assert code == 0, err
    r = json.loads(out)
    # decode 10 × T(8,1)/T(1,1) = 10; verify 10 × T(8,4)/T(1,4) = 22; drafting 3 × T(8,2)/T(1,2) = 4.2 for the
    # batch; 8 × 1 ms of bookkeeping: cycle 34.2
    assert r["batch"] == 8 and r["decode_ms"] == pytest.approx(10.0) and r["verify_ms"] == pytest.approx(22.0)
    assert r["break_even_accept_length"] == pytest.approx(3.42) and r["break_even_alpha"] is not None
    assert r["speedup"] == pytest.approx(2.4 * 10 / 34.2)   # the run's τ: the runs' batch-1 tok/s ratio is not used
    code, out, err = cli(capsys, "breakeven", "--run", spec, "--batch", 8, "--verify-curve", vc)
    assert code == 0 and "at batch 8" in out and "1.25 ms per sequence-token" in out and "8 × other 1.00" in out
    line = one_error_line(*cli(capsys, "breakeven", "--run", spec, "--batch", 4)[::2])
    assert "measured at batch 1; pass --verify-curve" in line


# ------------------------------------------------------------------------------------------------ the tuner

def _chain_cost() -> tuple[AcceptanceModel, CostModel]:
    acc = AcceptanceModel.from_conditional([0.8, 0.5, 0.5])
    s = VerifySurface.from_run(curve_run())
    cost = CostModel(decode_ms=10.0, step0_ms=1.0, expand_ms=1.0, select_ms=0.0, verify_ms=10.0, other_ms=1.0,
                     k0=1, n0=4.0, context=CTX, curve=s.curves[1], surface=s)
    return acc, cost


# speedup = τ_s · T(B, 1) / (T(B, s + 1) + D(B, s) + B · 1 ms of bookkeeping): τ = 1.8, 2.2, 2.4 for chains of
# 1, 2, 3; the batch drafts in one forward per step, D(B, s) = T(B, 2)/10 (catch-up) + (s - 1) · T(B, 1)/10
BEST = {1: (3, 2.4 * 10 / 14), 2: (3, 2.4 * 10 / 15), 4: (2, 2.2 * 10 / 18), 8: (2, 2.2 * 10 / 28.4),
        16: (1, 1.8 * 14 / 40.2)}


def test_predictions_by_concurrency_by_hand():
    acc, cost = _chain_cost()
    r = predict(acc, cost, 2, 1, 3, batch=4)            # T(4, 3) = 12, drafting 2, 4 × 1 ms bookkeeping: cycle 18
    assert (r["verify_ms"], r["draft_ms"], r["cycle_ms"], r["decode_ms"]) == pytest.approx((12.0, 2.0, 18.0, 10.0))
    assert r["tau"] == pytest.approx(2.2) and r["speedup"] == pytest.approx(22 / 18)
    assert r["tau_needed"] == pytest.approx(1.8)
    assert r["plain_ms_per_token"] == pytest.approx(2.5) and r["spec_ms_per_token"] == pytest.approx(18 / (4 * 2.2))
    assert predict(acc, cost, 3, 1, 4)["speedup"] == pytest.approx(24 / 14)    # batch 1 reads the batch-1 curve
    assert predict(acc, cost, 3, 1, 4, batch=16)["draft_ms"] == pytest.approx(2.2 + 2 * 1.4)   # drafting grows
    rows, skipped = by_concurrency(acc, cost, candidate_configs(acc), LEVELS)
    assert not skipped and [r["batch"] for r in rows] == list(LEVELS)
    for r in rows:
        assert (r["steps"], r["speedup"]) == (BEST[r["batch"]][0], pytest.approx(BEST[r["batch"]][1]))
    # speculation pays at 4 (22/18) and not at 8 (22/28.4): the crossover lies between, in log2(B)
    t = (22 / 18 - 1) / (22 / 18 - 22 / 28.4)
    assert crossover([r["batch"] for r in rows], [r["speedup"] for r in rows]) == pytest.approx(2 ** (2 + t))
    # levels the surface does not cover are left out, not extrapolated
    rows, skipped = by_concurrency(acc, cost, candidate_configs(acc), (1, 4, 32))
    assert [r["batch"] for r in rows] == [1, 4] and skipped == [32]
    no_surface = CostModel(**{**cost.__dict__, "surface": None})
    rows, skipped = by_concurrency(acc, no_surface, candidate_configs(acc), LEVELS)
    assert [r["batch"] for r in rows] == [1] and skipped == [2, 4, 8, 16]
    with pytest.raises(SpecscopeError, match="verify-curve --batch"):
        predict(acc, no_surface, 2, 1, 3, batch=2)


def test_verify_is_priced_against_decode_from_one_surface():
    """With a surface, verify(n, B) = the run's decode step × T(B, n)/T(1, 1), whatever the run's own verify time
    at its wide shape says (measured apart from its decode, it drifts); without one, that verify time × the batch-1
    curve's ratio, as before surfaces."""
    acc, cost = _chain_cost()
    drifted = replace(cost, verify_ms=7.0, decode_ms=12.0)
    for B in LEVELS:
        for n in (1, 3, 5):
            assert drifted.verify(n, B) == pytest.approx(12.0 * T(B, n) / T(1, 1))
            assert drifted.verify(n, B) / drifted.decode(B) == pytest.approx(T(B, n) / T(B, 1))
    no_surface = replace(drifted, surface=None)
    assert no_surface.verify(5) == pytest.approx(7.0 * T(1, 5) / T(1, 4))


def test_crossover_edges():
    assert crossover([1, 2, 4], [1.5, 1.2, 0.9]) == pytest.approx(2 ** (1 + 0.2 / 0.3))
    assert crossover([4, 1, 2], [0.9, 1.5, 1.2]) == pytest.approx(2 ** (1 + 0.2 / 0.3))   # order does not matter
    assert crossover([1, 2, 4], [1.5, 1.2, 1.1]) is None          # pays everywhere measured
    assert crossover([1, 2, 4], [0.95, 1.2, 1.1]) == 1.0           # pays nowhere from the start
    assert crossover([1, 2], [1.5, 1.0]) == pytest.approx(2.0)     # exactly even at 2: plain from there on
    assert crossover([], []) is None


def test_hybrid_at_batch_prices_one_forward_of_mean_rows():
    from specscope.economics.tune import HybridModel

    acc, cost = _chain_cost()
    hyb = HybridModel([("tree", 1, 0, 0, 0, 3), ("copy", 0, 4, 5, 5, 1)], ngram_tokens=2, copy_budget=4)
    r1, r4 = (predict(acc, cost, 2, 1, 3, 2, hyb, batch=B) for B in (1, 4))
    assert r1["verify_tokens"] == r4["verify_tokens"] == pytest.approx(0.75 * 3 + 0.25 * 5)
    assert r4["verify_ms"] == pytest.approx(T(4, 3.5))             # one forward at the mean rows per sequence
    assert r1["verify_ms"] == pytest.approx(0.75 * T(1, 3) + 0.25 * T(1, 5))   # batch 1: cycle by cycle
    assert r4["draft_ms"] == pytest.approx(0.75 * 2.0)               # the tree's drafting, in 3 cycles of 4
    assert r4["cycle_ms"] == pytest.approx(T(4, 3.5) + 0.75 * 2.0 + 4 * 1.0)


# ------------------------------------------------------------------------------------------------ the policy

def _table():
    from specscope.economics.policy import make_table

    acc, cost = _chain_cost()
    rows, _ = by_concurrency(acc, cost, candidate_configs(acc), LEVELS)
    return make_table(rows, crossover([r["batch"] for r in rows], [r["speedup"] for r in rows]), "m", "d",
                      run="r1")


def test_spec_policy_auto_reads_the_saved_table(tmp_path, monkeypatch):
    from specscope.economics.policy import policy_path, save_table, spec_policy
    from specscope.speculative.decode import SpecConfig

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    table = _table()
    assert table["crossover"] == pytest.approx(5.65, abs=0.01)
    path = save_table(table, policy_path("m", "d"))
    assert path.startswith(str(tmp_path / "cache" / "spec-policy"))
    cfg = SpecConfig(3, 1, 4)
    policy = spec_policy("auto", cfg, model="m", draft="d")
    shapes = {B: policy(B) for B in (1, 2, 3, 4, 6, 7, 8, 16, 64)}
    knobs = {B: (s.steps, s.topk, s.draft_tokens) if s else None for B, s in shapes.items()}
    assert knobs == {1: (3, 1, 4), 2: (3, 1, 4), 3: (3, 1, 4), 4: (2, 1, 3), 6: None, 7: None, 8: None,
                     16: None, 64: None}
    by_path = spec_policy(path, cfg)                    # the same table by its path
    assert [by_path(B) == shapes[B] for B in shapes] == [True] * len(shapes)
    # the signature serve calls keeps working
    assert spec_policy("always", cfg)(16) is cfg and spec_policy("off", cfg)(1) is None


def test_spec_policy_tables_are_kept_per_dtype(tmp_path, monkeypatch):
    """A bf16 step costs half an fp32 one while drafting does not: a table tuned in one dtype is neither found
    nor accepted for the other (fp32 keeps the name tables had before dtypes were told apart)."""
    from specscope.economics.policy import policy_path, save_table, spec_policy
    from specscope.speculative.decode import SpecConfig

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    assert policy_path("m", "d", "float32") == policy_path("m", "d", "fp32") == policy_path("m", "d")
    assert policy_path("m", "d", "bfloat16") == policy_path("m", "d", "bf16") != policy_path("m", "d")
    path = save_table({**_table(), "dtype": "bf16"}, policy_path("m", "d", "bf16"))
    cfg = SpecConfig(3, 1, 4)
    assert spec_policy("auto", cfg, model="m", draft="d", dtype="torch.bfloat16")(1) is not None
    with pytest.raises(SpecscopeError, match="no table for model 'm' and drafter 'd' at"):
        spec_policy("auto", cfg, model="m", draft="d", dtype="torch.float32")
    with pytest.raises(SpecscopeError, match="tuned in bf16, not fp32"):
        spec_policy(path, cfg, dtype="torch.float32")


def test_spec_policy_errors(tmp_path, monkeypatch):
    from specscope.economics.policy import envelope, save_table, spec_policy
    from specscope.speculative.decode import SpecConfig

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecscopeError, match="pass the table's path instead"):
        spec_policy("auto", SpecConfig(3, 1, 4))
    with pytest.raises(SpecscopeError, match="no table for model 'm' and drafter 'd' at .*spec-policy"):
        spec_policy("auto", SpecConfig(3, 1, 4), model="m", draft="d")
    with pytest.raises(SpecscopeError, match="not one of priced, always, off, auto"):
        spec_policy("sometimes", SpecConfig(3, 1, 4))
    path = save_table(_table(), tmp_path / "t.json")
    # the engine sized for chains of 2 cannot run the table's chain of 3 at batch 1
    with pytest.raises(SpecscopeError, match="--steps 3 --topk 1 --draft-tokens 4"):
        spec_policy(path, SpecConfig(2, 1, 3))
    e = envelope(_table())
    assert (e.steps, e.topk, e.draft_tokens) == (3, 1, 4)
    with pytest.raises(SpecscopeError, match="tuned for drafter 'd', not 'x'"):
        spec_policy(path, SpecConfig(3, 1, 4), draft="x")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecscopeError, match="cannot read it as JSON"):
        spec_policy(str(tmp_path / "bad.json"), SpecConfig(3, 1, 4))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "bench"}))
    with pytest.raises(SpecscopeError, match="not a spec-policy table"):
        spec_policy(str(tmp_path / "other.json"), SpecConfig(3, 1, 4))


def test_policy_key_names_a_known_model_alike_by_name_and_directory(tmp_path, monkeypatch):
    from specscope.economics.policy import policy_path

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    pulled = tmp_path / "cache" / "models" / "smollm2-135m"
    pulled.mkdir(parents=True)
    a = policy_path("smollm2-135m", "smollm2-135m-eagle3+ngram")
    assert a == policy_path(str(pulled), "smollm2-135m-eagle3+ngram")
    assert a.name.startswith("smollm2-135m__smollm2-135m-eagle3+ngram-")
    assert a != policy_path("smollm2-135m", "smollm2-135m-eagle3")


def test_tune_prints_and_saves_the_concurrency_table(tmp_path, monkeypatch, capsys):
    from specscope.economics.policy import spec_policy
    from specscope.speculative.decode import SpecConfig

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    spec, base, vc = _chain_runs()
    code, out, err = cli(capsys, "tune", "--run", spec, "--verify-curve", vc, "--save-policy", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [(c["batch"], c["steps"]) for c in r["concurrency"]] == [(B, BEST[B][0]) for B in LEVELS]
    assert [c["speedup"] for c in r["concurrency"]] == pytest.approx([BEST[B][1] for B in LEVELS])
    assert r["crossover"] == pytest.approx(5.65, abs=0.01) and r["concurrency_not_predicted"] == []
    assert r["policy"].startswith(str(tmp_path / "cache" / "spec-policy"))
    policy = spec_policy("auto", SpecConfig(3, 1, 4), model="m", draft="d")
    assert policy(1).steps == 3 and policy(8) is None
    code, out, err = cli(capsys, "tune", "--run", spec, "--verify-curve", vc, "--save-policy",
                         tmp_path / "p.json", "--max-concurrency", "1,4,8")
    assert code == 0, err
    assert "best shape by concurrency" in out and "past ~5.6 concurrent sequences" in out
    assert f"policy table: {tmp_path / 'p.json'}" in out
    assert json.loads((tmp_path / "p.json").read_text())["crossover"] == pytest.approx(5.65, abs=0.01)
    # a batch-1 curve cannot predict concurrency: said, not extrapolated
    old = _store("verify_curve", {}, curve_run(surface=False)["results"])
    code, out, err = cli(capsys, "tune", "--run", spec, "--verify-curve", old)
    assert code == 0 and "concurrency 2, 4, 8, 16 not predicted: no verify surface" in out
    line = one_error_line(*cli(capsys, "tune", "--run", spec, "--verify-curve", old, "--save-policy")[::2])
    assert "--save-policy needs predictions at every --max-concurrency level" in line


# ------------------------------------------------------------------------------------------------ bad --batch values

@pytest.mark.parametrize("cmd, args, msg", [
    ("verify-curve", ["--batch", "0"], "--batch must all be >= 1"),
    ("verify-curve", ["--batch", "1,x"], "--batch must be a comma-separated list of integers"),
    ("verify-curve", ["--batch", ""], "--batch is empty"),
    ("verify-curve", ["--batch", "1,100000"], "--batch values must be <= 1024"),
    ("verify-curve", ["--batch-context", "16"], "pass --batch too"),
    ("verify-curve", ["--batch", "2", "--batch-context", "250", "--tokens", "1,16"], "batch context 250 + 16"),
    ("verify-curve", ["--batch", "2", "--batch-context", "64", "--max-seq-len", "32"], "--max-seq-len 32 is shorter"),
    ("tune", ["--run", "x", "--max-concurrency", "1,-2"], "--max-concurrency must all be >= 1"),
    ("tune", ["--run", "x", "--concurrency", "2000"], "--max-concurrency values must be <= 1024"),
    ("tune", ["--run", "x", "--save-policy"], "--save-policy needs predictions above batch 1"),
    ("breakeven", ["--batch", "0", "--decode-ms", "1", "--verify-ms", "1", "--draft-ms", "1", "--steps", "1"],
     "--batch must be >= 1"),
    ("breakeven", ["--batch", "two"], "'two' is not a valid integer"),
])
def test_bad_batch_values_are_one_line_errors(cmd, args, msg, tmp_path, capsys):
    model = tmp_path / "tiny"
    make_hf_model(model)
    extra = ["--model", model, "--context", "16", "--no-plot", "--no-record"] if cmd == "verify-curve" else []
    line = one_error_line(*cli(capsys, cmd, *args, *extra)[::2])
    assert msg in line


# ------------------------------------------------------------------------------------------------ real, tiny

def test_verify_curve_batch_on_a_tiny_model(tmp_path, capsys):
    model = tmp_path / "tiny"
    make_hf_model(model)
    png = tmp_path / "curve.png"
    code, out, err = cli(capsys, "verify-curve", "--model", model, "--context", "16,32", "--tokens", "1,4",
                         "--batch", "1,2,3", "--repeats", 2, "--warmup", 0, "--device", "cpu", "--plot", png,
                         "--json")
    assert code == 0, err
    r = json.loads(out)
    surf = r["surface"]
    assert surf["batches"] == [1, 2, 3] and surf["context"] == 16 and surf["region"] == 16 + 4 + 1
    assert {(p["batch"], p["tokens"]) for p in surf["points"]} == {(B, n) for B in (1, 2, 3) for n in (1, 4)}
    assert all(0 < p["p10_ms"] <= p["median_ms"] <= p["p90_ms"] for p in surf["points"])
    assert r["batch_plot"] == str(tmp_path / "curve-batch.png") and (tmp_path / "curve-batch.png").stat().st_size
    assert png.exists()
    from specscope.registry import open_registry

    with open_registry() as reg:
        run = reg.get_run(r["run_id"])
    assert len(run["samples"]["batch_verify_ms"]["3:16:4"]) == 2
    s = VerifySurface.from_run(run)
    assert s.batches == [1, 2, 3] and s.region == 21
    med = {(p["batch"], p["tokens"]): p["median_ms"] for p in surf["points"]}
    assert s(3, 4, 16) == med[(3, 4)] and s(2, 1, 16) == med[(2, 1)]
    assert math.isfinite(s(2.5, 2, 16))
    # the human output: the batch table and a line per batch size
    code, out, err = cli(capsys, "verify-curve", "--model", model, "--context", "16", "--tokens", "1,2",
                         "--batch", "1,2", "--repeats", 1, "--device", "cpu", "--no-plot", "--no-record")
    assert code == 0, err
    assert "batch 2: a plain step" in out and "per sequence-token" in out


def _step(batch, drafted, tokens, rows, verify_ms, draft_ms=0.0, other_ms=0.5, prompt_rows=0):
    from specscope.engine.batch import StepRecord

    return StepRecord(batch=batch, drafted=drafted, prompt_rows=prompt_rows, rows=rows, tokens=tokens,
                      phases_ms={"draft": draft_ms, "verify": verify_ms, "accept": 0.1, "commit": 0.1,
                                 "other": other_ms})


def test_row_costs_interpolate_and_extrapolate():
    from specscope.economics.policy import RowCosts
    from specscope.speculative.budget import Prices

    c = RowCosts(Prices({1: 1.0, 4: 1.2, 16: 2.0}, 10.0))
    assert c(1) == pytest.approx(10.0) and c(4) == pytest.approx(12.0)
    assert c(10) == pytest.approx(16.0)             # linear between bins
    assert c(32) == pytest.approx(20.0 + 8 / 12 * 16)   # the last slope past the last bin
    for _ in range(50):                              # the run's own steps replace the prior
        c.add(16, 40.0)
    assert c(16) == pytest.approx(40.0, rel=0.01)
    assert RowCosts()(3) is None


def test_priced_policy_drafts_alone_and_stops_under_load():
    """A CPU-like machine: T(rows) = 10 ms + 1 ms a row; a drafting sequence commits 2.5 tokens a step for 7 verified
    rows and 2 ms of drafting. At batch 1 that is 2.5 tokens in 19 ms against 1 in 11: it drafts. At 16 it is 40
    tokens in 10 + 112 + 32 ms against 16 in 26: plain, with a drafting step only every 8 x probe steps."""
    from specscope.economics.policy import PricedPolicy
    from specscope.speculative.budget import Prices
    from specscope.speculative.decode import SpecConfig

    cfg = SpecConfig(3, 2, 7)
    T = lambda rows: 10.0 + rows   # noqa: E731
    pol = PricedPolicy(cfg, Prices({n: T(n) / T(1) for n in (1, 2, 4, 8, 16)}, T(1)), probe=4)

    def run(batch, steps):
        chosen = []
        for _ in range(steps):
            shape = pol(batch)
            chosen.append(shape is not None)
            rows = batch * (1 + cfg.verify_tokens) if shape else batch
            pol.observe(_step(batch, batch if shape else 0, int(2.5 * batch) if shape else batch, rows, T(rows),
                              2.0 * batch if shape else 0.0))
        return chosen

    assert all(run(1, 40))
    under_load = run(16, 200)
    assert sum(under_load) <= 200 // 32 + 2
    assert pol(1) is cfg                      # what it learned at 16 rows costs nothing at batch 1
    assert pol.attach(1) and not pol.attach(16)   # a request joining 15 others gets no drafter


def test_priced_policy_ignores_prefill_steps_for_rates():
    from specscope.economics.policy import PricedPolicy
    from specscope.speculative.decode import SpecConfig

    pol = PricedPolicy(SpecConfig(3, 1, 4))
    prior = pol.nodes.value
    pol(2)
    # a step that also prefilled 300 prompt rows: its time is a sample of T(rows) only
    pol.observe(_step(2, 2, 2, 310, 300.0, 4.0, prompt_rows=300))
    assert pol.tau.n == 2 and pol.costs(310) == pytest.approx(300.0)
    pol(2)
    pol.observe(_step(2, 2, 6, 10, 12.0, 2.0))
    assert pol.tau.value > 2.0 and pol.nodes.value == pytest.approx(prior + (4 - prior) / 3)   # prior worth 2
