"""EAGLE-3 drafter checkpoints in the two public layouts, and validation against a target.

- SafeAILab / SpecForge / SGLang ("sglang"): a LlamaConfig plus `draft_vocab_size`, optional `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids` (the *output of* layers i, i.e. our entering-layer id - 1; SGLang
  adds +1 when it reads them); weights `midlayer.*` with separate q/k/v and gate/up.
- vLLM speculators ("speculators"): `speculators_model_type: eagle3`, `transformer_layer_config`,
  `speculators_config`, `eagle_aux_hidden_state_layer_ids` (entering-layer ids); weights `layers.0.*`;
  `norm_before_residual` defaults to True when omitted (as vLLM reads it).

Our `Eagle3Drafter` fuses q/k/v and gate/up; this module splits and joins them. The target's embedding is shared
and never written; aux layer ids are kept in the entering-layer convention, with the file's own recorded in
`DrafterConfig.aux_convention_in_file` ("input", "output" or "default" when the file named none).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specscope.errors import SpecscopeError
from specscope.models.config import (MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
                                     cfg_bool, cfg_float, cfg_int, cfg_str, rope_scaling_of, rope_theta_of)
from specscope.models.loader import read_json_object
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
FORMATS = ("sglang", "speculators")
DRAFTER_CFG = "drafter config.json"
LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}
SPECULATORS_VERSION = "0.3.0"
# tensors a checkpoint may carry that we deliberately do not use
IGNORED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


# ---------------------------------------------------------------- config parsing

def read_config(path: Path) -> dict:
    """A checkpoint directory's config.json as a dict, with one-line errors for missing / invalid files."""
    f = path / "config.json"
    if not f.exists():
        raise SpecscopeError(f"drafter directory {str(path)!r} has no config.json")
    return read_json_object(f)


def detect_format(raw: dict) -> str:
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise SpecscopeError(f"speculators_model_type {raw['speculators_model_type']!r} is not supported; "
                                 f"only 'eagle3' drafters are")
        return "speculators"
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise SpecscopeError(f"{DRAFTER_CFG}: architectures must be a list of names, got {archs!r}")
    if archs and archs[0] in SPECULATORS_ARCHS:
        raise SpecscopeError(f"config.json names {archs[0]} but has no 'speculators_model_type'; "
                             f"a speculators checkpoint needs 'speculators_model_type': 'eagle3'")
    if archs and archs[0] not in SGLANG_ARCHS:
        raise SpecscopeError(f"config.json architecture {archs[0]!r} is not an EAGLE-3 drafter; expected one of "
                             f"{', '.join(SGLANG_ARCHS + SPECULATORS_ARCHS)}")
    if "draft_vocab_size" not in raw and "eagle_config" not in raw:
        raise SpecscopeError("config.json has neither 'draft_vocab_size' nor 'eagle_config': "
                             "this looks like a plain model, not an EAGLE-3 drafter")
    return "sglang"


def _refuse_unsupported(layer: dict, top: dict):
    n = cfg_int(layer, "num_hidden_layers", 1, hi=MAX_LAYERS, where=DRAFTER_CFG)
    if n != 1:
        raise SpecscopeError(f"drafter has num_hidden_layers={n}; only single-layer EAGLE-3 drafters are supported")
    types = layer.get("layer_types") or []
    if layer.get("use_sliding_window") or (isinstance(types, list) and "sliding_attention" in types) or \
            (layer.get("sliding_window") and layer.get("model_type") == "mistral"):
        raise SpecscopeError(f"drafter uses sliding-window attention (sliding_window="
                             f"{layer.get('sliding_window')}); sliding-window drafter attention is not supported")
    act = cfg_str(layer, "hidden_act", "silu", where=DRAFTER_CFG)
    if act not in ("silu", "swish"):
        raise SpecscopeError(f"drafter hidden_act {act!r} is not supported; only silu (SwiGLU)")
    if top.get("norm_before_fc"):
        raise SpecscopeError("drafter sets norm_before_fc=true, which is not supported (use fc_norm)")
    if layer.get("mlp_bias"):
        raise SpecscopeError("drafter sets mlp_bias=true, which is not supported")
    rope_scaling_of(layer, DRAFTER_CFG)  # a string / unknown type / missing factor: one clear line


