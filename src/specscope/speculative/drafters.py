"""Drafters behind one interface: EAGLE-3, a separate small draft model, n-gram copying, and the hybrid of a model
drafter and n-gram copying in one tree.

Each keeps its own state in step with the target: `start` after the target's prefill, `propose` a DraftTree
for the current root token, `commit` the accepted rows once the target has verified them. A model drafter may
sit out cycles (the hybrid skips it when a long copy is in hand): what `commit` hands it then waits, and the next
`propose` catches up on all of it in one forward.

Drafting is written as a generator (`drafting`) that yields each forward it needs (a `DraftForward`) and receives
the result: `propose` runs those forwards one by one on the drafter's own cache; the batched engine (engine/batch.py)
runs the same requests of many sequences' EAGLE-3 drafters as one forward (`run_together`), each in its region of
one shared cache, and the trees come out the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specscope.errors import SpecscopeError
from specscope.models.context import region_inputs
from specscope.models.rope import rope_table
from specscope.runtime.sampling import SamplingParams, probs_from_logits
from specscope.speculative.budget import BudgetRule, CopyStats, FixedPrices, LivePrices, Prices, best_copy
from specscope.speculative.ngram import SOURCES
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree, select_nodes


class Drafter:
    kind = "none"
    aux_layers: tuple[int, ...] = ()   # target hidden states the drafter needs from verify
    model_kind: str | None = None      # a hybrid's model drafter (its accepted tokens are counted by source)

    def start(self, prompt_ids: list[int], root: int, target_out, max_len: int):
        raise NotImplementedError

    def propose(self, cfg, sampling: SamplingParams, gen, profiler=None) -> DraftTree:
        return run_alone(self.drafting(cfg, sampling, gen, profiler))

    def drafting(self, cfg, sampling: SamplingParams, gen, profiler=None):
        """A generator that yields the DraftForwards drafting needs, is sent their (logits, states), and returns
        the DraftTree. This default needs none: it returns `propose`'s tree."""
        return self.propose(cfg, sampling, gen, profiler)
        yield  # noqa: makes this a generator

    def region_cache(self, slots: int):
        """A cache of `slots` entries that this drafter's spawns can share (use_region), or None if they cannot."""
        return None

    def use_region(self, cache, base: int) -> bool:
        """Draft in `cache` from slot `base` on (a batch's shared cache) instead of a cache of one's own; False
        where this drafter cannot (it then keeps its own and drafts alone)."""
        return False

    def commit(self, rows: list[int], verify_out, new_tokens: list[int]):
        raise NotImplementedError

    def spawn(self) -> "Drafter":
        """A drafter of the same kind and weights with no sequence state (a batch keeps one per sequence)."""
        raise NotImplementedError


class _NullPhase:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _phase(profiler, name):
    return profiler.phase(name) if profiler is not None else _NullPhase()


@dataclass
class DraftForward:
    """One drafter forward that drafting asks for: the catch-up on committed tokens (`tokens` None), or the
    expansion of frontier nodes (target ids [n], states [n, H] or None) at positions/slots [n] under mask [n, S]."""
    drafter: "TreeDrafter"
    tokens: torch.Tensor | None = None
    states: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def run(self):
        d = self.drafter
        return d._catch_up() if self.tokens is None else d._expand(self.tokens, self.states, self.positions,
                                                                   self.slots, self.mask)


def run_alone(steps):
    """Drive one drafting generator, each forward on its drafter's own cache -> the DraftTree."""
    try:
        req = next(steps)
        while True:
            req = steps.send(req.run())
    except StopIteration as e:
        return e.value


def _level_mask(prev_mask, f_prow, base: int, slot: int, n: int, dev) -> torch.Tensor:
    """The mask of a level's n expansions at slots slot..slot+n-1: row j sees the committed prefix, its ancestors'
    expansion slots (= its parent's row in the previous level's mask) and itself."""
    ar = torch.arange(n, device=dev)
    mask = torch.zeros(n, slot + n, dtype=torch.bool, device=dev)
    if prev_mask is None:
        mask[:, :base] = True
    else:
        mask[:, :prev_mask.shape[1]] = prev_mask[f_prow]
    mask[ar, slot + ar] = True
    return mask


