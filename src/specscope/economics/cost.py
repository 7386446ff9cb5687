"""The cost model of speculative decoding (reference §6).

τ (accept_length) counts the tokens one cycle yields: accepted drafts + the bonus token, so plain decoding has τ = 1.
A configuration pays when τ · T_decode > T_draft + T_verify(n) + T_other; the ratio of the two is the speedup.

At batch size B one target forward serves B sequences: plain decoding costs T(B, 1)/B per sequence-token, and
speculation (T(B, n) + D(B) + B·T_other)/(B·τ): the drafter's forwards run once for the whole batch (engine/batch.py
drafts every sequence in one forward per level; n-gram drafting is free), so D(B) grows with rows as a forward does,
while bookkeeping runs per sequence. The break-even τ = (T(B, n) + D(B) + B·T_other)/T(B, 1), and T(B, n) grows with
B·n once the forward is compute-bound while T(B, 1) stays flat longer, so the τ needed rises with B until plain
decoding wins (the crossover).

Acceptance comes in two shapes:
- per position (chain, or per depth of a tree): unconditional a_k = P(the first k drafts are all accepted),
  conditional c_k = P(draft k accepted | drafts 1..k-1 accepted); a_k = Π_{j≤k} c_j and τ = 1 + Σ_k a_k.
- per tree node: p(node) = P(node is the target's token | its parent was accepted). Under greedy verification
  siblings are mutually exclusive (at most one equals the target's argmax), so P(node on the accepted path) is the
  product of p along its path and τ = 1 + Σ_nodes Π_path p (the quantity EAGLE-2 and Sequoia maximise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specscope.errors import SpecscopeError


def iid_expected_tokens(alpha: float, gamma: int) -> float:
    """E = (1 - α^(γ+1)) / (1 - α): tokens per cycle with γ drafts each accepted independently with prob α."""
    _check_prob(alpha, "alpha")
    if gamma < 0:
        raise SpecscopeError(f"the number of draft tokens must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)  # the limit of the geometric sum
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def iid_alpha_for(tau: float, gamma: int, tol: float = 1e-12) -> float | None:
    """The per-token acceptance α at which the i.i.d. model yields τ tokens per cycle, or None if τ > γ + 1.

    E(α) rises monotonically from 1 (α=0) to γ+1 (α=1), so bisection finds the unique root; each step evaluates
    E in closed form, so the cost does not grow with γ (a huge --steps stays instant)."""
    if gamma < 1:
        raise SpecscopeError(f"steps must be >= 1, got {gamma}")
    if tau <= 1.0:
        return 0.0
    if tau > gamma + 1 + 1e-12:
        return None
    if tau >= gamma + 1 - 1e-12:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if _geometric_sum(mid, gamma + 1) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _geometric_sum(alpha: float, n: int) -> float:
    """Σ_{k<n} α^k for α in [0, 1). Written as -expm1(n·ln α) / (1 - α): the naive (1 - α^n) / (1 - α) cancels
    catastrophically near α = 1, and 1 - α is exact for the α >= 0.5 where that matters."""
    if alpha <= 0.0:
        return 1.0
    return -math.expm1(n * math.log(alpha)) / (1.0 - alpha)


def conditional_from_unconditional(a: list[float]) -> list[float]:
    """c_k = a_k / a_{k-1} (a_0 = 1); once a_{k-1} is 0 nothing further is reachable, c_k = 0."""
    out, prev = [], 1.0
    for x in a:
        _check_prob(x, "per-position acceptance")
        out.append(x / prev if prev > 0 else 0.0)
        prev = x
    return [min(1.0, c) for c in out]


def unconditional_from_conditional(c: list[float]) -> list[float]:
    out, run = [], 1.0
    for x in c:
        _check_prob(x, "conditional acceptance")
        run *= x
        out.append(run)
    return out


def chain_tau(conditional: list[float], steps: int | None = None) -> float:
    """τ of a chain of `steps` drafts from per-position conditional acceptance.

    Truncating is exact: draft k of a longer chain is the same token as draft k of a shorter one. Positions past
    the measured ones reuse the last measured rate (a stated extrapolation; `extends_measurement` tells callers)."""
    steps = len(conditional) if steps is None else steps
    if steps < 0:
        raise SpecscopeError(f"steps must be >= 0, got {steps}")
    if steps > 0 and not conditional:
        raise SpecscopeError("no per-position acceptance to predict τ from")
    c = list(conditional[:steps]) + [conditional[-1]] * max(0, steps - len(conditional))
    return 1.0 + sum(unconditional_from_conditional(c))


def tree_tau(parents: list[int], p: list[float]) -> float:
    """τ of a draft tree. parents[i] is node i's parent index (-1 = the root, i.e. the last committed token) and
    must come before i; p[i] = P(node i accepted | parent accepted)."""
    if len(parents) != len(p):
        raise SpecscopeError(f"tree has {len(parents)} parents but {len(p)} acceptance values")
    reach = []
    for i, (par, pi) in enumerate(zip(parents, p)):
        _check_prob(pi, "node acceptance")
        if par >= i or par < -1:
            raise SpecscopeError(f"tree node {i} has parent {par}; parents must be listed before children")
        reach.append(pi * (reach[par] if par >= 0 else 1.0))
    # siblings are exclusive events, so their reach probabilities may not exceed their parent's
    for i in range(-1, len(p)):
        kids = sum(reach[j] for j, par in enumerate(parents) if par == i)
        if kids > (reach[i] if i >= 0 else 1.0) + 1e-9:
            raise SpecscopeError(f"children of tree node {i} have acceptance summing above 1; greedy acceptance "
                                 f"accepts at most one sibling")
    return 1.0 + sum(reach)


@dataclass
class CycleCost:
    """Per-cycle milliseconds of one configuration and the plain decode step it competes with, at `batch`
    sequences: decode_ms, verify_ms and draft_ms are one step's forwards over all of them (drafting is batched),
    other_ms is per sequence (batch 1: the single-sequence cycle)."""

    decode_ms: float
    draft_ms: float
    verify_ms: float
    other_ms: float = 0.0
    batch: int = 1

    def __post_init__(self):
        check_positive(self.decode_ms, "decode time")
        check_positive(self.verify_ms, "verify time")
        check_nonneg(self.draft_ms, "draft time")
        check_nonneg(self.other_ms, "other time")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise SpecscopeError(f"batch size must be an integer >= 1, got {self.batch}")

    @property
    def cycle_ms(self) -> float:
        """One cycle of every sequence: the batch's drafting and verify forward and each sequence's bookkeeping."""
        return self.draft_ms + self.verify_ms + self.batch * self.other_ms

    @property
    def break_even_tau(self) -> float:
        return self.cycle_ms / self.decode_ms

    @property
    def plain_ms_per_token(self) -> float:
        """Plain decoding, ms per sequence-token: T(B, 1)/B."""
        return self.decode_ms / self.batch

    def spec_ms_per_token(self, tau: float) -> float:
        """Speculation at accept length τ, ms per sequence-token: (T(B, n) + D(B) + B·other)/(B·τ)."""
        return self.cycle_ms / (self.batch * tau)

    def speedup(self, tau: float) -> float:
        return tau * self.decode_ms / self.cycle_ms


def predicted_speedup(tau: float, decode_ms: float, draft_ms: float, verify_ms: float, other_ms: float = 0.0,
                      batch: int = 1) -> float:
    """speedup = τ · T_decode / (T_draft + T_verify(n) + T_other); at batch B, τ·T(B, 1)/(T(B, n) + D(B) + B·T_other)
    with decode_ms = T(B, 1), verify_ms = T(B, n) and draft_ms = D(B), the batch's drafting."""
    return CycleCost(decode_ms, draft_ms, verify_ms, other_ms, batch).speedup(tau)


