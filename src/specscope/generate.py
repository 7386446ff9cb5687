"""Baseline decoding, gpt-fast style: `prefill`, `decode_one_token`, `generate`."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from specscope.runtime.kv_cache import KVCache
from specscope.runtime.sampling import SamplingParams, make_generator, next_token
from specscope.errors import SpecscopeError

if TYPE_CHECKING:
    from specscope.speculative.stats import SpecStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_len: int
    prefill_s: float
    decode_s: float
    stop_reason: str                       # "eos" | "stop" | "length"
    step_ms: list[float] = field(default_factory=list)   # per decode step (baseline) or per cycle (speculative)
    stats: SpecStats | None = None         # what drafting measured; None for plain decoding

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_context(model, prompt_len: int, max_new_tokens: int, extra: int = 0) -> int:
    """Cache size for a request; clear error if it cannot fit in the model's context."""
    ctx = model.config.max_position_embeddings
    if prompt_len == 0:
        raise SpecscopeError("the prompt is empty")
    if prompt_len >= ctx:
        raise SpecscopeError(f"the prompt has {prompt_len} tokens but the model's context is {ctx}; shorten it")
    if max_new_tokens < 1:
        raise SpecscopeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > ctx:  # fail before streaming anything, not halfway through
        raise SpecscopeError(f"the prompt has {prompt_len} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                             f"the model's context of {ctx}; lower --max-new-tokens to at most {ctx - prompt_len}")
    need = prompt_len + max_new_tokens + extra
    return min(need, ctx + extra) if need > ctx else need


@torch.inference_mode()
def prefill(model, cache: KVCache, ids: torch.Tensor, aux_layers=()):
    """Run the prompt ids [1, T] at slots cache.length.., commit them; return the last logits (and aux states)."""
    T = ids.shape[1]
    cache.check_room(cache.length + T)
    pos = torch.arange(cache.length, cache.length + T, device=ids.device)[None]
    out = model(ids, pos, cache, logits_idx=[T - 1], aux_layers=aux_layers)
    cache.length += T
    return out


@torch.inference_mode()
def decode_one_token(model, cache: KVCache, token: torch.Tensor, aux_layers=()):
    """One token [1, 1] at the next slot; commits it."""
    cache.check_room(cache.length + 1)
    pos = torch.tensor([[cache.length]], device=token.device)
    out = model(token, pos, cache, aux_layers=aux_layers)
    cache.length += 1
    return out


class StopCriteria:
    def __init__(self, max_new_tokens: int, stop_ids=()):
        self.max_new_tokens = max_new_tokens
        self.stop_ids = set(int(s) for s in stop_ids)

    def emit(self, produced: list[int], new: list[int], on_tokens=None) -> str | None:
        """clip `new`, append what is kept to `produced`, stream it to `on_tokens`; return the stop reason."""
        kept, reason = self.clip(produced, new)
        produced += kept
        if on_tokens:
            on_tokens(kept)
        return reason

    def clip(self, produced: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Take tokens from `new` in order as baseline decoding would; return (kept, stop_reason or None)."""
        kept = []
        for t in new:
            kept.append(t)
            if t in self.stop_ids:
                return kept, "eos"
            if len(produced) + len(kept) >= self.max_new_tokens:
                return kept, "length"
        return kept, None


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
             stop_ids=(), on_tokens: Callable[[list[int]], None] | None = None, profiler=None) -> GenerationResult:
    """Plain autoregressive decoding (the baseline speculative decoding must match)."""
    sampling = sampling or SamplingParams()
    device = model.device
    max_len = check_context(model, len(prompt_ids), max_new_tokens)
    cache = model.new_cache(max_len)
    gen = make_generator(sampling, device)
    stop = StopCriteria(max_new_tokens, stop_ids)
    ids = torch.tensor([prompt_ids], device=device)
    sync(device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids).logits[:, -1]
    tok = next_token(logits, sampling, gen)
    t_first = int(tok)
    sync(device)
    t1 = time.perf_counter()
    out: list[int] = []
    reason = stop.emit(out, [t_first], on_tokens)
    step_ms = []
    while reason is None:
        ts = time.perf_counter()
        if profiler is not None:
            with profiler.phase("decode"):
                logits = decode_one_token(model, cache, tok.view(1, 1)).logits[:, -1]
                tok = next_token(logits, sampling, gen)
                t = int(tok)
        else:
            logits = decode_one_token(model, cache, tok.view(1, 1)).logits[:, -1]
            tok = next_token(logits, sampling, gen)
            t = int(tok)  # .item() syncs, so the step time below is real on CUDA too
        step_ms.append((time.perf_counter() - ts) * 1e3)
        with profiler.phase("other") if profiler is not None else nullcontext():   # stop check + streaming
            reason = stop.emit(out, [t], on_tokens)
        if profiler is not None:
            profiler.end_cycle(1)
    t2 = time.perf_counter()
    return GenerationResult(out, len(prompt_ids), t1 - t0, t2 - t1, reason, step_ms)