class TreeDrafter(Drafter):
    """Dynamic-tree drafting (EAGLE-2/3) over any model that can expand frontier nodes with a tree mask.

    Level 1 comes from the catch-up forward; each further level expands the best `topk` frontier nodes in one
    forward, each proposing `topk` children scored by cumulative log-probability. The best `draft_tokens - 1`
    nodes overall form the tree. With topk = 1 this is chain drafting; when sampling a chain, tokens are sampled
    from the draft distribution q and q is kept for the min(1, p/q) rule.
    """

    pos_offset = 0   # drafter position of the entry that expands a node = node's token position + pos_offset
    base = None      # first slot of this sequence's region in a batch's shared cache (None: a cache of its own)

    def __init__(self, device):
        self.device = device
        self.cache = None
        self.committed = 0       # drafter cache entries that belong to the committed sequence
        self.root_pos = 0        # token position of the current root

    def _drop_expansions(self):
        """Forget the cycle's speculative expansion entries (a shared cache's other regions are not ours)."""
        if self.cache is not None and self.base is None:
            self.cache.truncate(self.committed)

    # hooks -------------------------------------------------------------------------------------------------
    def _catch_up(self):
        """Run the pending committed inputs; return (logits [Vd] at the last one, its state [H] or None)."""
        raise NotImplementedError

    def _expand(self, tokens, states, positions, slots, mask):
        """Expand frontier nodes (target ids [K], states [K, H] or None) -> (logits [K, Vd], states or None)."""
        raise NotImplementedError

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def _target_dist(self, probs_draft: torch.Tensor) -> torch.Tensor:
        return probs_draft

    # drafting ----------------------------------------------------------------------------------------------
    def _best_children(self, logp, f_score, K):
        """Each frontier node's top-K children (target ids and cumulative scores, flattened [n * k]), k, and the
        rows of the best K overall, which go on (ties: first come)."""
        top_s, top_i = torch.topk(logp, min(K, logp.shape[-1]), dim=-1)   # [n, k]
        cum = (top_s + f_score[:, None]).flatten()
        return self._to_target(top_i).flatten(), cum, top_i.shape[1], torch.argsort(-cum, stable=True)[:K]

    def drafting(self, cfg, sampling, gen, profiler=None):
        """Candidates live in per-level tensors; a level's mask rows are its parents' rows plus one slot each
        (no loop over nodes), and the frontier keeps its states as one tensor gathered by parent row."""
        K, steps, dev = cfg.topk, cfg.steps, self.device
        sample_chain = (not sampling.greedy) and K == 1
        with _phase(profiler, "draft.step0"):
            logits, state = yield DraftForward(self)
        logp = torch.log_softmax(logits.float(), -1)
        cand_q = []
        if sample_chain:
            q = probs_from_logits(logits, sampling)
            top_i = torch.multinomial(q, 1, generator=gen)
            top_s = logp[top_i]
            cand_q.append(self._target_dist(q))
        else:
            top_s, top_i = torch.topk(logp, min(K, logp.shape[-1]))
        f_tok = self._to_target(top_i)                 # frontier: target ids, scores, candidate ids, states
        f_score = top_s
        n_cand = f_tok.numel()
        f_idx = torch.arange(n_cand, device=dev)
        f_state = None if state is None else state[None].repeat(n_cand, *([1] * state.dim()))
        f_prow = None                                  # each frontier node's parent row in the previous mask
        toks, pars, scores, depths = [f_tok], [torch.full((n_cand,), -1, device=dev)], [f_score], [1] * n_cand
        base = slot = self.committed
        prev_mask = None
        for level in range(2, steps + 1):
            with _phase(profiler, f"draft.step{level - 1}"):
                n = f_idx.numel()
                mask = _level_mask(prev_mask, f_prow, base, slot, n, dev)
                positions = torch.full((n,), self.root_pos + level - 1 + self.pos_offset, device=dev)
                logits, new_states = yield DraftForward(self, f_tok, f_state, positions,
                                                        slot + torch.arange(n, device=dev), mask)
                slot, prev_mask = slot + n, mask
                if sample_chain:
                    q = probs_from_logits(logits[0], sampling)
                    d = torch.multinomial(q, 1, generator=gen)
                    f_tok = self._to_target(d)
                    f_score = f_score + torch.log(q[d].clamp_min(1e-30))
                    cand_q.append(self._target_dist(q))
                    new_idx, f_prow = torch.full((1,), n_cand, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
                    toks.append(f_tok); pars.append(f_idx); scores.append(f_score); depths += [level]
                    n_cand += 1
                else:
                    tok_t, cum, k, order = self._best_children(torch.log_softmax(logits.float(), -1), f_score, K)
                    toks.append(tok_t); pars.append(f_idx.repeat_interleave(k)); scores.append(cum)
                    depths += [level] * (n * k)
                    f_tok, f_score, f_prow = tok_t[order], cum[order], order // k
                    new_idx = n_cand + order
                    n_cand += n * k
                f_idx = new_idx
                f_state = None if new_states is None else new_states[f_prow]
        self._drop_expansions()
        tree, kept = select_nodes(torch.cat(toks).tolist(), torch.cat(pars).tolist(), torch.cat(scores).tolist(),
                                  depths, cfg.draft_tokens - 1)
        tree.tokens, tree.parents, tree.depth = (tree.tokens.to(dev), tree.parents.to(dev), tree.depth.to(dev))
        if sample_chain:
            tree.q = torch.stack([cand_q[i] for i in kept]) if kept else None
        return tree


class Eagle3TreeDrafter(TreeDrafter):
    kind = "eagle3"
    pos_offset = -1   # the pair (feature at p, token at p+1) sits at drafter position p

    def __init__(self, drafter, target):
        super().__init__(target.device)
        self.model = drafter
        self.target = target
        self.aux_layers = drafter.aux_layers
        self.pending_aux = None
        self.pending_tokens = None

    def spawn(self):
        return Eagle3TreeDrafter(self.model, self.target)

    def region_cache(self, slots):
        return None if self.model.config.sliding_window else self.model.new_cache(slots)

    def use_region(self, cache, base):
        # key positions are slot indices in the drafter's masks (models/context.py): a region past slot 0 would
        # shift a sliding window, so a windowed drafter keeps a cache of its own
        if self.model.config.sliding_window:
            return False
        self.cache, self.base = cache, base
        return True

    def start(self, prompt_ids, root, target_out, max_len):
        if self.base is None:
            self.cache = self.model.new_cache(max_len)
        self.committed = 0
        self.pending_aux = target_out.aux_hidden               # [1, T, Ht] x3 for positions 0..T-1
        self.pending_tokens = torch.tensor([prompt_ids[1:] + [root]], device=self.device)
        self.root_pos = len(prompt_ids)

    def _catch_up_inputs(self):
        """(embeddings [m, H], fused target states [m, H], positions [m]) of the committed tokens waiting."""
        m = self.pending_tokens.shape[1]
        pos = torch.arange(self.committed, self.committed + m, device=self.device)
        return self.target.embed_tokens(self.pending_tokens)[0], self.model.fuse(self.pending_aux)[0], pos

    def _caught_up(self, m: int):
        self.committed += m
        if self.base is None:
            self.cache.length = self.committed
        self.pending_aux = self.pending_tokens = None

    def _catch_up(self):
        emb, hid, pos = self._catch_up_inputs()
        m = pos.numel()
        logits, h = self.model(emb[None], hid[None], pos[None], self.cache, pos[None], logits_idx=[m - 1])
        self._caught_up(m)   # the head ran for the last row only
        return logits[0, -1], h[0, -1]

    def _expand(self, tokens, states, positions, slots, mask):
        emb = self.target.embed_tokens(tokens)[None]
        logits, h = self.model(emb, states[None], positions[None], self.cache, slots[None], mask[None])
        return logits[0], h[0]

    def _to_target(self, draft_ids):
        return self.model.draft_to_target(draft_ids)

    def _target_dist(self, probs_draft):
        q = torch.zeros(self.model.config.vocab_size, device=probs_draft.device)
        q[self.model.draft_to_target(torch.arange(probs_draft.shape[-1], device=probs_draft.device))] = probs_draft
        return q

    def commit(self, rows, verify_out, new_tokens):
        idx = torch.tensor(rows, device=self.device)
        aux = [a[:, idx] for a in verify_out.aux_hidden]
        tokens = torch.tensor([new_tokens], device=self.device)
        if self.pending_tokens is not None:      # a skipped cycle: its tokens are still waiting
            aux = [torch.cat([a, b], 1) for a, b in zip(self.pending_aux, aux)]
            tokens = torch.cat([self.pending_tokens, tokens], 1)
        self.pending_aux, self.pending_tokens = aux, tokens
        self.root_pos += len(rows)
        self._drop_expansions()


class DraftModelDrafter(TreeDrafter):
    """A separate small model with the target's tokenizer, drafting a chain or a dynamic tree."""

    kind = "draft_model"

    def __init__(self, model, target):
        super().__init__(target.device)
        V, Vd = target.config.vocab_size, model.config.vocab_size
        if Vd < V and Vd < max(target.config.eos_token_id + [0]):
            raise SpecscopeError(f"draft model vocab ({Vd}) does not cover the target vocab ({V}); "
                                 f"use a draft model with the same tokenizer")
        self.model = model
        self.target = target
        self.target_vocab = V
        self.target_context = target.config.max_position_embeddings
        self.pending = None

    def spawn(self):
        return DraftModelDrafter(self.model, self.target)

    def start(self, prompt_ids, root, target_out, max_len):
        # positions stay below the target's context (and below max_len: each sits at a slot >= it). A draft model
        # with a shorter context of its own drafts past it with a longer RoPE table: worse guesses, never a crash.
        need = min(max_len, self.target_context)
        if need > self.model.rope.shape[1]:
            c = self.model.config
            self.model.rope = rope_table(c.head_dim, need, c.rope_theta, c.rope_scaling).to(self.model.rope.device)
        self.cache = self.model.new_cache(max_len)
        self.committed = 0
        self.pending = torch.tensor([prompt_ids + [root]], device=self.device)
        self.root_pos = len(prompt_ids)

    def _fit(self, logits):
        V = self.target_vocab
        if logits.shape[-1] > V:
            return logits[..., :V]
        if logits.shape[-1] < V:
            pad = logits.new_full(logits.shape[:-1] + (V - logits.shape[-1],), float("-inf"))
            return torch.cat([logits, pad], -1)
        return logits

    def _catch_up(self):
        m = self.pending.shape[1]
        pos = torch.arange(self.committed, self.committed + m, device=self.device)[None]
        out = self.model(self.pending, pos, self.cache, logits_idx=[m - 1])
        self.committed += m
        self.cache.length = self.committed
        self.pending = None
        return self._fit(out.logits[0, -1]), None

    def _expand(self, tokens, states, positions, slots, mask):
        out = self.model(tokens[None], positions[None], self.cache, slots[None], mask[None])
        return self._fit(out.logits[0]), None

    def commit(self, rows, verify_out, new_tokens):
        tokens = torch.tensor([new_tokens], device=self.device)
        self.pending = tokens if self.pending is None else torch.cat([self.pending, tokens], 1)   # after a skip
        self.root_pos += len(rows)
        self._drop_expansions()


class NgramDrafter(Drafter):
    """N-gram copying (`ngram.py`: the suffix index by default, or prompt lookup) over the prompt and the output.
    Chain only; drafts are deterministic."""

    kind = "ngram"

    def __init__(self, device, source: str = "suffix", prices: Prices | None = None, live: bool = True):
        self.device = device
        self.source_name = source
        self.source = SOURCES[source]()
        # priced (budget.py): each cycle verifies the copy's cost-optimal prefix, up to draft_tokens - 1 tokens;
        # the acceptance counts outlive a request (start() keeps them), as a server's would
        self.prices = prices
        # live: the prices follow the run's own verify times (LivePrices); False keeps them as given
        self.pricing = (LivePrices(prices) if live else FixedPrices(prices)) if prices is not None else None
        self.copy_stats = CopyStats() if prices is not None else None
        self._cycle: tuple[int, int] | None = None
        self._t0 = 0.0

    def spawn(self):
        return NgramDrafter(self.device, self.source_name, self.prices, isinstance(self.pricing, LivePrices))

    def start(self, prompt_ids, root, target_out, max_len):
        self.source.reset(list(prompt_ids) + [root])

    def propose(self, cfg, sampling, gen, profiler=None) -> DraftTree:
        chain, match = self.source.propose(cfg.draft_tokens - 1)
        chain = chain[:cfg.draft_tokens - 1]
        if self.prices is not None:
            self._t0 = time.perf_counter()
            cls = CopyStats.match_class(match, len(chain))
            L, _ = best_copy(self.copy_stats.rates(cls, len(chain)), self.pricing, len(chain))
            chain = chain[:L]
            self._cycle = (cls, L)
        return DraftTree.chain(chain, device=self.device)

    def commit(self, rows, verify_out, new_tokens):
        if self._cycle is not None:
            self.pricing.observe(self._cycle[1] + 1, (time.perf_counter() - self._t0) * 1e3)
            self.copy_stats.update(*self._cycle, len(rows) - 1)
            self._cycle = None
        self.source.extend(new_tokens)


class HybridDrafter(Drafter):
    """A model drafter's tree (EAGLE-3, or a draft model) and an n-gram copy in one verified tree.

    Each cycle the n-gram source proposes a copy of what followed the context's last tokens. When it matched at
    least `copy_match` tokens, the answer is copying: the model drafter sits the cycle out and the copy alone is
    verified, as a chain of the whole budget (draft_tokens - 1 + ngram_tokens). Otherwise the model drafter's tree
    (draft_tokens - 1 nodes) gets the copy's first `ngram_tokens` tokens grafted on, sharing the nodes where they
    agree. The rule comes from replaying 28 Spec-Bench prompts' greedy outputs (all six tasks, fp32, 128 tokens,
    SmolLM2 + the shipped drafter at 2x4x8) with the drafter's tree at every position: grafting whatever matched
    gave τ 2.75 at 6 copied tokens, against 2.60 / 2.42 when a match of 2 / 3 tokens was required; copy-only
    cycles from 4 matched tokens raised it to 2.97 and save the drafter's cost (EAGLE-3 alone 1.76, the suffix
    copy alone 2.14 at 8 tokens).

    Accepted tokens leave the drafter's own tree when they come from the copy; its state does not care: it
    catches up on the accepted tokens and their target hidden states from the verify forward, whichever node
    proposed them."""

    copy_match = 4
    # adaptive (opt-in): where the model drafter's own nodes have been earning less than `min_gain` accepted tokens
    # a tree cycle (a running mean), it sits out the short-copy cycles too, and is tried again every `probe` cycles
    min_gain, probe, ema = 0.5, 8, 0.25

    def __init__(self, drafter: Drafter, context: int, source: str | None = "suffix", adaptive: bool = False,
                 prices: Prices | None = None, live: bool = True):
        if source is None and prices is None:
            raise ValueError("a model drafter without a copy source is only wrapped to be priced: pass prices")
        self.drafter = drafter
        self.context = context                   # the target's: a node at depth d sits at position root + d
        self.source_name = source
        # source None: no copy at all -- the model drafter alone under the priced rule (`priced_alone`)
        self.source = SOURCES[source]() if source is not None else _NoCopy()
        self.kind = f"{drafter.kind}+ngram" if source is not None else drafter.kind
        self.model_kind = drafter.kind if source is not None else None
        self.aux_layers = drafter.aux_layers
        self.adaptive = adaptive
        self.gain: float | None = None           # drafted-only accepted tokens per tree cycle (running mean)
        self.idle = 0                            # short-copy cycles the drafter sat out since it last drafted
        self._tree: DraftTree | None = None      # this cycle's tree, when the drafter drafted
        # priced (budget.py; replaces the copy_match and adaptive rules): each cycle drafts a tree only where the
        # drafter's cycles have yielded more tokens per ms than the copy's cost-optimal prefix alone, and verifies
        # the nodes worth their rows; counts outlive a request (start() keeps them), as a server's would
        self.prices = prices
        self.pricing = (LivePrices(prices) if live else FixedPrices(prices)) if prices is not None else None
        self.rule = BudgetRule() if prices is not None else None
        self._cycle: tuple | None = None         # (class, copied tokens verified, drafting cost or None, tree)
        self._t0 = self._drafted_at = 0.0        # when this cycle's drafting began, and ended

    def spawn(self):
        h = HybridDrafter(self.drafter.spawn(), self.context, self.source_name, self.adaptive, self.prices,
                          isinstance(self.pricing, LivePrices))
        h.copy_match, h.min_gain, h.probe, h.ema = self.copy_match, self.min_gain, self.probe, self.ema
        return h

    def start(self, prompt_ids, root, target_out, max_len):
        self.drafter.start(prompt_ids, root, target_out, max_len)
        self.source.reset(list(prompt_ids) + [root])
        self.gain, self.idle, self._tree = None, 0, None
        if self.rule is not None:
            self.rule.tree_stats.new_request()

    def region_cache(self, slots):
        return self.drafter.region_cache(slots)

    def use_region(self, cache, base):
        return self.drafter.use_region(cache, base)

    def drafting(self, cfg, sampling, gen, profiler=None):
        room = self.context - len(self.source.tokens)        # depths left before the context ends
        budget = min(cfg.draft_tokens - 1 + cfg.ngram_tokens, room)
        chain, match = self.source.propose(budget)
        chain = chain[:budget]                   # a source may offer more than asked
        self._tree = None
        if self.prices is not None:
            return (yield from self._priced(cfg, sampling, gen, profiler, chain, match))
        if match >= self.copy_match:
            return DraftTree.empty(self.device).graft(chain)
        if self.adaptive and self.gain is not None and self.gain < self.min_gain and self.idle < self.probe:
            self.idle += 1   # a short match: only the copy's first ngram_tokens, as a tree cycle would graft
            return DraftTree.empty(self.device).graft(chain[:cfg.ngram_tokens])
        self.idle = 0
        tree = yield from self.drafter.drafting(cfg, sampling, gen, profiler)
        self._tree = tree.graft(chain[:cfg.ngram_tokens]) if chain else tree
        return self._tree

    def _priced(self, cfg, sampling, gen, profiler, chain, match):
        cls, rates, L, draft = self.rule.plan(match, len(chain), self.pricing)
        t0 = self._t0 = time.perf_counter()
        if not draft:
            tree = DraftTree.empty(self.device).graft(chain[:L])
            self._cycle = (cls, L, None, tree)
            return tree
        tree = yield from self.drafter.drafting(cfg, sampling, gen, profiler)
        self._drafted_at = time.perf_counter()
        cost = self.rule.tree_stats.drafted(self._drafted_at - t0, self.pricing)
        # every drafted node and the whole copy are candidates; the verified ones are those worth their rows, no
        # more than the declared verify budget (the cache's room is sized for it)
        full = tree.graft(chain) if chain else tree
        tree = full.subset(self.rule.keep(full, rates, self.pricing, cost, cfg.draft_tokens - 1 + cfg.ngram_tokens))
        src = tree.node_sources()
        self._cycle = (cls, sum(1 for x in src if x & COPIED), cost, tree)
        return tree

    @property
    def device(self):
        return self.drafter.device

    def commit(self, rows, verify_out, new_tokens):
        if self._cycle is not None:
            cls, offered, cost, tree = self._cycle
            src = tree.node_sources()
            took = set(rows[1:])
            nodes = [(d, x, i + 1 in took) for i, (d, x) in enumerate(zip(tree.depth.tolist(), tree.scores))
                     if src[i] & DRAFTED] if cost is not None and tree.scores is not None else []
            now = time.perf_counter()
            self.rule.learn(cls, cost is not None, offered, sum(1 for r in took if src[r - 1] & COPIED), len(rows),
                            (now - self._t0) * 1e3, nodes)
            self.pricing.observe(tree.size + 1, (now - (self._t0 if cost is None else self._drafted_at)) * 1e3)
            self._cycle = None
        if self._tree is not None:   # what the drafter's own nodes earned this cycle (rows: 0 = root, i = node i-1)
            src = self._tree.node_sources()
            got = sum(1 for r in rows[1:] if src[r - 1] == DRAFTED)
            self.gain = got if self.gain is None else (1 - self.ema) * self.gain + self.ema * got
            self._tree = None
        self.drafter.commit(rows, verify_out, new_tokens)
        self.source.extend(new_tokens)


class _NoCopy:
    """The copy source of a model drafter priced alone: it follows the sequence (the hybrid reads its length for
    the context's room) and never proposes."""

    def __init__(self):
        self.tokens: list[int] = []

    def reset(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, k: int) -> tuple[list[int], int]:
        return [], 0


def priced_alone(drafter: TreeDrafter, context: int, prices: Prices, live: bool = True) -> HybridDrafter:
    """A model drafter under the priced rule without a copy: each cycle it drafts only where its cycles have been
    yielding more tokens per ms than plain steps, and verifies the drafted nodes worth their rows at this host's
    prices (the hybrid's rule with no copy to weigh). Replaying 130 Spec-Bench prompts' greedy outputs at costs
    measured per prompt on a 2-core AVX-512 VM (bench/hybrid_ceiling.py) it predicts 1.20x for the shipped
    drafter's 2x4x8 tree, against 0.96x verifying the whole tree every cycle."""
    return HybridDrafter(drafter, context, None, prices=prices, live=live)


def run_together(steps: list) -> list[DraftTree]:
    """Drive many drafting generators in lockstep -> their trees, in order. Each round, the forwards of EAGLE-3
    drafters that share one network and one cache (use_region) run as one forward over all their rows; any other
    forward runs alone. Rows only see their own region and the kernels are row-invariant, so every tree is the one
    its drafter would draft alone."""
    trees: list = [None] * len(steps)
    reqs: dict[int, DraftForward] = {}

    def advance(i, value=None, first=False):
        try:
            reqs[i] = next(steps[i]) if first else steps[i].send(value)
        except StopIteration as e:
            trees[i] = e.value
            reqs.pop(i, None)

    for i in range(len(steps)):
        advance(i, first=True)
    while reqs:
        groups: dict = {}
        for i, r in reqs.items():
            d = r.drafter
            shared = isinstance(d, Eagle3TreeDrafter) and d.base is not None
            groups.setdefault((id(d.model), id(d.cache)) if shared else ("alone", i), []).append(i)
        results = {}
        for key, idx in groups.items():
            if key[0] == "alone":
                results[idx[0]] = reqs[idx[0]].run()
            else:
                results.update(zip(idx, _eagle3_together([reqs[i] for i in idx])))
        for i, res in results.items():
            advance(i, res)
    return trees


def _eagle3_together(reqs: list[DraftForward]) -> list:
    """The forwards of EAGLE-3 drafters sharing one network and cache as one -> each one's (logits, states), as
    its own _catch_up / _expand returns them."""
    d0 = reqs[0].drafter
    parts, embs, hids, need, spans = [], [], [], [], []
    r = 0
    for q in reqs:
        d = q.drafter
        if q.tokens is None:     # catch-up: causal over the region's committed entries, the head on the last row
            emb, hid, pos = d._catch_up_inputs()
            n = pos.numel()
            mask = torch.arange(d.committed + n, device=pos.device)[None, :] <= pos[:, None]
            parts.append((pos, pos, mask, d.base))
            need.append(r + n - 1)
        else:
            emb, hid, n = d.target.embed_tokens(q.tokens), q.states, q.tokens.numel()
            parts.append((q.positions, q.slots, q.mask, d.base))
            need.extend(range(r, r + n))
        embs.append(emb)
        hids.append(hid)
        spans.append((r, n))
        r += n
    pos, slots, mask = region_inputs(parts)
    logits, h = d0.model(torch.cat(embs)[None], torch.cat(hids)[None], pos, d0.cache, slots, mask, logits_idx=need)
    out, l = [], 0
    for q, (r, n) in zip(reqs, spans):
        if q.tokens is None:
            q.drafter._caught_up(n)
            out.append((logits[0, l], h[0, r + n - 1]))
            l += 1
        else:
            out.append((logits[0, l:l + n], h[0, r:r + n]))
            l += n
    return out
