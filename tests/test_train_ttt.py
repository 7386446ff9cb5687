"""TTT: the batched unroll equals inference step by step (the drafter's own cached forward, as decoding runs it),
and training lowers the loss on a tiny task."""

import pytest
import torch
from drafter_util import random_drafter, tiny_target

from specscope.train.ttt import TTTLoss, count_positions, summarise, ttt_unroll


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("tgt"), layers=8)


def _stepwise_reference(drafter, embed, aux, ids, K):
    """Row t, step k via drafter.forward with a KV cache: step 0 runs causally over all rows (the real features);
    then for each row t the chain continues one token at a time at positions t+1.., each draft step seeing the
    step-0 cache of rows 0..t and its own earlier draft steps - exactly an inference-time chain."""
    T = ids.shape[1]
    cache = drafter.new_cache(T + K)
    h0 = drafter.fuse(list(aux.unbind(2)))
    emb = embed[torch.nn.functional.pad(ids, (0, K + 1))]
    pos = torch.arange(T)[None]
    lg0, hid0 = drafter(emb[:, 1:1 + T], h0, pos, cache, pos)
    out = torch.full((K, T, drafter.config.draft_vocab_size), float("nan"))
    out[0] = lg0[0]
    for t in range(T):
        h = hid0[:, t:t + 1]
        for k in range(1, K):
            slot = T + k - 1
            mask = torch.zeros(1, 1, T + K, dtype=torch.bool)
            mask[0, 0, :t + 1] = True                      # step-0 keys of rows 0..t
            mask[0, 0, T:slot + 1] = True                  # this chain's earlier draft steps and itself
            lg, h = drafter(emb[:, 1 + k + t:2 + k + t], h, torch.tensor([[t + k]]), cache,
                            torch.tensor([[slot]]), mask)
            out[k, t] = lg[0, 0]
    return out


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "norm_output": True, "fc_norm": True}])
def test_ttt_matches_stepwise_inference(target, flags):
    d = random_drafter(target, **flags)
    torch.manual_seed(3)
    T, K = 9, 4
    ids = torch.randint(0, 101, (1, T))
    aux = torch.randn(1, T, 3, 64)
    embed = target.embed_tokens.weight
    with torch.no_grad():
        fast = torch.stack(ttt_unroll(d, embed, aux, ids, K))[:, 0]
        ref = _stepwise_reference(d, embed, aux, ids, K)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_ttt_batch_rows_independent_of_padding(target):
    """Right padding never changes a sequence's logits (causal keys only)."""
    d = random_drafter(target)
    torch.manual_seed(4)
    ids = torch.randint(0, 101, (2, 10))
    aux = torch.randn(2, 10, 3, 64)
    with torch.no_grad():
        both = ttt_unroll(d, target.embed_tokens.weight, aux, ids, 3)
        short = ttt_unroll(d, target.embed_tokens.weight, aux[1:, :6], ids[1:, :6], 3)
    for k in range(3):
        # rows whose shifted token input is still inside the short sequence
        n = 6 - 1 - k
        torch.testing.assert_close(both[k][1, :n], short[k][0, :n], rtol=1e-5, atol=1e-5)


def _toy_batch(target, T=24, B=4, seed=0):
    """A tiny synthetic task: the target's own features on random text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 101, (B, T), generator=g)
    with torch.no_grad():
        out = target(ids, torch.arange(T)[None].expand(B, T), aux_layers=(2, 4, 5), return_hidden=True)
    hid = out.hidden
    return {"aux": torch.stack(out.aux_hidden, 2), "hidden": hid, "input_ids": ids,
            "argmax": target.lm_head(hid).argmax(-1), "valid": torch.ones(B, T, dtype=torch.bool)}


def test_loss_decreases_and_metrics(target):
    torch.manual_seed(0)
    d = random_drafter(target, draft_vocab=101)           # full vocab: every target argmax is reachable
    d.d2t.zero_()
    d.t2d.fill_(True)
    d.requires_grad_(True).train()
    m = TTTLoss(d, target.embed_tokens.weight, target.lm_head.weight, K=3)
    batch = _toy_batch(target, T=16, B=3)
    opt = torch.optim.AdamW(d.parameters(), lr=5e-3)
    # soft CE cannot go below the target's entropy: measure the excess over that floor
    tp = m.targets(batch)
    ent = float(-(tp * tp.clamp(min=1e-30).log()).sum(-1)[:, 1:].mean())
    floor = sum(0.8 ** k for k in range(3)) * ent
    first = None
    for _ in range(25):
        loss, stats = m(batch)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, stats = m(batch)
    s = summarise([stats], 3)
    assert float(loss.detach()) - floor < 0.5 * (first - floor)
    assert s["acc"][0] > 0.5 and 1.0 <= s["sim_tau"] <= 4.0 and 1.0 <= s["chain_tau"] <= 4.0
    assert count_positions(batch, d.t2d, 3).tolist()[0] == 3 * 16 - 3   # the last position has no next token


def test_summarise_formula():
    st = {"loss_sum": [1.0, 2.0], "correct": [8, 4], "counted": [10, 10], "ce_counted": [10, 10],
          "chain_sum": 9, "chain_rows": 10}
    s = summarise([st], 2)
    assert s["acc"] == [0.8, 0.4]
    assert s["sim_tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.4)
    assert s["chain_tau"] == pytest.approx(1.9)


def test_bf16_autocast_loss_close_to_fp32(target):
    d = random_drafter(target)
    d.requires_grad_(True)
    m = TTTLoss(d, target.embed_tokens.weight, target.lm_head.weight, K=3)
    batch = _toy_batch(target, T=12, B=2)
    l32, _ = m(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l16, _ = m(batch)
    l16.backward()
    assert torch.isfinite(l16) and abs(float(l16) - float(l32)) < 0.05 * float(l32)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.parameters())
