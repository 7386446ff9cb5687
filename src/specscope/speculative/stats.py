"""What one speculative generation measured: `GenerationResult.stats` (None for plain decoding).

Typed so that a reader names a field instead of a string key (a misspelt key read None silently)."""

from __future__ import annotations

from dataclasses import dataclass


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
