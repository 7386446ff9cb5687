"""TTT: the batched unroll equals inference step by step (the drafter's own cached forward, as decoding runs it),
the chunked loss equals the whole-vocabulary one (loss, statistics and every gradient), and training lowers the loss
on a tiny task."""

import pytest
import torch
from drafter_util import random_drafter, tiny_target

import torch.nn.functional as F

from specscope.train import ttt
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


def _unchunked_loss(m: TTTLoss, batch, denom=None):
    """The TTT loss as first written: every step's [B, T, Vd] logits, log-probabilities and the whole batch's target
    distribution at once, autograd through all of them. soft_ce must give the same training."""
    K = m.K
    logits = ttt_unroll(m.drafter, m.embed, batch["aux"], batch["input_ids"], K)
    tp = F.pad(m.targets(batch), (0, 0, 0, K + 1))
    am = F.pad(batch["argmax"], (0, K + 1), value=-1)
    valid = F.pad(batch["valid"], (0, K + 1))
    in_draft = m.drafter.t2d[am.clamp(min=0)] & (am >= 0)
    T = batch["input_ids"].shape[1]
    loss, stats = 0.0, {"loss_sum": [], "correct": [], "counted": [], "ce_counted": []}
    for k, lg in enumerate(logits):
        sl = slice(1 + k, 1 + k + T)
        v, ce_mask = valid[:, sl], valid[:, sl] & in_draft[:, sl]
        ce = -(tp[:, sl] * lg.float().log_softmax(-1)).sum(-1)
        ce_sum, n = (ce * ce_mask).sum(), ce_mask.sum()
        d = denom[k] if denom is not None else n.clamp(min=1)
        loss = loss + (m.decay ** k) * ce_sum / d.clamp(min=1)
        ok = (m.drafter.draft_to_target(lg.argmax(-1)) == am[:, sl]) & v
        stats["loss_sum"].append(float(ce_sum.detach()))
        stats["ce_counted"].append(int(n))
        stats["correct"].append(int(ok.sum()))
        stats["counted"].append(int(v.sum()))
    full = valid[:, K:K + T]
    run, alive = torch.zeros_like(full, dtype=torch.long), torch.ones_like(full)
    for k, lg in enumerate(logits):
        alive = alive & (m.drafter.draft_to_target(lg.argmax(-1)) == am[:, 1 + k:1 + k + T])
        run = run + alive.long()
    stats["chain_sum"], stats["chain_rows"] = int((run * full).sum()), int(full.sum())
    return loss, stats


def _ragged_batch(target, drafter, seed=5):
    """Three sequences of lengths 11, 7 and 4 padded as collate pads them (zero features, argmax -1, not valid), the
    first with a user turn (not valid) at its start. Target argmaxes: the drafter's own step-0 choice at odd
    positions (so some predictions are right), random tokens elsewhere (some outside the draft vocabulary)."""
    b = _toy_batch(target, T=11, B=3, seed=seed)
    with torch.no_grad():
        own = drafter.draft_to_target(ttt_unroll(drafter, target.embed_tokens.weight, b["aux"], b["input_ids"], 1)[0]
                                      .argmax(-1))
    g = torch.Generator().manual_seed(seed)
    b["argmax"] = torch.randint(0, 101, (3, 11), generator=g)
    b["argmax"][:, 1::2] = own[:, 0:-1:2]                  # row t predicts position t+1's argmax
    for i, n in enumerate((11, 7, 4)):
        b["aux"][i, n:] = 0
        b["hidden"][i, n:] = 0
        b["input_ids"][i, n:] = 0
        b["argmax"][i, n:] = -1
        b["valid"][i, n - 1:] = False
    b["valid"][0, :3] = False
    return b


@pytest.mark.parametrize("chunk", [1, 3, 16, None])       # one position, a remainder chunk, one chunk
@pytest.mark.parametrize("use_denom", [False, True])
def test_chunked_loss_equals_unchunked(target, chunk, use_denom):
    """Loss, per-step statistics and every parameter's gradient equal the whole-vocabulary computation."""
    d = random_drafter(target, draft_vocab=40)
    d.requires_grad_(True).train()
    with torch.no_grad():                                  # a trained-looking head: argmaxes agree sometimes
        d.lm_head.weight.mul_(20)
    m = TTTLoss(d, target.embed_tokens.weight, target.lm_head.weight, K=3)
    m.chunk = chunk
    batch = _ragged_batch(target, d)
    denom = count_positions(batch, d.t2d, 3).float() * 1.5 if use_denom else None

    ref_loss, ref_stats = _unchunked_loss(m, batch, denom)
    (ref_loss * 2).backward()                              # a DDP-like factor: backward scales what forward formed
    ref_grads = {n: p.grad.clone() for n, p in d.named_parameters()}
    d.zero_grad(set_to_none=True)

    loss, stats = m(batch, denom)
    (loss * 2).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for key in ("loss_sum",):
        torch.testing.assert_close(torch.tensor(stats[key]), torch.tensor(ref_stats[key]), rtol=1e-5, atol=1e-5)
    for key in ("correct", "counted", "ce_counted", "chain_sum", "chain_rows"):
        assert stats[key] == ref_stats[key], key
    # the batch exercises what it should: right predictions, full chains, targets outside the draft vocabulary
    assert ref_stats["correct"][0] > 0 and ref_stats["chain_sum"] > 0
    assert 0 < ref_stats["ce_counted"][0] < ref_stats["counted"][0]
    assert set(ref_grads) == {n for n, p in d.named_parameters() if p.grad is not None}
    for n, p in d.named_parameters():
        # float32 rounding, as between two orders of the same sums: both lie ~1e-6 of the largest entry from a
        # float64 evaluation; a lost mask, weight or shift is off by far more
        scale = float(ref_grads[n].abs().max())
        assert scale > 0, n
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5 * scale, msg=lambda s: f"{n}: {s}")


def test_chunked_loss_without_grad_and_bf16(target):
    """Evaluation (no_grad) gives the same loss and statistics; under bf16 autocast the chunked loss and gradients
    stay within bf16 rounding of the unchunked ones."""
    d = random_drafter(target, draft_vocab=40)
    d.requires_grad_(True)
    m = TTTLoss(d, target.embed_tokens.weight, target.lm_head.weight, K=2)
    m.chunk = 4
    batch = _ragged_batch(target, d)
    with torch.no_grad():
        l0, s0 = m(batch)
        r0, rs0 = _unchunked_loss(m, batch)
    torch.testing.assert_close(l0, r0, rtol=1e-5, atol=1e-6)
    assert s0["correct"] == rs0["correct"] and s0["chain_sum"] == rs0["chain_sum"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = _unchunked_loss(m, batch)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in d.named_parameters()}
    d.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = m(batch)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-3)
    for n, p in d.named_parameters():
        scale = float(ref_grads[n].abs().max())
        assert float((p.grad - ref_grads[n]).abs().max()) <= 0.05 * scale + 1e-6, n


def test_chunk_size_bounds_the_vocab_tensors():
    """The default chunk of positions keeps each [B, chunk, Vd] float32 tensor within CHUNK_ELEMENTS (one position
    when a single one is larger) and is the largest that does, whatever the batch and vocabulary."""
    for B, vd in ((1, 40), (8, 8192), (32, 8192), (4, 200_000), (64, 128_256)):
        c = ttt.default_chunk(B, vd)
        assert c >= 1 and (c * B * vd <= ttt.CHUNK_ELEMENTS or c == 1)
        assert (c + 1) * B * vd > ttt.CHUNK_ELEMENTS
