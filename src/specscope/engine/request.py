"""What a decoding request is and what comes back: `Request`, `Finished`, their per-token logprob records, and the
two limits every request meets (`check_context` before it runs, `StopCriteria` while it runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from specscope.errors import SpecscopeError
from specscope.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from specscope.speculative.stats import SpecStats


class TokenLogprob(NamedTuple):
    """One position under the target: the log-softmax of its raw logits (before temperature, top-k, top-p), at
    the token that stands there and at the k likeliest tokens, as (id, logprob), likeliest first."""
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] (the rows that chose or predicted `tokens`, one each) -> a TokenLogprob per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if not k:
        return [TokenLogprob(c, []) for c in chosen]
    vals, idx = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return [TokenLogprob(c, list(zip(i, v))) for c, i, v in zip(chosen, idx.tolist(), vals.tolist())]


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple = ()
    on_tokens: Callable[[list[int]], None] | None = None   # streamed as tokens are committed; raising cancels
    # log-probabilities, taken from the logits the step chose each token by (a verify row when drafts were
    # accepted): so speculation never changes them. None: not computed; k: also the k likeliest tokens
    logprobs: int | None = None
    prompt_logprobs: int | None = None   # the same for prompt tokens 2..n: the prompt is then computed, not reused
    # (records, prompt) -> None: the prompt's records once (its first token's is None), then each committed
    # token's, always before on_tokens gets those tokens
    on_logprobs: Callable[[list, bool], None] | None = None


@dataclass
class Finished:
    id: str
    token_ids: list[int]
    stop_reason: str                      # "eos" | "length" | "cancelled" | "aborted" (see exc)
    prompt_len: int
    t_queued: float                       # perf_counter seconds: added, first scheduled, first token, finished
    t_scheduled: float | None
    t_first_token: float | None
    t_finished: float
    stats: SpecStats | None = None        # what its drafter measured; None for a sequence decoded plain
    exc: BaseException | None = None      # what on_tokens (or committing the sequence) raised, for "aborted"
    cached_tokens: int = 0                # prompt tokens whose keys/values were reused, not computed
    logprobs: list[TokenLogprob] | None = None          # per token_ids entry (Request.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # per prompt token, None for the first


def check_context(model, prompt_len: int, max_new_tokens: int) -> None:
    """A clear error, before anything runs, when a request cannot fit in the model's context."""
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
        """Take tokens from `new` in order as plain decoding would; return (kept, stop_reason or None)."""
        kept = []
        for t in new:
            kept.append(t)
            if t in self.stop_ids:
                return kept, "eos"
            if len(produced) + len(kept) >= self.max_new_tokens:
                return kept, "length"
        return kept, None
