"""Cost model and break-even: formulas against hand-computed cases, the CLI, and errors for bad input."""

import json
import math

import pytest

from specscope.cli import main
from specscope.economics.breakeven import BreakevenInputs, breakeven, inputs_from_runs
from specscope.economics.cost import (chain_tau, conditional_from_unconditional, iid_alpha_for, iid_expected_tokens,
                                      predicted_speedup, tree_tau, unconditional_from_conditional)
from specscope.errors import SpecscopeError


# ---------------------------------------------------------------------------------------------------- formulas

def test_iid_closed_form_hand_cases():
    # α = 0.5, γ = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875 = (1 - 0.5^4) / 0.5
    assert iid_expected_tokens(0.5, 3) == pytest.approx(1.875)
    # α = 0.8, γ = 2: 1 + 0.8 + 0.64 = 2.44 = (1 - 0.512) / 0.2
    assert iid_expected_tokens(0.8, 2) == pytest.approx(2.44)
    # limits: nothing accepted -> only the bonus token; everything accepted -> γ + 1
    assert iid_expected_tokens(0.0, 5) == 1.0
    assert iid_expected_tokens(1.0, 5) == 6.0
    # the closed form equals the geometric sum it abbreviates
    for a in (0.1, 0.37, 0.9, 0.999):
        for g in (1, 4, 7):
            assert iid_expected_tokens(a, g) == pytest.approx(sum(a ** k for k in range(g + 1)))


def test_iid_alpha_inverts_closed_form():
    assert iid_alpha_for(2.44, 2) == pytest.approx(0.8, abs=1e-9)
    assert iid_alpha_for(1.875, 3) == pytest.approx(0.5, abs=1e-9)
    assert iid_alpha_for(0.9, 3) == 0.0          # cycle cheaper than a decode step: no acceptance needed
    assert iid_alpha_for(3.0, 2) == pytest.approx(1.0, abs=1e-9)
    assert iid_alpha_for(3.01, 2) is None        # more than depth + 1 tokens per cycle: impossible


