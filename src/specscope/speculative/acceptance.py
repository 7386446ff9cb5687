"""Which draft tokens the target accepts.

Greedy: follow the child equal to the target's argmax; the argmax after the last accepted node is the bonus token.
Sampling (lossless): one rule for every child, in sibling order — accept draft x with min(1, p(x)/q(x)), and on
rejection replace p by norm(max(p - q, 0)) and go on to the next sibling; when all fail, sample from what remains
(Leviathan et al.; SpecInfer's multi-draft form). A child sampled from the drafter's q (chain sampling) carries q; a
deterministic one (top-k, or copied from the context) has q = one-hot(x), where the rule reads: accept with p(x),
else zero p(x) and renormalise. A sampled child must come before its deterministic siblings (the residual it leaves
is what they are tested against); `DraftTree.graft` keeps it so. Output distribution = the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specscope.runtime.sampling import probs_from_logits
from specscope.speculative.tree import COPIED, DRAFTED, DraftTree


class VerifyOutput(NamedTuple):
    """What verification decided (SGLang's EagleVerifyOutput): the accepted verify rows, root 0 first, and the
    bonus token the target proposes after the last of them."""
    rows: list[int]
    bonus: int


def accept_greedy(target_argmax: list[int], tree: DraftTree) -> VerifyOutput:
    """target_argmax[row] = argmax of the target at that verify row."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    rows, cur = [0], 0
    while True:
        want = target_argmax[cur]
        nxt = next((c for c in kids[cur] if tokens[c - 1] == want), None)
        if nxt is None:
            return VerifyOutput(rows, want)
        rows.append(nxt)
        cur = nxt


def _uniform(gen) -> float:
    return float(torch.rand(1, generator=gen, device=gen.device if gen is not None else "cpu"))


def _sample(p: torch.Tensor, gen) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def accept_sampling(target_probs: torch.Tensor, tree: DraftTree, gen) -> VerifyOutput:
    """target_probs: [n+1, V] float32 target distributions per verify row (already temperature/top-k/top-p)."""
    kids = tree.children()
    tokens = tree.tokens.tolist()
    rows, cur = [0], 0
    while True:
        p = target_probs[cur]
        accepted = None
        for c in kids[cur]:
            x, q = tokens[c - 1], _q_row(tree, c - 1)
            qx = 1.0 if q is None else float(q[x])
            if _uniform(gen) < min(1.0, float(p[x]) / max(qx, 1e-30)):
                accepted = c
                break
            if q is None:              # one-hot q: the residual is p without x
                resid = p.clone()
                resid[x] = 0.0
            else:
                resid = torch.clamp(p - q, min=0)
            s = resid.sum()
            if s <= 0:                 # only by rounding (p <= q everywhere means p = q, always accepted)
                break
            p = resid / s
        if accepted is None:
            return VerifyOutput(rows, _sample(p, gen))
        rows.append(accepted)
        cur = accepted


class Accepted(NamedTuple):
    """A cycle's outcome: the accepted verify rows (0 is the root) and the tokens committed (the accepted drafts
    and the bonus token)."""
    rows: list[int]
    tokens: list[int]


def accept(logits: torch.Tensor, tree: DraftTree, sampling, gen) -> Accepted:
    """The accepted path of `tree` under the target's logits [1 + size, V], greedy or by the sampling rule."""
    if sampling.greedy:
        rows, bonus = accept_greedy(logits.argmax(-1).tolist(), tree)
    else:
        rows, bonus = accept_sampling(probs_from_logits(logits, sampling), tree, gen)
    toks = tree.tokens.tolist()
    return Accepted(rows, [toks[r - 1] for r in rows[1:]] + [bonus])


def _q_row(tree: DraftTree, node: int) -> torch.Tensor | None:
    """The distribution a node was sampled from, or None for a deterministic (one-hot) proposal."""
    return tree.q[node] if tree.q is not None and node < tree.q.shape[0] else None


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


class SourceCounts:
    """A hybrid's accepted tokens by source, and its cycles by what each source alone would have had accepted.

    `accepted`: {drafter kind (e.g. eagle3), "ngram", "both"} -> accepted draft tokens proposed by that source
    only, or by both (a node where the copy and the drafter agreed). `cycles`: "mode,a_d,a_c,c_len,c_new" -> count,
    where mode is "tree" (drafter + grafted copy) or "copy" (the drafter sat out), a_d / a_c are the accepted nodes
    drafted / copied (under greedy verification exactly what each source alone would have had accepted: the
    accepted path's prefix within its nodes), c_len the copy's nodes and c_new those it added to the tree. What
    `specscope tune` predicts other n-gram budgets from (`economics.tune.HybridModel`)."""

    def __init__(self, kind: str):
        self.names = {DRAFTED: kind, COPIED: "ngram", DRAFTED | COPIED: "both"}
        self.accepted = {name: 0 for name in self.names.values()}
        self.cycles: dict[str, int] = {}

    def add(self, tree: DraftTree, rows: list[int]) -> list[str]:
        """One cycle; returns the source of each accepted draft token, in order."""
        src = tree.node_sources()
        acc = [src[r - 1] for r in rows[1:]]
        for s in acc:
            self.accepted[self.names[s]] += 1
        mode = "tree" if any(s & DRAFTED for s in src) else "copy"
        key = ",".join(map(str, (mode, sum(1 for s in acc if s & DRAFTED), sum(1 for s in acc if s & COPIED),
                                 sum(1 for s in src if s & COPIED), sum(1 for s in src if s == COPIED))))
        self.cycles[key] = self.cycles.get(key, 0) + 1
        return [self.names[s] for s in acc]

    @staticmethod
    def merge(dicts: list[dict]) -> dict | None:
        """Sum `accepted` or `cycles` dicts, e.g. one per prompt."""
        dicts = [d for d in dicts if d]
        if not dicts:
            return None
        out: dict = {}
        for d in dicts:
            for k, v in d.items():
                out[k] = out.get(k, 0) + v
        return out
