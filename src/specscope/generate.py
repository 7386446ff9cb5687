"""One request through the decoding loop: `generate` runs it as a batch of one in the batched engine
(engine/batch.py), plain or, given a drafter, speculative (`speculative_generate` checks the drafting shape and
calls it). The engine is the only loop; this returns what one request measured. Above engine/ and speculative/:
nothing there imports it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from specscope.engine.batch import BatchEngine
from specscope.engine.predict import Truth
from specscope.engine.request import Request
from specscope.errors import SpecscopeError
from specscope.runtime.sampling import SamplingParams
from specscope.speculative.decode import SpecConfig, check_chain
from specscope.speculative.stats import SpecTally

if TYPE_CHECKING:
    from specscope.speculative.stats import SpecStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_len: int
    prefill_s: float
    decode_s: float
    stop_reason: str                       # "eos" | "length"
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


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
             stop_ids=(), on_tokens: Callable[[list[int]], None] | None = None, profiler=None,
             drafter=None, cfg=None) -> GenerationResult:
    """Decode one prompt: plain autoregressive decoding (the baseline speculative decoding must match), or with
    `drafter` and its SpecConfig `cfg`, speculative. `on_tokens` streams committed tokens (an exception it raises
    propagates); `profiler` (CycleProfiler) gets every decode step or cycle, prefill left out."""
    engine = BatchEngine(model, drafter, cfg, max_num_seqs=1, max_seq_len=len(prompt_ids) + max_new_tokens,
                         max_num_batched_tokens=max(len(prompt_ids), 1), prefix_caching=False, profiler=profiler)
    t0 = time.perf_counter()
    engine.add(Request("0", list(prompt_ids), max_new_tokens, sampling or SamplingParams(), tuple(stop_ids),
                       on_tokens))
    done, step_ms = [], []
    while engine.busy:
        done += engine.step()
        if engine.last_step is not None and engine.last_step.batch:
            step_ms.append(engine.last_step.ms)
    f = done[0]
    if f.exc is not None:      # the request's own callback (or its commit) failed: the caller's to see
        raise f.exc
    stats = f.stats
    if stats is None and drafter is not None:   # speculative, ended before its first cycle: zero cycles
        stats = SpecTally(cfg, drafter.kind, drafter.model_kind).stats()
    return GenerationResult(f.token_ids, f.prompt_len, f.t_first_token - t0, f.t_finished - f.t_first_token,
                            f.stop_reason, step_ms, stats)


def speculative_generate(target, drafter, prompt_ids: list[int], max_new_tokens: int = 128,
                         sampling: SamplingParams | None = None, stop_ids=(), cfg: SpecConfig | None = None,
                         on_tokens=None, profiler=None) -> GenerationResult:
    """Speculative decoding with any drafter, through `generate`'s loop (the batched engine, one sequence);
    greedy output equals plain `generate`'s, sampling keeps its distribution."""
    cfg = _checked(cfg or SpecConfig.from_knobs(), drafter)
    return generate(target, prompt_ids, max_new_tokens, sampling, stop_ids, on_tokens, profiler, drafter, cfg)


def _checked(cfg: SpecConfig, drafter) -> SpecConfig:
    cfg.validate()
    check_chain(drafter, cfg.topk)
    if cfg.ngram_tokens and drafter.model_kind is None:
        raise SpecscopeError("--ngram-tokens is the n-gram branch of a hybrid drafter (--draft DRAFTER+ngram)")
    return cfg


@torch.inference_mode()
def truths_from_target(target, prompts: list[list[int]], new_tokens: int, aux_layers) -> list[Truth]:
    """Each prompt's greedy continuation of `new_tokens` (no stop token: the replay stops where decoding would)
    and the target's states over prompt + continuation from one forward."""
    out = []
    ctx = int(target.config.max_position_embeddings)
    for p in prompts:
        cont = generate(target, p, max(1, min(new_tokens, ctx - len(p))), stop_ids=()).token_ids
        seq = torch.tensor([list(p) + cont], device=target.device)
        T = seq.shape[1]
        fo = target(seq, torch.arange(T, device=target.device)[None], logits_idx=[T - 1],
                    aux_layers=tuple(aux_layers))
        out.append(Truth(list(p) + cont, len(p), list(fo.aux_hidden)))
    return out
