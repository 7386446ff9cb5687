"""The copy-based drafters: n-gram copying alone (`NgramDrafter`), and a model drafter and n-gram copying in one
tree: priced (`HybridDrafter`, the default) or under the fixed copy-first rule (`CopyFirstHybrid`, --draft-budget
fixed); `PricedDrafter`: a model drafter alone under the hybrid's priced rule (a HybridDrafter with no copy).

The copies come from `ngram.py`'s sources; the model drafters and the interface they share from `drafters.py`.
"""

from __future__ import annotations

import time

from specscope.speculative.budget import BudgetRule, CopyStats, FixedPrices, LivePrices, Prices, best_copy
from specscope.speculative.drafters import Drafter
from specscope.speculative.ngram import SOURCES
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree


class NgramDrafter(Drafter):
    """N-gram copying (`ngram.py`: the suffix index by default, or prompt lookup) over the prompt and the output.
    Chain only; drafts are deterministic."""

    kind = "ngram"
    chain_only = True

    def __init__(self, device, source: str = "suffix", prices: Prices | None = None, live: bool = True, *,
                 pricing: LivePrices | FixedPrices | None = None, copy_stats: CopyStats | None = None):
        self.device = device
        self.source_name = source
        self.source = SOURCES[source]()
        # priced (budget.py): each cycle verifies the copy's cost-optimal prefix, up to draft_tokens - 1 tokens;
        # the acceptance counts outlive a request (start() keeps them), as a server's would
        self.prices = prices
        # live: the prices follow the run's own verify times (LivePrices); False keeps them as given. A spawn
        # passes its parent's pricing and counts instead
        if prices is not None:
            pricing = pricing if pricing is not None else (LivePrices(prices) if live else FixedPrices(prices))
            copy_stats = copy_stats if copy_stats is not None else CopyStats()
        self.pricing, self.copy_stats = pricing, copy_stats
        self._cycle: tuple[int, int] | None = None
        self._t0 = 0.0

    def spawn(self):
        # what the priced rule learned is the server's, not one request's (a 48-token request ends before the
        # counts mean anything): every spawn shares its parent's prices and acceptance counts
        return NgramDrafter(self.device, self.source_name, self.prices, pricing=self.pricing,
                            copy_stats=self.copy_stats)

    def start(self, prompt_ids, root, target_out, max_len):
        self.source.reset(list(prompt_ids) + [root])

    def drafting(self, cfg, sampling, gen, profiler=None):
        return self._chain(cfg)
        yield  # noqa: a generator all the same, which needs no forward

    def _chain(self, cfg) -> DraftTree:
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


class _Hybrid(Drafter):
    """What the hybrids share: a model drafter (EAGLE-3, or a draft model) and an n-gram copy source over the same
    sequence, its state delegated to the model drafter. Accepted tokens leave the drafter's own tree when they come
    from the copy; its state does not care: it catches up on the accepted tokens and their target hidden states
    from the verify forward, whichever node proposed them."""

    def __init__(self, drafter: Drafter, context: int, source: str | None = "suffix"):
        self.drafter = drafter
        self.context = context                   # the target's: a node at depth d sits at position root + d
        self.source_name = source
        self.source = SOURCES[source]() if source is not None else None
        # without a copy it is its model drafter under the hybrid's rule, and reports as it (no per-source counts)
        self.kind = f"{drafter.kind}+ngram" if source is not None else drafter.kind
        self.model_kind = drafter.kind if source is not None else None   # its accepted tokens counted by source
        self.aux_layers = drafter.aux_layers

    @property
    def device(self):
        return self.drafter.device

    def region_cache(self, slots):
        return self.drafter.region_cache(slots)

    def use_region(self, cache, base):
        return self.drafter.use_region(cache, base)

    def start(self, prompt_ids, root, target_out, max_len):
        self.drafter.start(prompt_ids, root, target_out, max_len)
        if self.source is not None:
            self.source.reset(list(prompt_ids) + [root])

    def _copy(self, cfg) -> tuple[list[int], int]:
        """The copy's proposal for this cycle, within the verify budget and the context -> (chain, matched)."""
        if self.source is None:
            return [], 0
        room = self.context - len(self.source.tokens)        # depths left before the context ends
        budget = min(cfg.draft_tokens - 1 + cfg.ngram_tokens, room)
        chain, match = self.source.propose(budget)
        return chain[:budget], match             # a source may offer more than asked

    def commit(self, rows, verify_out, new_tokens):
        self.drafter.commit(rows, verify_out, new_tokens)
        if self.source is not None:
            self.source.extend(new_tokens)


