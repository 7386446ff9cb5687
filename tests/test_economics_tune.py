"""The tuner: the expected tree by hand, acceptance from rank counts, the recorder on a real DraftTree, prediction
logic on synthetic runs, and the profile -> predict -> validate loop on tiny real models."""

import json

import pytest
import torch

from specscope.cli import main
from specscope.economics.cost import expected_tree, tree_tau
from specscope.speculative.acceptance import RankCounts
from specscope.economics.tune import AcceptanceModel, CostModel, candidate_configs, predict, rank
from specscope.errors import SpecscopeError
from tiny import make_hf_model, make_tiny_tokenizer

RATES = {1: [0.6, 0.3], 2: [0.5, 0.2]}


def rate(d, r):
    return RATES[min(d, 2)][r - 1]


def test_expected_tree_by_hand():
    # steps 2, topk 2. Level 1: A .6, B .3 (root's top-2). Level 2 expands A and B:
    #   A's children AC .6·.5 = .3, AD .6·.2 = .12; B's children BC .3·.5 = .15, BD .3·.2 = .06.
    # 4 nodes (draft_tokens 5): A .6, B .3, AC .3, BC .15  ->  τ = 1 + .6 + .3 + .3 + .15 = 2.35
    parents, p = expected_tree(rate, 2, 2, 5)
    assert parents == [-1, -1, 0, 1] and p == pytest.approx([0.6, 0.3, 0.5, 0.5])
    assert tree_tau(parents, p) == pytest.approx(2.35)
    # 3 nodes: A, B, AC -> 1 + .6 + .3 + .3 = 2.2
    assert tree_tau(*expected_tree(rate, 2, 2, 4)) == pytest.approx(2.2)
    # topk 1 is the chain A -> AC: 1 + .6 + .3 = 1.9
    assert tree_tau(*expected_tree(rate, 2, 1, 3)) == pytest.approx(1.9)


def test_acceptance_from_rank_counts():
    acc = AcceptanceModel.from_counts([[6, 2], [3, 1]], [[10, 10], [6, 5]])
    assert acc.rates == [pytest.approx([0.6, 0.2]), pytest.approx([0.5, 0.2])]
    assert acc.depth == 2 and acc.max_topk == 2
    assert acc.rate(5, 1) == pytest.approx(0.5)          # deeper than measured: the deepest row
    # exclusive siblings: a sum above 1 (different denominators) is scaled back to 1
    acc = AcceptanceModel.from_counts([[9, 3]], [[10, 5]])
    assert sum(acc.rates[0]) == pytest.approx(1.0)
    # chains use the all-rank-1 path's rates when recorded, deeper rows repeating the last
    acc = AcceptanceModel.from_counts([[6, 2], [3, 1]], [[10, 10], [6, 5]], top_accepted=[6, 4],
                                      top_offered=[10, 5])
    assert acc.chain_rate(2, 1) == pytest.approx(0.8) and acc.chain_rate(4, 1) == pytest.approx(0.8)
    assert acc.rate(2, 1) == pytest.approx(0.5) and acc.chain_rate(2, 2) == pytest.approx(0.2)
    # a rank never offered ends the row; deeper, it borrows the shallower row's rate
    acc = AcceptanceModel.from_counts([[5, 0], [2, 0]], [[10, 3], [5, 0]])
    assert acc.rates == [pytest.approx([0.5, 0.0]), pytest.approx([0.4])] and acc.max_topk == 2
    assert acc.rate(2, 1) == pytest.approx(0.4) and acc.rate(2, 2) == 0.0 and acc.rate(1, 3) == 0.0


def test_rank_counts_on_a_real_tree():
    from specscope.speculative.tree import DraftTree

    # root ─┬─ A(node 0) ─┬─ C(2)        rows are node + 1; accepted path root -> A -> D = rows [0, 1, 4]
    #       │             └─ D(3)
    #       └─ B(1) ─── E(4)
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 1]),
                     torch.tensor([1, 1, 2, 2, 2]))
    rec = RankCounts(steps=3, topk=2)
    rec.add(tree, [0, 1, 4])
    # depth 1: A, B offered, A (rank 1) accepted; depth 2: C, D offered, D (rank 2) accepted; D has no children
    assert rec.offered == [[1, 1], [1, 1], [0, 0]]
    assert rec.accepted == [[1, 0], [0, 1], [0, 0]]
    # along the all-rank-1 path: depth 1 offered + accepted (A), depth 2 offered, rejected (D is rank 2)
    assert rec.top_offered == [1, 1, 0] and rec.top_accepted == [1, 0, 0]
    rec.add(tree, [0])                             # nothing accepted: only depth 1 was offered
    assert rec.offered[0] == [2, 2] and rec.accepted[0] == [1, 0] and rec.tree_sizes == [5, 5]
    assert rec.top_offered == [2, 1, 0] and rec.top_accepted == [1, 0, 0]
    rec.add(DraftTree.empty(), [0])                # nothing proposed counts as a rejected first draft
    assert rec.offered[0] == [3, 2] and rec.top_offered[0] == 3 and rec.accepted[0] == [1, 0]


