"""The draft vocabulary: the most frequent target tokens of the training responses -> d2t / t2d."""

from __future__ import annotations

import torch

from specscope.errors import SpecscopeError


def token_counts(data, vocab_size: int) -> torch.Tensor:
    """Counts of assistant-turn tokens over the captured data (the tokens a drafter must propose)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(data)):
        s = data.read(i, ("input_ids", "loss_mask"))      # not the features: a streamed capture reads only these
        ids = s["input_ids"].long()[s["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size].cpu()
    return counts


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`draft_vocab_size` ids by count (ties and unseen ids by ascending id), sorted ascending.
    Returns d2t (offsets, int64 [Vd]) and t2d (bool [V])."""
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise SpecscopeError(f"--draft-vocab must be in 1..{V} (the target vocabulary), got {draft_vocab_size}")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices
    ids = order[:draft_vocab_size].sort().values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    tot = int(counts.sum())
    return float(counts[t2d].sum()) / tot if tot else 0.0
