"""Every drafting shape is safe: steps 1-8 x topk 1-8 x draft tokens 2..max, prompts ending close to the context
limit, max-new-tokens ending inside an accepted run. Never a crash, always plain greedy decoding's tokens.

The grid is sampled with a fixed seed (100 shapes per drafter keep this file in seconds), weighted towards
the shapes whose wide, low-budget trees write more drafter-cache entries than they verify. Two drafters: the target
as its own draft model (every draft accepted, so runs really end inside an accepted run) and a random EAGLE-3
drafter over a small vocabulary (drafts accepted by chance) whose own max_position_embeddings is shorter than the
target's context. The real-model version is in test_spec_smollm2.py (slow).
"""

from __future__ import annotations

import pytest
import torch

from specscope.generate import generate
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import DraftModelDrafter, Eagle3TreeDrafter
from spec_helpers import check_grid, random_eagle3, sample_cases, tiny_target

CTX = 48          # the tiny target's context
DRAFTER_CTX = 16  # the EAGLE-3 drafter's own max_position_embeddings
VOCAB = 16
# shapes that crashed before (drafter cache sized from draft tokens; (steps - 1) * topk >= draft tokens + 3)
ISSUE_SHAPES = [(5, 4, 12), (7, 3, 12), (8, 2, 10), (4, 4, 8), (5, 2, 4), (10, 10, 2)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("shapes"), layers=2, vocab=VOCAB, max_position_embeddings=CTX)


@pytest.fixture(scope="module")
def drafters(target):
    eagle = random_eagle3(target, draft_vocab=12, seed=3, max_position_embeddings=DRAFTER_CTX)
    return {"self-draft": lambda: DraftModelDrafter(target, target),
            "eagle3": lambda: Eagle3TreeDrafter(eagle, target)}


def _prompt(T: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + T)
    return torch.randint(3, VOCAB, (T,), generator=g).tolist()


def test_sampled_shapes_near_the_context_end_equal_greedy(target, drafters):
    stats = check_grid(target, drafters, sample_cases(100, CTX, seed=12), _prompt)
    own, eagle = stats["self-draft"], stats["eagle3"]
    # the property is not vacuous: drafts were accepted and runs were cut by max_new inside them
    assert own["accepted"] >= 0.9 * own["cycled"] and own["ended_inside"] >= 10, own
    assert eagle["accepted"] >= 20 and eagle["ended_inside"] >= 1, eagle


@pytest.mark.parametrize("shape", ISSUE_SHAPES, ids=lambda s: "s{}k{}n{}".format(*s))
def test_issue_shapes_at_the_context_end(target, drafters, shape):
    """The audit's failing shapes, with prompt + max_new exactly at the context, one position short of it, and far
    from it (where only the drafter cache's size is at stake)."""
    cfg = SpecConfig(*shape)
    cases = [(cfg, CTX - m - slack, m) for m in (1, 2, 9) for slack in (0, 1)] + [(cfg, 20, 12)]
    check_grid(target, drafters, cases, _prompt)


def test_all_tuner_candidates_run(target, drafters):
    """The tuner's 85 candidates for a depth-5, 4-rank acceptance profile (12 of them used to crash)."""
    from specscope.economics.tune import AcceptanceModel, candidate_configs

    shapes = candidate_configs(AcceptanceModel([[0.5] * 4] * 5))
    assert len(shapes) == 85
    cases = [(SpecConfig(*s), CTX - 7 - (i % 3), 7) for i, s in enumerate(shapes)]
    check_grid(target, {"self-draft": drafters["self-draft"]}, cases, _prompt)


def test_short_drafter_context_drafts_as_if_declared_long(target):
    """A drafter whose max_position_embeddings (16) is below the positions it drafts at grows its RoPE table:
    it drafts exactly what the same weights declared with the full context draft."""
    short = random_eagle3(target, draft_vocab=12, seed=5, max_position_embeddings=DRAFTER_CTX)
    full = random_eagle3(target, draft_vocab=12, seed=5)
    cfg = SpecConfig(3, 2, 6)
    prompt = _prompt(30)
    a = speculative_generate(target, Eagle3TreeDrafter(short, target), prompt, 12, stop_ids=(), cfg=cfg)
    b = speculative_generate(target, Eagle3TreeDrafter(full, target), prompt, 12, stop_ids=(), cfg=cfg)
    assert a.token_ids == b.token_ids
    assert a.stats.accept_lengths == b.stats.accept_lengths
    n = min(short.rope.shape[1], full.rope.shape[1])   # tables grow in chunks: compare what both hold
    assert short.rope.shape[1] >= 30 + 12 and torch.equal(short.rope[:, :n], full.rope[:, :n])


def test_short_draft_model_context_does_not_crash(tmp_path, target):
    """The same for a separate draft model with a shorter context than the target's."""
    small = tiny_target(tmp_path, layers=1, vocab=VOCAB, max_position_embeddings=DRAFTER_CTX, seed=4)
    prompt = _prompt(CTX - 10)
    res = speculative_generate(target, DraftModelDrafter(small, target), prompt, 10, stop_ids=(),
                               cfg=SpecConfig(4, 2, 6))
    assert res.token_ids == generate(target, prompt, 10, stop_ids=[]).token_ids
