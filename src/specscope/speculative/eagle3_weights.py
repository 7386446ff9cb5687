"""A drafter checkpoint's tensors: read (one safetensors file, HF-style shards or pytorch_model.bin) from either
layout into our `Eagle3Drafter` state dict, and back. Our drafter fuses q/k/v and gate/up; this module splits and
joins them. The target's embedding is shared and never written. Loading reads tensors straight into their final
(fused) place in the stored dtype, shards included, so peak memory stays near the file size; every problem with the
weights is reported in one error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specscope.errors import SpecscopeError
from specscope.models.loader import SafetensorsReader, weight_files
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from specscope.speculative.eagle3_config import one_error

LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}
# tensors a checkpoint may carry that we deliberately do not use
IGNORED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


class _DictReader:
    """The SafetensorsReader interface over an in-memory state dict (pytorch_model.bin, tests)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def keys(self):
        return self.state.keys()

    def __contains__(self, name):
        return name in self.state

    def shape(self, name):
        return tuple(self.state[name].shape)

    def dtype(self, name):
        return self.state[name].dtype

    def read(self, name, out=None):
        return self.state[name] if out is None else out.copy_(self.state[name])

    def cat(self, names):
        return torch.cat([self.state[n] for n in names])


def weight_reader(path: Path):
    """Single file, HF-style shards (model.safetensors.index.json) or pytorch_model.bin."""
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return SafetensorsReader(weight_files(path))
    pt = path / "pytorch_model.bin"
    if pt.exists():
        try:
            try:
                state = torch.load(str(pt), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:     # legacy (non-zip) pickles cannot be memory-mapped
                state = torch.load(str(pt), map_location="cpu", weights_only=True)
            return _DictReader(state)
        except Exception as e:
            raise SpecscopeError(f"cannot read {pt} ({type(e).__name__}: {e})") from None
    raise SpecscopeError(f"drafter directory {str(path)!r} has no model.safetensors, model.safetensors.index.json "
                         f"or pytorch_model.bin")


def file_to_ours(src, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """File layout (either format; a reader or a plain state dict) -> Eagle3Drafter state dict (fused qkv /
    gate_up, fused in place while reading)."""
    if isinstance(src, dict):
        src = _DictReader(src)
    p = LAYER_PREFIX[cfg.format]
    other = LAYER_PREFIX["speculators" if cfg.format == "sglang" else "sglang"]
    if not any(k.startswith(p) for k in src.keys()) and any(k.startswith(other) for k in src.keys()):
        p = other   # some writers mix the config of one layout with the weight names of the other
    used: set[str] = set()
    missing: list[str] = []

    def have(*keys, what=None):
        absent = [k for k in keys if k not in src]
        missing.extend(f"{k!r}" + (f" ({what})" if what else "") for k in absent)
        used.update(keys)
        return not absent

    out = {}
    for k in ("fc.weight", "norm.weight", "lm_head.weight"):
        if have(k):
            out[k] = src.read(k)
    out["d2t"], out["t2d"] = _vocab_maps(src, cfg, used)
    if cfg.fc_norm:
        for i in range(3):
            if have(f"fc_norm.{i}.weight", what="fc_norm=true"):
                out[f"fc_norm.{i}.weight"] = src.read(f"fc_norm.{i}.weight")
    if cfg.norm_before_fc and have("input_norm.weight", what="norm_before_fc=true"):
        out["input_norm.weight"] = src.read("input_norm.weight")
    a, m = p + "self_attn.", p + "mlp."
    if have(*(a + f"{x}_proj.weight" for x in "qkv")):
        out["midlayer.self_attn.qkv_proj.weight"] = src.cat([a + f"{x}_proj.weight" for x in "qkv"])
    if cfg.attention_bias:
        if have(*(a + f"{x}_proj.bias" for x in "qkv"), a + "o_proj.bias", what="attention_bias=true"):
            out["midlayer.self_attn.qkv_proj.bias"] = src.cat([a + f"{x}_proj.bias" for x in "qkv"])
            out["midlayer.self_attn.o_proj.bias"] = src.read(a + "o_proj.bias")
    if have(a + "o_proj.weight"):
        out["midlayer.self_attn.o_proj.weight"] = src.read(a + "o_proj.weight")
    if have(m + "gate_proj.weight", m + "up_proj.weight"):
        out["midlayer.mlp.gate_up_proj.weight"] = src.cat([m + "gate_proj.weight", m + "up_proj.weight"])
    if have(m + "down_proj.weight"):
        out["midlayer.mlp.down_proj.weight"] = src.read(m + "down_proj.weight")
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        if have(p + n + ".weight"):
            out[f"midlayer.{n}.weight"] = src.read(p + n + ".weight")
    problems = [f"missing tensor {k}" for k in missing]
    unknown = [k for k in src.keys()
               if k not in used and k not in IGNORED_KEYS and not k.endswith("rotary_emb.inv_freq")]
    if unknown:
        problems.append(_unknown_tensors(unknown))
    if problems:
        raise SpecscopeError(one_error("drafter checkpoint", problems))
    return out


def _vocab_maps(src, cfg: DrafterConfig, used: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from the file, or derived: the identity for a full-vocabulary drafter, t2d from d2t."""
    if "d2t" in src:
        used.add("d2t")
        d2t = src.read("d2t").to(torch.long)
    elif cfg.draft_vocab_size == cfg.vocab_size:
        d2t = torch.zeros(cfg.vocab_size, dtype=torch.long)  # full-vocabulary drafter: identity map
    else:
        raise SpecscopeError(f"drafter checkpoint has no 'd2t' but its draft vocabulary ({cfg.draft_vocab_size}) is "
                             f"smaller than the target's ({cfg.vocab_size}); the draft->target id map is required")
    if "t2d" in src:
        used.add("t2d")
        return d2t, src.read("t2d").to(torch.bool)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    ids = torch.arange(len(d2t)) + d2t
    if ids.min() >= 0 and ids.max() < cfg.vocab_size:
        t2d[ids] = True
    return d2t, t2d


def _unknown_tensors(unknown: list[str]) -> str:
    """The problem line for tensors no field explains, with the likeliest reason."""
    hint = ""
    if any(k.startswith(("layers.1.", "midlayer.1.", "midlayers.")) for k in unknown):
        hint = " (more than one draft layer is not supported)"
    elif any("q_norm" in k or "k_norm" in k for k in unknown):
        hint = " (q/k RMSNorm in the draft layer is not supported)"
    elif any(k.startswith("fc_norm") for k in unknown):
        hint = " (config.json does not set fc_norm=true)"
    elif "input_norm.weight" in unknown:
        hint = " (config.json does not set norm_before_fc=true)"
    return f"tensors this loader does not understand: {', '.join(sorted(unknown)[:4])}{hint}"


def ours_to_file(drafter: Eagle3Drafter, fmt: str) -> dict[str, torch.Tensor]:
    cfg = drafter.config
    sd = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    p = LAYER_PREFIX[fmt]
    lc = cfg.layer_config()
    q, kv = lc.num_attention_heads * lc.head_dim, lc.num_key_value_heads * lc.head_dim
    out = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
           "d2t": sd["d2t"].to(torch.int64), "t2d": sd["t2d"].to(torch.bool)}
    if cfg.fc_norm:
        for i in range(3):
            out[f"fc_norm.{i}.weight"] = sd[f"fc_norm.{i}.weight"]
    if cfg.norm_before_fc:
        out["input_norm.weight"] = sd["input_norm.weight"]
    for suffix in ("weight", "bias"):
        key = f"midlayer.self_attn.qkv_proj.{suffix}"
        if key in sd:
            for name, t in zip("qkv", sd[key].split([q, kv, kv])):
                out[f"{p}self_attn.{name}_proj.{suffix}"] = t.contiguous()
        key = f"midlayer.self_attn.o_proj.{suffix}"
        if key in sd:
            out[f"{p}self_attn.o_proj.{suffix}"] = sd[key]
    gate, up = sd["midlayer.mlp.gate_up_proj.weight"].split(cfg.intermediate_size)
    out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    out[f"{p}mlp.down_proj.weight"] = sd["midlayer.mlp.down_proj.weight"]
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        out[f"{p}{n}.weight"] = sd[f"midlayer.{n}.weight"]
    return out


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating tensors in `state` holding NaN or inf: what a diverged training run leaves."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.device.type != "meta"
            and not _finite(v)]


def _finite(t: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """All of `t` finite, checked a slice at a time: a whole-tensor isfinite() would allocate a mask as large as
    the tensor's element count, on top of the weights being loaded."""
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def listed_names(keys: list[str]) -> str:
    """The first three names, and how many more."""
    return ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
