"""The hybrid drafter (a model drafter's tree + an n-gram copy in one verified tree) and the n-gram sources.

The property: whatever the copy proposes — the true continuation, tokens duplicating the drafter's nodes, junk,
branches longer than the budget, proposals at the context's edge, EOS inside an accepted copy — greedy output is
plain greedy decoding's, and the run really exercised merged trees, skipped drafters and accepted copies (so the
property is not vacuous). The sampling side is in test_spec_sampling.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from specscope.generate import generate
from specscope.errors import SpecscopeError
from specscope.profile import CycleProfiler
from specscope.generate import speculative_generate
from specscope.speculative.decode import DraftSpec, SpecConfig, build_drafter
from specscope.speculative.drafters import DraftModelDrafter, Eagle3TreeDrafter
from specscope.speculative.hybrid import CopyFirstHybrid
from specscope.speculative.ngram import PromptLookup, SuffixIndex
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree
from spec_helpers import check_grid, random_eagle3, sample_cases, tiny_target

CTX = 48
VOCAB = 16


# ------------------------------------------------------------------------------------------------ sources

def test_suffix_index_takes_the_longest_match_and_the_majority_continuation():
    s = SuffixIndex()
    # "1 2" is followed by 7 twice and by 8 once; the longest match "3 1 2" by 9
    s.reset([1, 2, 7, 1, 2, 8, 1, 2, 7, 3, 1, 2, 9, 5, 3, 1, 2])
    assert s.propose(2) == ([9, 5], 3)
    s.reset([1, 2, 7, 1, 2, 8, 1, 2, 7, 4, 1, 2])
    assert s.propose(1) == ([7], 2)                 # majority (7: 2 votes) over the latest (8... then 7)
    s.reset([5, 6, 5, 6, 5])                       # a loop: the copy reads its own draft past the end
    assert s.propose(5) == ([6, 5, 6, 5, 6], 3)
    s.reset([1, 2, 3])
    assert s.propose(4) == ([], 0)
    s.extend([1])                                  # the output counts as much as the prompt
    assert s.propose(2) == ([2, 3], 1)


def test_prompt_lookup_reports_its_ngram_length():
    s = PromptLookup()
    s.reset([4, 5, 6, 9, 4, 5, 6])
    assert s.propose(2) == ([9, 4], 3)
    s.reset([4, 5, 1, 5])
    assert s.propose(3) == ([1, 5], 1)


# ------------------------------------------------------------------------------------------------ the merge

def test_graft_shares_agreeing_nodes_and_appends_the_rest():
    # root -> a(5) -> c(7);  root -> b(6)
    t = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]),
                  q=torch.rand(3, 10))
    g = t.graft([5, 7, 8, 9])
    assert g.tokens.tolist() == [5, 6, 7, 8, 9]
    assert g.parents.tolist() == [-1, -1, 0, 2, 3]
    assert g.depth.tolist() == [1, 1, 2, 3, 4]
    assert g.sources == [DRAFTED | COPIED, DRAFTED, DRAFTED | COPIED, COPIED, COPIED]
    assert g.q is t.q                              # the sampled nodes keep their q; new ones are one-hot
    assert g.children()[0] == [1, 2]               # the drafter's children keep their ranks
    h = t.graft([6, 5])                            # diverging below a shared node
    assert h.parents.tolist()[3:] == [1] and h.sources == [DRAFTED, DRAFTED | COPIED, DRAFTED, COPIED]
    c = DraftTree.empty().graft([3, 3, 4])
    assert c.parents.tolist() == [-1, 0, 1] and c.sources == [COPIED] * 3


def test_draft_specs():
    assert DraftSpec.parse("ngram") == DraftSpec(None, "suffix") and DraftSpec.parse("ngram-lookup").ngram_only
    assert DraftSpec.parse("some/dir+ngram-lookup") == DraftSpec("some/dir", "lookup")
    assert DraftSpec.parse("some/dir+ngram-lookup").hybrid and not DraftSpec.parse("some/dir").hybrid
    assert DraftSpec.parse("some/dir+x") == DraftSpec("some/dir+x", None)
    assert SpecConfig.for_drafter("ngram").ngram_tokens == 0
    with pytest.raises(SpecscopeError, match="hybrid"):
        SpecConfig.for_drafter("ngram", ngram_tokens=3)


# ------------------------------------------------------------------------------------------------ greedy property

class FuzzSource:
    """An n-gram source that knows the answer and lies: a prefix of the true greedy continuation (so copies get
    accepted, and duplicate the drafter's nodes where it is right too), then junk from a small vocabulary (which
    collides with drafted nodes), up to three times longer than asked, with a random match length (both the
    grafted and the copy-only path)."""

    def __init__(self, target, seed: int):
        self.target, self.rng = target, random.Random(seed)
        self.tokens: list[int] = []
        self.truth: list[int] = []

    def reset(self, tokens):
        self.tokens = list(tokens)
        prompt = self.tokens[:-1]
        room = self.target.config.max_position_embeddings - len(prompt)
        self.truth = prompt + generate(self.target, prompt, room, stop_ids=[]).token_ids

    def extend(self, tokens):
        self.tokens += tokens

    def propose(self, k):
        r = self.rng.random()
        if r < 0.15:
            return [], 0
        n = len(self.tokens)
        right = self.truth[n:n + self.rng.randint(0, 3 * k)] if r < 0.8 else []
        junk = [self.rng.randrange(3, 7) for _ in range(self.rng.randint(0, 3 * k))]
        return right + junk, self.rng.choice([0, 1, 2, 3, 4, 5, 8])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("hybrid"), layers=2, vocab=VOCAB, max_position_embeddings=CTX)


@pytest.fixture(scope="module")
def eagle(target):
    return random_eagle3(target, draft_vocab=12, seed=3, max_position_embeddings=16)


def _prompt(T: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + T)
    base = torch.randint(3, VOCAB, (max(2, T // 3),), generator=g).tolist()
    return (base * 3)[:T]                          # repetitive: the real sources find copies


def _hybrid(inner, target, source, seed=0):
    h = CopyFirstHybrid(inner, CTX, "lookup" if source == "lookup" else "suffix")
    if source == "fuzz":
        h.source = FuzzSource(target, seed)
    return h


def hybrid_cases(n: int, seed: int, budgets, rng_seed: int) -> list:
    """sample_cases with a random n-gram budget from `budgets` on each."""
    rng = random.Random(rng_seed)
    cases = []
    for cfg, T, max_new in sample_cases(n, CTX, seed=seed, max_dt=12):
        cfg.ngram_tokens = rng.choice(budgets)
        cases.append((cfg, T, max_new))
    return cases


def _stats(res, stats):
    cyc = res.stats.hybrid_cycles
    stats["copy"] += sum(v for k, v in cyc.items() if k.startswith("copy"))
    stats["grafted"] += sum(v for k, v in cyc.items() if k.startswith("tree") and int(k.split(",")[3]) > 0)
    for name, n in res.stats.accepted_by_source.items():
        stats[name] = stats.get(name, 0) + n


def test_hybrid_shapes_near_the_context_end_equal_greedy(target, eagle, monkeypatch):
    """Sampled shapes x n-gram budgets with prompts ending at or near the context, for the EAGLE-3 and the
    draft-model drafter with the real sources and the fuzzing one."""
    counter = iter(range(10 ** 6))
    drafters = {f"{inner}+{src}": (lambda inner=inner, src=src: _hybrid(
        Eagle3TreeDrafter(eagle, target) if inner == "eagle3" else DraftModelDrafter(target, target), target, src,
        next(counter))) for inner in ("eagle3", "self") for src in ("suffix", "lookup", "fuzz")}
    cases = hybrid_cases(40, 21, [0, 1, 3, 6, 12], rng_seed=5)
    seen = {"copy": 0, "grafted": 0}

    import spec_helpers

    def spy(*a, **kw):
        res = speculative_generate(*a, **kw)
        _stats(res, seen)
        return res

    monkeypatch.setattr(spec_helpers, "speculative_generate", spy)
    stats = check_grid(target, drafters, cases, _prompt)
    assert all(s["accepted"] > 0 for s in stats.values()), stats
    assert stats["eagle3+fuzz"]["ended_inside"] >= 1, stats
    # every path was taken: copy-only cycles, copies grafted onto trees, tokens accepted from each source
    assert seen["copy"] >= 20 and seen["grafted"] >= 20, seen
    assert seen.get("ngram", 0) >= 20 and seen.get("both", 0) >= 20 and seen.get("eagle3", 0) >= 5, seen


def test_eos_inside_an_accepted_copy(target, eagle):
    p = _prompt(20)
    full = generate(target, p, 20, stop_ids=[]).token_ids
    for k in (1, 4, 9):
        eos = full[k]
        ref = generate(target, p, 20, stop_ids=[eos])
        for src in ("fuzz", "suffix"):
            res = speculative_generate(target, _hybrid(Eagle3TreeDrafter(eagle, target), target, src), p, 20,
                                       stop_ids=[eos], cfg=SpecConfig(2, 2, 4, 6))
            assert res.token_ids == ref.token_ids and res.stop_reason == "eos"


def test_skipped_drafter_catches_up_on_everything(target, eagle):
    """After cycles the drafter sat out, it catches up on all their accepted tokens and target states at once: at
    every root it drafted from, its logits equal those of a drafter fed one token at a time from a plain forward
    over the final sequence (rounding aside: here the verify forwards' rows need not be bit-identical)."""
    from types import SimpleNamespace

    seen = {}

    class Spy(Eagle3TreeDrafter):
        def _catch_up(self):
            logits, state = super()._catch_up()
            seen[self.root_pos] = logits.clone()
            return logits, state

    p = _prompt(24, seed=2)
    hyb = _hybrid(Spy(eagle, target), target, "fuzz", seed=1)
    res = speculative_generate(target, hyb, p, 20, stop_ids=[], cfg=SpecConfig(2, 2, 5, 4))
    copies = sum(v for k, v in res.stats.hybrid_cycles.items() if k.startswith("copy"))
    assert copies >= 2 and len(seen) >= 3          # the drafter did sit out cycles, and drafted after them
    out, T = res.token_ids, len(p)
    with torch.inference_mode():
        full = target(torch.tensor([p + out]), torch.arange(T + len(out))[None], target.new_cache(CTX),
                      aux_layers=eagle.aux_layers)
        ref = Eagle3TreeDrafter(eagle, target)
        ref.start(p, out[0], SimpleNamespace(aux_hidden=[a[:, :T] for a in full.aux_hidden]), CTX + 4)
        for t in range(len(out) - 1):
            logits, _ = ref._catch_up()
            if T + t in seen:
                torch.testing.assert_close(seen.pop(T + t), logits, atol=1e-4, rtol=1e-4)
            step = SimpleNamespace(aux_hidden=[a[:, T + t:T + t + 1] for a in full.aux_hidden])
            ref.commit([0], step, [out[t + 1]])
    assert not seen


def test_per_source_acceptance_is_reported_and_recorded(target, eagle, tmp_path):
    prof = CycleProfiler()
    p = _prompt(24)
    res = speculative_generate(target, _hybrid(Eagle3TreeDrafter(eagle, target), target, "fuzz"), p, 20,
                               stop_ids=[], cfg=SpecConfig(2, 2, 5, 4), profiler=prof)
    s = prof.summary()
    by = res.stats.accepted_by_source
    assert s["accepted_by_source"] == {k: v for k, v in by.items() if v}
    assert sum(by.values()) == sum(res.stats.accept_lengths) - res.stats.cycles
    line = next(x for x in prof.lines() if x.startswith("Accepted tokens by source: "))
    assert all(f"{k} {v} (" in line for k, v in s["accepted_by_source"].items()) and "ngram" in line
    from specscope.registry.records import make_record

    rec = make_record("speculative", config={}, profiler=prof)
    assert rec["results"]["accepted_by_source"] == s["accepted_by_source"]


def test_build_drafter_makes_the_hybrid(tmp_path):
    from specscope.speculative.formats import save_drafter

    target = tiny_target(tmp_path / "t", layers=4)
    save_drafter(random_eagle3(target, draft_vocab=60), tmp_path / "d")
    d = build_drafter(f"{tmp_path / 'd'}+ngram-lookup", target)
    assert isinstance(d, CopyFirstHybrid) and d.kind == "eagle3+ngram" and isinstance(d.source, PromptLookup)
    with pytest.raises(SpecscopeError, match="hybrid"):
        speculative_generate(target, d.drafter, [5, 6, 7], 4, cfg=SpecConfig(2, 2, 4, 3))