def _phases(**ms):
    return {k.replace("_", "."): {"mean_ms": v, "median_ms": v, "p90_ms": v, "share": 0.0} for k, v in ms.items()}


def _tree_run():
    return {"id": "spec1", "kind": "speculative",
            "config": {"steps": 3, "topk": 2, "draft_tokens": 6},
            "results": {"acceptance_by_depth_rank": {"accepted": [[60, 20], [40, 10], [20, 5]],
                                                     "offered": [[100, 100], [80, 80], [50, 50]]},
                        "phases": _phases(draft=5.0, draft_step0=2.0, draft_step1=1.2, draft_step2=1.0,
                                          verify=30.0, accept=0.5, commit=0.4, other=0.1),
                        "verify_tokens_mean": 6.0, "mean_context": 200}}


def test_tree_predictions_are_calibrated_to_the_profiled_tree():
    run = _tree_run()
    raw = AcceptanceModel.from_run(run)
    model_tau = tree_tau(*expected_tree(raw.rate, 3, 2, 6))
    run["results"]["accept_length"] = 1 + 0.8 * (model_tau - 1)     # the drafter kept worse nodes than the model
    acc = AcceptanceModel.from_run(run)
    assert acc.tree_scale == pytest.approx(0.8)
    cost = CostModel.from_runs(run, None, decode_ms=25.0)
    assert predict(acc, cost, 3, 2, 6)["tau"] == pytest.approx(run["results"]["accept_length"])
    # chains read the all-rank-1 path, which needs no calibration
    assert predict(acc, cost, 2, 1, 3)["tau"] == pytest.approx(predict(raw, cost, 2, 1, 3)["tau"])


def test_a_priced_run_is_named_in_the_notes():
    run = _tree_run()
    assert not any("priced" in n for n in CostModel.from_runs(run, None, decode_ms=25.0).notes)
    run["config"]["draft_budget"] = "priced"
    assert any("spec1 was priced" in n and "--draft-budget fixed" in n
               for n in CostModel.from_runs(run, None, decode_ms=25.0).notes)


def test_cost_model_reproduces_the_profiled_cycle():
    run = _tree_run()
    cost = CostModel.from_runs(run, {"results": {"decode_ms_per_token": 25.0}})
    acc = AcceptanceModel.from_run(run)
    r = predict(acc, cost, 3, 2, 6)
    # without a verify curve the profiled configuration's cycle is exactly the measured one: 5 + 30 + 1
    assert r["cycle_ms"] == pytest.approx(36.0) and r["verify_tokens"] == 6
    assert r["speedup"] == pytest.approx(r["tau"] * 25.0 / 36.0)
    # a chain drops the per-step width and the selection work with fewer candidates
    c = predict(acc, cost, 2, 1, 99)
    assert c["draft_tokens"] == 3 and c["tau"] == pytest.approx(1 + 0.6 + 0.6 * 0.5)
    assert c["draft_ms"] == pytest.approx(2.0 + 1.1 + (5.0 - 4.2) / 10 * 2)
    assert "no verify curve" in cost.notes[0]


def test_verify_curve_scales_verify_cost():
    from specscope.economics.verify_curve import PiecewiseFit, VerifyCurve

    run = _tree_run()
    curve = VerifyCurve({200: PiecewiseFit(20.0, 2.0, 4.0, 0.0)})     # T(6) = 24, T(3) = 20
    cost = CostModel.from_runs(run, None, curve, decode_ms=25.0)
    acc = AcceptanceModel.from_run(run)
    assert predict(acc, cost, 2, 1, 3)["verify_ms"] == pytest.approx(30.0 * 20 / 24)
    rows = rank(acc, cost, candidate_configs(acc))
    assert rows[0]["speedup"] == max(r["speedup"] for r in rows)
    assert {r["topk"] for r in rows} == {1, 2} and max(r["steps"] for r in rows) == 3


