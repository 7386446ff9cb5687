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


class RankCounts:
    """Acceptance by (depth, sibling rank) along the accepted path: after each verify, which sibling ranks were
    offered under the accepted parent at each depth and which one the target took. What the tuner needs to predict
    other tree shapes from one run (`economics.tune.AcceptanceModel.from_counts`).

    A tree lists siblings in descending draft score, so a child's rank is its order among its parent's kept
    children (kept siblings are always the top ranks: selection is by score)."""

    def __init__(self, steps: int, topk: int):
        self.accepted = [[0] * topk for _ in range(steps)]
        self.offered = [[0] * topk for _ in range(steps)]
        # the same along the all-rank-1 path only: what a chain of the same drafter would see
        self.top_accepted = [0] * steps
        self.top_offered = [0] * steps
        self.tree_sizes: list[int] = []

    def add(self, tree: DraftTree, rows: list[int]) -> None:
        """One cycle: the proposed tree and the accepted verify rows (0 = the root, node i = row i + 1)."""
        self.tree_sizes.append(tree.size)
        steps, topk = len(self.offered), len(self.offered[0])
        if tree.size == 0:
            # nothing proposed (n-gram without a match): for τ it is a first draft rejected
            self.offered[0][0] += 1
            self.top_offered[0] += 1
            return
        kids: dict[int, list[int]] = {}
        for i, par in enumerate(tree.parents.tolist()):
            kids.setdefault(par, []).append(i)
        top_path = True                               # every accepted node so far was its parent's rank 1
        for d in range(1, min(len(rows), steps) + 1):  # parent at depth d-1 was accepted (row 0 = the root)
            children = kids.get(rows[d - 1] - 1, [])
            if not children:
                break
            for r in range(min(len(children), topk)):
                self.offered[d - 1][r] += 1
            if top_path:
                self.top_offered[d - 1] += 1
            rank = None
            if d < len(rows) and rows[d] - 1 in children:
                rank = children.index(rows[d] - 1)
                if rank < topk:
                    self.accepted[d - 1][rank] += 1
            if top_path and rank == 0:
                self.top_accepted[d - 1] += 1
            top_path = top_path and rank == 0

    def counts(self) -> dict:
        return {"accepted": self.accepted, "offered": self.offered, "top_path_accepted": self.top_accepted,
                "top_path_offered": self.top_offered}

    @staticmethod
    def merge(counts: list[dict]) -> dict | None:
        """Sum `counts()` dicts of runs with the same (steps, topk), e.g. one per prompt."""
        counts = [c for c in counts if c]
        if not counts:
            return None

        def add(a, b):
            return [add(x, y) for x, y in zip(a, b)] if isinstance(a, list) else a + b

        out = counts[0]
        for c in counts[1:]:
            out = {k: add(out[k], c[k]) for k in out}
        return out
