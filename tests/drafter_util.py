"""Helpers for drafter tests: tiny targets, random drafters, raw checkpoints with the published key names, and an
independent step-by-step reference of the EAGLE-3 layer (separate q/k/v, written from the spec, not our modules)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

CONFIGS = Path(__file__).parent / "data" / "drafter_configs"
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=101, draft_vocab_size=40)


def tiny_target(tmp_path, layers: int = 8, hidden: int = 64, vocab: int = 101):
    from tiny import make_hf_model

    from specscope.models import load_model

    d = Path(tmp_path) / f"target-{layers}-{hidden}-{vocab}"
    if not d.exists():
        make_hf_model(d, "llama", layers=layers, hidden=hidden, vocab=vocab)
    return load_model(d, "fp32", "cpu")


def shrink(raw: dict) -> dict:
    """Same fields and flags as a published config, small sizes."""
    raw = json.loads(json.dumps(raw))
    layer = raw.get("transformer_layer_config", raw)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        layer[k] = SMALL[k]
    if "head_dim" in layer:
        layer["head_dim"] = SMALL["head_dim"]
    raw["draft_vocab_size"] = SMALL["draft_vocab_size"]
    return raw


def published(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def vocab_map(draft: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:draft].sort().values
    d2t = ids - torch.arange(draft)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def raw_tensors(raw: dict, prefix: str, seed: int = 0, target_hidden: int | None = None) -> dict:
    """Random tensors with exactly the file names of §2 for the (shrunk) config."""
    layer = raw.get("transformer_layer_config", raw)
    H, I = layer["hidden_size"], layer["intermediate_size"]
    nh, nkv = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or H // nh
    Ht = target_hidden or raw.get("target_hidden_size") or H
    Vd, V = raw["draft_vocab_size"], layer["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    d2t, t2d = vocab_map(Vd, V, seed)
    t = {"fc.weight": r(H, 3 * Ht), "norm.weight": 1 + r(H, scale=0.1), "lm_head.weight": r(Vd, H),
         "d2t": d2t, "t2d": t2d,
         prefix + "self_attn.q_proj.weight": r(nh * hd, 2 * H), prefix + "self_attn.k_proj.weight": r(nkv * hd, 2 * H),
         prefix + "self_attn.v_proj.weight": r(nkv * hd, 2 * H), prefix + "self_attn.o_proj.weight": r(H, nh * hd),
         prefix + "mlp.gate_proj.weight": r(I, H), prefix + "mlp.up_proj.weight": r(I, H),
         prefix + "mlp.down_proj.weight": r(H, I)}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        t[f"{prefix}{n}.weight"] = 1 + r(H, scale=0.1)
    if raw.get("fc_norm"):
        for i in range(3):
            t[f"fc_norm.{i}.weight"] = 1 + r(Ht, scale=0.1)
    if raw.get("norm_before_fc"):
        t["input_norm.weight"] = 1 + r(3 * Ht, scale=0.1)     # speculators: one norm over cat(low, mid, high)
    return t


def shrink_text(name: str, **values) -> bytes:
    """A published config shrunk by editing its text: the published bytes (CRLF, missing final newline, odd
    spacing) stay as they are, only the numbers change. `values` override or add (as JSON) top-level fields."""
    import re

    text = (CONFIGS / name).read_bytes().decode()
    sizes = {**SMALL, "head_dim": SMALL["head_dim"]}
    for k, v in sizes.items():
        text, n = re.subn(rf'("{k}"\s*:\s*)-?\d+', rf"\g<1>{v}", text)
    for k, v in values.items():
        pat = rf'("{k}"\s*:\s*)(\[[^\]]*\]|[^,\r\n}}]+)'
        if re.search(pat, text):
            text = re.sub(pat, lambda m: m.group(1) + json.dumps(v), text, count=1)
        else:
            text = text.replace("{", "{" + json.dumps(k) + ": " + json.dumps(v) + ",", 1)
    return text.encode()


def write_raw(path: Path, raw: dict | bytes, tensors: dict, bin_file: bool = False) -> Path:
    """A drafter directory: config.json (a dict, or the exact bytes to write) and its tensors."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(raw, bytes):
        (path / "config.json").write_bytes(raw)
    else:
        (path / "config.json").write_text(json.dumps(raw))
    if bin_file:
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_step(t: dict, prefix: str, cfg: dict, embeds, hidden, positions, keys=None):
    """One EAGLE-3 layer over T new tokens (batch 1) written from §1 of the spec.
    `keys`: list of (k, v, pos) already cached (per-head tensors); the new tokens attend causally to the cache and
    to each other. Returns (logits, next_hidden, new_keys)."""
    H, nh, nkv, hd = cfg["H"], cfg["nh"], cfg["nkv"], cfg["hd"]
    eps, theta = cfg["eps"], cfg["theta"]
    p = prefix
    hn = _rms(hidden, t[p + "hidden_norm.weight"], eps)
    residual = hn if cfg["norm_before_residual"] else hidden
    x = torch.cat([_rms(embeds, t[p + "input_layernorm.weight"], eps), hn], -1)      # embedding first
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd).transpose(0, 1)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    new = (k, v, positions)
    allk = torch.cat([kk for kk, _, _ in (keys or [])] + [k], 1)
    allv = torch.cat([vv for _, vv, _ in (keys or [])] + [v], 1)
    allp = torch.cat([pp for _, _, pp in (keys or [])] + [positions])
    rep = nh // nkv
    allk, allv = allk.repeat_interleave(rep, 0), allv.repeat_interleave(rep, 0)
    s = q @ allk.transpose(1, 2) / math.sqrt(hd)
    n_cached = allk.shape[1] - k.shape[1]
    vis = torch.ones(len(positions), allk.shape[1], dtype=torch.bool)
    vis[:, n_cached:] = torch.tril(torch.ones(len(positions), len(positions), dtype=torch.bool))
    if cfg.get("window"):
        vis &= (positions[:, None] - allp[None, :]) < cfg["window"]
    s = s.masked_fill(~vis, float("-inf"))
    a = (s.softmax(-1) @ allv).transpose(0, 1).reshape(-1, nh * hd) @ t[p + "self_attn.o_proj.weight"].T
    h = residual + a
    m = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    hn = _rms(h, t["norm.weight"], eps)
    return hn @ t["lm_head.weight"].T, (hn if cfg["norm_output"] else h), (keys or []) + [new]


def ref_cfg(drafter) -> dict:
    c = drafter.config
    return dict(H=c.hidden_size, nh=c.num_attention_heads, nkv=c.num_key_value_heads, hd=c.head_dim,
                eps=c.rms_norm_eps, theta=c.rope_theta, norm_before_residual=c.norm_before_residual,
                norm_output=c.norm_output, window=c.sliding_window)


def random_drafter(target, draft_vocab: int = 40, seed: int = 0, **flags):
    from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter

    tc = target.config
    cfg = DrafterConfig(hidden_size=tc.hidden_size, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab,
                        target_hidden_size=tc.hidden_size,
                        aux_layer_ids=DrafterConfig.default_aux_layers(tc.num_hidden_layers),
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, max_position_embeddings=256, **flags)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for n, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in n else 0.2) + (1.0 if "norm" in n else 0.0))
    d2t, t2d = vocab_map(draft_vocab, tc.vocab_size, seed)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    return d.eval()
