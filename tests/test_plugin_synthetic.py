"""The plugin's synthetic acceptance for vLLM's CPU build (plugins/synthetic.py): the loop of vLLM's Triton kernels
in synthetic mode, position by position; a real vLLM runs it in tests/engines/test_vllm.py."""

import torch

from specscope.plugins.synthetic import greedy_impl, random_impl, synthetic_row

PLACEHOLDER = -1


def _batch(drafts: list[list[int]]):
    flat = [t for d in drafts for t in d]
    cu = torch.tensor([sum(len(d) for d in drafts[:i + 1]) for i in range(len(drafts))], dtype=torch.int32)
    width = max(len(d) for d in drafts) + 1
    out = torch.full((len(drafts), width), PLACEHOLDER, dtype=torch.int32)
    return out, cu, torch.tensor(flat, dtype=torch.int32), width - 1


def _never(*a, **k):
    raise AssertionError("synthetic mode must not reach vLLM's own kernel")


def test_row_accepts_below_the_rate_and_stops_at_the_first_rejection():
    rates = [0.9, 0.5, 0.2]
    assert synthetic_row([11, 12, 13], [0.1, 0.4, 0.1], rates, [21, 22, 23], 99) == [11, 12, 13, 99]
    assert synthetic_row([11, 12, 13], [0.1, 0.6, 0.0], rates, [21, 22, 23], 99) == [11, 22]
    assert synthetic_row([11, 12, 13], [0.95, 0.0, 0.0], rates, [21, 22, 23], 99) == [21]
    # a draw equal to the rate rejects (vLLM: uniform < rate), and a padded slot (-1) is never accepted
    assert synthetic_row([11, 12], [0.5, 0.0], [0.5, 1.0], [21, 22], 99) == [21]
    assert synthetic_row([11, -1], [0.0, 0.0], [1.0, 1.0], [21, 22], 99) == [11, 22]


def test_greedy_kernel_fills_greedy_rows_only_and_keeps_placeholders():
    out, cu, drafts, k = _batch([[5, 6, 7], [8, 9], [1, 2, 3]])
    argmax = torch.tensor([50, 60, 70, 80, 90, 10, 20, 30])
    bonus = torch.tensor([[100], [200], [300]])
    uniform = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.9, 0.0, 0.0, 0.0], dtype=torch.float64)
    rates = torch.tensor([1.0, 0.5, 0.5])
    is_greedy = torch.tensor([True, True, False])
    greedy_impl(_never)(out, cu, drafts, argmax, bonus, is_greedy, k, uniform, rates, SYNTHETIC_MODE=True)
    assert out.tolist() == [[5, 6, 7, 100], [8, 90, -1, -1], [-1, -1, -1, -1]]


def test_random_kernel_rejects_into_the_recovered_token():
    out, cu, drafts, k = _batch([[5, 6], [8, 9]])
    recovered = torch.tensor([15, 16, 18, 19])
    bonus = torch.tensor([[100], [200]])
    uniform = torch.tensor([0.2, 0.7, 0.2, 0.1], dtype=torch.float64)
    rates = torch.tensor([0.5, 0.5])
    is_greedy = torch.tensor([False, True])
    random_impl(_never)(out, cu, drafts, None, None, bonus, recovered, uniform, is_greedy, k, 32, rates,
                        NO_DRAFT_PROBS=True, SYNTHETIC_MODE=True)
    assert out.tolist() == [[5, 16, -1], [-1, -1, -1]]


def test_without_synthetic_mode_vllms_own_kernel_runs_with_its_arguments():
    seen = []
    greedy_impl(lambda *a: seen.append(a))("out", "cu", "d", "am", "b", None, 3)
    random_impl(lambda *a: seen.append(a))("out", "cu", "d", "dp", "tp", "b", "r", "u", "g", 3, 32)
    assert seen == [("out", "cu", "d", "am", "b", None, 3, None, None, False),
                    ("out", "cu", "d", "dp", "tp", "b", "r", "u", "g", 3, 32, None, False, False)]


def test_the_pinned_rates_give_the_pinned_accept_length():
    # vLLM's conditional rates for an unconditional schedule [0.8, 0.5, 0.2]: τ = 1 + 0.8 + 0.5 + 0.2 = 2.5
    uncond = [0.8, 0.5, 0.2]
    cond = [p / q for p, q in zip(uncond, [1.0] + uncond[:-1])]
    gen = torch.Generator().manual_seed(0)
    n = 20000
    out, cu, drafts, k = _batch([[1, 2, 3]] * n)
    uniform = torch.rand(3 * n, generator=gen, dtype=torch.float64)
    greedy_impl(_never)(out, cu, drafts, torch.zeros(3 * n, dtype=torch.int64) + 7, torch.full((n, 1), 9), None, k,
                        uniform, torch.tensor(cond), SYNTHETIC_MODE=True)
    tau = ((out != PLACEHOLDER).sum(dim=1)).double().mean().item()
    assert abs(tau - 2.5) < 0.03        # sd of the mean ~0.006
