"""Speculative sampling preserves the target distribution (chi-square on a tiny vocabulary).

We compute the exact joint distribution of generated tokens 2 and 3 from the target (tokens after the first come
from speculative cycles), sample them many times with fixed seeds, and test the counts against it. A deliberately
broken acceptance rule must fail the same test, which shows the test has the power to catch a wrong rule.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import specscope.speculative.acceptance as acceptance_mod
from specscope.generate import generate
from specscope.runtime.sampling import SamplingParams, probs_from_logits
from specscope.speculative.acceptance import accept_sampling
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.budget import Prices
from specscope.speculative.drafters import Eagle3TreeDrafter
from specscope.speculative.hybrid import CopyFirstHybrid, HybridDrafter, PricedDrafter
from spec_helpers import random_eagle3, tiny_target

V = 6
PROMPT = [1, 4, 2, 5]
N = 800
SP = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("t"), vocab=V, hidden=16, layers=2, seed=3)


def exact_pair_dist(target):
    """P(t2, t3) = Σ_t1 P(t1) P(t2|t1) P(t3|t1,t2), by brute force over all continuations."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=2)])
    pos = torch.arange(seqs.shape[1])[None].expand_as(seqs)
    with torch.no_grad():
        probs = probs_from_logits(target(seqs, pos).logits, SP)  # [V*V, T+2, V]
    T = len(PROMPT)
    p1 = probs[0, T - 1]
    joint = torch.zeros(V, V)
    for i, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        pa_b = p1[a] * probs[i, T, b]
        joint[b] += pa_b * probs[i, T + 1]  # marginalise t1 = a
    return joint.flatten().double()


def sample_pairs(target, drafter_factory, cfg, seed0=0):
    counts = torch.zeros(V * V)
    for s in range(N):
        sp = SamplingParams(temperature=1.0, seed=seed0 + s)
        res = speculative_generate(target, drafter_factory(), PROMPT, 3, sp, stop_ids=[], cfg=cfg)
        counts[res.token_ids[1] * V + res.token_ids[2]] += 1
    return counts


def chi2_p(counts, probs):
    counts = counts.double()
    exp = probs / probs.sum() * counts.sum()
    keep = exp > 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).numpy()
    ex = torch.cat([exp[keep], exp[~keep].sum()[None]]).numpy()
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    ex = ex * obs.sum() / ex.sum()
    return chisquare(obs, ex).pvalue


CASES = {"chain_q": SpecConfig(2, 1, 3), "tree": SpecConfig(2, 2, 5),
         # the hybrid: a copy grafted onto a top-k tree, and onto a chain sampled from q (siblings with q and
         # one-hot siblings under one node; merged nodes keep q), with copy-only cycles between
         "hybrid_tree": SpecConfig(2, 2, 5, 3), "hybrid_chain_q": SpecConfig(2, 1, 3, 2),
         # priced (speculative/budget.py): each cycle verifies a subset of those nodes, chosen by past acceptance
         # and row costs, and some cycles only the copy or nothing; one drafter across samples, as in a server
         "hybrid_priced_tree": SpecConfig(2, 2, 5, 3), "hybrid_priced_chain_q": SpecConfig(2, 1, 3, 2),
         # the drafter alone under the priced rule (no copy): pruned trees and plain steps
         "priced_tree": SpecConfig(2, 2, 5), "priced_chain_q": SpecConfig(2, 1, 3)}
