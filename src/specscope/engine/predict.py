"""Predicted τ: the engine's speculative loop replayed on the target's known greedy output, without a target forward
per cycle.

Under greedy decoding the target's choice after every position of its own greedy output is that output's next
token, and its hidden states there are the ones one forward over the whole sequence computes (or a capture holds).
So a cycle needs no verify forward: the drafter drafts exactly as the engine drives it (`drafting`, alone, on its
own cache), the engine's greedy rule (`accept_greedy`) accepts against the true next tokens, the drafter is handed
the accepted positions' true states as a verify would hand them (`commit`), and the engine's own counters
(`SpecTally`, `StopCriteria`) count and stop. Draft rows off the true path never need the target's choice: the rule
reads it only at accepted rows. What remains between this and a real run is float rounding of the states (one
forward over the sequence against prefill + verify forwards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest

import torch

from specscope.engine.request import StopCriteria
from specscope.errors import SpecscopeError
from specscope.models.llama import ForwardOutput
from specscope.runtime.sampling import SamplingParams
from specscope.speculative.acceptance import accept_greedy
from specscope.speculative.decode import SpecConfig, check_chain
from specscope.speculative.drafters import Drafter, run_alone
from specscope.speculative.stats import SpecStats, SpecTally

GREEDY = SamplingParams()


@dataclass
class Truth:
    """One sequence as the target decodes it greedily: `ids` (the prompt, then the target's greedy continuation),
    `prompt_len`, and `aux` (per aux layer [1, T, H]: the target's states at every position of `ids`)."""
    ids: list[int]
    prompt_len: int
    aux: list[torch.Tensor]


@dataclass
class Replay:
    """One sequence replayed: the tokens decoding commits, the drafter's counters, and whether the known truth ran
    out before decoding would have stopped (a capture's sequence shorter than max_new_tokens)."""
    tokens: list[int]
    stats: SpecStats
    truncated: bool = False


@dataclass
class Prediction:
    """τ and per-position acceptance a shape gets on some sequences, counted as `SpecStats` counts a real run."""
    shape: SpecConfig
    max_new_tokens: int
    replays: list[Replay] = field(default_factory=list)

    @property
    def label(self) -> str:
        return shape_label(self.shape)

    @property
    def cycles(self) -> int:
        return sum(r.stats.cycles for r in self.replays)

    @property
    def tokens(self) -> int:
        """Tokens the cycles committed (accepted + bonus), as τ counts them."""
        return sum(sum(r.stats.accept_lengths) for r in self.replays)

    @property
    def accept_length(self) -> float:
        """τ over all cycles of all sequences."""
        return self.tokens / self.cycles if self.cycles else 0.0

    @property
    def accepted_per_pos(self) -> list[int]:
        return _sum_lists(r.stats.accepted_per_pos for r in self.replays)

    @property
    def drafts_per_pos(self) -> list[int]:
        return _sum_lists(r.stats.drafts_per_pos for r in self.replays)

    @property
    def per_position(self) -> list[float]:
        """Acceptance at each draft depth: cycles whose draft there was accepted / cycles that drafted there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)]

    def to_dict(self) -> dict:
        s = self.shape
        return {"shape": self.label, "steps": s.steps, "topk": s.topk, "draft_tokens": s.draft_tokens,
                "tau": self.accept_length, "per_position_acceptance": self.per_position,
                "accepted_per_pos": self.accepted_per_pos, "drafts_per_pos": self.drafts_per_pos,
                "cycles": self.cycles, "tokens": self.tokens, "sequences": len(self.replays),
                "truncated": sum(r.truncated for r in self.replays), "max_new_tokens": self.max_new_tokens}


def _sum_lists(lists) -> list[int]:
    return [sum(xs) for xs in zip_longest(*lists, fillvalue=0)]


def shape_label(cfg: SpecConfig) -> str:
    return f"chain {cfg.steps}" if cfg.topk == 1 else f"tree {cfg.steps}x{cfg.topk}x{cfg.draft_tokens}"


def default_tree(declared: SpecConfig | None) -> SpecConfig:
    """The tree a drafter is served with when no knob is given: its declared shape when that is a tree, else
    SpecConfig's default for topk 4."""
    return declared if declared is not None and declared.topk > 1 else SpecConfig.from_knobs(topk=4)


def shapes_for(steps: int, tree: SpecConfig | None) -> list[SpecConfig]:
    """Chains of 1..steps draft tokens, then `tree` if given."""
    return [SpecConfig.from_knobs(steps=k, topk=1) for k in range(1, steps + 1)] + ([tree] if tree else [])


@torch.inference_mode()
def replay(drafter: Drafter, truth: Truth, cfg: SpecConfig, max_new_tokens: int, stop_ids=(),
           context: int | None = None) -> Replay:
    """Greedy speculative decoding of `truth`'s prompt with `drafter` in shape `cfg`, as engine/batch.py runs one
    sequence, the target's forwards replaced by `truth`. `context`: the target's (drafting stops short of it as
    the engine's does); None: no limit but the truth's length."""
    cfg.validate()
    check_chain(drafter, cfg.topk)
    ids, P = truth.ids, truth.prompt_len
    if not 0 < P < len(ids):
        raise SpecscopeError(f"a sequence to predict on needs a prompt and at least one continuation token "
                             f"(prompt {P} of {len(ids)} tokens)")
    tally, stop = SpecTally(cfg, drafter.kind, drafter.model_kind), StopCriteria(max_new_tokens, stop_ids)
    produced: list[int] = []
    drafter.start(ids[:P], ids[P], ForwardOutput(None, [a[:, :P] for a in truth.aux]),
                  P + max_new_tokens + 1 + cfg.expansion_slots)
    length, truncated = P, False
    reason = stop.emit(produced, [ids[P]])
    while reason is None:
        room = len(ids) - 2 - length              # deepest draft whose true next token is known
        if room < 1:
            truncated = True
            break
        if context is not None:
            room = min(room, context - 1 - length)
        tree = run_alone(drafter.drafting(cfg.within(room), GREEDY, None))
        at = length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.cpu()])   # each verify row's position
        rows, bonus = accept_greedy([ids[p + 1] for p in at.tolist()], tree)
        toks = tree.tokens.tolist()
        new_tokens = [toks[r - 1] for r in rows[1:]] + [bonus]
        # the verify forward's states at the tree's rows: only the accepted ones (on the true path) are read
        drafter.commit(rows, ForwardOutput(None, [a[:, at.to(a.device)] for a in truth.aux]), new_tokens)
        tally.add(tree, rows)
        length += len(rows)
        reason = stop.emit(produced, new_tokens)
    return Replay(produced, tally.stats(), truncated)