def check_positive(x: float, what: str):
    if x is None or not math.isfinite(x) or x <= 0:
        raise SpecscopeError(f"{what} must be a positive number of milliseconds, got {x}")


def check_nonneg(x: float, what: str):
    if x is None or not math.isfinite(x) or x < 0:
        raise SpecscopeError(f"{what} must be >= 0 ms, got {x}")


def _check_prob(x: float, what: str):
    if not (0.0 <= x <= 1.0):
        raise SpecscopeError(f"{what} must be a probability in [0, 1], got {x}")


def expected_tree(rate, steps: int, topk: int, draft_tokens: int) -> tuple[list[int], list[float]]:
    """The tree a dynamic-tree drafter (EAGLE-2/3, SGLang's knobs) builds when its confidence equals acceptance.

    `rate(depth, rank)` = P(the rank-th child (1-based, by draft score) is accepted | its parent was accepted).
    Mirrors that drafter: level 1 is the root's top-k children; each further level expands the best `topk` frontier
    nodes into `topk` children each, scored by the product along the path (the drafter's cumulative draft
    probability, under calibration); then the best `draft_tokens - 1` nodes overall are kept, parents first.
    Returns (parents, p) for `tree_tau`."""
    if steps < 1 or topk < 1 or draft_tokens < 2:
        raise SpecscopeError(f"need steps >= 1, topk >= 1, draft_tokens >= 2; got {steps}, {topk}, {draft_tokens}")
    # candidates: (score, depth, parent candidate index, conditional p)
    cands: list[tuple[float, int, int, float]] = []
    frontier = []
    for r in range(1, topk + 1):
        p = rate(1, r)
        cands.append((p, 1, -1, p))
        frontier.append(len(cands) - 1)
    for level in range(2, steps + 1):
        nxt = []
        for f in frontier:
            for r in range(1, topk + 1):
                p = rate(level, r)
                cands.append((cands[f][0] * p, level, f, p))
                nxt.append(len(cands) - 1)
        nxt.sort(key=lambda i: -cands[i][0])
        frontier = nxt[:topk]
    order = sorted(range(len(cands)), key=lambda i: (-cands[i][0], cands[i][1], i))
    kept, kept_set = [], set()
    for i in order:
        if len(kept) >= draft_tokens - 1:
            break
        par = cands[i][2]
        if par == -1 or par in kept_set:
            kept.append(i)
            kept_set.add(i)
    kept.sort(key=lambda i: (cands[i][1], i))
    index = {c: j for j, c in enumerate(kept)}
    parents = [index[cands[i][2]] if cands[i][2] != -1 else -1 for i in kept]
    return parents, [cands[i][3] for i in kept]
