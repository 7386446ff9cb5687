"""Tree-masked verification and KV-cache compaction: the two mechanisms speculative decoding relies on."""

import pytest
import torch

from specscope.runtime.kv_cache import KVCache
from specscope.models import load_model
from tiny import ARCHS, make_hf_model

# a small branching tree: node -> parent (-1 = root, which hangs off the prefix)
#            0
#          /   \
#         1     2
#        / \     \
#       3   4     5
#       |
#       6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def depth(i):
    d = 0
    while PARENTS[i] != -1:
        i, d = PARENTS[i], d + 1
    return d


def path(i):
    p = [i]
    while PARENTS[p[-1]] != -1:
        p.append(PARENTS[p[-1]])
    return p[::-1]


def leaves():
    return [i for i in range(len(PARENTS)) if i not in PARENTS]


def tree_mask(prefix: int, n: int) -> torch.Tensor:
    """bool [1, n, prefix + n]: every node sees the prefix, its ancestors and itself."""
    m = torch.zeros(1, n, prefix + n, dtype=torch.bool)
    m[:, :, :prefix] = True
    for i in range(n):
        for j in path(i):
            m[0, i, prefix + j] = True
    return m


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_hf_model(d, request.param)
    return load_model(d, dtype="fp32")


def _prefill(model, prefix_ids, max_len=64):
    cache = model.new_cache(max_len)
    P = prefix_ids.shape[1]
    model(prefix_ids, torch.arange(P)[None], cache)
    cache.length = P
    return cache


@torch.no_grad()
def test_tree_forward_equals_each_branch(model):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 101, (1, 9), generator=g)
    tree = torch.randint(3, 101, (1, len(PARENTS)), generator=g)
    P, n = prefix.shape[1], len(PARENTS)
    cache = _prefill(model, prefix)
    pos = torch.tensor([[P + depth(i) for i in range(n)]])
    slots = torch.arange(P, P + n)[None]  # tree tokens sit past the prefix, in node order
    out = model(tree, pos, cache, slots=slots, mask=tree_mask(P, n), aux_layers=(0, 1, 3), return_hidden=True)
    assert cache.length == P  # a verify forward writes slots but commits nothing
    for leaf in leaves():
        br = path(leaf)
        ids = torch.cat([prefix, tree[:, br]], 1)
        ref = model(ids, torch.arange(ids.shape[1])[None], aux_layers=(0, 1, 3), return_hidden=True)
        torch.testing.assert_close(out.logits[0, br], ref.logits[0, P:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden[0, br], ref.hidden[0, P:], atol=1e-4, rtol=1e-4)
        for a, r in zip(out.aux_hidden, ref.aux_hidden):
            torch.testing.assert_close(a[0, br], r[0, P:], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_tree_logits_idx_selects_positions(model):
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 101, (1, 5), generator=g)
    tree = torch.randint(3, 101, (1, len(PARENTS)), generator=g)
    P, n = 5, len(PARENTS)
    pos = torch.tensor([[P + depth(i) for i in range(n)]])
    slots = torch.arange(P, P + n)[None]
    full = model(tree, pos, _prefill(model, prefix), slots=slots, mask=tree_mask(P, n)).logits
    sel = model(tree, pos, _prefill(model, prefix), slots=slots, mask=tree_mask(P, n), logits_idx=[6, 2]).logits
    assert sel.shape == (1, 2, full.shape[-1])
    torch.testing.assert_close(sel[0], full[0, [6, 2]], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_compact_accepted_branch_then_decode_matches_plain(model):
    """Verify a tree, keep one branch with compact(), decode on: identical to never having drafted."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 101, (1, 7), generator=g)
    tree = torch.randint(3, 101, (1, len(PARENTS)), generator=g)
    P, n = 7, len(PARENTS)
    cache = _prefill(model, prefix)
    pos = torch.tensor([[P + depth(i) for i in range(n)]])
    model(tree, pos, cache, slots=torch.arange(P, P + n)[None], mask=tree_mask(P, n))
    accepted = path(4)  # nodes 0, 1, 4: slots P+0, P+1, P+4 (not contiguous)
    cache.compact([P + j for j in accepted])
    assert cache.length == P + len(accepted)
    assert cache.pos[0, :cache.length].tolist() == list(range(P + len(accepted)))
    assert (cache.pos[0, cache.length:] == -1).all()
    nxt = torch.tensor([[42]])
    L = cache.length
    got = model(nxt, torch.tensor([[L]]), cache).logits[0, -1]
    ids = torch.cat([prefix, tree[:, accepted], nxt], 1)
    ref = model(ids, torch.arange(ids.shape[1])[None]).logits[0, -1]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_compact_moves_entries_and_drops_the_rest():
    c = KVCache(num_layers=2, num_kv_heads=1, head_dim=3, max_len=12)
    c.length = 4
    vals = torch.arange(12, dtype=torch.float32)
    c.k[:, 0, 0] = vals[:, None]
    c.v[:, 0, 0] = -vals[:, None]
    c.pos[0, :10] = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7, 6])
    c.compact([5, 7, 9])
    assert c.length == 7
    assert c.k[0, 0, 0, :7, 0].tolist() == [0, 1, 2, 3, 5, 7, 9]
    assert c.v[1, 0, 0, :7, 1].tolist() == [0, -1, -2, -3, -5, -7, -9]
    assert c.pos[0, :7].tolist() == [0, 1, 2, 3, 5, 6, 6]
    assert (c.pos[0, 7:] == -1).all()
    # already in place: nothing moves, length advances
    c.compact([7, 8])
    assert c.length == 9
    # nothing accepted: length unchanged
    c.compact([])
    assert c.length == 9


def test_cache_write_at_slots_and_room_check():
    from specscope.errors import SpecscopeError

    c = KVCache(num_layers=1, num_kv_heads=2, head_dim=4, max_len=8)
    k = torch.randn(1, 2, 3, 4)
    v = torch.randn(1, 2, 3, 4)
    c.write(0, torch.tensor([[5, 1, 6]]), k, v)
    torch.testing.assert_close(c.k[0, 0, :, [5, 1, 6]], k[0])
    torch.testing.assert_close(c.v[0, 0, :, [5, 1, 6]], v[0])
    with pytest.raises(SpecscopeError, match="KV slots"):
        c.check_room(9)