def predict(drafter: Drafter, truths: list[Truth], cfg: SpecConfig, max_new_tokens: int, stop_ids=(),
            context: int | None = None) -> Prediction:
    """`replay` over every sequence -> the shape's Prediction."""
    return Prediction(cfg, max_new_tokens, [replay(drafter, t, cfg, max_new_tokens, stop_ids, context)
                                            for t in truths])


def continuation_tokens(max_new_tokens: int, shapes: list[SpecConfig]) -> int:
    """How far the truth must run past the prompt for every shape's last cycle to be verified in full: decoding
    stops at max_new_tokens, but the cycle that gets there drafts (and counts) up to `steps` tokens beyond."""
    return max_new_tokens + max(s.steps for s in shapes) + 1


@dataclass
class PredictedTau:
    """A drafter's Prediction per shape on some sequences: the target's own forward ("own forward") or features
    captured in an engine ("captured")."""
    predictions: list[Prediction]
    sequences: int
    max_new_tokens: int
    source: str

    def metadata(self) -> dict:
        """What travels with an exported drafter (its config.json's specscope.predicted_tau)."""
        return {"tau": {p.label: round(p.accept_length, 3) for p in self.predictions}, "prompts": self.sequences,
                "max_new_tokens": self.max_new_tokens, "source": self.source}

    def to_dict(self) -> dict:
        return {**self.metadata(), "shapes": [p.to_dict() for p in self.predictions]}


def predict_shapes(drafter: Drafter, truths: list[Truth], shapes: list[SpecConfig], max_new_tokens: int,
                   source: str, stop_ids=(), context: int | None = None) -> PredictedTau:
    return PredictedTau([predict(drafter, truths, s, max_new_tokens, stop_ids, context) for s in shapes],
                        len(truths), max_new_tokens, source)
