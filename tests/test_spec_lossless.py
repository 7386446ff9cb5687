"""Greedy speculative decoding is token-identical to baseline greedy decoding."""

import pytest
import torch

from specscope.generate import generate
from specscope.runtime.sampling import SamplingParams
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import DraftModelDrafter, Eagle3TreeDrafter
from specscope.speculative.hybrid import NgramDrafter
from spec_helpers import random_eagle3, tiny_target

SHAPES = [SpecConfig(1, 1, 2), SpecConfig(4, 1, 5), SpecConfig(3, 2, 6), SpecConfig(4, 3, 10), SpecConfig(2, 4, 9)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("t"), layers=4)


def prompts(n=4, V=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    # repetitive prompts give the n-gram drafter and weak drafters something to accept
    out = []
    for i in range(n):
        base = torch.randint(3, V, (5,), generator=g).tolist()
        out.append((base * 3)[: 6 + 3 * i])
    return out


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"s{c.steps}k{c.topk}n{c.draft_tokens}")
def test_eagle3_greedy_identical(target, cfg):
    d = random_eagle3(target, draft_vocab=60)
    for p in prompts():
        ref = generate(target, p, 24, stop_ids=[])
        res = speculative_generate(target, Eagle3TreeDrafter(d, target), p, 24, cfg=cfg)
        assert res.token_ids == ref.token_ids
        assert res.stats.cycles >= 1


def test_self_draft_accepts_everything(tmp_path, target):
    """The target as its own draft model accepts every draft: τ = draft_tokens, and output is unchanged."""
    cfg = SpecConfig(4, 1, 5)
    p = prompts()[1]
    ref = generate(target, p, 21, stop_ids=[])
    res = speculative_generate(target, DraftModelDrafter(target, target), p, 21, cfg=cfg)
    assert res.token_ids == ref.token_ids
    assert res.stats.accept_lengths[:4] == [5, 5, 5, 5]


@pytest.mark.parametrize("cfg", [SpecConfig(3, 2, 6), SpecConfig(3, 1, 4)])
def test_draft_model_greedy_identical(tmp_path, target, cfg):
    other = tiny_target(tmp_path, seed=7, layers=2)
    for p in prompts():
        ref = generate(target, p, 20, stop_ids=[])
        res = speculative_generate(target, DraftModelDrafter(other, target), p, 20, cfg=cfg)
        assert res.token_ids == ref.token_ids


def test_ngram_greedy_identical(target):
    for p in prompts():
        ref = generate(target, p, 30, stop_ids=[])
        res = speculative_generate(target, NgramDrafter(target.device), p, 30, cfg=SpecConfig(4, 1, 5))
        assert res.token_ids == ref.token_ids


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 11])
def test_truncation_at_max_tokens_inside_accepted_run(target, max_new):
    p = prompts()[0]
    ref = generate(target, p, max_new, stop_ids=[])
    res = speculative_generate(target, DraftModelDrafter(target, target), p, max_new, cfg=SpecConfig(5, 1, 6))
    assert res.token_ids == ref.token_ids and len(res.token_ids) == max_new
    assert res.stop_reason == "length"


def test_truncation_at_eos_inside_accepted_run(target):
    """Declare a token in the middle of the greedy continuation to be EOS: both stop right after it."""
    p = prompts()[2]
    full = generate(target, p, 30, stop_ids=[]).token_ids
    for k in (0, 3, 9):
        eos = full[k]
        ref = generate(target, p, 30, stop_ids=[eos])
        res = speculative_generate(target, DraftModelDrafter(target, target), p, 30, stop_ids=[eos],
                                   cfg=SpecConfig(5, 1, 6))
        assert res.token_ids == ref.token_ids
        assert res.token_ids[-1] == eos and res.stop_reason == "eos"