PRICES = Prices({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, 10.0)
PRICED: dict = {}


class ContextCopy:
    """A deterministic n-gram source over a 6-token vocabulary: its proposals are a function of the context,
    collide with the drafter's often, and every third context is a 'long match' (the drafter sits out)."""

    def reset(self, tokens):
        self.tokens = list(tokens)

    def extend(self, tokens):
        self.tokens += tokens

    def propose(self, k):
        h = sum((i + 1) * t for i, t in enumerate(self.tokens[-3:]))
        return [(h + 2 * i) % V for i in range(k)], 4 if h % 3 == 0 else 1


def drafter_for(target, d, name):
    if name.startswith("priced"):
        h = PricedDrafter(Eagle3TreeDrafter(d, target), target.config.max_position_embeddings, PRICES)
        PRICED[name] = h
        return lambda: h
    if not name.startswith("hybrid"):
        return lambda: Eagle3TreeDrafter(d, target)

    def make():
        h = CopyFirstHybrid(Eagle3TreeDrafter(d, target), target.config.max_position_embeddings)
        h.source = ContextCopy()
        return h
    if "priced" in name:
        h = HybridDrafter(Eagle3TreeDrafter(d, target), target.config.max_position_embeddings, prices=PRICES)
        h.source = ContextCopy()
        PRICED[name] = h
        return lambda: h
    return make


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_target(target, name):
    d = random_eagle3(target, draft_vocab=5, seed=1, scale=4.0)
    probs = exact_pair_dist(target)
    counts = sample_pairs(target, drafter_for(target, d, name), CASES[name])
    assert chi2_p(counts, probs) > 1e-3
    if name in PRICED:       # both choices were taken: drafted (and priced) trees, and cycles without the drafter
        ts = PRICED[name].rule.tree_stats
        assert sum(ts.count[True]) >= 20 and sum(ts.count[False]) >= 20, ts.count


def test_baseline_sampling_matches_target(target):
    probs = exact_pair_dist(target)
    counts = torch.zeros(V * V)
    for s in range(N):
        r = generate(target, PROMPT, 3, SamplingParams(temperature=1.0, seed=s), stop_ids=[])
        counts[r.token_ids[1] * V + r.token_ids[2]] += 1
    assert chi2_p(counts, probs) > 1e-3


def _broken_accept(target_probs, tree, gen):
    """Wrong: accept every draft token (as greedy acceptance of sampled drafts would)."""
    rows = [0]
    kids = tree.children()
    cur = 0
    while kids[cur]:
        cur = kids[cur][0]
        rows.append(cur)
    return rows, int(torch.multinomial(target_probs[cur], 1, generator=gen))


def _broken_residual(target_probs, tree, gen):
    """Wrong: min(1, p/q) acceptance but resampling from p instead of norm(max(p - q, 0)) on rejection."""
    from specscope.speculative.tree import DraftTree

    if tree.q is None:
        return accept_sampling(target_probs, tree, gen)
    kids, toks = tree.children(), tree.tokens.tolist()
    rows, cur = [0], 0
    while kids[cur]:
        c = kids[cur][0]
        p, q = target_probs[cur], tree.q[c - 1]
        x = toks[c - 1]
        if float(torch.rand(1, generator=gen)) < min(1.0, float(p[x] / q[x])):
            rows.append(c)
            cur = c
        else:
            return rows, int(torch.multinomial(p, 1, generator=gen))
    return rows, int(torch.multinomial(target_probs[cur], 1, generator=gen))


def _broken_siblings(target_probs, tree, gen):
    """Wrong: each sibling tried against the target's p itself, not against what the rejected siblings before it
    leave (as if a copied token were an independent proposal)."""
    kids, toks = tree.children(), tree.tokens.tolist()
    rows, cur = [0], 0
    while kids[cur]:
        p0, acc = target_probs[cur], None
        p = p0.clone()
        for c in kids[cur]:
            x = toks[c - 1]
            q = tree.q[c - 1] if tree.q is not None and c - 1 < tree.q.shape[0] else None
            qx = 1.0 if q is None else float(q[x])
            if float(torch.rand(1, generator=gen)) < min(1.0, float(p0[x]) / qx):
                acc = c
                break
            p = torch.clamp(p - q, min=0) if q is not None else p.index_fill(0, torch.tensor([x]), 0.0)
        if acc is None:
            return rows, int(torch.multinomial(p / p.sum(), 1, generator=gen))
        rows.append(acc)
        cur = acc
    return rows, int(torch.multinomial(target_probs[cur], 1, generator=gen))


def _broken_merged(target_probs, tree, gen):
    """Wrong: a node both sampled by the drafter and copied judged as a copy (one-hot q) instead of by its q."""
    from specscope.speculative.tree import COPIED, DraftTree

    q = tree.q.clone()
    for i in range(q.shape[0]):
        if tree.sources[i] & COPIED:
            q[i] = torch.nn.functional.one_hot(tree.tokens[i], q.shape[1]).to(q.dtype)
    return accept_sampling(target_probs, DraftTree(tree.tokens, tree.parents, tree.depth, q, tree.sources), gen)


MIXED_V = 6


def mixed_tree_pairs(rule, n=20000):
    """Counts of the first two output tokens of one cycle over a mixed tree: a chain sampled from q (x, then y)
    with the copy [1, 4] grafted on — a one-hot sibling of x, or merged with it when x = 1, and below. A second
    token the cycle does not produce is sampled from the target, as the next cycle would."""
    from specscope.speculative.tree import DraftTree

    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    q0 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
    p_next = torch.softmax(torch.randn(MIXED_V, MIXED_V, generator=g) * 1.5, -1)   # target after each token
    q_next = torch.softmax(torch.randn(MIXED_V, MIXED_V, generator=g) * 1.5, -1)   # drafter after each token
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(MIXED_V * MIXED_V)
    for _ in range(n):
        x = int(torch.multinomial(q0, 1, generator=gen))
        y = int(torch.multinomial(q_next[x], 1, generator=gen))
        tree = DraftTree.chain([x, y], q=torch.stack([q0, q_next[x]])).graft([1, 4])
        toks = tree.tokens.tolist()
        rows, bonus = rule(torch.stack([p0] + [p_next[t] for t in toks]), tree, gen)
        out = [toks[r - 1] for r in rows[1:]] + [bonus]
        if len(out) == 1:
            out.append(int(torch.multinomial(p_next[out[0]], 1, generator=gen)))
        counts[out[0] * MIXED_V + out[1]] += 1
    return counts, (p0[:, None] * p_next).flatten().double()


@pytest.mark.parametrize("rule", [accept_sampling, _broken_siblings, _broken_merged],
                         ids=["exact", "no-residual-for-siblings", "merged-node-as-copy"])
def test_mixed_siblings_keep_the_target_distribution(rule):
    """The acceptance rule on its own, where the hybrid needs it: sampled and copied siblings, merged nodes."""
    counts, exact = mixed_tree_pairs(rule)
    p = chi2_p(counts, exact)
    assert (p > 1e-3) if rule is accept_sampling else (p < 1e-6)


@pytest.mark.parametrize("broken,name", [(_broken_accept, "tree"), (_broken_residual, "chain_q"),
                                         (_broken_accept, "hybrid_tree")])
def test_broken_rule_is_detected(target, monkeypatch, broken, name):
    monkeypatch.setattr(acceptance_mod, "accept_sampling", broken)   # where acceptance.accept looks it up
    d = random_eagle3(target, draft_vocab=5, seed=1, scale=4.0)
    probs = exact_pair_dist(target)
    counts = sample_pairs(target, drafter_for(target, d, name), CASES[name])
    assert chi2_p(counts, probs) < 1e-3
