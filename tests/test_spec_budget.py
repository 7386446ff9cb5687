"""Cost-aware draft budgets (speculative/budget.py): the pieces, and the priced n-gram, hybrid and model-alone
drafters, which choose per cycle which nodes are verified and must still give plain greedy decoding's output. Their sampling side
is in test_spec_sampling.py."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from specscope.generate import generate
from specscope.economics.prices import host_prices, measure_prices, prices_path
from specscope.speculative.budget import (Calibration, CopyStats, LivePrices, Prices, TreeStats, best_copy,
                                          best_nodes, copy_value, node_probs)
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import DraftModelDrafter, Eagle3TreeDrafter
from specscope.speculative.hybrid import HybridDrafter, NgramDrafter, PricedDrafter
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree
from spec_helpers import check_grid, tiny_target
from test_spec_hybrid import CTX, FuzzSource, _prompt, eagle, hybrid_cases, target  # noqa: F401 (fixtures)

FLAT = Prices({1: 1.0, 16: 1.0}, 10.0)                 # a GPU below its knee: rows are free
STEEP = Prices({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6}, 10.0)  # a 2-core CPU: every row costs


# ------------------------------------------------------------------------------------------------ the pieces

def test_prices_interpolate_and_extend_the_last_slope():
    p = Prices({1: 1.0, 3: 1.2, 5: 2.0}, 4.0)
    assert p.verify(1) == 1.0 and p.verify(0.5) == 1.0
    assert p.verify(2) == pytest.approx(1.1) and p.verify(4) == pytest.approx(1.6)
    assert p.verify(7) == pytest.approx(2.8)
    assert Prices.from_dict(p.to_dict()) == p


def test_live_prices_follow_the_run_and_start_from_the_measured_curve():
    base = Prices({1: 1.0, 4: 1.3, 8: 1.7, 16: 2.5}, 10.0)
    live = LivePrices(base)
    assert live.verify(1) == 1.0 and live.verify(8) == pytest.approx(1.7, abs=0.08)   # the prior's fit
    rng = random.Random(1)
    for _ in range(300):                          # the machine changed: T(n) = 20 + 0.5 n ms
        n = rng.randint(1, 14)
        live.observe(n, 20 + 0.5 * n + rng.uniform(-0.3, 0.3))
    assert live.decode_ms == pytest.approx(20.5, abs=0.3)
    assert live.verify(11) == pytest.approx(25.5 / 20.5, abs=0.03)
    assert live.verify(0.5) == 1.0               # never below a plain step
    cheap = LivePrices(base)
    for _ in range(50):
        cheap.observe(4, 0.0)                     # nonsense: the measured curve's scale stays
    assert cheap.decode_ms > 0 and cheap.verify(8) >= 1.0


def test_copy_stats_count_only_the_depths_a_copy_reached():
    s = CopyStats(prior=0.5, strength=2.0)
    assert s.rates(1, 3) == [0.5, 0.5, 0.5]
    for _ in range(8):
        s.update(1, offered=4, accepted=1)        # depth 1 taken, depth 2 refused, depths 3-4 never judged
    r = s.rates(1, 4)
    assert r[0] == pytest.approx((8 + 1) / (8 + 2)) and r[1] == pytest.approx((0 + 2 * r[0]) / (8 + 2))
    assert s.trials[1][2:4] == [0, 0] and r[2] == pytest.approx(r[1])   # unjudged depths borrow the one above
    s.update(2, offered=3, accepted=3)            # all taken: no refusal counted past the copy
    assert s.trials[2][:4] == [1, 1, 1, 0] and s.hits[2][:3] == [1, 1, 1]
    assert s.rates(3, 5) == [0.5] * 5             # classes are apart
    assert CopyStats.match_class(7, 3) == 4 and CopyStats.match_class(0, 3) == 1 and CopyStats.match_class(5, 0) == 0


def test_best_copy_follows_the_prices():
    sure = [0.95] * 12
    assert best_copy(sure, FLAT, 12)[0] == 12                 # free rows: the whole copy
    likely = [0.8] * 12
    L, v = best_copy(likely, STEEP, 12)
    assert 1 <= L < 12 and v == pytest.approx(copy_value(likely, STEEP, L))
    assert all(copy_value(likely, STEEP, m) <= v + 1e-12 for m in range(13))
    assert best_copy([0.0] * 5, STEEP, 5) == (0, 1.0)         # a worthless copy: a plain step
    assert best_copy([0.3] * 5, STEEP, 5)[0] == 1             # (1 + 0.3) / 1.05 beats a plain step; 2 does not
    assert best_copy([0.3] * 5, Prices({1: 1.0, 2: 1.4}, 1.0), 5)[0] == 0   # 1.3 tokens for 1.4 steps


def test_best_nodes_keeps_a_closed_tree_of_the_best_value():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 12)
        parents, depth, probs = [], [], []
        for i in range(n):
            p = rng.randint(-1, i - 1)
            parents.append(p)
            depth.append(1 if p < 0 else depth[p] + 1)
            probs.append(rng.random() * (probs[p] if p >= 0 else 1.0))
        prices, fixed, limit = rng.choice([FLAT, STEEP]), rng.random(), rng.choice([None, 1, 3, 20])
        keep, v = best_nodes(probs, parents, depth, prices, fixed_cost=fixed, limit=limit)
        assert limit is None or len(keep) <= limit
        value = lambda ks: (1 + sum(probs[i] for i in ks)) / (fixed + prices.verify(1 + len(ks)))   # noqa: E731
        assert len(set(keep)) == len(keep) and v == pytest.approx(value(keep))
        assert all(parents[i] == -1 or parents[i] in keep for i in keep)
        if n <= 9:                                # the best of every closed subset, by brute force
            closed = [[i for i in range(n) if m >> i & 1] for m in range(1 << n)]
            closed = [ks for ks in closed if all(parents[i] == -1 or parents[i] in ks for i in ks)
                      and (limit is None or len(ks) <= limit)]
            assert v >= max(map(value, closed)) - 1e-9
        if prices is FLAT and limit is None:      # free rows: every node with a chance is worth its row
            assert set(keep) >= {i for i in range(n) if probs[i] > 0}


def test_node_probs_take_the_better_source_and_never_exceed_the_parent():
    # root -> a (drafted, p=e^-0.1) -> b (both); root -> c (copied only: depth 1)... copied chain is [a, b]
    t = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 1]),
                  scores=[-0.1, -3.0, -0.5])
    g = t.graft([5, 6, 9])                       # the copy walks a -> b, then adds 9 under b
    assert g.sources == [DRAFTED | COPIED, DRAFTED | COPIED, DRAFTED, COPIED]
    assert g.scores[:3] == [-0.1, -3.0, -0.5] and g.scores[3] == float("-inf")
    p = node_probs(g, [0.5, 0.9, 0.9], Calibration())
    assert p[0] == pytest.approx(max(math.exp(-0.1), 0.5))
    assert p[1] == pytest.approx(max(math.exp(-3.0), 0.45))
    assert p[2] == pytest.approx(math.exp(-0.5))
    assert p[3] == pytest.approx(0.5 * 0.9 * 0.9)
    c = Calibration()
    for _ in range(50):
        c.update(1, 0.8, False)                  # the drafter claims 0.8 at depth 1 and is never right
    assert node_probs(g, [0.0] * 3, c)[2] < 0.05


def test_subset_keeps_order_ranks_sources_scores_and_q():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]),
                  q=torch.rand(2, 10), sources=[DRAFTED, DRAFTED, COPIED, COPIED], scores=[-1.0, -2.0, -3.0, -4.0])
    s = t.subset([2, 0, 1])
    assert s.tokens.tolist() == [5, 6, 7] and s.parents.tolist() == [-1, -1, 0] and s.depth.tolist() == [1, 1, 2]
    assert s.sources == [DRAFTED, DRAFTED, COPIED] and s.scores == [-1.0, -2.0, -3.0]
    assert torch.equal(s.q, t.q)
    s = t.subset([1])
    assert s.parents.tolist() == [-1] and torch.equal(s.q, t.q[1:2])
    assert t.subset([]).size == 0
    with pytest.raises(ValueError, match="parent"):
        t.subset([3])


def test_tree_stats_drafts_where_faster_and_probes():
    s = TreeStats(probe=3)
    assert s.wants(1)                             # nothing known: draft
    s.add(1, True, tokens=2, ms=20.0)             # 0.1 tokens/ms
    assert not s.wants(1)                         # sitting out not tried yet
    s.add(1, False, tokens=1, ms=5.0)             # 0.2 tokens/ms: faster
    # half the rate: tried again after probe x (1 + 8 x 0.5) = 15 cycles; at equal rates after probe = 3
    assert [s.wants(1) for _ in range(32)] == ([False] * 15 + [True]) * 2
    s.add(3, True, tokens=2, ms=10.0)
    s.add(3, False, tokens=2, ms=10.0)
    assert [s.wants(3) for _ in range(8)] == [False, False, False, True, False, False, False, True]
    s.add(1, True, tokens=4, ms=20.0)             # the plain mean of the first cycles: 3 tokens, 20 ms
    assert s.value(1, True) == pytest.approx(0.15) and s.value(2, True) is None
    for _ in range(200):
        s.add(1, True, tokens=10, ms=20.0)        # then a running mean: drafting became the faster choice
    assert s.value(1, True) > 0.45 and s.wants(1)


def test_measure_prices_on_a_tiny_model(tmp_path):
    target = tiny_target(tmp_path, layers=2)
    p = measure_prices(target, context=16, rows=(1, 2, 4), repeats=3)
    assert sorted(p.verify_ratio) == [1, 2, 4] and p.verify_ratio[1] == 1.0 and p.decode_ms > 0
    assert p.verify_ratio[1] <= p.verify_ratio[2] <= p.verify_ratio[4]
    short = tiny_target(tmp_path / "short", layers=1, max_position_embeddings=12)
    assert max(measure_prices(short, repeats=1).verify_ratio) < 12     # context and rows fit the model's


def test_host_prices_are_cached_and_a_corrupt_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    target = tiny_target(tmp_path, layers=1, max_position_embeddings=40)
    notes = []
    p = host_prices(target, notes.append)
    path = prices_path(target)
    assert path.is_file() and Prices.from_dict(json.loads(path.read_text())) == p and len(notes) == 1
    assert host_prices(target, notes.append) == p and len(notes) == 1          # read, not measured
    for bad in ("{not json", '{"verify_ratio": {}, "decode_ms": 3}', '{"verify_ratio": {"1": -1}, "decode_ms": 3}'):
        path.write_text(bad)
        assert host_prices(target, notes.append).verify_ratio[1] == 1.0
        assert Prices.from_dict(json.loads(path.read_text())).decode_ms > 0    # rewritten whole


@pytest.mark.parametrize("bad", [
    '{"verify_ratio": [1, 2], "decode_ms": 1}',                  # parsed, wrong shape: was an AttributeError
    '{"verify_ratio": {"1": 1.0}, "decode_ms": 1.0}',            # a curve with no key: was an IndexError
    '{"verify_ratio": {"1": 1.0, "2": 1.1}, "decode_ms": 1.0, "key": "another model"}',
    '{"verify_ratio": {"0": 1.0, "1": 1.0}, "decode_ms": 1.0}', "[]", "null", "{not json", "dir"])
def test_a_bad_price_file_is_measured_again_once_with_one_warning(tmp_path, monkeypatch, capsys, bad):
    from specscope import cachedir

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    target = tiny_target(tmp_path, layers=1, max_position_embeddings=40)
    capsys.readouterr()                                                      # the model writer's progress bar
    path = prices_path(target)
    path.parent.mkdir(parents=True)
    if bad == "dir":
        path.mkdir()
        (path / "x").write_text("x")
    else:
        path.write_text(bad)
    p = host_prices(target)
    assert p.verify(1) == 1.0 and p.verify(64) >= p.verify(2) > 0
    (w,) = capsys.readouterr().err.splitlines()
    assert w.startswith(f"warning: the cached verify prices {path} is unusable (") and w.endswith("measuring them again")
    assert sorted(f.name for f in path.parent.iterdir()) == [path.name]     # rewritten whole, no temp file left
    assert host_prices(target) == p and capsys.readouterr().err == ""        # healed: read, silently


def test_a_one_point_curve_prices_each_further_row_as_a_step():
    one = Prices({1: 1.0}, 10.0)
    assert one.verify(1) == 1.0 and one.verify(4) == 4.0
    with pytest.raises(ValueError, match="verify_ratio must be an object"):
        Prices.from_dict({"verify_ratio": [1, 2], "decode_ms": 1})
    with pytest.raises(ValueError, match="must start at 1 row"):
        Prices.from_dict({"verify_ratio": {"2": 1.0}, "decode_ms": 1})


# ------------------------------------------------------------------------------------------------ greedy property

def test_priced_drafters_equal_greedy(target, eagle, monkeypatch):
    """Priced at flat and steep verify costs, with the real suffix source and the lying one, and each drafter kept
    across cases (its counts carry over, as in a server): greedy output is plain greedy decoding's, and the runs
    took every path -- copy-only cycles, plain steps, pruned and grafted trees."""
    counter = iter(range(10 ** 6))
    kept: dict = {}

    def hybrid(prices, src):
        key = ("h", id(prices), src)
        if key not in kept:
            kept[key] = HybridDrafter(Eagle3TreeDrafter(eagle, target), CTX, prices=prices, live=prices is not FLAT)
        h = kept[key]
        if src == "fuzz":
            h.source = FuzzSource(target, next(counter))
        return h

    def ngram(prices):
        return kept.setdefault(("n", id(prices)), NgramDrafter(target.device, prices=prices, live=prices is not FLAT))

    drafters = {f"priced-{pn}+{src}": (lambda p=p, src=src: hybrid(p, src))
                for pn, p in (("flat", FLAT), ("steep", STEEP)) for src in ("suffix", "fuzz")}
    ngrams = {f"ngram-{pn}": (lambda p=p: ngram(p)) for pn, p in (("flat", FLAT), ("steep", STEEP))}
    seen = {"copy_only": 0, "plain": 0, "tree": 0, "pruned": 0, "grafted": 0}
    orig = HybridDrafter._priced

    def spy(self, cfg, *a):
        tree = yield from orig(self, cfg, *a)
        cost = self._cycle[2]
        src = tree.node_sources()
        if cost is None:
            seen["copy_only" if tree.size else "plain"] += 1
        else:
            seen["tree"] += 1
            seen["pruned"] += sum(1 for x in src if x & DRAFTED) < cfg.draft_tokens - 1
            seen["grafted"] += any(x == COPIED for x in src)
        return tree

    monkeypatch.setattr(HybridDrafter, "_priced", spy)
    cases = hybrid_cases(16, 41, [1, 3, 6], rng_seed=7)
    stats = check_grid(target, drafters, cases, _prompt)
    chains = [(SpecConfig(max(1, c.draft_tokens - 1), 1, max(2, c.draft_tokens)), T, m) for c, T, m in cases]
    stats.update(check_grid(target, ngrams, chains, _prompt))
    assert all(s["accepted"] > 0 for s in stats.values()), stats
    assert all(v >= 3 for v in seen.values()), seen


def test_priced_ngram_verifies_less_where_rows_cost_more(target):
    p = _prompt(30, seed=4)
    want = generate(target, p, 16, stop_ids=[]).token_ids
    rows = {}
    for name, prices in (("flat", FLAT), ("steep", STEEP)):
        d = NgramDrafter(target.device, prices=prices, live=False)
        res = speculative_generate(target, d, p, 16, stop_ids=[], cfg=SpecConfig(12, 1, 13))
        assert res.token_ids == want
        rows[name] = res.stats.verify_tokens_mean
    assert rows["steep"] < rows["flat"], rows


def test_priced_model_drafter_alone_equals_greedy_and_prunes(target, eagle):
    """EAGLE-3 alone under the priced rule (no copy): greedy output is plain greedy decoding's at flat and steep
    prices, it reports as the model drafter (no per-source counts), and where rows cost more it verifies fewer
    nodes than the declared shape."""
    kept = {pn: PricedDrafter(Eagle3TreeDrafter(eagle, target), CTX, p, live=False)
            for pn, p in (("flat", FLAT), ("steep", STEEP))}
    assert all(d.kind == "eagle3" and d.model_kind is None for d in kept.values())
    # and a separate draft model (the target drafting for itself) under the same rule
    own = PricedDrafter(DraftModelDrafter(target, target), CTX, STEEP, live=False)
    cases = [(c, T, m) for c, T, m in hybrid_cases(10, 43, [0], rng_seed=3)]
    stats = check_grid(target, {**{f"alone-{pn}": (lambda d=d: d) for pn, d in kept.items()},
                                "alone-draft-model": lambda: own}, cases, _prompt)
    assert own.kind == "draft_model" and sum(own.rule.tree_stats.count[True]) > 0
    assert all(s["accepted"] > 0 for s in stats.values()), stats
    assert sum(kept["steep"].rule.tree_stats.count[True]) > 0      # it drafted, priced trees
    p = _prompt(20, seed=5)
    want = generate(target, p, 20, stop_ids=[]).token_ids
    rows = {}
    for pn, d in kept.items():
        res = speculative_generate(target, d, p, 20, stop_ids=[], cfg=SpecConfig(3, 4, 12))
        assert res.token_ids == want and res.stats.accepted_by_source is None
        rows[pn] = res.stats.verify_tokens_mean
    assert rows["steep"] < 12 and rows["steep"] <= rows["flat"], rows
    with pytest.raises(ValueError, match="prices"):
        HybridDrafter(Eagle3TreeDrafter(eagle, target), CTX, source=None)