def test_chain_tau_from_per_position_acceptance():
    # conditional 0.8, 0.5, 0.25 -> unconditional 0.8, 0.4, 0.1 -> τ = 1 + 0.8 + 0.4 + 0.1 = 2.3
    assert unconditional_from_conditional([0.8, 0.5, 0.25]) == pytest.approx([0.8, 0.4, 0.1])
    assert conditional_from_unconditional([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert chain_tau([0.8, 0.5, 0.25]) == pytest.approx(2.3)
    # a shorter chain keeps the first positions: 1 + 0.8 + 0.4 = 2.2
    assert chain_tau([0.8, 0.5, 0.25], steps=2) == pytest.approx(2.2)
    # a longer one repeats the last rate: c = .8 .5 .25 .25 .25 -> a = .8 .4 .1 .025 .00625 -> 2.33125
    assert chain_tau([0.8, 0.5, 0.25], steps=5) == pytest.approx(2.33125)
    # i.i.d. acceptance is the special case of a constant rate
    assert chain_tau([0.7] * 4) == pytest.approx(iid_expected_tokens(0.7, 4))


def test_tree_tau_small_tree_by_hand():
    # root ─┬─ A (p .6) ─┬─ C (p .5)
    #       │            └─ D (p .2)
    #       └─ B (p .3) ─── E (p .4)
    # P(on the accepted path) = product of p along the path:
    #   A .6, B .3, C .6·.5 = .3, D .6·.2 = .12, E .3·.4 = .12
    # τ = 1 (bonus) + .6 + .3 + .3 + .12 + .12 = 2.44
    parents = [-1, -1, 0, 0, 1]
    p = [0.6, 0.3, 0.5, 0.2, 0.4]
    assert tree_tau(parents, p) == pytest.approx(2.44)
    # a chain written as a tree gives the chain formula
    assert tree_tau([-1, 0, 1], [0.8, 0.5, 0.25]) == pytest.approx(2.3)


def test_tree_tau_rejects_impossible_trees():
    with pytest.raises(SpecscopeError, match="at most one sibling"):
        tree_tau([-1, -1], [0.7, 0.6])           # two siblings cannot both be the target's token
    with pytest.raises(SpecscopeError, match="parents must be listed before"):
        tree_tau([1, -1], [0.5, 0.5])
    with pytest.raises(SpecscopeError, match="probability"):
        tree_tau([-1], [1.5])


def test_predicted_speedup():
    # τ 3 · 12 ms / (2 + 20 + 2) ms = 1.5
    assert predicted_speedup(3.0, 12.0, 2.0, 20.0, 2.0) == pytest.approx(1.5)
    with pytest.raises(SpecscopeError):
        predicted_speedup(3.0, 0.0, 2.0, 20.0)


# ---------------------------------------------------------------------------------------------------- breakeven

def test_breakeven_numbers():
    r = breakeven(BreakevenInputs(decode_ms=12.1, verify_ms=29, draft_ms=1.2, steps=2))
    assert set(r) == {"cycle_ms", "break_even_accept_length", "break_even_alpha", "max_accept_length"}
    assert r["cycle_ms"] == pytest.approx(30.2)
    assert r["break_even_accept_length"] == pytest.approx(30.2 / 12.1)
    # 1 + α + α² = 30.2/12.1  ->  α = (-1 + sqrt(1 + 4(30.2/12.1 - 1))) / 2
    assert r["break_even_alpha"] == pytest.approx((-1 + math.sqrt(1 + 4 * (30.2 / 12.1 - 1))) / 2, abs=1e-9)
    assert r["max_accept_length"] == 3.0


def test_breakeven_impossible_and_measured():
    r = breakeven(BreakevenInputs(decode_ms=12.1, verify_ms=29, draft_ms=1.2, steps=1, measured_tok_s=60))
    assert r["break_even_accept_length"] > r["max_accept_length"] == 2.0
    assert r["break_even_alpha"] is None
    assert r["speedup"] == pytest.approx(60 * 12.1 / 1000)     # 60 tok/s against 82.6 tok/s plain
    r = breakeven(BreakevenInputs(decode_ms=10, verify_ms=20, draft_ms=4, steps=4, other_ms=1,
                                  measured_accept_length=3.0))
    assert r["speedup"] == pytest.approx(3.0 * 10 / 25)


def test_breakeven_cli_words_and_json(capsys):
    main(["breakeven", "--decode-ms", "12.1", "--verify-ms", "29", "--draft-ms", "1.2", "--steps", "2",
          "--measured-tok-s", "60", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"cycle_ms", "break_even_accept_length", "break_even_alpha", "max_accept_length", "speedup"}
    assert out["speedup"] == pytest.approx(0.726)
    main(["breakeven", "--decode-ms", "12.1", "--verify-ms", "29", "--draft-ms", "1.2", "--steps", "1"])
    text = capsys.readouterr().out
    assert "impossible" in text and "at most 2" in text


@pytest.mark.parametrize("args, msg", [
    (["--decode-ms", "0", "--verify-ms", "29", "--draft-ms", "1", "--steps", "2"], "--decode-ms must be a positive"),
    (["--decode-ms", "12", "--verify-ms", "-3", "--draft-ms", "1", "--steps", "2"], "--verify-ms must be a positive"),
    (["--decode-ms", "12", "--verify-ms", "29", "--draft-ms", "0", "--steps", "2"], "--draft-ms must be a positive"),
    (["--decode-ms", "12", "--verify-ms", "29", "--draft-ms", "1", "--steps", "0"], "--steps must be >= 1"),
    (["--decode-ms", "12", "--verify-ms", "29", "--draft-ms", "1", "--steps", "2", "--other-ms", "-1"],
     "--other-ms must be >= 0"),
    (["--decode-ms", "12", "--verify-ms", "29", "--steps", "2"], "needs --draft-ms"),
    (["--decode-ms", "12", "--verify-ms", "29", "--draft-ms", "1", "--steps", "2", "--measured-accept-length",
      "0.5"], "must be >= 1"),
    (["--run", "nosuchrun"], "no run 'nosuchrun'"),
])
def test_breakeven_bad_input(args, msg, capsys):
    from specscope.registry import open_registry

    open_registry().close()   # an existing, empty registry: --run names a run it does not hold
    with pytest.raises(SystemExit) as e:
        main(["breakeven", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------- from runs

def _store(kind, config, results):
    from specscope.registry import make_record, store_record

    return store_record(make_record(kind, kind, config=config, results=results, env={}))


def _phases(**ms):
    return {k: {"mean_ms": v, "median_ms": v, "p90_ms": v, "share": 0.0} for k, v in ms.items()}


def test_breakeven_from_runs(capsys):
    spec = _store("speculative", {"model": "m", "draft": "d", "steps": 3, "topk": 1, "draft_tokens": 4},
                  {"accept_length": 2.5, "tok_per_s": 50.0,
                   "phases": _phases(draft=3.0, **{"draft.step0": 1.0, "draft.step1": 1.0, "draft.step2": 1.0},
                                     verify=20.0, accept=0.5, commit=0.3, other=0.2)})
    base = _store("baseline", {"model": "m"}, {"decode_ms_per_token": 12.0, "tok_per_s": 40.0,
                                               "phases": _phases(decode=12.0)})
    main(["breakeven", "--run", spec, "--baseline-run", base, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["cycle_ms"] == pytest.approx(24.0)                 # 3 + 20 + (0.5 + 0.3 + 0.2); sub-steps not twice
    assert out["break_even_accept_length"] == pytest.approx(2.0)
    assert out["max_accept_length"] == 4.0
    assert out["speedup"] == pytest.approx(50.0 / 40.0)           # measured end to end: tok/s ratio of the runs
    main(["breakeven", "--run", spec, "--baseline-run", base])
    text = capsys.readouterr().out
    assert "baseline run" in text and "1.25x" in text
    # a run that names its baseline needs no --baseline-run
    linked = _store("speculative", {"steps": 3, "topk": 1, "baseline_run": base},
                    {"accept_length": 2.5, "tok_per_s": 50.0, "phases": _phases(draft=3.0, verify=20.0)})
    main(["breakeven", "--run", linked, "--json"])
    assert json.loads(capsys.readouterr().out)["speedup"] == pytest.approx(1.25)


def test_breakeven_from_ingested_run_says_what_is_missing(capsys):
    ing = _store("ingest", {"engine": "sglang"}, {"accept_length": 1.95, "tok_per_s": 178.86})
    with pytest.raises(SystemExit):
        main(["breakeven", "--run", ing])
    err = capsys.readouterr().err
    assert "τ = 1.95" in err and "178.86 tok/s" in err
    assert "--verify-ms" in err and "--steps" in err and "--baseline-run ID or --decode-ms" in err
    # completing it by hand works, and the run's τ gives the speedup
    main(["breakeven", "--run", ing, "--decode-ms", "6.3", "--verify-ms", "9", "--draft-ms", "1", "--steps", "3",
          "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["cycle_ms"] == pytest.approx(10.0)
    assert out["speedup"] == pytest.approx(1.95 * 6.3 / 10.0)


def test_inputs_from_runs_command_line_wins():
    run = {"id": "r1", "kind": "speculative", "config": {"steps": 5},
           "results": {"phases": _phases(draft=2.0, verify=10.0), "accept_length": 3.0}}
    inp = inputs_from_runs(run, None, BreakevenInputs(decode_ms=5.0, verify_ms=8.0))
    assert (inp.verify_ms, inp.draft_ms, inp.steps, inp.decode_ms) == (8.0, 2.0, 5, 5.0)
    assert breakeven(inp)["speedup"] == pytest.approx(3.0 * 5.0 / 10.0)
