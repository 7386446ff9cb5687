"""Training-time test (TTT): K unrolled draft steps over a whole sequence in one pass per step.

Row t of step k stands for the k-th draft step taken after the target produced feature f_t:
- token input: the ground truth shifted by k (x[t+1+k]; the token the step-(k-1) draft should have produced),
- hidden input: f_t through fc at step 0, the drafter's own step-(k-1) output at row t afterwards,
- position id: t + k,
- attention: the step-0 keys of rows 0..t (causal; the real features in the inference cache) plus the keys of
  steps 1..k at row t (the earlier draft tokens of this chain),
- target: the target's distribution at position t+1+k restricted to the draft vocabulary (what the target says
  after seeing x[..t+1+k]), counted where token t+2+k is an assistant token.
This is exactly what inference does with the cache, which tests/test_train_ttt.py checks step by step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specscope.models.rope import apply_rope


def _ttt_attention(attn, x, cos, sin, Ks, Vs, causal):
    B, T, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    v = v.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, k, cos, sin)
    Ks.append(k)
    Vs.append(v)
    rep = attn.n_heads // attn.n_kv
    scale = 1.0 / math.sqrt(attn.head_dim)
    K0, V0 = Ks[0].repeat_interleave(rep, 1), Vs[0].repeat_interleave(rep, 1)
    s0 = (q @ K0.transpose(-1, -2)) * scale                                   # [B, nh, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * kj.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for kj in Ks[1:]]
    p = torch.cat([s0] + diag, dim=-1).float().softmax(-1).to(q.dtype)
    y = p[..., :T] @ V0
    for j, vj in enumerate(Vs[1:]):
        y = y + p[..., T + j:T + j + 1] * vj.repeat_interleave(rep, 1)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, attn.q_size))


def ttt_unroll(drafter, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, K: int):
    """aux [B, T, 3, Ht], input_ids [B, T] -> list of K draft-vocab logits [B, T, Vd] (row t, step k as above).
    `embed` is the target's (frozen) embedding matrix."""
    B, T = input_ids.shape
    dev = input_ids.device
    layer = drafter.midlayer
    ids = F.pad(input_ids, (0, K + 1))
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    hidden = drafter.fuse(list(aux.unbind(2)))
    Ks, Vs, out = [], [], []
    for k in range(K):
        pos = torch.arange(k, T + k, device=dev)
        rope = drafter.rope_upto(T + K)
        cos = rope[0][pos].to(hidden.dtype)[None, None]
        sin = rope[1][pos].to(hidden.dtype)[None, None]
        emb = embed[ids[:, 1 + k:1 + k + T]].to(hidden.dtype)
        hn = layer.hidden_norm(hidden)
        residual = hn if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), hn], dim=-1)
        h = residual + _ttt_attention(layer.self_attn, x, cos, sin, Ks, Vs, causal)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hn = drafter.norm(h)
        out.append(drafter.lm_head(hn))
        hidden = hn if drafter.config.norm_output else h
    return out


