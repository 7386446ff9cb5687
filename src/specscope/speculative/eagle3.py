"""The EAGLE-3 draft model.

fc fuses three target hidden states (low, mid, high) into one H-wide feature (variants: `fc_norm`, one RMSNorm per
input; speculators' `norm_before_fc`, one RMSNorm over the 3·Ht concatenation); one decoder layer ("midlayer") takes
[input_layernorm(embed(token)), hidden_norm(h)] (2H wide, embedding first) and predicts the next token over a reduced
draft vocabulary (`d2t` maps draft ids to target ids by offset). The target's embedding is shared, never stored here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, asdict

import torch
from torch import nn

from specscope.runtime.kv_cache import KVCache
from specscope.errors import SpecscopeError
from specscope.models.config import ModelConfig
from specscope.models.context import ForwardContext, forward_context
from specscope.models.llama import MLP, Attention, RMSNorm
from specscope.models.rope import rope_table


ROPE_CHUNK = 4096


@dataclass
class FileMeta:
    """What a drafter's config.json holds beyond the network: named in checks, written back on export."""
    aux_ids_in_file: list | None = None        # the aux layer ids as the file wrote them (in its convention)
    verifier_logits_layer: int | None = None   # speculators' 4th aux id (entering convention): feeds the verifier's
                                               # logits in training only
    verifier: dict | None = None               # speculators: {"name_or_path", "architectures"} of the target
    proposal_methods: list | None = None       # speculators' proposal methods and the default one
    default_proposal_method: str | None = None
    speculators_version: str | None = None
    # the τ a drafter was predicted to reach ({"tau": {shape: τ}, "prompts", "max_new_tokens", "source"}; issue 49):
    # config.json's specscope.predicted_tau, kept through conversions, compared by check-drafter
    predicted_tau: dict | None = None


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]         # canonical: hidden states *entering* these target layers (vLLM convention)
    aux_convention_in_file: str = "input"   # how the checkpoint named them: "input" or "output" (SpecForge)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    norm_output: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False     # speculators: one RMSNorm over cat(low, mid, high) before fc
    sliding_window: int | None = None   # drafter attention sees only the last `sliding_window` positions
    attention_bias: bool = False
    format: str = "sglang"           # the layout it was loaded from
    meta: FileMeta = field(default_factory=FileMeta)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """The inverse of to_dict (a training checkpoint's copy), also of one written before `meta` had fields
        of its own (an `extra` dict of the same keys)."""
        d = dict(d)
        meta = d.pop("meta", None) or d.pop("extra", None) or {}
        return cls(**d, meta=FileMeta(**{k: v for k, v in meta.items() if k in FileMeta.__dataclass_fields__}))

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, qkv_bias=self.attention_bias,
            attention_bias=self.attention_bias)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def default_aux_layers(num_target_layers: int) -> list[int]:
        L = num_target_layers
        return [2, L // 2, L - 3]


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        lc = cfg.layer_config()
        H = cfg.hidden_size
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(lc, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(lc)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, ctx: ForwardContext):
        hn = self.hidden_norm(hidden)
        residual = hn if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)
        h = residual + self.self_attn(x, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if len(cfg.aux_layer_ids) != 3:
            raise SpecscopeError(f"EAGLE-3 drafters fuse exactly 3 target layers; this one names "
                                 f"{len(cfg.aux_layer_ids)} ({cfg.aux_layer_ids}), which is not supported")
        self.config = cfg
        Ht, H = cfg.target_hidden_size, cfg.hidden_size
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(3)) if cfg.fc_norm else None
        self.input_norm = RMSNorm(3 * Ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # built lazily to the positions in use (a 262,144-position table is 128 MB of float32 nobody reads)
        self.register_buffer("rope", self._rope_table(min(cfg.max_position_embeddings, ROPE_CHUNK)), persistent=False)

    def _rope_table(self, n: int) -> torch.Tensor:
        c = self.config
        return rope_table(c.head_dim, n, c.rope_theta, c.rope_scaling)

    def rope_upto(self, n: int) -> torch.Tensor:
        """The cos/sin table covering positions 0..n-1 (grown in ROPE_CHUNK steps, float32, on the drafter's
        device)."""
        if n > self.rope.shape[1] or self.rope.is_meta or self.rope.dtype != torch.float32 or \
                self.rope.device != self.device:
            size = max(self.rope.shape[1] if not self.rope.is_meta else 0, -(-n // ROPE_CHUNK) * ROPE_CHUNK)
            self.rope = self._rope_table(size).to(self.device)
        return self.rope

    # from the norm, not fc: a packed fc (models/linear.py) would unpack its weight to answer
    @property
    def device(self):
        return self.norm.weight.device

    @property
    def dtype(self):
        return self.norm.weight.dtype

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)

    def cover_positions(self, n: int) -> None:
        """Make the RoPE table cover positions 0..n-1. RoPE is defined for any position, and published drafters
        say max_position_embeddings 2048 under targets with far longer contexts: the table grows (same theta and
        scaling, float32, existing rows unchanged) instead of failing at position 2048."""
        self.rope_upto(n)

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.config
        self.cover_positions(max_len)   # drafting writes a position at a slot >= it, so max_len positions suffice
        return KVCache(1, c.num_key_value_heads, c.head_dim, max_len, batch, self.device, self.dtype)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """cat(low, mid, high) of the target's hidden states -> the drafter's H-wide input feature."""
        if self.fc_norm is not None:
            aux = [n(a) for n, a in zip(self.fc_norm, aux)]
        x = torch.cat(aux, dim=-1).to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, slots=None, mask=None, compute_logits: bool = True, logits_idx=None):
        """embeds, hidden: [B, T, H]. Returns (draft-vocab logits [B, T, Vd] or None, next hidden [B, T, H]).
        logits_idx: positions along T whose logits to compute (None = all)."""
        # key positions are the slot indices (committed slots are positions; tree nodes sit within `depth` of
        # their query, well inside any real window), and the window applies once it can hide a key
        ctx = forward_context(position_ids, self.rope_upto, hidden.dtype, cache, slots, mask,
                              self.config.sliding_window, slot_positions=True, lazy_window=True)
        h = self.midlayer(embeds.to(self.dtype), hidden, ctx)
        hn = self.norm(h)
        logits = None
        if compute_logits:
            logits = self.lm_head(hn if logits_idx is None else hn[:, logits_idx])
        return logits, (hn if self.config.norm_output else h)
