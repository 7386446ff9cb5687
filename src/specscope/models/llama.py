"""Our compact Llama-family forward (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

One call takes token ids with explicit position ids, the cache slots to write them into and an optional boolean
mask over (cached + new) slots, so a whole draft tree is verified in one forward. It returns logits for all or
selected positions and, on request, the hidden states *entering* given layers (EAGLE-3 reads three of them).
q/k/v and gate/up are fused at load time: fewer, larger matmuls per layer (as gpt-fast and nano-vllm do).
Layers take (x, ctx): the step's positions, rotary tables, slots and mask, built once per forward
(models/context.py). The row-invariant CPU kernels come in by swapping these classes (models/kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specscope.errors import SpecscopeError
from specscope.models.config import ModelConfig
from specscope.models.context import ForwardContext, forward_context
from specscope.models.rope import apply_rope, rope_table, rotate
from specscope.runtime.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalised in float32 and cast back before the weight, as transformers' LlamaRMSNorm does; the fused
        # kernel replaces 7 small ops per call (per-op overhead is a visible share of a CPU decode step)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, in_dim: int | None = None):
        super().__init__()
        self.layer = layer   # which of the cache's layers holds this one's keys and values
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(in_dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv_rope(self, x, ctx: ForwardContext):
        """q [B, Hq, T, D], k and v [B, Hkv, T, D], q and k rotated to ctx's positions."""
        B, T, _ = x.shape
        nq, nqk = self.n_heads, self.n_heads + self.n_kv
        qkv = self.qkv_proj(x).view(B, T, nqk + self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = apply_rope(self.q_norm(qkv[:, :, :nq]).transpose(1, 2),
                              self.k_norm(qkv[:, :, nq:nqk]).transpose(1, 2), ctx.cos, ctx.sin)
        else:
            # q and k heads rotated in one pass: half the small elementwise ops of a decode step
            qk = rotate(qkv[:, :, :nqk], ctx.cos.transpose(1, 2), ctx.sin.transpose(1, 2))
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)
        return q, k, qkv[:, :, nqk:].transpose(1, 2)

    def forward(self, x, ctx: ForwardContext):
        return self.o_proj(ctx.attend(self, *self.qkv_rope(x, ctx)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def act(self, gu):
        gate, up = gu.split(self.inter, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def add_norm(self, h, a):
        """(h + a, post_attention_layernorm(h + a))."""
        h = h + a
        return h, self.post_attention_layernorm(h)

    def forward(self, h, ctx: ForwardContext):
        h, x = self.add_norm(h, self.self_attn(self.input_layernorm(h), ctx))
        return h + self.mlp(x)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None          # [B, n, V] for the selected positions
    aux_hidden: list[torch.Tensor]       # hidden states entering each requested layer, [B, T, H] each
    hidden: torch.Tensor | None = None   # final normed hidden state at the selected positions, when asked


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                cfg.rope_scaling), persistent=False)

    # None: the parameters' dtype; "bf16": weights and each linear's input rounded to bf16 in fp32 tensors (set by
    # models/loader.py round_to_bf16)
    precision: str | None = None

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        # the bf16 precision keeps keys and values in bf16, as a bf16 engine does: half the cache's bytes, and the
        # row kernels' bf16 attention (vdpbf16ps where the CPU has it)
        dtype = torch.bfloat16 if self.precision == "bf16" else self.dtype
        return KVCache.for_model(self.config, max_len, batch, self.device, dtype)

    def run_layers(self, h, ctx: ForwardContext, aux_layers) -> tuple[torch.Tensor, dict]:
        """(h after the last layer, {layer: h entering it} for aux_layers)."""
        aux = {i: None for i in aux_layers}
        for i, layer in enumerate(self.layers):
            if i in aux:
                aux[i] = h
            h = layer(h, ctx)
        if self.config.num_hidden_layers in aux:
            aux[self.config.num_hidden_layers] = h
        return h, aux

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                logits_idx=None, aux_layers=(), return_hidden: bool = False,
                compute_logits: bool = True) -> ForwardOutput:
        """input_ids, position_ids: [B, T]. slots: [B, T] cache slots to write (default: the positions).
        mask: bool [B, T, S] over cache slots 0..S-1 (True = may attend); default causal over slots.
        logits_idx: indices along T whose logits to compute (None = all)."""
        if int(position_ids.max()) >= self.rope.shape[1]:
            raise SpecscopeError(
                f"position {int(position_ids.max())} exceeds the model's context of {self.rope.shape[1]} tokens; "
                f"shorten the prompt or lower --max-new-tokens")
        h = self.embed_tokens(input_ids)
        ctx = forward_context(position_ids, lambda n: self.rope, h.dtype, cache, slots, mask,
                              self.config.sliding_window)
        h, aux = self.run_layers(h, ctx, aux_layers)
        if logits_idx is not None:
            h = h[:, logits_idx]
        hn = self.norm(h) if (compute_logits or return_hidden) else None
        logits = None
        if compute_logits:   # no rows (a step of prompt chunks only): the kernels are not asked for an empty gemm
            logits = self.lm_head(hn) if hn.shape[1] else hn.new_empty(hn.shape[0], 0, self.config.vocab_size)
        return ForwardOutput(logits, [aux[i] for i in aux_layers], hn if return_hidden else None)
