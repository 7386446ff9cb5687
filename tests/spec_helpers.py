"""Tiny targets and drafters for speculative-decoding tests."""

from __future__ import annotations

import torch

from specscope.models import load_model
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from tiny import make_hf_model


def tiny_target(path, arch="llama", seed=0, **kw):
    make_hf_model(path, arch, seed=seed, **kw)
    return load_model(path, dtype="fp32")


def random_eagle3(target, draft_vocab: int | None = None, seed: int = 0, scale: float = 3.0, **flags):
    """An EAGLE-3 drafter with random weights over the target's first `draft_vocab` ids (or a strided subset)."""
    tc = target.config
    V = tc.vocab_size
    Vd = draft_vocab or V
    cfg = DrafterConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=tc.hidden_size,
                        aux_layer_ids=DrafterConfig.default_aux_layers(max(tc.num_hidden_layers, 4))
                        if tc.num_hidden_layers >= 4 else [0, 1, tc.num_hidden_layers - 1],
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        max_position_embeddings=flags.pop("max_position_embeddings",
                                                          tc.max_position_embeddings), **flags)
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
        ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
        d.d2t.copy_(ids - torch.arange(Vd))
        d.t2d.zero_()
        d.t2d[ids] = True
    return d.eval().requires_grad_(False)
