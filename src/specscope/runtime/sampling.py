"""Turning logits into a next-token distribution and a token: temperature, top-k, top-p; greedy at T=0."""

from __future__ import annotations

from dataclasses import dataclass, asdict

import torch

from specscope.runtime.params import check_sampling


@dataclass
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # the one schema the CLI and the server use too (runtime/params.py)
        self.temperature, self.top_p, self.top_k, self.seed = check_sampling(
            self.temperature, self.top_p, self.top_k, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self):
        return asdict(self)


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature / top-k / top-p filtering."""
    logits = logits.float() / max(sp.temperature, 1e-6)
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) > sp.top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one id per row of [..., V] probabilities."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if sp.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, sp), generator)


def make_generator(sp: SamplingParams, device) -> torch.Generator | None:
    if sp.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(sp.seed if sp.seed is not None else torch.seed())
    return g
