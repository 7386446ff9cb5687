"""The batched engine (engine/batch.py): a sequence's output never depends on what else is in the batch.

Random schedules of requests joining and leaving (mixed prompt lengths, prompts at the context's edge, token budgets
that hold prefills back, cancellations) must give every completed request exactly the tokens offline decoding gives
it -- plain `generate` or `speculative_generate` with the same drafter and shape, greedy and sampled with the same
seed (so sampling stays exact per sequence: offline speculative sampling is tested exact in test_spec_sampling.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from specscope.economics.policy import spec_policy
from specscope.engine import BatchEngine, Request
from specscope.engine.batch import Rows, batch_inputs
from specscope.errors import SpecscopeError
from specscope.generate import generate
from specscope.models.linear import pack_linears
from specscope.runtime.sampling import SamplingParams
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import Eagle3TreeDrafter
from specscope.speculative.hybrid import CopyFirstHybrid, NgramDrafter
from spec_helpers import random_eagle3, tiny_target

CTX = 64
VOCAB = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # a small vocabulary makes drafts get accepted (and n-gram copies match), so the trees really carry tokens
    return tiny_target(tmp_path_factory.mktemp("t") / "m", "llama", vocab=VOCAB, layers=4,
                       max_position_embeddings=CTX)


def packed_eagle3(target, seed):
    """A random EAGLE-3 drafter with the target's row kernels, as build_drafter loads one on CPU."""
    d = random_eagle3(target, seed=seed)
    pack_linears(d, keep_dense=())
    return d


def drafters(target):
    d = packed_eagle3(target, 3)
    return {
        "plain": (None, None),
        "eagle3 tree": (Eagle3TreeDrafter(d, target), SpecConfig(3, 2, 5)),
        "eagle3 chain": (Eagle3TreeDrafter(d, target), SpecConfig(3, 1, 4)),
        "ngram": (NgramDrafter(target.device), SpecConfig(4, 1, 5)),
        "hybrid": (CopyFirstHybrid(Eagle3TreeDrafter(d, target), CTX), SpecConfig(2, 2, 4, ngram_tokens=3)),
    }


def offline(target, drafter, cfg, prompt, max_new, sampling):
    if drafter is None:
        return generate(target, prompt, max_new, sampling, stop_ids=[1]).token_ids
    return speculative_generate(target, drafter.spawn(), prompt, max_new, sampling, stop_ids=[1],
                                cfg=cfg).token_ids


def random_requests(rng, n, greedy=True):
    """Mixed lengths, some at the context's edge; some prompts repeat an earlier one or extend its prefix (what
    prefix caching reuses)."""
    reqs = []
    for i in range(n):
        max_new = rng.randint(1, 14)
        T = rng.choice([1, 2, rng.randint(3, 20), CTX - max_new - rng.randint(0, 3)])   # some at the edge
        T = max(1, min(T, CTX - max_new))
        prompt = [rng.randrange(2, VOCAB) for _ in range(T)]
        if reqs and rng.random() < 0.4:
            old = rng.choice(reqs).prompt_ids
            keep = rng.choice([len(old), rng.randint(1, len(old))])
            prompt = (old[:keep] + prompt)[:max(keep, T)]
            max_new = min(max_new, CTX - len(prompt))
        sp = SamplingParams() if greedy else SamplingParams(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(99))
        reqs.append(Request(f"r{i}", prompt, max_new, sp, stop_ids=(1,)))
    return reqs


def run_schedule(engine, reqs, rng, cancel_p=0.0, follow_up_p=0.0):
    """Add requests at random steps, cancel some; a finished one may be followed by its next chat turn (its
    prompt + answer + more, appended to `reqs`: what prefix caching reuses in a conversation); -> {id: Finished}."""
    pending, done, streamed = list(reqs), {}, {r.id: [] for r in reqs}
    for r in reqs:
        r.on_tokens = streamed[r.id].extend
    cancelled = set()
    by_id = {r.id: r for r in reqs}
    while pending or engine.busy:
        for _ in range(rng.randint(0, 3)):
            if pending:
                engine.add(pending.pop(0))
        if cancel_p and engine.running and rng.random() < cancel_p:
            victim = rng.choice(engine.running).req.id
            engine.cancel(victim)
            cancelled.add(victim)
        for f in engine.step():
            assert f.id not in done
            done[f.id] = f
            r = by_id[f.id]
            turn = r.prompt_ids + f.token_ids + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 3))]
            if f.stop_reason != "cancelled" and len(turn) < CTX - 2 and rng.random() < follow_up_p:
                nxt = Request(f.id + "+", turn, rng.randint(1, min(8, CTX - len(turn))), r.sampling, r.stop_ids)
                streamed[nxt.id], by_id[nxt.id] = [], nxt
                nxt.on_tokens = streamed[nxt.id].extend
                reqs.append(nxt)
                pending.insert(0, nxt)
    for f in done.values():
        assert f.token_ids == streamed[f.id], "streamed tokens are the result's"
    return done, cancelled


