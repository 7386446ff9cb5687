"""Drafters behind one interface (`Drafter`, abstract): EAGLE-3 and a separate small draft model here; n-gram
copying and the hybrid of a model drafter and n-gram copying in one tree in `hybrid.py`; all built by
`decode.py`'s factory (`build_drafter`, or `drafter_for` around a network already loaded).

Each keeps its own state in step with the target: `start` after the target's prefill, `drafting` a DraftTree
for the current root token, `commit` the accepted rows once the target has verified them. A model drafter may
sit out cycles (the hybrid skips it when a long copy is in hand): what `commit` hands it then waits, and the next
drafting catches up on all of it in one forward.

Drafting is written as a generator (`drafting`) that yields each forward it needs (a `DraftForward`) and receives
the result: `propose` (`run_alone`) runs those forwards one by one on the drafter's own cache; the batched engine
(engine/batch.py) runs a round's forwards of drafters that share a `batch_key` as one forward (`run_together`:
many sequences' EAGLE-3 drafters, each in its region of one shared cache), and the trees come out the same."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specscope.errors import SpecscopeError
from specscope.models.context import region_inputs
from specscope.models.rope import rope_table
from specscope.runtime.sampling import SamplingParams, probs_from_logits
from specscope.speculative.tree import DraftTree, select_nodes


class Drafter(ABC):
    """The interface the engine drives. `drafting` is the primitive (a drafter that needs no forward of its own
    returns its tree at once); `propose` runs it alone. `start`, `commit` and `spawn` keep the per-sequence state."""

    kind = "none"
    aux_layers: tuple[int, ...] = ()   # target hidden states the drafter needs from verify
    model_kind: str | None = None      # a hybrid's model drafter (its accepted tokens are counted by source)
    chain_only = False                 # it proposes one continuation per cycle (n-gram copying): topk 1 only

    @abstractmethod
    def start(self, prompt_ids: list[int], root: int, target_out, max_len: int):
        """Take the target's prefill of the prompt (its root token drawn)."""

    @abstractmethod
    def drafting(self, cfg, sampling: SamplingParams, gen, profiler=None):
        """A generator that yields the DraftForwards drafting needs, is sent their (logits, states), and returns
        the DraftTree for the current root."""

    @abstractmethod
    def commit(self, rows: list[int], verify_out, new_tokens: list[int]):
        """Take the rows the target accepted (verify_out: its verify forward) and the tokens they commit."""

    @abstractmethod
    def spawn(self) -> "Drafter":
        """A drafter of the same kind and weights with no sequence state (a batch keeps one per sequence)."""

    def propose(self, cfg, sampling: SamplingParams, gen, profiler=None) -> DraftTree:
        """The DraftTree, each forward run on this drafter's own cache."""
        return run_alone(self.drafting(cfg, sampling, gen, profiler))

    def region_cache(self, slots: int):
        """A cache of `slots` entries that this drafter's spawns can share (use_region), or None if they cannot."""
        return None

    def use_region(self, cache, base: int) -> bool:
        """Draft in `cache` from slot `base` on (a batch's shared cache) instead of a cache of one's own; False
        where this drafter cannot (it then keeps its own and drafts alone)."""
        return False


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
    @abstractmethod
    def _catch_up(self):
        """Run the pending committed inputs; return (logits [Vd] at the last one, its state [H] or None)."""

    @abstractmethod
    def _expand(self, tokens, states, positions, slots, mask):
        """Expand frontier nodes (target ids [K], states [K, H] or None) -> (logits [K, Vd], states or None)."""

    def batch_key(self):
        """What drafters whose forwards can run as one forward share (run_together then hands a round's forwards
        of one key to `forwards_together`); None: this drafter's forwards run alone."""
        return None

    def forwards_together(self, reqs: list["DraftForward"]) -> list:
        """The forwards of drafters sharing this one's batch_key -> each one's (logits, states), as it would get
        them alone. This default runs them one by one."""
        return [q.run() for q in reqs]

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

    def batch_key(self):
        # spawns drafting in regions of one shared cache with one network run as one forward
        return None if self.base is None else (id(self.model), id(self.cache))

    def forwards_together(self, reqs):
        return _eagle3_together(reqs)

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


def run_together(steps: list) -> list[DraftTree]:
    """Drive many drafting generators in lockstep -> their trees, in order. Each round, the forwards of drafters
    with one batch_key (EAGLE-3 spawns sharing one network and one cache) run as one forward over all their rows
    (the first one's forwards_together); any other forward runs alone. Rows only see their own region and the
    kernels are row-invariant, so every tree is the one its drafter would draft alone."""
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
            key = r.drafter.batch_key()
            groups.setdefault(("alone", i) if key is None else ("key", key), []).append(i)
        results = {}
        for key, idx in groups.items():
            if key[0] == "alone":
                results[idx[0]] = reqs[idx[0]].run()
            else:
                results.update(zip(idx, reqs[idx[0]].drafter.forwards_together([reqs[i] for i in idx])))
        for i, res in results.items():
            advance(i, res)
    return trees


def _eagle3_together(reqs: list[DraftForward]) -> list:
    """The forwards of EAGLE-3 drafters sharing one network and cache (one batch_key) as one -> each one's
    (logits, states), as its own _catch_up / _expand returns them."""
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
