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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specscope.models.context import ForwardContext, forward_context


@dataclass
class TTTStep(ForwardContext):
    """One unrolled step's context: queries see the step-0 keys causally (the real features in the inference
    cache) and, at their own row, the keys of steps 1..k (this chain's earlier drafts). Each step appends its keys
    and values for the later ones."""
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    def attend(self, attn, q, k, v):
        B, _, T, _ = q.shape
        self.keys.append(k)
        self.values.append(v)
        rep = attn.n_heads // attn.n_kv
        scale = 1.0 / math.sqrt(attn.head_dim)
        K0, V0 = self.keys[0].repeat_interleave(rep, 1), self.values[0].repeat_interleave(rep, 1)
        s0 = (q @ K0.transpose(-1, -2)) * scale                                   # [B, nh, T, T]
        s0 = s0.masked_fill(~self.mask[0], float("-inf"))
        diag = [(q * kj.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for kj in self.keys[1:]]
        p = torch.cat([s0] + diag, dim=-1).float().softmax(-1).to(q.dtype)
        y = p[..., :T] @ V0
        for j, vj in enumerate(self.values[1:]):
            y = y + p[..., T + j:T + j + 1] * vj.repeat_interleave(rep, 1)
        return y.transpose(1, 2).reshape(B, T, attn.q_size)


def ttt_hidden(drafter, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, K: int):
    """aux [B, T, 3, Ht], input_ids [B, T] -> list of K normed hidden states [B, T, H], the drafter's lm_head
    input (row t, step k as above). `embed` is the target's (frozen) embedding matrix."""
    T = input_ids.shape[1]
    dev = input_ids.device
    ids = F.pad(input_ids, (0, K + 1))
    hidden = drafter.fuse(list(aux.unbind(2)))
    keys, values, out = [], [], []
    for k in range(K):
        # causal over the step's positions t + k, i.e. over rows
        c = forward_context(torch.arange(k, T + k, device=dev)[None], drafter.rope_upto, hidden.dtype)
        ctx = TTTStep(c.positions, c.cos, c.sin, mask=c.mask, keys=keys, values=values)
        emb = embed[ids[:, 1 + k:1 + k + T]].to(hidden.dtype)
        h = drafter.midlayer(emb, hidden, ctx)
        hn = drafter.norm(h)
        out.append(hn)
        hidden = hn if drafter.config.norm_output else h
    return out


def ttt_unroll(drafter, embed: torch.Tensor, aux: torch.Tensor, input_ids: torch.Tensor, K: int):
    """aux [B, T, 3, Ht], input_ids [B, T] -> list of K draft-vocab logits [B, T, Vd] (row t, step k as above).
    `embed` is the target's (frozen) embedding matrix. Training never forms these (see ttt_soft_ce)."""
    return [drafter.lm_head(hn) for hn in ttt_hidden(drafter, embed, aux, input_ids, K)]


CHUNK_ELEMENTS = 1 << 22      # rows per chunk x draft vocabulary: 16 MB per float32 [rows, Vd] tensor


class _TTTSoftCE(torch.autograd.Function):
    """Σ_k coef_k Σ_t mask_k[t]·CE(p[t+1+k], q_k[t]) with p = softmax(th·Wtᵀ) the target's distribution at each
    position and q_k = softmax(h_k·Wᵀ) the draft's at step k, a chunk of positions at a time; also each step's
    Σ mask·CE and each row's argmax (not differentiable). A chunk's target distribution serves all K steps (row t
    of step k reads position t+1+k), and the gradients for h_k and W are formed chunk by chunk in the forward
    (d CE/d logits = q - p needs nothing but the chunk), so no [B, T, Vd] tensor is ever formed and backward only
    scales them: peak memory is one chunk's logits instead of every step's logits and log-probabilities, the
    whole target distribution and their gradients. Rows whose position t+1+k lies past the end get CE 0 and
    argmax 0 (never counted: valid is padded there)."""

    @staticmethod
    def forward(ctx, th, Wt, masks, coefs, chunk, want_grad, W, *hs):
        K, (B, T, _) = len(hs), hs[0].shape
        ce = torch.zeros(K, B, T, dtype=torch.float32, device=W.device)
        am = torch.zeros(K, B, T, dtype=torch.long, device=W.device)
        gh = [torch.zeros_like(h) for h in hs] if want_grad else []
        gW = torch.zeros_like(W) if want_grad else None
        for a in range(1, T, chunk):                       # target positions a..b-1 (position 0 is no target)
            b = min(T, a + chunk)
            tp = (th[:, a:b].float() @ Wt.float().T).softmax(-1)          # [B, b-a, Vd]
            for k, h in enumerate(hs):
                t0, t1 = max(0, a - 1 - k), b - 1 - k                      # the rows reading positions a..b-1
                if t1 <= t0:
                    continue
                p = tp[:, t0 + 1 + k - a:t1 + 1 + k - a]
                z = F.linear(h[:, t0:t1], W)         # as lm_head computes it (bf16 under bf16 autocast)
                lg = z.float()
                logq = lg.log_softmax(-1)
                ce[k, :, t0:t1] = -(p * logq).sum(-1)
                am[k, :, t0:t1] = lg.argmax(-1)
                if want_grad:
                    g = logq.exp_().sub_(p).mul_((masks[k, :, t0:t1] * coefs[k])[..., None])
                    g = g.to(z.dtype)                # lm_head's backward runs in its forward's dtype
                    gh[k][:, t0:t1] = g @ W.to(z.dtype)
                    gW += g.flatten(0, 1).T @ h[:, t0:t1].flatten(0, 1).to(z.dtype)
                del z, lg, logq, p
            del tp
        sums = (ce * masks).sum((1, 2))
        loss = (sums * coefs).sum()
        ctx.save_for_backward(gW, *gh)
        ctx.mark_non_differentiable(sums, am)
        return loss, sums, am

    @staticmethod
    def backward(ctx, g, _g_sums, _g_am):
        gW, *gh = ctx.saved_tensors
        if gW is None:
            return (None,) * len(ctx.needs_input_grad)
        return (None,) * 6 + (gW * g, *(x * g for x in gh))


def default_chunk(batch: int, draft_vocab: int) -> int:
    """Target positions per loss chunk: each [batch, chunk, Vd] float32 tensor within CHUNK_ELEMENTS (one position
    when a single one is larger)."""
    return max(1, CHUNK_ELEMENTS // (batch * draft_vocab))


def ttt_soft_ce(hs: list[torch.Tensor], W: torch.Tensor, th: torch.Tensor, Wt: torch.Tensor, masks: torch.Tensor,
                coefs: torch.Tensor, chunk: int | None = None):
    """The TTT loss of the K steps' normed hidden states hs (each [B, T, H]) through lm_head W [Vd, H] against the
    target's distribution softmax(th [B, T, Ht] @ Wtᵀ): returns (Σ_k coefs[k]·Σ masks[k]·CE, per-step Σ masks·CE
    [K], per-row argmax [K, B, T]), the loss differentiable in hs and W. `chunk` target positions (all rows) at a
    time (default: CHUNK_ELEMENTS / (B·Vd))."""
    chunk = chunk or default_chunk(hs[0].shape[0], W.shape[0])
    want = torch.is_grad_enabled() and (W.requires_grad or any(h.requires_grad for h in hs))
    return _TTTSoftCE.apply(th.detach(), Wt.detach(), masks.float(), coefs.float(), chunk, want, W, *hs)


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
        self.chunk: int | None = None      # target positions per loss chunk (None: CHUNK_ELEMENTS / (B·Vd))

    def targets(self, batch):
        """Target distribution over the draft vocabulary at each position [B, T, Vd] (whole; training forms it a
        chunk at a time inside ttt_soft_ce)."""
        with torch.no_grad():
            return (batch["hidden"].float() @ self.w_t2d.float().T).softmax(-1)

    def forward(self, batch, denom: torch.Tensor | None = None):
        """Returns (loss, stats). stats has per-step sums (loss, correct, counted) to aggregate across batches and
        ranks. `denom` [K]: global number of counted positions per step, so that the sum over ranks of the
        per-rank losses equals the single-process loss (DDP averages gradients, hence the world-size factor
        the caller applies).

        Step k's loss is the soft cross-entropy between the target's distribution at position t+1+k and the
        draft's at row t, computed by ttt_soft_ce a chunk of positions at a time: no [B, T, Vd] tensor is formed."""
        K = self.K
        hs = ttt_hidden(self.drafter, self.embed, batch["aux"], batch["input_ids"], K)
        B, T = batch["input_ids"].shape
        am = F.pad(batch["argmax"], (0, K + 1), value=-1)
        valid = F.pad(batch["valid"], (0, K + 1))
        in_draft = self.drafter.t2d[am.clamp(min=0)] & (am >= 0)
        vs = [valid[:, 1 + k:1 + k + T] for k in range(K)]
        masks = torch.stack([v & in_draft[:, 1 + k:1 + k + T] for k, v in enumerate(vs)])    # [K, B, T]
        ns = masks.sum((1, 2))
        d = (denom if denom is not None else ns).clamp(min=1)
        coefs = torch.tensor([self.decay ** k for k in range(K)], device=d.device) / d
        loss, sums, top = ttt_soft_ce(hs, self.drafter.lm_head.weight, batch["hidden"], self.w_t2d, masks, coefs,
                                      self.chunk)
        stats = {"loss_sum": sums.tolist(), "ce_counted": ns.tolist(), "correct": [], "counted": [], "chain": None}
        # per-row accepted run over the chain (a row counts only when all K targets exist)
        full = valid[:, K:K + T]
        run = torch.zeros_like(full, dtype=torch.long)
        alive = torch.ones_like(full)
        for k, v in enumerate(vs):
            hit = self.drafter.draft_to_target(top[k]) == am[:, 1 + k:1 + k + T]
            stats["correct"].append(int((hit & v).sum()))
            stats["counted"].append(int(v.sum()))
            alive = alive & hit
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
            "positions": int(tot["counted"][0]), "chain_positions": int(cr)}


# held-out conversations below which a held-out τ is too few to trust: one conversation's positions are alike (its
# topic, its length), so 2 conversations' 61 positions measured τ 3.30 where vLLM then measured 1.42
MIN_HELDOUT = 20


def heldout_words(ev: dict, conversations: int) -> str:
    """The held-out figures with the samples they rest on (and a mark when those are too few to trust)."""
    few = " (too few to trust)" if conversations < MIN_HELDOUT else ""
    return (f"held-out acc_0 {ev['acc'][0]:.3f} sim τ {ev['sim_tau']:.2f} chain τ {ev['chain_tau']:.2f} over "
            f"{conversations} conversation{'s' * (conversations != 1)}, {ev['chain_positions']} "
            f"positions{few}")


def heldout_warning(held: int, total: int) -> str | None:
    """Why the held-out figures cannot be trusted, and the fix; None when enough conversations are held out."""
    if not held or held >= MIN_HELDOUT:
        return None
    need = math.ceil(MIN_HELDOUT / total * 100) / 100
    fix = (f"hold out more with --eval-fraction {need:.2f}" if need <= 0.5 else
           f"train on more conversations (at least {2 * MIN_HELDOUT} for --eval-fraction 0.5)")
    return (f"the held-out τ rests on {held} of {total} conversations (fewer than {MIN_HELDOUT}): too few to trust, "
            f"a real engine may measure far less; {fix}")
