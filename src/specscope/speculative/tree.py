"""Draft trees: the token tree a drafter proposes, its attention mask and positions for one verify forward.

Rows of a verify forward are [root, node 0, node 1, ...]; nodes are ordered parents-before-children and
`parents[i]` is the parent's node index (-1 = the root). A chain is the tree whose every parent is the previous node.
A hybrid tree also says which source proposed each node (`sources`: DRAFTED, COPIED or both, as bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

DRAFTED, COPIED = 1, 2            # source bits: the model drafter's tree, the n-gram branch


class VerifyInput(NamedTuple):
    """One verify forward's inputs for a tree (SGLang's EagleVerifyInput): rows are [root, node 0, node 1, ...]."""
    ids: torch.Tensor             # [1, n+1]
    positions: torch.Tensor       # [1, n+1]: the root's position + depth
    slots: torch.Tensor           # [1, n+1]: cache slots the rows are written to
    mask: torch.Tensor            # [1, n+1, prefix_len + n + 1]: the prefix and each row's ancestors


@dataclass
class DraftTree:
    tokens: torch.Tensor          # [n] target-vocab ids of the draft nodes (root excluded)
    parents: torch.Tensor         # [n] parent node index, -1 = root
    depth: torch.Tensor           # [n] 1 = child of the root
    # [m, V]: the distribution each of the first m nodes was sampled from (chain sampling); nodes past m, and all
    # nodes when None, are deterministic proposals (top-k or copied): q = one-hot
    q: torch.Tensor | None = None
    sources: list[int] | None = None   # [n] DRAFTED | COPIED bits per node (hybrid trees); None = one source
    # [n] the drafter's cumulative log-prob of each node (-inf for nodes it did not propose); None = not known
    scores: list[float] | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def node_sources(self) -> list[int]:
        """The source bits of every node (all DRAFTED for a single-source tree)."""
        return list(self.sources) if self.sources is not None else [DRAFTED] * self.size

    @classmethod
    def empty(cls, device="cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone())

    @classmethod
    def chain(cls, tokens, q=None, device="cpu") -> "DraftTree":
        t = torch.as_tensor(tokens, dtype=torch.long, device=device)
        n = t.numel()
        return cls(t, torch.arange(-1, n - 1, device=device), torch.arange(1, n + 1, device=device), q)

    def children(self) -> list[list[int]]:
        """children[row] = rows of its children; row 0 = root, row i+1 = node i."""
        kids = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i + 1)
        return kids

    def ancestor_matrix(self) -> torch.Tensor:
        """[n+1, n+1] bool: row r sees row c iff c is r or an ancestor of r (root = row 0)."""
        n = self.size
        anc = torch.eye(n + 1, dtype=torch.bool, device=self.tokens.device)
        for i, p in enumerate(self.parents.tolist()):
            anc[i + 1] |= anc[p + 1]
        return anc

    def verify_inputs(self, root: int, root_pos: int, prefix_len: int) -> VerifyInput:
        dev = self.tokens.device
        n = self.size
        if n == 0:   # a plain step, the commonest under load: the root alone, over every slot before it
            t = torch.tensor([[root], [root_pos], [prefix_len]], device=dev)
            return VerifyInput(t[0:1], t[1:2], t[2:3], torch.ones(1, 1, prefix_len + 1, dtype=torch.bool, device=dev))
        ids = torch.cat([torch.tensor([root], device=dev), self.tokens])[None]
        pos = (root_pos + torch.cat([torch.zeros(1, dtype=torch.long, device=dev), self.depth]))[None]
        slots = torch.arange(prefix_len, prefix_len + n + 1, device=dev)[None]
        mask = torch.cat([torch.ones(n + 1, prefix_len, dtype=torch.bool, device=dev), self.ancestor_matrix()], 1)
        return VerifyInput(ids, pos, slots, mask[None])

    def graft(self, chain: list[int]) -> "DraftTree":
        """This tree with `chain` (the tokens after the root) merged in as a trie: the chain walks down existing
        nodes while one carries its next token, and the rest hangs below as new nodes appended at the end. Nodes
        keep their indices, so the first `size` nodes are still this tree (and `q` still covers the sampled ones),
        and every node of it keeps its rank among siblings: a sampled child stays before the deterministic new
        ones, which the acceptance rule needs."""
        toks, pars, dep = self.tokens.tolist(), self.parents.tolist(), self.depth.tolist()
        src = self.node_sources()
        scores = list(self.scores) if self.scores is not None else None
        child = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks))}
        cur = -1
        for t in chain:
            nxt = child.get((cur, t))
            if nxt is None:
                nxt = child[(cur, t)] = len(toks)
                toks.append(t); pars.append(cur); dep.append(dep[cur] + 1 if cur >= 0 else 1); src.append(0)
                if scores is not None:
                    scores.append(float("-inf"))
            src[nxt] |= COPIED
            cur = nxt
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=self.tokens.device)   # noqa: E731
        return DraftTree(as_t(toks), as_t(pars), as_t(dep), self.q, src, scores)

    def subset(self, keep: list[int]) -> "DraftTree":
        """The tree of the nodes `keep` (each one's parent kept too), in their order here: parents still come
        before children, siblings keep their ranks, and the sampled nodes `q` covers stay first."""
        keep = sorted(keep)
        index = {c: j for j, c in enumerate(keep)}
        pars = self.parents.tolist()
        if any(pars[i] != -1 and pars[i] not in index for i in keep):
            raise ValueError("subset: a kept node's parent is not kept")
        dev = self.tokens.device
        at = torch.tensor(keep, dtype=torch.long, device=dev)
        q = None
        if self.q is not None:
            m = sum(1 for i in keep if i < self.q.shape[0])
            q = self.q[at[:m]] if m else None
        return DraftTree(self.tokens[at], torch.tensor([index[pars[i]] if pars[i] != -1 else -1 for i in keep],
                                                       dtype=torch.long, device=dev),
                         self.depth[at], q,
                         [self.sources[i] for i in keep] if self.sources is not None else None,
                         [self.scores[i] for i in keep] if self.scores is not None else None)


def select_nodes(cand_tokens, cand_parents, cand_scores, cand_depth, budget: int):
    """Keep the `budget` best candidates by cumulative log-prob such that every kept node's parent is kept.

    Candidates are indexed 0..m-1 with parents -1 (root) or an earlier candidate index. Since log-probs are <= 0 a
    child never outscores its parent, so a score-ordered pass that skips orphans (possible only under ties) keeps
    the tree closed. Returns a DraftTree ordered parents-before-children, plus the kept candidate indices.
    """
    order = sorted(range(len(cand_tokens)), key=lambda i: (-cand_scores[i], cand_depth[i], i))
    kept: list[int] = []
    kept_set = set()
    for i in order:
        if len(kept) >= budget:
            break
        p = cand_parents[i]
        if p == -1 or p in kept_set:
            kept.append(i)
            kept_set.add(i)
    kept.sort(key=lambda i: (cand_depth[i], -cand_scores[i], i))
    index = {c: j for j, c in enumerate(kept)}
    tokens = torch.tensor([cand_tokens[i] for i in kept], dtype=torch.long)
    parents = torch.tensor([index[cand_parents[i]] if cand_parents[i] != -1 else -1 for i in kept], dtype=torch.long)
    depth = torch.tensor([cand_depth[i] for i in kept], dtype=torch.long)
    return DraftTree(tokens, parents, depth, scores=[float(cand_scores[i]) for i in kept]), kept
