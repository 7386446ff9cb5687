"""Dynamic-tree drafting (TreeDrafter.propose, batched per level) against a node-by-node reference.

The reference expands one frontier node per forward, with its mask row built by walking its ancestors, and picks
the next frontier with a plain stable sort. With the row-invariant CPU kernels a 1-row forward gives the bits of
the same row in a batched one, so the two must propose identical trees: masks, positions, slots, parents, states
and tie-breaking all have to agree. (Lossless-output tests cannot see a wrong parent index: verify just rejects.)
"""

import pytest
import torch

from specscope.runtime.sampling import SamplingParams
from specscope.models import rowgemm
from specscope.models.kernels import RowAttention
from specscope.models.linear import PackedLinear, pack_linears
from specscope.speculative.decode import SpecConfig, build_drafter
from specscope.speculative.drafters import Eagle3TreeDrafter
from specscope.speculative.tree import select_nodes
from spec_helpers import random_eagle3, tiny_target

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="no AVX-512 or no C++ compiler here")


def reference_propose(dr, cfg):
    K = cfg.topk
    logits, state = dr._catch_up()
    logp = torch.log_softmax(logits.float(), -1)
    top_s, top_i = torch.topk(logp, min(K, logp.shape[-1]))
    cand = []                     # (token, parent candidate, score (float32 tensor), depth)
    frontier = []                 # (candidate, token, score, state, expansion slot of the parent or None)
    for s, i in zip(top_s, dr._to_target(top_i)):
        cand.append((int(i), -1, s, 1))
        frontier.append((len(cand) - 1, int(i), s, state, None))
    seen = {}                     # candidate -> slots its expansion row sees (ancestors' expansions + its own)
    slot = dr.committed
    for level in range(2, cfg.steps + 1):
        base = slot
        nxt = []
        for j, (ci, tok, score, st, _) in enumerate(frontier):
            par = cand[ci][1]
            vis = list(seen.get(par, [])) + [base + j]
            seen[ci] = vis
            mask = torch.zeros(1, base + j + 1, dtype=torch.bool)
            mask[0, :dr.committed] = True
            mask[0, vis] = True
            pos = torch.tensor([dr.root_pos + level - 1 + dr.pos_offset])
            lg, h = dr._expand(torch.tensor([tok]), st[None], pos, torch.tensor([base + j]), mask)
            lp = torch.log_softmax(lg.float(), -1)[0]
            ts, ti = torch.topk(lp, min(K, lp.shape[-1]))
            for s, t in zip(ts, dr._to_target(ti)):
                c = s + score                                   # float32, as the batched code adds
                cand.append((int(t), ci, c, level))
                nxt.append((len(cand) - 1, int(t), c, h[0], None))
        slot = base + len(frontier)
        nxt.sort(key=lambda f: -float(f[2]))                     # stable: ties keep expansion order
        frontier = nxt[:K]
    dr.cache.truncate(dr.committed)
    tree, _ = select_nodes([c[0] for c in cand], [c[1] for c in cand], [float(c[2]) for c in cand],
                           [c[3] for c in cand], cfg.draft_tokens - 1)
    return tree


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    target = tiny_target(tmp_path_factory.mktemp("t"), layers=4)
    d = random_eagle3(target, draft_vocab=60)
    pack_linears(d, keep_dense=())
    return target, d


@pytest.mark.parametrize("steps,topk,draft_tokens", [(4, 1, 5), (3, 2, 6), (4, 3, 10), (2, 4, 9), (5, 2, 9),
                                                     (4, 4, 16)])
def test_batched_levels_equal_node_by_node_expansion(setup, steps, topk, draft_tokens):
    target, d = setup
    cfg = SpecConfig(steps, topk, draft_tokens)
    for seed in range(3):
        prompt = torch.randint(3, 101, (9 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.inference_mode():
            out = target(torch.tensor([prompt]), torch.arange(len(prompt))[None], target.new_cache(64),
                         aux_layers=d.aux_layers)
            root = int(out.logits[0, -1].argmax())
            trees = []
            for fn in (lambda dr: dr.propose(cfg, SamplingParams(), None), lambda dr: reference_propose(dr, cfg)):
                dr = Eagle3TreeDrafter(d, target)
                dr.start(prompt, root, out, 128)
                trees.append(fn(dr))
                assert dr.cache.length == dr.committed == len(prompt)
        got, ref = trees
        assert got.tokens.tolist() == ref.tokens.tolist()
        assert got.parents.tolist() == ref.parents.tolist()
        assert got.depth.tolist() == ref.depth.tolist()


def test_build_drafter_gives_the_drafter_the_fast_kernels(tmp_path):
    from specscope.speculative.formats import save_drafter

    target = tiny_target(tmp_path / "t", layers=4)
    save_drafter(random_eagle3(target, draft_vocab=60), tmp_path / "d")
    dr = build_drafter(str(tmp_path / "d"), target)
    kinds = {m.kernel for m in dr.model.modules() if isinstance(m, PackedLinear)}
    assert kinds == {"rowgemm"} and isinstance(dr.model.midlayer.self_attn, RowAttention)