def test_runs_the_tuner_cannot_use():
    run = _tree_run()
    del run["results"]["acceptance_by_depth_rank"]
    with pytest.raises(SpecscopeError, match="without acceptance by sibling rank"):
        AcceptanceModel.from_run(run)
    chain = {"id": "c1", "config": {"steps": 3, "topk": 1},
             "results": {"per_position_acceptance_conditional": [0.7, 0.5, None]}}
    acc = AcceptanceModel.from_run(chain)
    assert acc.rates == [[0.7], [0.5], [0.5]] and candidate_configs(acc) == [(1, 1, 2), (2, 1, 3), (3, 1, 4)]
    with pytest.raises(SpecscopeError, match="--baseline-run ID or --decode-ms"):
        CostModel.from_runs(_tree_run(), None)
    with pytest.raises(SpecscopeError, match="no per-phase timings"):
        CostModel.from_runs({"id": "x", "config": {}, "results": {}}, None, decode_ms=5.0)


def test_tune_cli_errors(capsys):
    with pytest.raises(SystemExit):
        main(["tune"])
    assert "pass --run ID" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--run", "nosuchrun"])
    assert "no run registry at" in capsys.readouterr().err      # reading never creates one
    from specscope.registry import open_registry

    open_registry().close()
    with pytest.raises(SystemExit):
        main(["tune", "--run", "nosuchrun"])
    assert "no run 'nosuchrun'" in capsys.readouterr().err


