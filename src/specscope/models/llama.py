"""Our compact Llama-family forward (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

One call takes token ids with explicit position ids, the cache slots to write them into and an optional boolean
mask over (cached + new) slots, so a whole draft tree is verified in one forward. It returns logits for all or
selected positions and, on request, the hidden states *entering* given layers (EAGLE-3 reads three of them).
q/k/v and gate/up are fused at load time: fewer, larger matmuls per layer (as gpt-fast and nano-vllm do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specscope.errors import SpecscopeError
from specscope.models import rowgemm
from specscope.models.config import ModelConfig
from specscope.models.rope import apply_rope, rope_table, rotate
from specscope.runtime.kv_cache import KVCache


class RMSNorm(nn.Module):
    row_kernels = False   # set by models.linear.pack_linears where the row-invariant CPU kernels are in use

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def fast(self, x) -> bool:
        return self.row_kernels and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"

    def forward(self, x):
        if self.fast(x):
            return rowgemm.rmsnorm(x, self.weight, self.eps)
        # normalised in float32 and cast back before the weight, as transformers' LlamaRMSNorm does; the fused
        # kernel replaces 7 small ops per call (per-op overhead is a visible share of a CPU decode step)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class RowInputs(NamedTuple):
    """A forward's per-token inputs in the row kernels' layout, sliced once for all layers: cos/sin [T, D], slots
    [T], mask [T, S] or None (one sequence)."""
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


class Attention(nn.Module):
    row_kernels = False   # see RMSNorm

    def __init__(self, cfg: ModelConfig, in_dim: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(in_dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, slots, mask, kv_len: int = 0,
                rows: RowInputs | None = None):
        B, T, _ = x.shape
        nq, nqk = self.n_heads, self.n_heads + self.n_kv
        fast = cache is not None and self.row_kernels and B == 1 and x.dtype == torch.float32 and x.device.type == "cpu"
        if fast and self.q_norm is None:
            # rotary embedding, cache write and attention in one row-invariant kernel call (models/rowgemm.py)
            if rows is None:
                rows = RowInputs(cos[0, 0], sin[0, 0], slots[0], None if mask is None else mask[0])
            y = rowgemm.rope_attention(self.qkv_proj(x).view(T, -1), nq, self.n_kv, rows.cos, rows.sin, rows.slots,
                                       cache.k_rows[layer], cache.v_rows[layer], kv_len, rows.mask)
            return self.o_proj(y.view(B, T, self.q_size))
        qkv = self.qkv_proj(x).view(B, T, nqk + self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = apply_rope(self.q_norm(qkv[:, :, :nq]).transpose(1, 2),
                              self.k_norm(qkv[:, :, nq:nqk]).transpose(1, 2), cos, sin)
        else:
            # q and k heads rotated in one pass: half the small elementwise ops of a decode step
            qk = rotate(qkv[:, :, :nqk], cos.transpose(1, 2), sin.transpose(1, 2))
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)
        v = qkv[:, :, nqk:].transpose(1, 2)
        if fast:
            # the row-invariant kernel reads the cache in place and writes [T, heads * D], o_proj's layout
            cache.write(layer, slots, k, v)
            y = rowgemm.attention(q[0].transpose(0, 1), cache.k_rows[layer], cache.v_rows[layer], kv_len,
                                  None if mask is None else mask[0])
            return self.o_proj(y.view(B, T, self.q_size))
        if cache is not None:
            cache.write(layer, slots, k, v)
            k, v = cache.k[layer, :B, :, :kv_len], cache.v[layer, :B, :, :kv_len]
        attn_mask = mask[:, None] if mask is not None else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.q_size))


class MLP(nn.Module):
    row_kernels = False   # see RMSNorm

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gu = self.gate_up_proj(x)
        if self.row_kernels and gu.dtype == torch.float32 and gu.is_contiguous() and gu.device.type == "cpu":
            return self.down_proj(rowgemm.silu_mul(gu, self.inter))
        gate, up = gu.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, layer, cache, slots, mask, kv_len=0, rows: RowInputs | None = None):
        a = self.self_attn(self.input_layernorm(h), cos, sin, layer, cache, slots, mask, kv_len, rows)
        norm = self.post_attention_layernorm
        if norm.fast(h) and a.is_contiguous():
            h, x = rowgemm.rmsnorm(h, norm.weight, norm.eps, delta=a)   # residual add + norm in one pass
        else:
            h = h + a
            x = norm(h)
        return h + self.mlp(x)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None          # [B, n, V] for the selected positions
    aux_hidden: list[torch.Tensor]       # hidden states entering each requested layer, [B, T, H] each
    hidden: torch.Tensor | None = None   # final normed hidden state at the selected positions, when asked


class Transformer(nn.Module):
    row_stack = None   # rowgemm.LayerStack, set by models.linear.pack_linears: every layer in one kernel call

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                cfg.rope_scaling), persistent=False)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache.for_model(self.config, max_len, batch, self.device, self.dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                logits_idx=None, aux_layers=(), return_hidden: bool = False,
                compute_logits: bool = True) -> ForwardOutput:
        """input_ids, position_ids: [B, T]. slots: [B, T] cache slots to write (default: the positions).
        mask: bool [B, T, S] over cache slots 0..S-1 (True = may attend); default causal over slots.
        logits_idx: indices along T whose logits to compute (None = all)."""
        B, T = input_ids.shape
        if int(position_ids.max()) >= self.rope.shape[1]:
            raise SpecscopeError(
                f"position {int(position_ids.max())} exceeds the model's context of {self.rope.shape[1]} tokens; "
                f"shorten the prompt or lower --max-new-tokens")
        kv_len = 0
        if cache is not None:
            if slots is None:
                slots = position_ids
            cache.pos[:B].scatter_(1, slots, position_ids)
            kv_len = mask.shape[-1] if mask is not None else int(slots.max()) + 1
            if mask is None and (T > 1 or self.config.sliding_window):  # decode steps need the window too
                mask = torch.arange(kv_len, device=slots.device)[None, None, :] <= slots[:, :, None]
            if mask is not None and self.config.sliding_window:
                kpos = cache.pos[:B, :mask.shape[-1]]
                mask = mask & ((position_ids[:, :, None] - kpos[:, None, :]) < self.config.sliding_window)
        else:
            # no cache: plain causal attention over the given tokens (optionally with the caller's mask)
            if mask is None:
                mask = position_ids[:, None, :] <= position_ids[:, :, None]
                if self.config.sliding_window:
                    mask = mask & ((position_ids[:, :, None] - position_ids[:, None, :]) < self.config.sliding_window)
        cos, sin = self.rope[0][position_ids], self.rope[1][position_ids]
        h = self.embed_tokens(input_ids)
        cos, sin = cos.to(h.dtype)[:, None], sin.to(h.dtype)[:, None]
        rows = None
        if cache is not None and B == 1 and self.layers and self.layers[0].self_attn.row_kernels:
            rows = RowInputs(cos[0, 0], sin[0, 0], slots[0].contiguous(),
                             None if mask is None else mask[0].contiguous())
        if rows is not None and self.row_stack is not None and h.dtype == torch.float32:
            h, aux_set = self.row_stack(h[0], rows.cos, rows.sin, rows.slots, cache, kv_len, rows.mask, aux_layers)
            h, aux_set = h[None], {i: a[None] for i, a in aux_set.items()}
        else:
            aux_set = {i: None for i in aux_layers}
            for i, layer in enumerate(self.layers):
                if i in aux_set:
                    aux_set[i] = h
                h = layer(h, cos, sin, i, cache, slots, mask, kv_len, rows)
            if self.config.num_hidden_layers in aux_set:
                aux_set[self.config.num_hidden_layers] = h
        if logits_idx is not None:
            h = h[:, logits_idx]
        logits = None
        hn = self.norm(h) if (compute_logits or return_hidden) else None
        if compute_logits:
            logits = self.lm_head(hn)
        return ForwardOutput(logits, [aux_set[i] for i in aux_layers], hn if return_hidden else None)
