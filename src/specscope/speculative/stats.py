"""What one speculative generation measured: `GenerationResult.stats` (None for plain decoding).

Typed so that a reader names a field instead of a string key (a misspelt key read None silently)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from specscope.speculative.acceptance import RankCounts, SourceCounts
from specscope.speculative.tree import DRAFTED, DraftTree


@dataclass
class SpecStats:
    drafter: str                          # the drafter's kind ("eagle3", "ngram", "eagle3+ngram", ...)
    steps: int
    topk: int
    draft_tokens: int
    accept_lengths: list[int]             # accepted drafts + the bonus token, per cycle
    accepted_per_pos: list[int]           # cycles whose draft at depth i was accepted
    drafts_per_pos: list[int]             # cycles that drafted to depth i
    acceptance_by_depth_rank: dict        # RankCounts.counts(): what `specscope tune --run` predicts other shapes from
    verify_tokens_mean: float | None      # tokens verified per cycle, root included (None without a cycle)
    # a hybrid drafter's (DRAFTER+ngram) split; None for every other drafter
    ngram_tokens: int | None = None
    accepted_by_source: dict | None = None
    hybrid_cycles: dict | None = None

    @property
    def cycles(self) -> int:
        return len(self.accept_lengths)

    @property
    def accept_length(self) -> float:
        """τ: tokens committed per cycle (accepted + bonus)."""
        return sum(self.accept_lengths) / self.cycles if self.cycles else 0.0

    @property
    def hybrid(self) -> bool:
        return self.hybrid_cycles is not None


class CycleCounts(NamedTuple):
    """One cycle as the profiler counts it (CycleProfiler.add_cycle): tokens committed (accepted + bonus), the
    accepted flag per draft depth along the path, nodes verified, and a hybrid's source per accepted token."""
    accept_length: int
    accepted: list[bool]
    num_draft: int
    sources: list[str] | None


class SpecTally:
    """The counters of one speculative generation, added cycle by cycle -> `stats()`. `model_kind`: a hybrid's
    model drafter (its tree is counted as if it had drafted alone; the copy's tokens by source)."""

    def __init__(self, cfg, kind: str, model_kind: str | None = None):
        self.cfg, self.kind = cfg, kind
        self.accept_lengths: list[int] = []
        self.acc_pos = [0] * cfg.steps            # grow past steps where a hybrid's copy runs deeper
        self.drafts_pos = [0] * cfg.steps
        self.ranks = RankCounts(cfg.steps, cfg.topk)   # what `specscope tune --run` predicts other shapes from
        self.by_source = SourceCounts(model_kind) if model_kind else None
        self.verified: list[int] = []             # draft nodes verified per cycle

    def add(self, tree: DraftTree, rows: list[int]) -> CycleCounts:
        """One cycle: `tree` verified, `rows` its accepted path (0 = the root)."""
        hybrid = self.by_source is not None
        self.verified.append(tree.size)
        own = drafted_part(tree, rows) if hybrid else (tree, rows)
        if own is not None:                       # the model drafter's own tree, as if it had drafted alone
            self.ranks.add(*own)
        n_acc = len(rows) - 1
        depth = int(tree.depth.max()) if tree.size else 0
        for pos_list in (self.acc_pos, self.drafts_pos):
            pos_list += [0] * (depth - len(pos_list))
        for i in range(depth):
            self.drafts_pos[i] += 1
            if i < n_acc:
                self.acc_pos[i] += 1
        self.accept_lengths.append(n_acc + 1)
        sources = self.by_source.add(tree, rows) if hybrid else None
        return CycleCounts(n_acc + 1, [i < n_acc for i in range(depth)], tree.size, sources)

    def stats(self) -> SpecStats:
        cfg, cycles, bs = self.cfg, len(self.accept_lengths), self.by_source
        split = dict(ngram_tokens=cfg.ngram_tokens, accepted_by_source=bs.accepted,
                     hybrid_cycles=bs.cycles) if bs is not None else {}
        return SpecStats(self.kind, cfg.steps, cfg.topk, cfg.draft_tokens, self.accept_lengths, self.acc_pos,
                         self.drafts_pos, self.ranks.counts(), 1 + sum(self.verified) / cycles if cycles else None,
                         **split)


def drafted_part(tree: DraftTree, rows: list[int]):
    """A hybrid tree's model-drafted nodes (its first ones: the copy is grafted after them) and the accepted rows
    among them — what that drafter alone would have had accepted under greedy verification — or None when the
    drafter sat the cycle out."""
    n = sum(1 for s in tree.sources or [] if s & DRAFTED) if tree.sources is not None else tree.size
    if n == 0:
        return None
    own = DraftTree(tree.tokens[:n], tree.parents[:n], tree.depth[:n], tree.q)
    return own, [r for r in rows if r <= n]