def _perturbed_copy(src_model, path, noise=0.15, seed=1):
    """A draft model that agrees with the target often but not always."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in src_model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    src_model.save_pretrained(str(path))


def test_profile_predict_validate_tiny(tmp_path, capsys):
    target = tmp_path / "target"
    make_hf_model(target)
    make_tiny_tokenizer(target)
    draft = tmp_path / "draft"
    _perturbed_copy(make_hf_model(tmp_path / "scratch"), draft)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox jumps\nwrite a short poem about the sea\n")
    main(["tune", "--profile", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts),
          "--num-prompts", "1", "--max-new-tokens", "12", "--steps", "3", "--topk", "2", "--draft-tokens", "6",
          "--max-draft-tokens", "6", "--validate", "2", "--device", "cpu", "--plot-dir", str(tmp_path / "plots"),
          "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["run"] and out["baseline_run"] and out["verify_curve"]
    assert "depth and rank" in out["acceptance"]["source"]
    assert len(out["validation"]) == 2
    for v in out["validation"]:
        assert v["measured"] > 0 and v["predicted"] > 0 and 1.0 <= v["measured_tau"] <= v["steps"] + 1
    assert all((tmp_path / "plots" / f).stat().st_size > 5000 for f in ("tau-needed.png",
                                                                       "predicted-vs-measured.png"))
    # the stored profiled run is enough to tune again later, from the registry alone
    main(["tune", "--run", out["run"], "--top", "3"])
    text = capsys.readouterr().out
    assert "best: --steps" in text and "no verify curve" in text
    main(["tune", "--run", out["run"], "--verify-curve", out["verify_curve"], "--json"])
    again = json.loads(capsys.readouterr().out)
    assert again["verify_curve"] == out["verify_curve"] and again["predictions"]


def test_self_drafting_predicts_full_acceptance(tmp_path):
    """Drafting with the target itself: every rank-1 draft is accepted, so predicted τ = steps + 1 and the
    measured τ matches it (up to the last, length-clipped cycle)."""
    from specscope.economics.probe import profile, validate
    from specscope.models import load_model
    from specscope.speculative.decode import SpecConfig, build_drafter

    path = tmp_path / "t"
    make_hf_model(path)
    tgt = load_model(path, dtype="fp32")
    drafter = build_drafter(str(path), tgt)
    ids = [[1, 5, 9, 14, 20, 7]]
    brec, srec = profile(tgt, drafter, ids, SpecConfig(3, 2, 11), 17, [], {"model": str(path)}, record=False)
    acc = AcceptanceModel.from_run(srec)
    assert [row[0] for row in acc.rates] == [1.0, 1.0, 1.0] and acc.rates[0][1] == 0.0
    cost = CostModel.from_runs(srec, brec)
    chain = predict(acc, cost, 3, 1, 4)
    assert chain["tau"] == pytest.approx(4.0)
    (m,) = validate(tgt, drafter, ids, [(3, 1, 4)], 17, [])
    assert m["baseline_ms_per_token"] > 0 and m["measured"] == pytest.approx(m["baseline_ms_per_token"]
                                                                              / m["ms_per_token"])
    assert m["measured_tau"] == pytest.approx(4.0)     # 16 decode tokens = 4 full cycles of 4


def test_recorded_chain_acceptance_reproduces_measured_tau(tmp_path):
    """For a chain, offered(d) = accepted(d-1), so the product of recorded rates telescopes to
    accepted(d)/cycles and the predicted τ of the profiled configuration is exactly the measured one."""
    from specscope.economics.probe import profile
    from specscope.models import load_model
    from specscope.speculative.decode import SpecConfig, build_drafter

    make_hf_model(tmp_path / "t")
    tgt = load_model(tmp_path / "t", dtype="fp32")
    _perturbed_copy(make_hf_model(tmp_path / "scratch"), tmp_path / "d")
    drafter = build_drafter(str(tmp_path / "d"), tgt)
    ids = [[1, 5, 9, 14, 20, 7], [1, 30, 31, 32, 33]]
    _, srec = profile(tgt, drafter, ids, SpecConfig(3, 1, 4), 20, [], {}, record=False)
    counts = srec["results"]["acceptance_by_depth_rank"]
    assert counts["offered"][0][0] == srec["results"]["cycles"]   # every cycle offers a first draft
    assert 1.2 < srec["results"]["accept_length"] < 3.8          # some drafts accepted, not all
    acc = AcceptanceModel.from_run(srec)
    cost = CostModel.from_runs(srec, None, decode_ms=1.0)
    assert predict(acc, cost, 3, 1, 4)["tau"] == pytest.approx(srec["results"]["accept_length"], abs=1e-4)


def test_borrowed_ranks_never_push_siblings_above_one():
    """A well-fed drafter: deep rank 1 is accepted 0.9 of the time, and the deep row never offered ranks 2-3, which
    are borrowed from depth 1. Borrowed as they are, the siblings would sum to 1.3 and tree_tau would refuse the
    tree; scaled to the 0.1 the measured rank leaves, every configuration predicts."""
    acc = AcceptanceModel(rates=[[0.5, 0.3, 0.1], [0.9]])
    assert acc.row(1) == [0.5, 0.3, 0.1]
    assert acc.row(2) == pytest.approx([0.9, 0.075, 0.025])
    assert acc.rate(2, 1) == 0.9 and acc.rate(2, 3) == pytest.approx(0.025) and acc.rate(2, 4) == 0.0
    assert acc.row(5) == acc.row(2)                               # deeper than measured: the deepest row
    assert AcceptanceModel(rates=[[0.5, 0.3, 0.1], [0.4]]).row(2) == [0.4, 0.3, 0.1]   # room enough: as measured
    cost = CostModel(decode_ms=10.0, step0_ms=1.0, expand_ms=1.0, select_ms=0.0, verify_ms=12.0, other_ms=0.5,
                     k0=3, n0=8.0, context=100.0)
    for c in candidate_configs(acc, max_steps=4):
        r = predict(acc, cost, *c)
        assert 1.0 <= r["tau"] <= c[0] + 1


# ------------------------------------------------------------------------------------------------ hybrids

def _hybrid_run():
    """A hybrid run (steps 3, topk 2, 6 draft tokens, 4 n-gram tokens): cycles "mode,a_d,a_c,c_len,c_new"."""
    run = _tree_run()
    run["config"]["ngram_tokens"] = 4
    run["results"]["hybrid_cycles"] = {
        "tree,2,0,4,4": 10,     # the copy was wrong from its first token: the drafter's 2 stand
        "tree,1,3,4,3": 10,     # shared its first node, then 2 more accepted from the copy alone
        "tree,0,0,0,0": 10,     # no copy offered
        "copy,0,8,9,9": 10,     # long copies, drafter skipped: 8 of 9 accepted
    }
    return run


def test_hybrid_model_reads_what_the_copy_added():
    from specscope.economics.tune import HybridModel

    hyb = HybridModel.from_run(_hybrid_run())
    assert hyb.ngram_tokens == 4 and hyb.copy_budget == 9 and hyb.copy_share == pytest.approx(0.25)
    assert hyb.drafted_tau == pytest.approx(1 + (2 + 1 + 0) / 3)
    # a copy of L tokens: its first L are exact truncations of the recorded ones
    assert [hyb.tree_gain(L) for L in range(5)] == pytest.approx([0, 0, 1 / 3, 2 / 3, 2 / 3])
    assert [hyb.tree_nodes(L) for L in range(5)] == pytest.approx([0, 1 / 3, 3 / 3, 5 / 3, 7 / 3])
    assert hyb.copy_tau(9) == 9 and hyb.copy_tau(5) == 6 and hyb.copy_rows(5) == 6


def test_hybrid_predictions_price_copies_at_verify_cost_only():
    from specscope.economics.tune import HybridModel, hybrid_configs
    from specscope.economics.verify_curve import PiecewiseFit, VerifyCurve

    run = _hybrid_run()
    hyb = HybridModel.from_run(run)
    acc = AcceptanceModel.from_run(run)
    flat = CostModel.from_runs(run, None, decode_ms=25.0).drafted_only(1 - hyb.copy_share)
    assert flat.step0_ms == pytest.approx(2.0 / 0.75)          # the drafter ran in 3 of 4 cycles
    r0, r4 = (predict(acc, flat, 3, 2, 6, L, hyb) for L in (0, 4))
    assert r4["draft_ms"] == r0["draft_ms"] == pytest.approx(0.75 * predict(acc, flat, 3, 2, 6)["draft_ms"])
    # tree cycles gain 2/3 from a 4-token copy; copy cycles verify chains of 5 + L: 6 tokens at L 0, 9 at L 4
    assert r4["tau"] - r0["tau"] == pytest.approx(0.75 * 2 / 3 + 0.25 * (9 - 6))
    # without a curve verify is flat, so a longer copy only gains; a steep curve makes its rows cost
    by_L = sorted(rank(acc, flat, hybrid_configs([(3, 2, 6)], hyb), hyb), key=lambda r: r["ngram_tokens"])
    assert [r["ngram_tokens"] for r in by_L] == [0, 1, 2, 3, 4]
    assert [r["speedup"] for r in by_L] == sorted(r["speedup"] for r in by_L)
    assert by_L[0]["speedup"] < by_L[4]["speedup"]
    steep = VerifyCurve({200: PiecewiseFit(20.0, 1.0, 1.0, 8.0)})
    cost = CostModel.from_runs(run, None, steep, decode_ms=25.0).drafted_only(0.75)
    rows = rank(acc, cost, hybrid_configs([(3, 2, 6)], hyb), hyb)
    assert rows[0]["ngram_tokens"] < 4
    verify = [r["verify_ms"] for r in sorted(rows, key=lambda r: r["ngram_tokens"])]
    assert verify == sorted(verify) and verify[0] < verify[-1]
    # the drafter's own τ, not the copy's gains, calibrates its tree
    assert acc.tree_scale == AcceptanceModel.from_run({**run, "results": {**run["results"],
                                                                          "accept_length": 99.0}}).tree_scale


def test_breakeven_bounds_a_hybrid_by_its_copy_chain():
    from specscope.economics.breakeven import BreakevenInputs, breakeven, inputs_from_runs

    run = _hybrid_run()
    run["results"]["accept_length"] = 4.5          # more than steps + 1: copy cycles verify chains of 9
    inp = inputs_from_runs(run, {"id": "b", "results": {"decode_ms_per_token": 25.0}}, BreakevenInputs())
    assert inp.steps == 9 and breakeven(inp)["max_accept_length"] == 10


def test_profile_and_tune_a_hybrid_tiny(tmp_path, capsys):
    target = tmp_path / "target"
    make_hf_model(target)
    make_tiny_tokenizer(target)
    draft = tmp_path / "draft"
    _perturbed_copy(make_hf_model(tmp_path / "scratch"), draft)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the the quick brown fox the quick brown fox jumps the quick\n")
    main(["tune", "--profile", "--model", str(target), "--draft", f"{draft}+ngram", "--prompts", str(prompts),
          "--num-prompts", "1", "--max-new-tokens", "16", "--steps", "2", "--topk", "2", "--draft-tokens", "4",
          "--ngram-tokens", "3", "--max-draft-tokens", "4", "--max-steps", "2", "--validate", "1",
          "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    preds = out["predictions"]
    assert {p["ngram_tokens"] for p in preds} <= {0, 1, 2, 3} and all("copy_share" in p for p in preds)
    v = out["validation"][0]
    assert v["ngram_tokens"] == preds[0]["ngram_tokens"] and v["measured_tau"] >= 1.0
    main(["tune", "--run", out["run"], "--top", "3"])
    assert "--ngram-tokens" in capsys.readouterr().out
