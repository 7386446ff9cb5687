"""B sequences decoded together: continuous batching with plain and speculative steps.

The target's KV cache is one flat run of slots cut into fixed regions, one per running sequence. A step is one
target forward over the rows of every sequence in it: a new sequence's whole prompt (its prefill), a plain
sequence's next token, a speculative sequence's root and draft tree. Each row carries its own position, slot and
mask row, and a row's mask only opens its own region, so a batch is verified the way one sequence's draft tree is:
the row-invariant CPU kernels (models/rowgemm.py) give every row the bits it gets alone, and a request's output
does not depend on what else is in the batch. Drafters keep per-sequence state (`Drafter.spawn`); drafting runs
per sequence, verification once for all.
"""

from __future__ import annotations

import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from specscope.engine.request import (Finished, Request, StopCriteria, TokenLogprob, check_context,
                                      token_logprobs)
from specscope.errors import SpecscopeError
from specscope.models.context import region_inputs
from specscope.models import rowgemm
from specscope.models.llama import ForwardOutput
from specscope.runtime.sampling import make_generator, next_token
from specscope.speculative.acceptance import accept
from specscope.speculative.drafters import Drafter, run_alone, run_together
from specscope.speculative.stats import CycleCounts, SpecTally
from specscope.speculative.tree import DraftTree

__all__ = ["BatchEngine", "Finished", "Request", "StepRecord", "TokenLogprob"]
PLAIN = CycleCounts(1, [], 0, None)      # a plain sequence's step, as the profiler counts it


class _Seq:
    """A running sequence: its region of the target cache, committed length, next root and drafter."""

    def __init__(self, req: Request, base: int, drafter: Drafter | None, cfg, t_queued: float, device):
        self.req, self.base, self.drafter, self.cfg = req, base, drafter, cfg
        self.length = 0                   # committed target tokens (slots base .. base + length - 1)
        self.root: int | None = None      # the token the next step feeds (None until prefilled)
        self.prefilled = 0                # prompt tokens in the region so far (reused, then computed in chunks)
        self.cached = 0                   # of which reused from the region's previous sequence
        self.chunk = 0                    # prompt rows this step computes
        self.aux: list[list[torch.Tensor]] = []   # the chunks' aux states, for a drafter's start
        self.produced: list[int] = []
        self.stop = StopCriteria(req.max_new_tokens, req.stop_ids)
        self.gen = make_generator(req.sampling, device)     # on the logits' device, as torch.multinomial needs
        self.tally = SpecTally(cfg, drafter.kind, drafter.model_kind) if drafter is not None else None
        self.t_queued, self.t_scheduled, self.t_first = t_queued, None, None
        self.tree: DraftTree | None = None
        self.drafted = False              # this step's tree came from the drafter (a plain step's did not)
        self.counts = PLAIN               # this step's, for a profiler
        self.idle = 0                     # plain steps in a row with a drafter attached (see BatchEngine.DETACH)
        self.exc: BaseException | None = None
        self.lps = [] if req.logprobs is not None else None                # per committed token
        self.prompt_lps = [None] if req.prompt_logprobs is not None else None
        self.step_lps: list[TokenLogprob] = []                              # this step's new tokens'


@dataclass
class StepRecord:
    """What one engine step did and where its time went: `batch` sequences decoding (a token or a verified tree
    each; `drafted` of them from a drafter), `prompt_rows` prompt tokens computed beside them, `tokens` committed,
    and the wall time per phase in ms -- draft (the drafters), verify (the one target forward), accept (choosing
    tokens from the logits), commit (KV compaction, the drafters' catch-up state, the counters), other (admission,
    inputs, stop checks and the clients' streaming callbacks) -- which add up to the step's wall time."""
    batch: int = 0
    drafted: int = 0
    prompt_rows: int = 0
    rows: int = 0            # the target forward's rows: every sequence's (a token, or root + tree) + prompt rows
    tokens: int = 0
    phases_ms: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return sum(v for k, v in self.phases_ms.items() if "." not in k)   # sub-phases lie inside their phase


PHASES = ("draft", "verify", "accept", "commit", "other")


