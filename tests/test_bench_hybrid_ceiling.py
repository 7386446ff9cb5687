"""bench/hybrid_ceiling.py's arithmetic: accepted paths, the hindsight oracle (a dynamic programme, checked against
brute force and against every fixed method), and the priced rule replayed on recorded positions."""

import itertools
import math
import random

from bench_util import load_bench

hc = load_bench("hybrid_ceiling")


def costs(decode=10.0, per_row=1.5, draft=2.0, overhead=0.5):
    curve = {n: decode + per_row * (n - 1) for n in (1, 2, 4, 8, 16, 24)}
    return hc.prompt_costs({"verify_ms": curve, "draft_ms": [draft]}, overhead)


def random_row(rng):
    """One position: a copy (maybe none), and one drafted tree with its accepted and shared paths."""
    copy_len = rng.choice([0, 0, 2, 5, 8])
    copy_acc = rng.randint(0, copy_len)
    pars = [-1, -1, 0, 0, 1, 2, 4]
    scores, depth = [], []
    for i, q in enumerate(pars):
        depth.append(1 if q < 0 else depth[q] + 1)
        scores.append((scores[q] if q >= 0 else 0.0) + math.log(rng.uniform(0.05, 0.9)))
    path = [[], [0], [0, 2], [1, 4, 6], [0, 3]][rng.randrange(5)]
    shared = [[], [0], [0, 2], [1]][rng.randrange(4)][:copy_len]
    return {"copy_len": copy_len, "match": rng.randint(1, 6) if copy_len else 0, "copy_acc": copy_acc,
            "trees": [{"size": len(pars), "acc": len(path), "shared": len(shared), "ms": 2.0, "parents": pars,
                       "scores": scores, "path": path, "shared_path": shared}]}


def test_accepted_path_walks_the_tree_along_the_truth():
    toks, pars = [5, 6, 7, 8, 9], [-1, -1, 0, 0, 2]      # 5 -> {7, 8}, 6; 7 -> 9
    assert hc.accepted_path(toks, pars, [5, 7, 9, 1]) == [0, 2, 4]
    assert hc.accepted_path(toks, pars, [6, 7]) == [1]
    assert hc.accepted_path(toks, pars, [4]) == [] and hc.accepted(toks, pars, [5, 8]) == 2


def test_oracle_is_the_least_cost_over_every_choice_sequence():
    rng = random.Random(0)
    c = costs()
    for _ in range(30):
        rows = [random_row(rng) for _ in range(rng.randint(1, 5))]

        def brute(i):
            if i >= len(rows):
                return 0.0
            return min(ms + brute(i + 1 + acc) for acc, ms in hc.options(rows[i], c, prune=True, oracle=True))

        assert math.isclose(hc.best_cost(rows, c, prune=True), brute(0))
        # no fixed method, nor the replayed rule, beats hindsight
        for choose in hc.methods_for([type("S", (), {"steps": 2, "topk": 4, "draft_tokens": 8})()], 8).values():
            assert hc.fixed_cost(rows, lambda row: choose(row, c)) >= hc.best_cost(rows, c, prune=True) - 1e-9
        assert hc.best_cost(rows, c, prune=True) <= hc.best_cost(rows, c, prune=False) + 1e-9


def test_priced_rule_accepts_only_what_it_verified():
    from specscope.speculative.budget import FixedPrices, Prices

    rng = random.Random(1)
    for copy in (True, False):
        rule = hc.PricedRule(0, 13, copy=copy)
        c = costs(per_row=4.0)
        prices = FixedPrices(Prices({n: c["verify"](n) / c["decode_ms"] for n in range(1, 25)}, c["decode_ms"]))
        drafted = sat_out = 0
        for _ in range(300):
            row = random_row(rng)
            acc, ms = rule.cycle(row, c, prices)
            t = row["trees"][0]
            assert 0 <= acc <= max(t["acc"], min(row["copy_acc"], row["copy_len"]) if copy else 0)
            assert ms >= c["decode_ms"] - 1e-9
            drafted, sat_out = sum(rule.rule.tree_stats.count[True]), sum(rule.rule.tree_stats.count[False])
        assert drafted > 0 and sat_out > 0        # both choices were taken


def test_calibration_counts_nodes_whose_parent_was_accepted():
    rec = {"rows": [{"trees": [{"parents": [-1, -1, 0], "scores": [math.log(0.8), math.log(0.1), math.log(0.4)],
                                "path": [0, 2]}]},
                    {"trees": [{"parents": [-1, -1, 0], "scores": [math.log(0.8), math.log(0.1), math.log(0.4)],
                                "path": [1]}]}]}
    cal = hc.calibration([rec])
    top = next(c for c in cal[1] if c["q_from"] == 0.75)
    assert top["nodes"] == 2 and top["accepted"] == 0.5
    assert [c["nodes"] for c in cal[2]] == [1]       # the depth-2 node counts only where its parent was accepted
    assert cal[2][0]["q_from"] == 0.45 and cal[2][0]["accepted"] == 1.0