class TTTLoss(nn.Module):
    """Wraps a drafter for training (and for DDP: its forward is the whole TTT loss).

    The target's embedding and its lm_head rows for the draft vocabulary are plain tensors, not parameters or
    buffers: frozen, and never broadcast by DDP."""

    def __init__(self, drafter, embed: torch.Tensor, lm_head_w: torch.Tensor, K: int = 7, decay: float = 0.8):
        super().__init__()
        self.drafter = drafter
        self.embed = embed
        self.w_t2d = lm_head_w[drafter.t2d.to(lm_head_w.device)]            # [Vd, H] in draft-id order
        self.K, self.decay = K, decay

    def targets(self, batch):
        """Target distribution over the draft vocabulary at each position, and the loss-eligible positions."""
        with torch.no_grad():
            tp = (batch["hidden"].float() @ self.w_t2d.float().T).softmax(-1)
        return tp

    def forward(self, batch, denom: torch.Tensor | None = None):
        """Returns (loss, stats). stats has per-step sums (loss, correct, counted) to aggregate across batches and
        ranks. `denom` [K]: global number of counted positions per step, so that the sum over ranks of the
        per-rank losses equals the single-process loss (DDP averages gradients, hence the world-size factor
        the caller applies)."""
        K = self.K
        logits = ttt_unroll(self.drafter, self.embed, batch["aux"], batch["input_ids"], K)
        tp = F.pad(self.targets(batch), (0, 0, 0, K + 1))
        am = F.pad(batch["argmax"], (0, K + 1), value=-1)
        valid = F.pad(batch["valid"], (0, K + 1))
        in_draft = self.drafter.t2d[am.clamp(min=0)] & (am >= 0)
        T = batch["input_ids"].shape[1]
        loss = 0.0
        stats = {"loss_sum": [], "correct": [], "counted": [], "ce_counted": [], "chain": None}
        chain = None
        for k, lg in enumerate(logits):
            sl = slice(1 + k, 1 + k + T)
            v, ce_mask = valid[:, sl], valid[:, sl] & in_draft[:, sl]
            logq = lg.float().log_softmax(-1)
            ce = -(tp[:, sl] * logq).sum(-1)
            ce_sum = (ce * ce_mask).sum()
            n = ce_mask.sum()
            d = denom[k] if denom is not None else n.clamp(min=1)
            loss = loss + (self.decay ** k) * ce_sum / d.clamp(min=1)
            pred = self.drafter.draft_to_target(lg.argmax(-1))
            ok = (pred == am[:, sl]) & v
            chain = ok if chain is None else chain & ok
            stats["loss_sum"].append(float(ce_sum.detach()))
            stats["ce_counted"].append(int(n))
            stats["correct"].append(int(ok.sum()))
            stats["counted"].append(int(v.sum()))
        # per-row accepted run over the chain (a row counts only when all K targets exist)
        full = valid[:, 1 + K - 1:K + T]
        run = torch.zeros_like(full, dtype=torch.long)
        alive = torch.ones_like(full)
        for k, lg in enumerate(logits):
            sl = slice(1 + k, 1 + k + T)
            alive = alive & (self.drafter.draft_to_target(lg.argmax(-1)) == am[:, sl])
            run = run + alive.long()
        stats["chain_sum"] = int((run * full).sum())
        stats["chain_rows"] = int(full.sum())
        return loss, stats


def count_positions(batch, t2d: torch.Tensor, K: int) -> torch.Tensor:
    """Per-step number of CE-counted positions in a batch (for the global loss normaliser)."""
    T = batch["input_ids"].shape[1]
    am = F.pad(batch["argmax"], (0, K + 1), value=-1)
    valid = F.pad(batch["valid"], (0, K + 1))
    in_draft = t2d[am.clamp(min=0)] & (am >= 0)
    return torch.stack([(valid[:, 1 + k:1 + k + T] & in_draft[:, 1 + k:1 + k + T]).sum() for k in range(K)])


def summarise(stats_list: list[dict], K: int) -> dict:
    """Aggregate per-batch stats -> acc_k, loss_k, simulated τ (SpecForge's 1 + Σ_k Π_{j<=k} acc_j) and the
    per-row chain τ (1 + mean accepted run of K draft tokens)."""
    tot = {k: [0.0] * K for k in ("loss_sum", "correct", "counted", "ce_counted")}
    cs = cr = 0
    for s in stats_list:
        for key in tot:
            for k in range(K):
                tot[key][k] += s[key][k]
        cs += s["chain_sum"]
        cr += s["chain_rows"]
    acc = [c / max(n, 1) for c, n in zip(tot["correct"], tot["counted"])]
    loss = [ls / max(n, 1) for ls, n in zip(tot["loss_sum"], tot["ce_counted"])]
    tau, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        tau += prod
    return {"acc": acc, "loss": loss, "sim_tau": tau, "chain_tau": 1.0 + cs / max(cr, 1),
            "positions": int(tot["counted"][0])}
