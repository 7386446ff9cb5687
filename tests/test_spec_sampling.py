"""Speculative sampling preserves the target distribution (chi-square on a tiny vocabulary).

We compute the exact joint distribution of generated tokens 2 and 3 from the target (tokens after the first come
from speculative cycles), sample them many times with fixed seeds, and test the counts against it. A deliberately
broken acceptance rule must fail the same test, which shows the test has the power to catch a wrong rule.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import specscope.speculative.decode as decode_mod
from specscope.engine.generate import generate
from specscope.engine.sampling import SamplingParams, probs_from_logits
from specscope.speculative.acceptance import accept_sampling
from specscope.speculative.decode import SpecConfig, speculative_generate
from specscope.speculative.drafters import Eagle3TreeDrafter
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


CASES = {"chain_q": SpecConfig(2, 1, 3), "tree": SpecConfig(2, 2, 5)}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_target(target, name):
    d = random_eagle3(target, draft_vocab=5, seed=1, scale=4.0)
    probs = exact_pair_dist(target)
    counts = sample_pairs(target, lambda: Eagle3TreeDrafter(d, target), CASES[name])
    assert chi2_p(counts, probs) > 1e-3


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


@pytest.mark.parametrize("broken,name", [(_broken_accept, "tree"), (_broken_residual, "chain_q")])
def test_broken_rule_is_detected(target, monkeypatch, broken, name):
    monkeypatch.setattr(decode_mod, "accept_sampling", broken)
    d = random_eagle3(target, draft_vocab=5, seed=1, scale=4.0)
    probs = exact_pair_dist(target)
    counts = sample_pairs(target, lambda: Eagle3TreeDrafter(d, target), CASES[name])
    assert chi2_p(counts, probs) < 1e-3