class CopyFirstHybrid(_Hybrid):
    """The hybrid under a fixed rule (--draft-budget fixed): when the copy matched at least `copy_match` tokens,
    the model drafter sits the cycle out and the copy alone is verified, as a chain of the whole budget
    (draft_tokens - 1 + ngram_tokens); otherwise the model drafter's tree (draft_tokens - 1 nodes) gets the copy's
    first `ngram_tokens` tokens grafted on, sharing the nodes where they agree. The rule comes from replaying 28
    Spec-Bench prompts' greedy outputs (all six tasks, fp32, 128 tokens, SmolLM2 + the shipped drafter at 2x4x8)
    with the drafter's tree at every position: grafting whatever matched gave τ 2.75 at 6 copied tokens, against
    2.60 / 2.42 when a match of 2 / 3 tokens was required; copy-only cycles from 4 matched tokens raised it to 2.97
    and save the drafter's cost (EAGLE-3 alone 1.76, the suffix copy alone 2.14 at 8 tokens)."""

    copy_match = 4

    def spawn(self):
        h = CopyFirstHybrid(self.drafter.spawn(), self.context, self.source_name)
        h.copy_match = self.copy_match
        return h

    def drafting(self, cfg, sampling, gen, profiler=None):
        chain, match = self._copy(cfg)
        if match >= self.copy_match:
            return DraftTree.empty(self.device).graft(chain)
        tree = yield from self.drafter.drafting(cfg, sampling, gen, profiler)
        return tree.graft(chain[:cfg.ngram_tokens]) if chain else tree


class HybridDrafter(_Hybrid):
    """A model drafter's tree and an n-gram copy in one verified tree, priced (budget.py; the default budget):
    each cycle drafts a tree only where the drafter's cycles have yielded more tokens per ms than the copy's
    cost-optimal prefix alone, and verifies the nodes (drafted and copied) worth their rows at this host's verify
    cost, within the declared shape. Counts outlive a request (start() keeps them) and spawns share them, as a
    server's would. `live`: the prices follow the run's own verify times (LivePrices); False keeps them as given."""

    def __init__(self, drafter: Drafter, context: int, source: str | None = "suffix", prices: Prices | None = None,
                 live: bool = True, *, pricing: LivePrices | FixedPrices | None = None, rule: BudgetRule | None = None):
        if prices is None:
            raise ValueError("HybridDrafter is priced: pass prices (CopyFirstHybrid is the fixed rule)")
        super().__init__(drafter, context, source)
        self.prices = prices
        self.pricing = pricing if pricing is not None else (LivePrices(prices) if live else FixedPrices(prices))
        self.rule = rule if rule is not None else BudgetRule()
        self._cycle: tuple | None = None         # (class, copied tokens verified, drafting cost or None, tree)
        self._t0 = self._drafted_at = 0.0        # when this cycle's drafting began, and ended

    def spawn(self):
        # the priced rule's counts and prices are shared (as NgramDrafter.spawn's)
        return HybridDrafter(self.drafter.spawn(), self.context, self.source_name, self.prices,
                             pricing=self.pricing, rule=self.rule)

    def start(self, prompt_ids, root, target_out, max_len):
        super().start(prompt_ids, root, target_out, max_len)
        self.rule.tree_stats.new_request()

    def drafting(self, cfg, sampling, gen, profiler=None):
        chain, match = self._copy(cfg)
        return (yield from self._priced(cfg, sampling, gen, profiler, chain, match))

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
        super().commit(rows, verify_out, new_tokens)


def PricedDrafter(drafter: Drafter, context: int, prices: Prices, live: bool = True) -> HybridDrafter:
    """A model drafter alone under the hybrid's priced rule, with no copy to weigh: each cycle it drafts only where
    its cycles have been yielding more tokens per ms than plain steps, and verifies the drafted nodes worth their
    rows at this host's prices. It reports as its model drafter (kind, no per-source counts). Replaying 130
    Spec-Bench prompts' greedy outputs at costs measured per prompt on a 2-core AVX-512 VM
    (bench/hybrid_ceiling.py) it predicts 1.20x for the shipped drafter's 2x4x8 tree, against 0.96x verifying the
    whole tree every cycle."""
    return HybridDrafter(drafter, context, None, prices, live)