def _aux_ids(ids, convention: str, target_layers: int | None) -> tuple[list[int], str]:
    if ids is None:
        if target_layers is None:
            raise SpecscopeError("the drafter's config does not name its aux layers "
                                 "(eagle_aux_hidden_state_layer_ids); pass the target so the default layers "
                                 "(2, L//2, L-3) can be used")
        return DrafterConfig.default_aux_layers(target_layers), "default"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SpecscopeError(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if len(ids) != 3:
        raise SpecscopeError(f"eagle_aux_hidden_state_layer_ids names {len(ids)} layers ({ids}); EAGLE-3 fuses "
                             f"exactly 3 (a fourth aux layer feeding verifier logits is not supported)")
    return ([i + 1 for i in ids] if convention == "output" else list(ids)), convention


def parse_config(raw: dict, target_layers: int | None = None) -> DrafterConfig:
    fmt = detect_format(raw)
    if fmt == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpecscopeError("speculators config.json lacks 'transformer_layer_config'")
        ids, conv = _aux_ids(raw.get("eagle_aux_hidden_state_layer_ids"), "input", target_layers)
        nbr_default = True       # vLLM assumes True when a speculators config omits it
    else:
        layer = raw
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise SpecscopeError(f"{DRAFTER_CFG}: eagle_config must be an object, got {eagle!r}")
        ids, conv = _aux_ids(eagle.get("eagle_aux_hidden_state_layer_ids"), "output", target_layers)
        nbr_default = False      # the original EAGLE layer adds the un-normed residual
    _refuse_unsupported(layer, raw)
    w = DRAFTER_CFG
    H = cfg_int(layer, "hidden_size", hi=MAX_HIDDEN, where=w)
    heads = cfg_int(layer, "num_attention_heads", hi=MAX_HEADS, where=w)
    vocab = cfg_int(layer, "vocab_size", hi=MAX_VOCAB, where=w)
    top_or_layer = lambda k: raw if raw.get(k) is not None else layer  # noqa: E731  (either level may hold it)
    cfg = DrafterConfig(
        hidden_size=H,
        intermediate_size=cfg_int(layer, "intermediate_size", hi=MAX_HIDDEN * 16, where=w),
        num_attention_heads=heads,
        num_key_value_heads=cfg_int(layer, "num_key_value_heads", heads, hi=heads, where=w),
        head_dim=cfg_int(layer, "head_dim", max(H // heads, 1), hi=MAX_HEAD_DIM, where=w),
        vocab_size=vocab,
        draft_vocab_size=cfg_int(top_or_layer("draft_vocab_size"), "draft_vocab_size", vocab, hi=MAX_VOCAB,
                                 where=w),
        target_hidden_size=cfg_int(top_or_layer("target_hidden_size"), "target_hidden_size", H, hi=MAX_HIDDEN,
                                   where=w),
        aux_layer_ids=ids,
        aux_convention_in_file=conv,
        rms_norm_eps=cfg_float(layer, "rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True, where=w),
        rope_theta=rope_theta_of(layer, w),
        rope_scaling=rope_scaling_of(layer, w),
        max_position_embeddings=cfg_int(layer, "max_position_embeddings", 4096, hi=MAX_POSITIONS, where=w),
        norm_before_residual=cfg_bool(raw, "norm_before_residual", nbr_default, where=w),
        norm_output=cfg_bool(raw, "norm_output", False, where=w),
        fc_norm=cfg_bool(raw, "fc_norm", False, where=w),
        attention_bias=cfg_bool(layer, "attention_bias", False, where=w),
        format=fmt,
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise SpecscopeError(f"drafter num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({cfg.num_key_value_heads})")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        raise SpecscopeError(f"draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size ({cfg.vocab_size})")
    return cfg


# ---------------------------------------------------------------- weights

def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.exists():
        from specscope.models.loader import read_safetensors
        return read_safetensors([st])
    if pt.exists():
        try:
            return torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as e:
            raise SpecscopeError(f"cannot read {pt} ({type(e).__name__}: {e})") from None
    raise SpecscopeError(f"drafter directory {str(path)!r} has no model.safetensors or pytorch_model.bin")


def file_to_ours(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """File layout (either format) -> Eagle3Drafter state dict (fused qkv / gate_up)."""
    p = LAYER_PREFIX[cfg.format]
    other = LAYER_PREFIX["speculators" if cfg.format == "sglang" else "sglang"]
    if not any(k.startswith(p) for k in state) and any(k.startswith(other) for k in state):
        p = other   # some writers mix the config of one layout with the weight names of the other
    used = set()

    def need(key, what=None):
        if key not in state:
            raise SpecscopeError(f"drafter checkpoint is missing tensor {key!r}" + (f" ({what})" if what else ""))
        used.add(key)
        return state[key]

    out = {"fc.weight": need("fc.weight"), "norm.weight": need("norm.weight"), "lm_head.weight": need("lm_head.weight")}
    if "d2t" in state:
        out["d2t"] = need("d2t").to(torch.long)
    elif cfg.draft_vocab_size == cfg.vocab_size:
        out["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)  # full-vocabulary drafter: identity map
    else:
        raise SpecscopeError(f"drafter checkpoint has no 'd2t' but its draft vocabulary ({cfg.draft_vocab_size}) is "
                             f"smaller than the target's ({cfg.vocab_size}); the draft->target id map is required")
    if "t2d" in state:
        out["t2d"] = need("t2d").to(torch.bool)
    else:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        ids = torch.arange(len(out["d2t"])) + out["d2t"]
        if ids.min() >= 0 and ids.max() < cfg.vocab_size:
            t2d[ids] = True
        out["t2d"] = t2d
    if cfg.fc_norm:
        for i in range(3):
            out[f"fc_norm.{i}.weight"] = need(f"fc_norm.{i}.weight", "fc_norm=true")
    a = p + "self_attn."
    out["midlayer.self_attn.qkv_proj.weight"] = torch.cat([need(a + f"{x}_proj.weight") for x in "qkv"])
    if cfg.attention_bias:
        out["midlayer.self_attn.qkv_proj.bias"] = torch.cat([need(a + f"{x}_proj.bias") for x in "qkv"])
        out["midlayer.self_attn.o_proj.bias"] = need(a + "o_proj.bias")
    out["midlayer.self_attn.o_proj.weight"] = need(a + "o_proj.weight")
    m = p + "mlp."
    out["midlayer.mlp.gate_up_proj.weight"] = torch.cat([need(m + "gate_proj.weight"), need(m + "up_proj.weight")])
    out["midlayer.mlp.down_proj.weight"] = need(m + "down_proj.weight")
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        out[f"midlayer.{n}.weight"] = need(p + n + ".weight")
    unknown = [k for k in state if k not in used and k not in IGNORED_KEYS and not k.endswith("rotary_emb.inv_freq")
               and k not in ("d2t", "t2d")]
    if unknown:
        hint = ""
        if any(k.startswith(("layers.1.", "midlayer.1.", "midlayers.")) for k in unknown):
            hint = " (more than one draft layer is not supported)"
        elif any("q_norm" in k or "k_norm" in k for k in unknown):
            hint = " (q/k RMSNorm in the draft layer is not supported)"
        elif any(k.startswith("fc_norm") for k in unknown):
            hint = " (config.json does not set fc_norm=true)"
        raise SpecscopeError(f"drafter checkpoint has tensors this loader does not understand: "
                             f"{', '.join(sorted(unknown)[:4])}{hint}")
    return out


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


# ---------------------------------------------------------------- public API

def load_drafter(path: str | Path, target=None, dtype: torch.dtype | None = None, device=None) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter directory in either layout. With `target`, validate against it and place the drafter
    on the target's device and dtype (unless given)."""
    from specscope.models.rope import rope_table

    path = Path(path)
    if not path.is_dir():
        raise SpecscopeError(f"drafter {str(path)!r} is not a directory")
    raw = read_config(path)
    L = target.config.num_hidden_layers if target is not None else None
    cfg = parse_config(raw, L)
    ours = file_to_ours(_read_weights(path), cfg)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg)
    drafter = drafter.to_empty(device="cpu")
    expected = drafter.state_dict()
    for name, t in ours.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise SpecscopeError(f"drafter tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                                 f"{tuple(expected[name].shape)}; the weights and config.json do not match")
    missing = [k for k in expected if k not in ours]
    if missing:
        raise SpecscopeError(f"drafter checkpoint lacks {missing[:3]}")
    wdtype = ours["fc.weight"].dtype
    drafter.load_state_dict(ours, strict=True)
    if dtype is None:
        dtype = target.dtype if target is not None else (wdtype if wdtype.is_floating_point else torch.float32)
    if device is None:
        device = target.device if target is not None else "cpu"
    # d2t / t2d are integer / bool buffers: .to(dtype) only casts floating tensors
    drafter = drafter.to(device=device, dtype=dtype)
    # the rope table stays float32 whatever the weights' dtype (built after the cast, not cast down and back)
    drafter.rope = rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                              cfg.rope_scaling).to(drafter.device)
    drafter.source_path = str(path)
    drafter.eval().requires_grad_(False)
    if target is not None:
        validate_drafter(drafter, target)
    return drafter


def config_dict(drafter: Eagle3Drafter, fmt: str, target_info: dict | None = None, dtype: str | None = None) -> dict:
    cfg = drafter.config
    target_info = target_info or {}
    dtype = dtype or str(drafter.dtype).replace("torch.", "")
    layer = {
        "attention_bias": cfg.attention_bias, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": cfg.rope_scaling, "rope_theta": cfg.rope_theta, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
    }
    flags = {"norm_before_residual": cfg.norm_before_residual, "norm_output": cfg.norm_output,
             "fc_norm": cfg.fc_norm}
    if fmt == "sglang":
        if min(cfg.aux_layer_ids) < 1:
            raise SpecscopeError(f"aux layer ids {cfg.aux_layer_ids} include the embedding output (layer 0), which "
                                 f"the SGLang output-of-layer convention cannot name; save as speculators")
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size, "torch_dtype": dtype,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                                 "use_aux_hidden_state": True},
                **flags}
    if fmt == "speculators":
        verifier = {"name_or_path": target_info.get("name_or_path"),
                    "architectures": target_info.get("architectures") or ["LlamaForCausalLM"]}
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), **flags,
                "transformer_layer_config": layer, "torch_dtype": dtype,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                             "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                       "verifier": verifier}}
    raise SpecscopeError(f"unknown drafter format {fmt!r}; use one of {', '.join(FORMATS)}")


def save_drafter(drafter: Eagle3Drafter, path: str | Path, format: str = "sglang", target_info: dict | None = None,
                 dtype: torch.dtype | None = None, extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors in the given layout (the target embedding is never written)."""
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise SpecscopeError(f"unknown drafter format {format!r}; use one of {', '.join(FORMATS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = ours_to_file(drafter, format)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    wdtype = str(tensors["fc.weight"].dtype).replace("torch.", "")
    cfg = config_dict(drafter, format, target_info, wdtype)
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)   # safetensors creates private files; a drafter is meant to be shared
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    return path


def validate_drafter(drafter: Eagle3Drafter, target) -> None:
    """Refuse a drafter that cannot serve `target`; every message names both values."""
    c, t = drafter.config, target.config
    if c.target_hidden_size != t.hidden_size:
        raise SpecscopeError(f"drafter expects target hidden size {c.target_hidden_size} (fc takes "
                             f"3x{c.target_hidden_size}) but the target's hidden size is {t.hidden_size}")
    if c.hidden_size != t.hidden_size:
        raise SpecscopeError(f"drafter hidden size {c.hidden_size} differs from the target's {t.hidden_size}; "
                             f"the drafter reads the target's token embeddings, so they must match")
    if c.vocab_size != t.vocab_size:
        raise SpecscopeError(f"drafter was built for a target vocabulary of {c.vocab_size} tokens but the target "
                             f"has {t.vocab_size}; it belongs to a different model")
    L = t.num_hidden_layers
    bad = [i for i in c.aux_layer_ids if not 0 <= i <= L]
    if bad:
        raise SpecscopeError(f"drafter aux layer ids {c.aux_layer_ids} (entering-layer convention) are out of "
                             f"range for a target with {L} layers (valid: 0..{L})")
    d2t, t2d = drafter.d2t.cpu(), drafter.t2d.cpu()
    if d2t.numel() != c.draft_vocab_size:
        raise SpecscopeError(f"d2t has {d2t.numel()} entries but draft_vocab_size is {c.draft_vocab_size}")
    if t2d.numel() != t.vocab_size:
        raise SpecscopeError(f"t2d has {t2d.numel()} entries but the target vocabulary has {t.vocab_size}")
    if drafter.lm_head.weight.shape[0] != c.draft_vocab_size:
        raise SpecscopeError(f"lm_head has {drafter.lm_head.weight.shape[0]} rows but draft_vocab_size is "
                             f"{c.draft_vocab_size}")
    ids = torch.arange(d2t.numel()) + d2t
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= t.vocab_size:
        raise SpecscopeError(f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocabulary "
                             f"0..{t.vocab_size - 1}")
    if ids.unique().numel() != ids.numel():
        raise SpecscopeError(f"d2t maps {ids.numel()} draft ids onto only {ids.unique().numel()} distinct target "
                             f"ids; the map must be one-to-one")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise SpecscopeError(f"t2d marks {int(t2d.sum())} target ids but d2t maps {d2t.numel()} draft ids (or marks "
                             f"different ones); d2t and t2d are inconsistent")
