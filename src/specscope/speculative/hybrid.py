"""The copy-based drafters: n-gram copying alone (`NgramDrafter`), and the hybrid of a model drafter and n-gram
copying in one tree (`HybridDrafter`; `priced_alone`: a model drafter under the hybrid's priced rule, with no copy).

The copies come from `ngram.py`'s sources; the model drafters and the interface they share from `drafters.py`.
"""

from __future__ import annotations

import time

from specscope.speculative.budget import BudgetRule, CopyStats, FixedPrices, LivePrices, Prices, best_copy
from specscope.speculative.drafters import Drafter, TreeDrafter
from specscope.speculative.ngram import SOURCES
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree


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
        d = NgramDrafter(self.device, self.source_name, self.prices, isinstance(self.pricing, LivePrices))
        # what the priced rule learned is the server's, not one request's (a 48-token request ends before the
        # counts mean anything): every spawn shares its parent's prices and acceptance counts
        d.pricing, d.copy_stats = self.pricing, self.copy_stats
        return d

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
        h.pricing, h.rule = self.pricing, self.rule   # the priced rule's counts are the server's (NgramDrafter.spawn)
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
