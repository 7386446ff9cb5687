"""vLLM's synthetic rejection sampling on its CPU build: the verify-cost surface at pinned acceptance (issue 47).

`--speculative-config '{..., "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}'` makes
vLLM accept each draft token with a fixed per-position rate instead of by the target, so a step's cost can be
measured at a chosen τ before a good drafter exists. The rates are vLLM's own (conditional, from
`unconditional_to_conditional_rates`), and so are the uniform draws; only the loop that applies them is missing on
the CPU build, whose C++ fallbacks of the two rejection kernels assert `not SYNTHETIC_MODE`
(`vllm/utils/cpu_triton_utils.py`). This module supplies that loop with the semantics of vLLM's Triton kernels
(`rejection_greedy_sample_kernel` / `rejection_random_sample_kernel`): per request, draft token `pos` is accepted
when it is a real token (>= 0) and its uniform draw is below the rate of its position; the first rejected position
takes the target's token there (greedy: the argmax; random: the recovered token) and ends the request's row; a row
accepted whole appends the bonus token. Without synthetic mode every call goes to vLLM's own implementation.

Installed by the plugin's `register()` in each vLLM process of a CPU build, before the platform registers its
kernel overrides (vLLM >= 0.31 reads the implementations from `cpu_triton_utils` then; 0.29 / 0.30 read the
module's kernel wrappers when the CPU model runner is built).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("specscope.plugins.synthetic")
_said: list = []        # the one log line, said at the first synthetic step

# vLLM's names: the C++ fallback implementations and, on 0.29 / 0.30, the `kernel[grid]` wrappers around them
IMPLS = {"greedy": ("_rejection_greedy_sample_kernel_impl", "rejection_greedy_sample_kernel"),
         "random": ("_rejection_random_sample_kernel_impl", "rejection_random_sample_kernel")}


def synthetic_row(drafts: list[int], uniform: list[float], rates: list[float], replacement: list[int],
                  bonus: int) -> list[int]:
    """One request's output tokens under synthetic acceptance (vLLM's kernels, position by position)."""
    row = []
    for pos, token in enumerate(drafts):
        if token >= 0 and uniform[pos] < rates[pos]:
            row.append(token)
        else:
            row.append(replacement[pos])
            return row
    row.append(bonus)
    return row


def synthetic_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, replacement_ids, bonus_token_ids,
                     uniform_probs, rates, rows) -> None:
    """Write the synthetic rows of the requests `rows(i)` selects into output_token_ids [batch, max_spec_len + 1]
    (the rest keep their placeholders, as the kernels leave them)."""
    import torch

    if not _said:
        _said.append(True)
        # printed as the phase report is: vLLM's worker processes drop this package's log records
        print("specscope: synthetic rejection sampling on vLLM's CPU build (specscope.plugins.synthetic): drafts are "
              "accepted at the pinned rates, not by the target, so outputs are not the target's", file=sys.stderr,
              flush=True)
    ends = cu_num_draft_tokens.tolist()
    drafts, replacement = draft_token_ids.tolist(), replacement_ids.tolist()
    uniform, rate = uniform_probs.tolist(), rates.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    start = 0
    for i, end in enumerate(ends):
        if rows(i):
            row = synthetic_row(drafts[start:end], uniform[start:end], rate, replacement[start:end], bonus[i])
            output_token_ids[i, :len(row)] = torch.tensor(row, dtype=output_token_ids.dtype)
        start = end


def greedy_impl(original):
    """vLLM's greedy CPU kernel, with synthetic mode (its signature, so vLLM binds arguments as it binds its own)."""
    def _rejection_greedy_sample_kernel_impl(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                                             bonus_token_ids, is_greedy, max_spec_len, uniform_probs=None,
                                             synthetic_conditional_rates=None, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                            is_greedy, max_spec_len, uniform_probs, synthetic_conditional_rates, SYNTHETIC_MODE)
        greedy = None if is_greedy is None else is_greedy.tolist()
        synthetic_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                         uniform_probs, synthetic_conditional_rates, lambda i: greedy is None or greedy[i])

    _rejection_greedy_sample_kernel_impl.__wrapped__ = original
    return _rejection_greedy_sample_kernel_impl


def random_impl(original):
    """vLLM's random (sampled) CPU kernel, with synthetic mode."""
    def _rejection_random_sample_kernel_impl(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                             target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                             is_greedy, max_spec_len, vocab_size, synthetic_conditional_rates=None,
                                             NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                            bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
                            synthetic_conditional_rates, NO_DRAFT_PROBS, SYNTHETIC_MODE)
        greedy = is_greedy.tolist()
        synthetic_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, recovered_token_ids,
                         bonus_token_ids, uniform_probs, synthetic_conditional_rates, lambda i: not greedy[i])

    _rejection_random_sample_kernel_impl.__wrapped__ = original
    return _rejection_random_sample_kernel_impl


def register(tested) -> bool:
    """The plugin's entry: installed on the vLLM versions the plugin is tested on (their kernels' signatures are the
    ones above), quietly nowhere else."""
    try:
        import vllm
    except ImportError:
        return False
    return getattr(vllm, "__version__", None) in tested and install()


def install() -> bool:
    """Give vLLM's CPU build synthetic acceptance; False (and nothing changed) where it is not a CPU build or its
    kernels are not the ones this module knows."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.utils import cpu_triton_utils as cpu_tl
    except Exception as e:  # noqa: BLE001 - a build without these modules simply keeps its own kernels
        log.debug("specscope synthetic acceptance: not installed (%s: %s)", type(e).__name__, e)
        return False
    made = {"greedy": greedy_impl, "random": random_impl}
    for kind, (impl_name, wrapper_name) in IMPLS.items():
        original = getattr(cpu_tl, impl_name, None)
        if original is None or hasattr(original, "__wrapped__"):
            continue        # unknown to this build, or installed already
        ours = made[kind](original)
        setattr(cpu_tl, impl_name, ours)
        wrapper = getattr(cpu_tl, wrapper_name, None)       # 0.29 / 0.30: kernel[grid] wrappers made at import
        if wrapper is not None and getattr(wrapper, "func", None) is original:
            wrapper.func = ours
    return True