@pytest.mark.parametrize("name", ["plain", "eagle3 tree", "eagle3 chain", "ngram", "hybrid"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_batch_composition_never_changes_a_sequence(target, name, greedy):
    drafter, cfg = drafters(target)[name]
    rng = random.Random(hash((name, greedy)) % 1000)
    hits = 0
    for max_seqs, budget in [(4, 64), (3, 8), (1, 2048), (2, 5)]:    # small budgets: prompts prefilled in chunks
        reqs = random_requests(rng, 10, greedy)
        engine = BatchEngine(target, drafter, cfg, max_num_seqs=max_seqs, max_seq_len=CTX,
                             max_num_batched_tokens=budget)
        done, cancelled = run_schedule(engine, reqs, rng, cancel_p=0.15, follow_up_p=0.5)
        hits += engine.prefix_hits
        assert sum(f.cached_tokens for f in done.values()) == engine.prefix_hits
        assert set(done) == {r.id for r in reqs}
        for r in reqs:
            f = done[r.id]
            want = offline(target, drafter, cfg, r.prompt_ids, r.max_new_tokens, r.sampling)
            if r.id in cancelled and f.stop_reason == "cancelled":
                assert want[:len(f.token_ids)] == f.token_ids, (name, r.id)
            else:
                assert f.stop_reason in ("eos", "length")
                assert f.token_ids == want, (name, r.id, max_seqs)
        assert not engine.running and not engine.waiting
        assert sorted(engine.free) == list(range(0, engine.region * max_seqs, engine.region)), "every region freed"
    # prefix caching reuses a freed region's keys unless the drafter needs the prompt's hidden states (EAGLE-3)
    assert (hits > 0) == (name in ("plain", "ngram")), hits


def test_speculative_batches_accept_drafts_and_count_them(target):
    """Not vacuous: the trees in the batch carried tokens the target accepted, counted per sequence."""
    drafter, cfg = drafters(target)["hybrid"]
    engine = BatchEngine(target, drafter, cfg, max_num_seqs=4, max_seq_len=CTX)
    assert engine.draft_cache is not None, "the EAGLE-3 drafters share one cache and draft in one forward"
    rng = random.Random(5)
    done, _ = run_schedule(engine, random_requests(rng, 8), rng)
    accepted = [sum(f.stats.accepted_per_pos) for f in done.values() if f.stats is not None]
    assert accepted and sum(accepted) > 0
    assert any(f.stats.hybrid_cycles for f in done.values() if f.stats is not None)


def test_plain_steps_inside_a_speculative_run_stay_lossless(target):
    """A policy that speculates only at small batch sizes switches sequences between plain and drafted steps:
    the drafter catches up on the plain steps' tokens and the output is still plain greedy decoding's."""
    drafter, cfg = drafters(target)["eagle3 tree"]
    engine = BatchEngine(target, drafter, cfg, max_num_seqs=4, max_seq_len=CTX,
                         spec_policy=lambda n: cfg if n <= 2 else None)
    rng = random.Random(11)
    reqs = random_requests(rng, 9)
    done, _ = run_schedule(engine, reqs, rng)
    for r in reqs:
        assert done[r.id].token_ids == generate(target, r.prompt_ids, r.max_new_tokens, stop_ids=[1]).token_ids
    off = BatchEngine(target, drafter, cfg, max_num_seqs=2, spec_policy=spec_policy("off", cfg))
    off.add(Request("x", [3, 4, 5], 6, stop_ids=()))
    f = [f for _ in range(8) for f in off.step()][0]
    assert f.stats is None and f.token_ids == generate(target, [3, 4, 5], 6, stop_ids=[]).token_ids


def test_a_failing_callback_ends_only_its_own_sequence(target):
    engine = BatchEngine(target, max_num_seqs=3, max_seq_len=CTX)

    class Boom(Exception):
        pass

    def boom(_):
        raise Boom("client went away")

    engine.add(Request("bad", [2, 3, 4], 8, on_tokens=boom, stop_ids=()))
    engine.add(Request("good", [5, 6], 8, stop_ids=()))
    done = {}
    while engine.busy:
        done.update({f.id: f for f in engine.step()})
    assert done["bad"].stop_reason == "aborted" and isinstance(done["bad"].exc, Boom)
    assert done["good"].token_ids == generate(target, [5, 6], 8, stop_ids=[]).token_ids


def test_requests_that_cannot_fit_are_refused_before_anything_runs(target):
    engine = BatchEngine(target, max_num_seqs=2, max_seq_len=20)
    with pytest.raises(SpecscopeError, match="max-seq-len of 20"):
        engine.add(Request("a", [2] * 15, 6))
    with pytest.raises(SpecscopeError, match="context"):
        engine.add(Request("b", [2] * CTX, 1))
    with pytest.raises(SpecscopeError, match="max-num-seqs"):
        BatchEngine(target, max_num_seqs=0)
    assert not engine.busy


def test_batch_inputs_open_only_each_sequences_region():
    a = Rows(torch.tensor([7, 8]), torch.tensor([3, 4]), torch.tensor([3, 4]),
             torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool), base=0)
    b = Rows(torch.tensor([9]), torch.tensor([1]), torch.tensor([1]), torch.tensor([[1, 1]], dtype=torch.bool), base=10)
    ids, pos, slots, mask = batch_inputs([a, b], "cpu")
    assert ids.tolist() == [[7, 8, 9]] and pos.tolist() == [[3, 4, 1]] and slots.tolist() == [[3, 4, 11]]
    assert mask.shape == (1, 3, 12)
    assert mask[0, 2].nonzero().flatten().tolist() == [10, 11]
    assert mask[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_drafting_together_gives_each_sequence_the_tree_it_drafts_alone(target):
    """run_together over spawns sharing one cache == each spawn's propose on a cache of its own, tree for tree
    (tokens, parents, and the draft distributions of a sampled chain), across several cycles."""
    from specscope.speculative.drafters import run_together
    d = packed_eagle3(target, 7)
    proto = Eagle3TreeDrafter(d, target)
    rng = random.Random(2)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    for cfg, sp in [(SpecConfig(3, 2, 6), SamplingParams()), (SpecConfig(3, 1, 4), SamplingParams(temperature=1.0))]:
        region = 40
        shared = proto.region_cache(region * len(prompts))
        together, alone = [], []
        for i, p in enumerate(prompts):
            a, b = proto.spawn(), proto.spawn()
            assert a.use_region(shared, i * region)
            out = target(torch.tensor([p]), torch.arange(len(p))[None], target.new_cache(CTX),
                         aux_layers=proto.aux_layers)
            for x in (a, b):
                x.start(p, 3, out, region)
            together.append(a)
            alone.append(b)
        for cycle in range(3):
            gens = [torch.Generator().manual_seed(cycle * 10 + i) for i in range(len(prompts))]
            gens2 = [torch.Generator().manual_seed(cycle * 10 + i) for i in range(len(prompts))]
            trees = run_together([x.drafting(cfg, sp, g) for x, g in zip(together, gens)])
            for x, g, t in zip(alone, gens2, trees):
                u = x.propose(cfg, sp, g)
                assert t.tokens.tolist() == u.tokens.tolist() and t.parents.tolist() == u.parents.tolist()
                if u.q is not None:
                    assert torch.equal(t.q, u.q)
            # commit the first path of each tree (as if verify accepted it) to move both on alike
            for x, y, t in zip(together, alone, trees):
                rows = [0] + ([1] if t.size else [])
                toks = ([t.tokens[0].item()] if t.size else []) + [4]
                aux = [torch.randn(1, len(rows), target.config.hidden_size, generator=torch.Generator().manual_seed(cycle))
                       for _ in proto.aux_layers]
                from specscope.models.llama import ForwardOutput
                for z in (x, y):
                    z.commit(rows, ForwardOutput(None, aux), toks)


def test_requests_admitted_without_a_drafter_decode_plain_and_reuse_prefixes(target):
    """A policy's attach(batch) decides per admitted request: those it turns down decode as plain sequences beside
    the drafting ones (greedy output unchanged), reuse cached prompt prefixes though the drafter is EAGLE-3, and
    keep no drafter state (no stats)."""
    drafter, cfg = drafters(target)["eagle3 tree"]

    class EveryOther:
        def __init__(self):
            self.asked = []

        def __call__(self, n):
            return cfg

        def attach(self, n):
            self.asked.append(n)
            return len(self.asked) % 2 == 1

    pol = EveryOther()
    engine = BatchEngine(target, drafter, cfg, max_num_seqs=2, max_seq_len=CTX, spec_policy=pol)
    rng = random.Random(5)
    base = [rng.randrange(2, VOCAB) for _ in range(12)]
    reqs = [Request(f"r{i}", base + [rng.randrange(2, VOCAB) for _ in range(i % 3 + 1)], 8, stop_ids=(1,))
            for i in range(8)]
    done, _ = run_schedule(engine, reqs, rng)
    attached = [f for f in done.values() if f.stats is not None]
    assert 0 < len(attached) < len(done) and len(pol.asked) == len(reqs)
    assert engine.prefix_hits > 0                       # the plain ones reused the shared 12-token prefix
    for r in reqs:
        assert done[r.id].token_ids == offline(target, None, None, r.prompt_ids, 8, r.sampling), r.id


def test_a_drafter_idle_under_load_is_dropped_and_the_sequence_decodes_on(target):
    """Requests that joined when drafting paid, then sat in plain steps (the load rose): after DETACH such steps
    each drops its drafter (the policy would not attach one now) and decodes plain, with unchanged greedy output and
    the stats of the cycles it drafted."""
    drafter, cfg = drafters(target)["eagle3 tree"]

    class LoadRises:
        attached = True

        def __call__(self, n):
            return cfg if self.attached else None

        def attach(self, n):
            return self.attached

    pol = LoadRises()
    engine = BatchEngine(target, drafter, cfg, max_num_seqs=2, max_seq_len=CTX, spec_policy=pol)
    prompts = [[3, 4, 5, 6, 7, 3, 4], [5, 6, 7, 8, 9]]
    for i, p in enumerate(prompts):
        engine.add(Request(f"r{i}", p, 30, stop_ids=(1,)))
    done = {}
    for _ in range(3):
        done.update({f.id: f for f in engine.step()})
    pol.attached = False
    steps = 0
    while engine.busy:
        done.update({f.id: f for f in engine.step()})
        steps += 1
        if steps == engine.DETACH - 1:
            assert len(engine.running) == 2 and all(s.drafter is not None for s in engine.running)
        if steps == engine.DETACH:
            assert len(engine.running) == 2 and all(s.drafter is None for s in engine.running)
    assert steps > engine.DETACH
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].token_ids == offline(target, None, None, p, 30, SamplingParams())
        assert done[f"r{i}"].stats is not None and done[f"r{i}"].stats.cycles >= 1


def test_one_request_is_profiled_cycle_by_cycle(target):
    """generate / speculative_generate run a batch of one through the engine: each decode step is one profiler
    cycle, with the drafters' sub-phases, acceptance counted as the request's stats count it, and phases that add
    up to the cycle; plain decoding's forward is its "decode" phase."""
    from specscope.profile import CycleProfiler

    d, cfg = drafters(target)["eagle3 tree"]
    prof = CycleProfiler()
    r = speculative_generate(target, d, [3, 4, 5, 6], 20, stop_ids=[], cfg=cfg, profiler=prof)
    s = prof.summary()
    assert s["cycles"] == r.stats.cycles == len(r.step_ms) > 0
    assert s["tokens"] == sum(r.stats.accept_lengths) >= r.num_tokens - 1
    assert {"draft", "verify", "accept", "commit", "draft.step0", "draft.step1"} <= set(s["phases"])
    top = sum(v["mean_ms"] for k, v in s["phases"].items() if "." not in k)
    assert top == pytest.approx(s["cycle_ms"]["mean_ms"], rel=1e-3)
    assert s["phases"]["draft.step0"]["mean_ms"] <= s["phases"]["draft"]["mean_ms"]
    plain = CycleProfiler()
    g = generate(target, [3, 4, 5, 6], 12, stop_ids=[], profiler=plain)
    ps = plain.summary()
    assert ps["cycles"] == g.num_tokens - 1 == len(g.step_ms)
    assert "decode" in ps["phases"] and "verify" not in ps["phases"] and ps["accept_length"] == 1
