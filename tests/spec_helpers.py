"""Tiny targets and drafters for speculative-decoding tests."""

from __future__ import annotations

import random

import torch

from specscope.generate import generate
from specscope.models import load_model
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
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


# ---- the every-shape property (tests/test_spec_shapes.py, and on the real model in test_spec_smollm2.py)

def max_draft_tokens(steps: int, topk: int) -> int:
    return 1 + topk + (steps - 1) * topk * topk


def sample_cases(n: int, ctx: int, seed: int, max_new_hi: int = 12,
                 max_dt: int | None = None) -> list[tuple[SpecConfig, int, int]]:
    """Seeded sample of (shape, prompt length, max new tokens) over steps 1-8 x topk 1-8 x draft tokens 2..max
    (or `max_dt`), half of them from the shapes that expand more drafter-cache entries than they verify, with
    prompt + max_new within `steps` of the context (or exactly at it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        steps, topk = rng.randint(1, 8), rng.randint(1, 8)
        hi = min(max_draft_tokens(steps, topk), max_dt or 10 ** 9)
        crowded = max(2, (steps - 1) * topk - 3)   # more expansions than verified tokens
        dt = rng.randint(2, min(crowded, hi)) if rng.random() < 0.5 else rng.randint(2, hi)
        max_new = rng.randint(1, max_new_hi)
        slack = rng.randint(0, steps)              # free positions left after the last token
        out.append((SpecConfig(steps, topk, dt), ctx - max_new - slack, max_new))
    return out


def check_grid(target, drafters: dict, cases, prompt_for) -> dict:
    """Run every case with every drafter; assert greedy identity. Returns per drafter: cases, cases that ran a
    cycle, cases with an accepted draft, and cases that max_new cut inside an accepted run of drafts."""
    stats = {name: {"cases": 0, "cycled": 0, "accepted": 0, "ended_inside": 0} for name in drafters}
    refs = {}
    for cfg, T, max_new in cases:
        prompt = prompt_for(T)
        if (T, max_new) not in refs:
            refs[(T, max_new)] = generate(target, prompt, max_new, stop_ids=[]).token_ids
        want = refs[(T, max_new)]
        for name, make in drafters.items():
            res = speculative_generate(target, make(), prompt, max_new, stop_ids=(), cfg=cfg)
            label = f"{name} steps={cfg.steps} topk={cfg.topk} draft_tokens={cfg.draft_tokens} prompt={T} " \
                    f"max_new={max_new} context={target.config.max_position_embeddings}"
            assert res.token_ids == want, label
            assert res.stop_reason == "length", label
            acc = res.stats.accept_lengths
            s = stats[name]
            s["cases"] += 1
            s["cycled"] += bool(acc)                  # max_new = 1 is the prefill's token alone
            s["accepted"] += any(a > 1 for a in acc)
            # the last cycle produced `overshoot` tokens past max_new: its bonus and overshoot - 1 accepted drafts
            overshoot = 1 + sum(acc) - len(res.token_ids)
            s["ended_inside"] += overshoot >= 2
    return stats


def tiny_target_and_drafter(root):
    """(model dir, drafter dir, loaded target) under `root`: a 4-layer llama with a 101-token tokenizer and a
    random EAGLE-3 drafter for it saved in SGLang's layout -- what the bad-input suites run commands against."""
    from specscope.speculative.formats import save_drafter
    from tiny import make_tiny_tokenizer

    model = root / "model"
    make_hf_model(model, "llama", layers=4, vocab=101)
    make_tiny_tokenizer(model, 101)
    target = load_model(model, "fp32", "cpu")
    drafter = root / "drafter"
    save_drafter(random_eagle3(target, draft_vocab=60), drafter, "sglang", dtype=torch.float32)
    return model, drafter, target


def tiny_world(root) -> dict:
    """What the bad-input suites run commands against: a tiny target with tokenizer (`model`), a drafter for it
    (`drafter`) and a registry holding one generate run (`db`), all under `root`."""
    from specscope.registry import make_record, store_record

    model, drafter, _ = tiny_target_and_drafter(root)
    db = root / "runs.db"
    store_record(make_record("generate", name="a run", config={"model": str(model)}, results={"tok_per_s": 10.0},
                             env={"host": "test"}), db)
    return {"root": root, "model": model, "drafter": drafter, "db": db}