class _Clock:
    """Phase stopwatch of one step: `lap(name)` charges the time since the previous lap to `name`; `phase(name)`
    times a sub-phase within the current one (a drafter's "draft.step0", kept for a profiler). `sync` (on CUDA,
    when a profiler reads the phases): every reading waits for the device, so each phase holds its own kernels'
    time rather than their launches'; without one the step pays no extra synchronisation."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.cuda = sync and device.type == "cuda"
        self.t = self._now()
        self.ms = dict.fromkeys(PHASES, 0.0)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.ms[name] += (now - self.t) * 1e3
        self.t = now

    @contextmanager
    def phase(self, name: str):
        t0 = self._now()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (self._now() - t0) * 1e3


@dataclass
class Rows:
    """One sequence's rows in a step, in its own coordinates: slots local to its region (0 = its first), mask
    [n, S_local] over its region."""
    ids: torch.Tensor        # [n]
    positions: torch.Tensor  # [n]
    slots: torch.Tensor      # [n]
    mask: torch.Tensor       # bool [n, S_local]
    base: int                # the region's first slot


def batch_inputs(parts: list[Rows], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, slots, mask) of one forward over every part's rows: ids/positions/slots [1, N], mask
    [1, N, S] with each part's block at its region's columns and nothing else open (models/context.py)."""
    pos, slots, mask = region_inputs([(p.positions, p.slots, p.mask, p.base) for p in parts])
    return torch.cat([p.ids for p in parts])[None], pos, slots, mask


def _prefill_rows(seq: _Seq, dev) -> Rows:
    """The prompt's next chunk: positions lo..hi-1, each attending to the prompt up to itself."""
    lo, hi = seq.prefilled, seq.prefilled + seq.chunk
    ar = torch.arange(lo, hi, device=dev)
    return Rows(torch.tensor(seq.req.prompt_ids[lo:hi], device=dev), ar, ar,
                torch.arange(hi, device=dev)[None, :] <= ar[:, None], seq.base)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _slice(out: ForwardOutput, r0: int, r1: int, l0: int, l1: int) -> ForwardOutput:
    """One sequence's part of a batched forward: rows r0..r1-1 (aux states), logits rows l0..l1-1."""
    return ForwardOutput(out.logits[:, l0:l1], [a[:, r0:r1] for a in out.aux_hidden])


