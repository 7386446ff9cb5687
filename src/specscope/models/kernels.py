"""The row-invariant CPU kernels (models/rowgemm.py) brought into a model by swapping its modules' classes at load
time, as gpt-fast's quantize.py swaps linears: models/llama.py never mentions them. Each Row* class takes its
kernel where the input qualifies (fp32, CPU, one sequence with a cache for attention) and the plain path
otherwise."""

from __future__ import annotations

import torch

from specscope.models import rowgemm
from specscope.models.context import ForwardContext
from specscope.models.llama import MLP, Attention, DecoderLayer, RMSNorm, Transformer


def _fits(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"


class RowRMSNorm(RMSNorm):
    def forward(self, x):
        return rowgemm.rmsnorm(x, self.weight, self.eps) if _fits(x) else super().forward(x)


class RowMLP(MLP):
    def act(self, gu):
        return rowgemm.silu_mul(gu, self.inter) if _fits(gu) else super().act(gu)


class RowAttention(Attention):
    def forward(self, x, ctx: ForwardContext):
        cache = ctx.cache
        if cache is None or x.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
            return super().forward(x, ctx)
        T, rows = x.shape[1], ctx.rows
        k_rows, v_rows = cache.k_rows[self.layer], cache.v_rows[self.layer]
        if self.q_norm is None:
            # rotary embedding, cache write and attention in one kernel call
            y = rowgemm.rope_attention(self.qkv_proj(x).view(T, -1), self.n_heads, self.n_kv, rows.cos, rows.sin,
                                       rows.slots, k_rows, v_rows, ctx.kv_len, rows.mask)
        else:
            # the kernel reads the cache in place and writes [T, heads * D], o_proj's layout
            q, k, v = self.qkv_rope(x, ctx)
            cache.write(self.layer, ctx.slots, k, v)
            y = rowgemm.attention(q[0].transpose(0, 1), k_rows, v_rows, ctx.kv_len, rows.mask)
        return self.o_proj(y.view(1, T, self.q_size))


class RowDecoderLayer(DecoderLayer):
    def add_norm(self, h, a):
        norm = self.post_attention_layernorm
        if _fits(h) and a.is_contiguous():
            return rowgemm.rmsnorm(h, norm.weight, norm.eps, delta=a)   # residual add and norm in one pass
        return super().add_norm(h, a)


class RowTransformer(Transformer):
    row_stack: rowgemm.LayerStack | None = None   # every decoder layer in one kernel call, where all qualify

    def run_layers(self, h, ctx: ForwardContext, aux_layers):
        if self.row_stack is None or ctx.cache is None or h.shape[0] != 1 or h.dtype != torch.float32:
            return super().run_layers(h, ctx, aux_layers)
        r = ctx.rows
        h, aux = self.row_stack(h[0], r.cos, r.sin, r.slots, ctx.cache, ctx.kv_len, r.mask, aux_layers)
        return h[None], {i: a[None] for i, a in aux.items()}


SWAPS = {RMSNorm: RowRMSNorm, MLP: RowMLP, Attention: RowAttention, DecoderLayer: RowDecoderLayer,
         Transformer: RowTransformer}


def use_row_kernels(model: torch.nn.Module) -> None:
    """Swap `model`'s norms, attention, MLPs, decoder layers and (a Transformer) the model itself for their Row*
    classes, in place; a Transformer whose layers all qualify also runs them in one call (layer_stack)."""
    for m in model.modules():
        if type(m) in SWAPS:
            m.__class__ = SWAPS[type(m)]
    if isinstance(model, RowTransformer):
        model.row_stack = layer_stack(model)


def layer_stack(model) -> rowgemm.LayerStack | None:
    """All of `model`'s decoder layers in one kernel call, where every layer qualifies: our kernel on all four
    linears (a PackedLinear with row panels), no q/k norm, fp32 contiguous norm weights."""
    def ok(lin):
        return getattr(lin, "rg", None) is not None

    if not model.layers or not rowgemm.available():
        return None
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.q_norm is not None or not all(map(ok, (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))):
            return None
        if any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous()
               for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
    return rowgemm.LayerStack(model)
