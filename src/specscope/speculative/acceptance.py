"""Which draft tokens the target accepts.

Greedy: follow the child equal to the target's argmax; the argmax after the last accepted node is the bonus token.
Sampling (lossless): for deterministic (top-k) drafts, try each sibling x with probability p(x), on rejection zero
p(x) and renormalise, and if all fail sample the bonus from what remains; for a chain sampled from q, accept x with
min(1, p(x)/q(x)) and on rejection sample from norm(max(p - q, 0)) (Leviathan et al.). Both leave the output
distribution equal to the target's.
"""

from __future__ import annotations

import torch

from specscope.speculative.tree import DraftTree


def accept_greedy(target_argmax: list[int], tree: DraftTree) -> tuple[list[int], int]:
    """target_argmax[row] = argmax of the target at that verify row. Returns (accepted rows incl. root 0, bonus)."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    rows, cur = [0], 0
    while True:
        want = target_argmax[cur]
        nxt = next((c for c in kids[cur] if tokens[c - 1] == want), None)
        if nxt is None:
            return rows, want
        rows.append(nxt)
        cur = nxt


def _uniform(gen) -> float:
    return float(torch.rand(1, generator=gen, device=gen.device if gen is not None else "cpu"))


def _sample(p: torch.Tensor, gen) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def accept_sampling(target_probs: torch.Tensor, tree: DraftTree, gen) -> tuple[list[int], int]:
    """target_probs: [n+1, V] float32 target distributions per verify row (already temperature/top-k/top-p)."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    rows, cur = [0], 0
    while True:
        p = target_probs[cur]
        if not kids[cur]:
            return rows, _sample(p, gen)
        accepted = None
        if tree.q is not None:
            c = kids[cur][0]
            x, q = tokens[c - 1], tree.q[c - 1]
            if _uniform(gen) < min(1.0, float(p[x]) / max(float(q[x]), 1e-30)):
                accepted = c
            else:
                resid = torch.clamp(p - q, min=0)
                s = resid.sum()
                return rows, _sample(resid / s if s > 0 else p, gen)
        else:
            p = p.clone()
            for c in kids[cur]:
                x = tokens[c - 1]
                if _uniform(gen) < float(p[x]):
                    accepted = c
                    break
                p[x] = 0.0
                s = p.sum()
                if s <= 0:
                    break
                p = p / s
            if accepted is None:
                return rows, _sample(p, gen)
        rows.append(accepted)
        cur = accepted