class BatchEngine:
    """Continuous batching over one target: `add` requests, call `step` until `busy` is False; each step admits
    waiting requests, runs one forward for every sequence and returns the requests that finished.

    A step's rows are its decoding sequences' (one token, or root + draft tree) and, within the token budget
    (--max-num-batched-tokens), chunks of prompts: a long prompt is prefilled over several steps (chunked prefill)
    while the others keep decoding. With `prefix_caching`, a new request takes the free region whose previous
    sequence shares the longest prefix with its prompt and starts its prefill after that prefix (the keys there
    are the bits it would compute: the kernels are row-invariant); sequences whose drafter needs the target's
    hidden states over the whole prompt (EAGLE-3) always compute it. `spec_policy(batch_size) -> SpecConfig |
    None` picks the draft shape for the step's speculative sequences (None: a plain step; their drafters catch up
    later). A policy with `attach(batch_size)` also says whether a request admitted at that batch size gets a
    drafter at all: one that will not draft at the load it joins decodes as a plain sequence (its prompt reusing
    cached prefixes, no drafter state kept per token), which is what makes a drafter free under load.

    `profiler` (profile/cycle.py CycleProfiler): every step that decodes is one cycle of it, with the step's
    phases (a step where nothing drafted is "decode") and, for one sequence, its acceptance: `generate` runs a
    request as a batch of one through this loop and profiles it so."""

    def __init__(self, target, drafter: Drafter | None = None, cfg=None, max_num_seqs: int = 16,
                 max_seq_len: int | None = None, max_num_batched_tokens: int = 2048,
                 spec_policy: Callable[[int], object] | None = None, prefix_caching: bool = True, profiler=None):
        if max_num_seqs < 1:
            raise SpecscopeError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise SpecscopeError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
        self.target, self.drafter, self.cfg = target, drafter, cfg
        if drafter is not None and cfg is None:
            raise SpecscopeError("a drafter needs its SpecConfig")
        self.context = int(target.config.max_position_embeddings)
        self.extra = cfg.verify_tokens + 1 if cfg is not None else 0
        self.region = min(max_seq_len or self.context, self.context) + self.extra
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.spec_policy = spec_policy or (lambda n: cfg)
        self.cache = target.new_cache(self.region * max_num_seqs)
        self.free = list(range(0, self.region * max_num_seqs, self.region))   # a heap: lowest region first
        self.waiting: list[tuple[Request, float]] = []
        self.running: list[_Seq] = []
        self.cancelled: set[str] = set()
        self.aux_layers = drafter.aux_layers if drafter is not None else ()
        self.attach = getattr(self.spec_policy, "attach", None) if drafter is not None else None
        # the drafters' caches: one shared cache in regions where the drafter allows it, so one forward drafts for
        # every sequence (speculative/drafters.py run_together); else each spawn keeps its own
        self.draft_region = self.region + 1 + (cfg.expansion_slots if cfg is not None else 0)
        # (a batch of one: its drafter keeps a cache of its own and drafts as it would alone)
        self.draft_cache = drafter.region_cache(self.draft_region * max_num_seqs) \
            if drafter is not None and max_num_seqs > 1 else None
        # prefix caching: the tokens whose keys/values each free region still holds (slots base .. base + len - 1)
        self.prefix_caching = prefix_caching
        self.held: dict[int, list[int]] = {}
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens admitted / reused (vLLM's counters)
        self.last_step: StepRecord | None = None     # the latest step's phases and counts (the server exports them)
        self.profiler = profiler
        self.no_tree = DraftTree.empty(target.device)   # a plain step's (never modified: one for all)

    # -- requests -----------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request; a prompt or length that cannot fit a region fails here, before anything runs."""
        check_context(self.target, len(req.prompt_ids), req.max_new_tokens)
        if len(req.prompt_ids) + req.max_new_tokens + self.extra > self.region:
            raise SpecscopeError(f"the prompt has {len(req.prompt_ids)} tokens; with max_new_tokens="
                                 f"{req.max_new_tokens} that exceeds the engine's --max-seq-len of "
                                 f"{self.region - self.extra}; lower max_tokens or raise --max-seq-len")
        self.waiting.append((req, time.perf_counter()))

    def cancel(self, rid: str) -> None:
        """Drop a request at the next step; its region is free for the step after."""
        self.cancelled.add(rid)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self) -> list[Finished]:
        if self.target.device.type != "cpu":
            return self._step()
        with rowgemm.step_threads():     # torch's own ops inline, the row kernels on torch's thread count
            return self._step()

    def _step(self) -> list[Finished]:
        clock, self.last_step = _Clock(self.target.device, sync=self.profiler is not None), None
        done = self._drop_cancelled()
        self._admit()
        if not self.running:
            return done
        shape = self.spec_policy(len(self.running)) if self.drafter is not None else None
        clock.lap("other")
        self._draft(shape, clock if self.profiler is not None else None)
        clock.lap("draft")
        self._chunk()
        stepping = [s for s in self.running if s.root is not None or s.chunk]
        planned = [self._plan(seq) for seq in stepping]
        ids, pos, slots, mask = batch_inputs([rows for rows, _ in planned], self.target.device)
        # logits only where a token is chosen (a prompt's last row, every verified row) or a prompt logprob is due
        need, r = [], 0
        for seq, (p, plan) in zip(stepping, planned):
            n = int(p.ids.numel())
            need.extend(range(r + n - self._logit_rows(seq, plan, n), r + n))
            r += n
        clock.lap("other")
        aux = self.aux_layers if any(s.drafter is not None for s in stepping) else ()
        out = self.target(ids, pos, self.cache, slots, mask, logits_idx=need, aux_layers=aux)
        clock.lap("verify")
        rec = StepRecord(batch=sum(plan == "verify" for _, plan in planned), rows=int(ids.numel()),
                         drafted=sum(seq.drafted for seq in stepping),
                         prompt_rows=sum(seq.chunk for seq in stepping))
        done += self._finish_all(stepping, planned, out, clock, rec)
        rec.phases_ms = clock.ms
        self.last_step = rec
        if self.profiler is not None and rec.batch:
            self._profile(rec, [s for s, (_, plan) in zip(stepping, planned) if plan == "verify"])
        observe = getattr(self.spec_policy, "observe", None)
        if observe is not None:     # a live policy (economics/policy.py PricedPolicy) learns from every step
            observe(rec)
        return done

    def _finish_all(self, stepping: list[_Seq], planned: list, out: ForwardOutput, clock: _Clock,
                    rec: StepRecord) -> list[Finished]:
        """Each sequence's part of the forward: choose and commit its tokens, stream them, retire it if it ended."""
        done, r, l = [], 0, 0
        now = time.perf_counter()
        for seq, (p, plan) in zip(stepping, planned):
            n = int(p.ids.numel())
            nl = self._logit_rows(seq, plan, n)
            try:
                new_tokens = self._finish(seq, plan, _slice(out, r, r + n, l, l + nl), clock)
                rec.tokens += len(new_tokens) if plan == "verify" else 0
                reason = None
                if new_tokens:
                    if seq.t_first is None:
                        seq.t_first = now
                    reason = seq.stop.emit(seq.produced, new_tokens, lambda kept, s=seq: self._commit(s, kept))
            except Exception as e:       # the client's callback (cancelled, a stop string) or a bug: only it ends
                reason, seq.exc = "aborted", e
            if reason is not None:
                done.append(self._retire(seq, reason))
            clock.lap("other")
            r, l = r + n, l + nl
        return done

    def _profile(self, rec: StepRecord, decoding: list[_Seq]) -> None:
        """The step as one profiler cycle: a plain step's forward, choice and commit are its "decode" (as plain
        decoding has always been profiled); a drafted step keeps its phases. One sequence's acceptance counts; a
        step of several sequences counts the tokens they committed."""
        ph = dict(rec.phases_ms)
        if not rec.drafted:
            ph = {"decode": ph.pop("verify") + ph.pop("accept") + ph.pop("commit"), "other": ph.pop("other") +
                  ph.pop("draft"), **ph}
        counts = decoding[0].counts if len(decoding) == 1 else CycleCounts(rec.tokens, [], 0, None)
        self.profiler.add_cycle(ph, *counts)

    @staticmethod
    def _logit_rows(seq: _Seq, plan: str, n: int) -> int:
        """How many of a part's last rows need logits: all verified rows, all prompt rows when prompt logprobs
        are asked for, else the prompt's last row only."""
        if plan == "verify" or seq.prompt_lps is not None:
            return n
        return 1 if plan == "prefill" else 0

    @staticmethod
    def _commit(seq: _Seq, kept: list[int]) -> None:
        """Stream the tokens StopCriteria kept: their logprobs first, then the tokens."""
        if seq.lps is not None:
            recs = seq.step_lps[:len(kept)]
            seq.lps += recs
            if seq.req.on_logprobs is not None:
                seq.req.on_logprobs(recs, False)
        if seq.req.on_tokens is not None:
            seq.req.on_tokens(kept)

    def _drop_cancelled(self) -> list[Finished]:
        if not self.cancelled:
            return []
        done = []
        for req, tq in [w for w in self.waiting if w[0].id in self.cancelled]:
            done.append(Finished(req.id, [], "cancelled", len(req.prompt_ids), tq, None, None, time.perf_counter()))
        self.waiting = [w for w in self.waiting if w[0].id not in self.cancelled]
        for seq in [s for s in self.running if s.req.id in self.cancelled]:
            done.append(self._retire(seq, "cancelled"))
        self.cancelled.clear()
        return done

    def _admit(self) -> list[_Seq]:
        """Waiting requests join, first come first served, while a region is free and the step's token budget
        has room left for prompt rows (a prompt too long for it is prefilled in chunks over several steps)."""
        budget = self.token_budget - sum(1 + (s.cfg.verify_tokens if s.drafter else 0) if s.root is not None
                                         else len(s.req.prompt_ids) - s.prefilled for s in self.running)
        new = []
        # the batch a request joins: everyone running and waiting, as far as regions go (four requests arriving
        # together join a batch of four, not of one, two, three and four)
        joins = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        while self.waiting and self.free and budget > 0:
            req, tq = self.waiting.pop(0)
            drafting = self.drafter is not None and (self.attach is None or self.attach(joins))
            # a drafter that needs the target's states over the whole prompt (EAGLE-3) cannot start from reused keys
            base, reuse = self._region_for(req.prompt_ids, req.prompt_logprobs is None
                                           and not (drafting and self.aux_layers))
            budget -= len(req.prompt_ids) - reuse
            # one sequence at a time keeps the caller's drafter (its state stays theirs to read, as generate's has)
            drafter = (self.drafter if self.max_num_seqs == 1 else self.drafter.spawn()) if drafting else None
            if drafter is not None and self.draft_cache is not None:
                drafter.use_region(self.draft_cache, base // self.region * self.draft_region)
            seq = _Seq(req, base, drafter, self.cfg, tq, self.target.device)
            seq.prefilled = seq.cached = reuse
            seq.t_scheduled = time.perf_counter()
            self.prefix_queries += len(req.prompt_ids)
            self.prefix_hits += reuse
            self.running.append(seq)
            new.append(seq)
        return new

    def _region_for(self, prompt: list[int], reuse_ok: bool = True) -> tuple[int, int]:
        """A free region for `prompt` -> (its first slot, prompt tokens whose keys/values it already holds): the
        one sharing the longest prefix (at most all but the prompt's last token, whose logits are needed), else
        the lowest. reuse_ok False: none reused (prompt logprobs need every prompt row's logits)."""
        best, reuse = self.free[0], 0
        if self.prefix_caching and reuse_ok:
            for base in self.free:
                n = min(common_prefix(self.held.get(base, []), prompt), len(prompt) - 1)
                if n > reuse or (n == reuse and reuse and base < best):
                    best, reuse = base, n
        self.free.remove(best)
        heapq.heapify(self.free)
        self.held.pop(best, None)
        if reuse:   # the reused slots' positions, cleared when the region was freed (windowed masks read them)
            self.cache.pos[0, best:best + reuse] = torch.arange(reuse, device=self.cache.pos.device)
        return best, reuse

    def _chunk(self) -> None:
        """This step's prompt rows per prefilling sequence: what the token budget leaves after the decoding
        sequences' rows, first come first served (with none left, prompts wait: decoding sequences end, and a
        step without them gives prompts the whole budget)."""
        budget = self.token_budget - sum(1 + s.tree.size for s in self.running if s.root is not None)
        for seq in self.running:
            seq.chunk = 0
            if seq.root is None:
                seq.chunk = max(0, min(len(seq.req.prompt_ids) - seq.prefilled, budget))
                budget -= seq.chunk

    def _retire(self, seq: _Seq, reason: str) -> Finished:
        self.running.remove(seq)
        heapq.heappush(self.free, seq.base)
        self.cache.pos[0, seq.base:seq.base + self.region] = -1
        if self.prefix_caching and reason != "aborted":   # what the region's committed slots hold, for reuse
            self.held[seq.base] = (seq.req.prompt_ids + seq.produced)[:seq.length] if seq.root is not None \
                else seq.req.prompt_ids[:seq.prefilled]
        stats = seq.tally.stats() if seq.tally is not None and seq.tally.accept_lengths else None
        return Finished(seq.req.id, seq.produced, reason, len(seq.req.prompt_ids), seq.t_queued, seq.t_scheduled,
                        seq.t_first, time.perf_counter(), stats, seq.exc, seq.cached, seq.lps, seq.prompt_lps)

    def _draft(self, shape, clock: _Clock | None = None) -> None:
        """Every prefilled sequence's tree for this step: drafted together (shape given) or empty (a plain step;
        a drafter catches up on it later). `clock`: where the drafters time their own sub-phases (profiled)."""
        drafting = []
        for seq in self.running:
            seq.drafted = seq.root is not None and seq.drafter is not None and shape is not None
            seq.tree = self.no_tree
            if seq.drafted:
                drafting.append(seq)
        if shape is None and self.attach is not None:
            self._detach_idle()
        steps = [s.drafter.drafting(shape.within(self.context - 1 - s.length), s.req.sampling, s.gen, clock)
                 for s in drafting]
        # one sequence drafting in a cache of its own (a batch of one): its forwards as it would run them alone
        trees = [run_alone(steps[0])] if len(steps) == 1 and self.draft_cache is None else run_together(steps)
        for seq, tree in zip(drafting, trees):
            seq.tree = tree
            seq.idle = 0

    DETACH = 8   # plain steps in a row after which a sequence drops its drafter, if its batch would not attach one

    def _detach_idle(self) -> None:
        """A sequence that joined when drafting paid and has sat in plain steps since (the load rose) drops its
        drafter once the policy would not attach one at this batch size: it decodes plain from here (the same
        tokens; sampling stays exact), without the drafter's per-token state. Its counts so far stay in its stats."""
        attach = None
        for seq in self.running:
            if seq.drafter is None or seq.root is None:
                continue
            seq.idle += 1
            if seq.idle >= self.DETACH:
                attach = self.attach(len(self.running)) if attach is None else attach
                if not attach:
                    seq.drafter = None

    def _plan(self, seq: _Seq) -> tuple[Rows, str]:
        if seq.root is None:   # "prefill": the chunk that ends the prompt; "chunk": an earlier one
            last = seq.prefilled + seq.chunk == len(seq.req.prompt_ids)
            return _prefill_rows(seq, self.target.device), "prefill" if last else "chunk"
        v = seq.tree.verify_inputs(seq.root, seq.length, seq.length)
        return Rows(v.ids[0], v.positions[0], v.slots[0], v.mask[0], seq.base), "verify"

    def _finish(self, seq: _Seq, plan: str, out: ForwardOutput, clock: _Clock) -> list[int]:
        """Choose the sequence's tokens from its logits and commit them -> the new tokens."""
        logits = out.logits[0]
        if plan != "verify":
            self._prompt_logprobs(seq, logits)
            seq.prefilled += seq.chunk
            if seq.drafter is not None and self.aux_layers:
                seq.aux.append(out.aux_hidden)
            if plan == "chunk":
                return []
            seq.length = len(seq.req.prompt_ids)
            seq.root = int(next_token(logits[-1:], seq.req.sampling, seq.gen))
            if seq.lps is not None:
                seq.step_lps = token_logprobs(logits[-1:], [seq.root], seq.req.logprobs)
            clock.lap("accept")
            if seq.drafter is not None:   # the drafter starts from the whole prompt's states, chunks joined
                aux = [torch.cat(a, dim=1) for a in zip(*seq.aux)] if seq.aux else []
                seq.aux = []
                seq.drafter.start(list(seq.req.prompt_ids), seq.root, ForwardOutput(out.logits[:, -1:], aux),
                                  seq.length + seq.req.max_new_tokens + 1 + self.cfg.expansion_slots)
                clock.lap("draft")
            return [seq.root]
        tree = seq.tree
        if seq.drafter is None:     # plain decoding draws exactly as `generate` does
            rows, new_tokens = [0], [int(next_token(logits[-1:], seq.req.sampling, seq.gen))]
        else:
            rows, new_tokens = accept(logits, tree, seq.req.sampling, seq.gen)
        if seq.lps is not None:   # token i was chosen by verify row rows[i]: the target's own logits there
            seq.step_lps = token_logprobs(logits[rows], new_tokens, seq.req.logprobs)
        clock.lap("accept")
        self._compact(seq, rows)
        seq.counts = PLAIN
        if seq.drafter is not None:
            seq.drafter.commit(rows, out, new_tokens)
            if seq.drafted:
                seq.counts = seq.tally.add(tree, rows)
        seq.root = new_tokens[-1]
        clock.lap("commit")
        return new_tokens

    @staticmethod
    def _prompt_logprobs(seq: _Seq, logits: torch.Tensor) -> None:
        """A prompt chunk's records: row j (position lo + j) predicts prompt token lo + j + 1; the prompt's last
        row predicts the first generated token, recorded with it. Handed over once the prompt is complete."""
        if seq.prompt_lps is None:
            return
        prompt, lo = seq.req.prompt_ids, seq.prefilled
        nxt = prompt[lo + 1:lo + seq.chunk + 1]
        if nxt:
            seq.prompt_lps += token_logprobs(logits[:len(nxt)], nxt, seq.req.prompt_logprobs)
        if lo + seq.chunk == len(prompt) and seq.req.on_logprobs is not None:
            seq.req.on_logprobs(seq.prompt_lps, True)

    def _compact(self, seq: _Seq, rows: list[int]) -> None:
        """The accepted rows' cache entries to the end of the sequence's committed ones; the rest of its region
        emptied."""
        dst = seq.base + seq.length
        self.cache.compact([r + dst for r in rows], dst, seq.base + self.region)
        seq.length += len(rows)
