"""EAGLE-3 drafter checkpoints in the two public layouts, and validation against a target.

- SafeAILab / SpecForge / SGLang ("sglang"): a LlamaConfig plus `draft_vocab_size`, optional `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids` (the *output of* layers i, i.e. our entering-layer id - 1; SGLang
  adds +1 when it reads them); weights `midlayer.*` with separate q/k/v and gate/up.
- vLLM speculators ("speculators"): `speculators_model_type: eagle3`, `transformer_layer_config`,
  `speculators_config`, `eagle_aux_hidden_state_layer_ids` (entering-layer ids); weights `layers.0.*`;
  `norm_before_residual` defaults to True when omitted (as vLLM reads it).

Our `Eagle3Drafter` fuses q/k/v and gate/up; this module splits and joins them. The target's embedding is shared
and never written; aux layer ids are kept in the entering-layer convention, with the file's own recorded in
`DrafterConfig.aux_convention_in_file` ("input", "output" or "default" when the file named none). speculators
variants are honoured: `norm_before_fc` (`input_norm.weight`, one RMSNorm over the 3·Ht fc input), sliding-window
attention, and a 4th aux id (the verifier-logits layer used in training; kept for re-export, not an fc input).

Loading reads tensors straight into their final (fused) place in the stored dtype, shards included, so peak memory
stays near the file size; every problem with a config, its weights or the pair is reported in one error. Export
keeps what the source recorded (verifier, speculators version, proposal methods) unless a target overrides it, and
refuses the SGLang layout for features SGLang would silently ignore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from specscope.errors import SpecscopeError
from specscope.fileio import atomic_output, write_atomic
from specscope.jsonio import dtype_name
from specscope.models.config import (MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
                                     cfg_bool, cfg_float, cfg_int, cfg_str, rope_scaling_of, rope_theta_of)
from specscope.models.hub import KNOWN_MODELS, parse_hub_id, resolve_model
from specscope.models.loader import SafetensorsReader, read_json_object, weight_files
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
FORMATS = ("sglang", "speculators")
DRAFTER_CFG = "drafter config.json"
LAYER_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}
# written only when neither the source checkpoint nor an installed `speculators` names a version. Metadata only:
# vLLM's SpeculatorsConfig reads speculators_model_type, speculators_config and transformer_layer_config and never
# this field (vllm/transformers_utils/configs/speculators/base.py); released checkpoints carry 0.1.0.dev14 to 0.8.x
SPECULATORS_VERSION = "0.3.0"
# vLLM's usual num_speculative_tokens; used only when the source names none and --speculative-tokens is not given
DEFAULT_SPECULATIVE_TOKENS = 3
# tensors a checkpoint may carry that we deliberately do not use
IGNORED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


# ---------------------------------------------------------------- config parsing

def read_config(path: Path) -> dict:
    """A checkpoint directory's config.json as a dict, with one-line errors for missing / invalid files."""
    f = path / "config.json"
    if not f.exists():
        raise SpecscopeError(f"drafter directory {str(path)!r} has no config.json")
    return read_json_object(f)


def is_eagle3_config(raw: dict) -> bool:
    """Whether a checkpoint's config.json describes an EAGLE-3 drafter (either layout) rather than a plain model
    (which drafts as a small draft model)."""
    archs = raw.get("architectures") or []
    return ("draft_vocab_size" in raw or raw.get("speculators_model_type") == "eagle3"
            or any("Eagle3" in a for a in archs))


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


def _problems_of(layer: dict, top: dict) -> list[str]:
    """Everything in a drafter config this network cannot honour (all of it, not the first): a field that fails
    its own validation becomes one entry of the list too."""
    out = []

    def check(fn):
        try:
            return fn()
        except SpecscopeError as e:
            out.append(str(e))
            return None

    n = check(lambda: cfg_int(layer, "num_hidden_layers", 1, hi=MAX_LAYERS, where=DRAFTER_CFG))
    if n is not None and n != 1:
        out.append(f"num_hidden_layers={n}: only single-layer EAGLE-3 drafters are supported")
    types = layer.get("layer_types") or []
    if isinstance(types, list) and len(set(map(str, types))) > 1:
        out.append(f"layer_types {types} mixes attention kinds; one drafter layer has one kind")
    act = check(lambda: cfg_str(layer, "hidden_act", "silu", where=DRAFTER_CFG))
    if act is not None and act not in ("silu", "swish"):
        out.append(f"hidden_act {act!r} is not supported; only silu (SwiGLU)")
    if top.get("norm_before_fc") and top.get("fc_norm"):
        out.append("norm_before_fc and fc_norm are both set; a drafter normalises its fc input one way or the other")
    if layer.get("mlp_bias"):
        out.append("mlp_bias=true is not supported")
    check(lambda: rope_scaling_of(layer, DRAFTER_CFG))      # a string / unknown type / missing factor
    check(lambda: _sliding_window(layer))
    return out


def _sliding_window(layer: dict) -> int | None:
    slides = layer.get("use_sliding_window") or "sliding_attention" in (layer.get("layer_types") or []) or \
        (layer.get("model_type") == "mistral" and layer.get("sliding_window"))
    if not (slides and layer.get("sliding_window")):
        return None
    return cfg_int(layer, "sliding_window", None, hi=MAX_POSITIONS, where=DRAFTER_CFG)


def _aux_ids(ids, convention: str, target_layers: int | None, problems: list[str]):
    """-> (3 fc input ids in the entering-layer convention, the convention, a 4th id or None)."""
    if ids is None:
        if target_layers is None:
            problems.append("the config does not name its aux layers (eagle_aux_hidden_state_layer_ids); pass the "
                            "target so the default layers (2, L//2, L-3) can be used")
            return [1, 2, 3], "default", None
        return DrafterConfig.default_aux_layers(target_layers), "default", None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
        return [1, 2, 3], convention, None
    if len(ids) not in (3, 4):
        problems.append(f"eagle_aux_hidden_state_layer_ids names {len(ids)} layers ({ids}); EAGLE-3 fuses 3 "
                        f"(speculators may add a 4th that only feeds the verifier's logits in training)")
        return [1, 2, 3], convention, None
    ids = [i + 1 for i in ids] if convention == "output" else list(ids)
    return ids[:3], convention, (ids[3] if len(ids) == 4 else None)


def _speculators_extra(raw: dict) -> dict:
    """The speculators file's metadata kept for re-export: verifier, proposal methods, format version."""
    extra: dict = {}
    sc = raw.get("speculators_config") or {}
    if isinstance(sc, dict):
        if isinstance(sc.get("verifier"), dict):
            extra["verifier"] = {k: sc["verifier"].get(k) for k in ("name_or_path", "architectures")}
        if isinstance(sc.get("proposal_methods"), list):
            extra["proposal_methods"] = sc["proposal_methods"]
            extra["default_proposal_method"] = sc.get("default_proposal_method")
    if raw.get("speculators_version"):
        extra["speculators_version"] = str(raw["speculators_version"])
    return extra


def _layout(raw: dict, fmt: str, target_layers: int | None, problems: list[str]):
    """(the layer's fields, aux layer ids, their convention in the file, the norm_before_residual default, extra
    metadata) of either layout; aux-id problems go to `problems`."""
    if fmt == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpecscopeError("speculators config.json lacks 'transformer_layer_config'")
        file_ids = raw.get("eagle_aux_hidden_state_layer_ids")
        ids, conv, fourth = _aux_ids(file_ids, "input", target_layers, problems)
        nbr_default = True       # vLLM assumes True when a speculators config omits it
        extra = _speculators_extra(raw)
    else:
        layer = raw
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise SpecscopeError(f"{DRAFTER_CFG}: eagle_config must be an object, got {eagle!r}")
        file_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        ids, conv, fourth = _aux_ids(file_ids, "output", target_layers, problems)
        nbr_default = False      # the original EAGLE layer adds the un-normed residual
        extra = {}
    if file_ids is not None:
        extra["aux_ids_in_file"] = file_ids
    if fourth is not None:
        extra["verifier_logits_layer"] = fourth     # entering-layer convention, like aux_layer_ids
    return layer, ids, conv, nbr_default, extra


def parse_config(raw: dict, target_layers: int | None = None) -> DrafterConfig:
    """A drafter config.json (either layout) -> DrafterConfig. Every problem is reported in one error."""
    fmt = detect_format(raw)
    problems: list[str] = []
    layer, ids, conv, nbr_default, extra = _layout(raw, fmt, target_layers, problems)
    problems += _problems_of(layer, raw)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer]
    if missing:
        problems.append(f"missing required field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    if problems:
        raise SpecscopeError(_one_error("drafter config.json", problems))
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
        norm_before_fc=cfg_bool(raw, "norm_before_fc", False, where=w),
        sliding_window=_sliding_window(layer),
        attention_bias=cfg_bool(layer, "attention_bias", False, where=w),
        format=fmt,
        extra=extra,
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                        f"num_key_value_heads ({cfg.num_key_value_heads})")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        problems.append(f"draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size ({cfg.vocab_size})")
    if problems:
        raise SpecscopeError(_one_error("drafter config.json", problems))
    return cfg


def _one_error(what: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    return f"{what}: {len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))


# ---------------------------------------------------------------- weights

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
        raise SpecscopeError(_one_error("drafter checkpoint", problems))
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


# ---------------------------------------------------------------- the target, as far as a drafter cares

@dataclass
class TargetFacts:
    """What a drafter must agree with, read from a target's config.json alone (no weights needed)."""
    name_or_path: str | None
    architectures: list[str]
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    path: Path | None = None         # the checkpoint directory, when there is one

    @classmethod
    def from_raw(cls, raw: dict, name_or_path: str | None, path: Path | None = None) -> "TargetFacts":
        """Checked as `generate` checks a config: integers in range (not "576", not 0), so that an impossible
        target is refused here rather than exported against or passed by check-drafter."""
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        src = {**raw, **{k: v for k, v in text.items() if k not in raw}}   # multimodal: the LM under text_config
        where = "target config.json"
        missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if src.get(k) is None]
        if missing:
            raise SpecscopeError(f"target config.json lacks {', '.join(missing)}; is it a causal LM config?")
        hidden = cfg_int(src, "hidden_size", hi=MAX_HIDDEN, where=where)
        heads = cfg_int(src, "num_attention_heads", None, hi=MAX_HEADS, where=where)
        if heads is not None:
            cfg_int(src, "num_key_value_heads", None, hi=heads, where=where)
            if hidden % heads and src.get("head_dim") is None:
                raise SpecscopeError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                     f"{heads} and no head_dim is given; fix the file or re-export the checkpoint")
        cfg_int(src, "head_dim", None, hi=MAX_HEAD_DIM, where=where)
        try:
            return cls(name_or_path=name_or_path, architectures=list(raw.get("architectures") or []),
                       hidden_size=hidden, vocab_size=cfg_int(src, "vocab_size", hi=MAX_VOCAB, where=where),
                       num_hidden_layers=cfg_int(src, "num_hidden_layers", hi=MAX_LAYERS, where=where),
                       rope_theta=float(rope_theta_of(text or raw)),
                       rope_scaling=rope_scaling_of(text or raw),
                       max_position_embeddings=cfg_int(src, "max_position_embeddings", None, hi=MAX_POSITIONS,
                                                       where=where),
                       torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), path=path)
        except (TypeError, ValueError) as e:
            raise SpecscopeError(f"target config.json has an invalid value: {e}") from None

    @classmethod
    def from_model(cls, target) -> "TargetFacts":
        c = target.config
        return cls(name_or_path=getattr(target, "source_path", None), architectures=[c.architecture],
                   hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_hidden_layers=c.num_hidden_layers,
                   rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                   max_position_embeddings=c.max_position_embeddings, torch_dtype=c.torch_dtype)

    def info(self) -> dict:
        return {"name_or_path": self.name_or_path, "architectures": self.architectures}


def resolve_target(spec: str, record_as: str | None = None, files: str = "config") -> TargetFacts:
    """--model (the target): a known name (pulled on first use), a local HF directory, just its config.json, or a
    Hugging Face id (only its config.json is fetched unless `files="model"`: no weights needed)."""
    f = Path(spec).expanduser()
    if f.is_file():
        raw = read_json_object(f)
        d = f.parent
        name = record_as or raw.get("_name_or_path") or str(d.resolve())
        return TargetFacts.from_raw(raw, name, d if any(d.glob("*.safetensors")) else None)
    d = resolve_model(spec, files=files)
    if not (d / "config.json").exists():
        raise SpecscopeError(f"target {spec!r} ({d}) has no config.json; pass a Hugging Face checkpoint directory, "
                             f"its config.json, a Hugging Face id or a known name ({', '.join(KNOWN_MODELS)})")
    km = KNOWN_MODELS.get(spec)
    hub = parse_hub_id(spec) if not f.exists() and not km else None
    name = record_as or (getattr(km, "hf_repo", None) if km else None) or (hub[0] if hub else None) or \
        (spec if km else str(d.resolve()))
    return TargetFacts.from_raw(read_json_object(d / "config.json"), name, d)


# a drafter directory's own record of the target it was trained for (the shipped drafters carry one)
TARGET_FILE = "specscope_target.json"


def declared_target(drafter_dir: str | Path, record_as: str | None = None) -> TargetFacts | None:
    """The target `drafter_dir/specscope_target.json` names ({"name_or_path": hub id, "config": the fields of its
    config.json a drafter is checked against}), so exporting a shipped drafter needs no --model and no download;
    None when the directory declares none."""
    f = Path(drafter_dir) / TARGET_FILE
    if not f.is_file():
        return None
    raw = read_json_object(f)
    name, cfg = raw.get("name_or_path"), raw.get("config")
    if not isinstance(name, str) or not name or not isinstance(cfg, dict):
        raise SpecscopeError(f"{f} must hold \"name_or_path\" (the target's id) and \"config\" (its config.json "
                             f"fields); fix it, or delete it and pass --model")
    return TargetFacts.from_raw(cfg, record_as or name)


def pair_problems(cfg: DrafterConfig, t: TargetFacts) -> list[str]:
    """Every reason this drafter cannot serve this target (sizes and layer ids; each names both values)."""
    out = []
    if cfg.target_hidden_size != t.hidden_size:
        out.append(f"drafter expects target hidden size {cfg.target_hidden_size} (fc takes "
                   f"3x{cfg.target_hidden_size}) but the target's hidden size is {t.hidden_size}")
    if cfg.hidden_size != t.hidden_size:
        out.append(f"drafter hidden size {cfg.hidden_size} differs from the target's {t.hidden_size}; "
                   f"the drafter reads the target's token embeddings, so they must match")
    if cfg.vocab_size != t.vocab_size:
        out.append(f"drafter was built for a target vocabulary of {cfg.vocab_size} tokens but the target "
                   f"has {t.vocab_size}; it belongs to a different model")
    L = t.num_hidden_layers
    ids = list(cfg.aux_layer_ids) + ([cfg.extra["verifier_logits_layer"]] if "verifier_logits_layer" in cfg.extra
                                     else [])
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        out.append(f"drafter aux layer ids {ids} (entering-layer convention) are out of range for a target "
                   f"with {L} layers (valid: 0..{L})")
    return out


def aux_conventions(cfg: DrafterConfig) -> dict:
    """The aux layer ids in both conventions, saying which is which."""
    return {"hidden_state_index": list(cfg.aux_layer_ids),
            "sglang_output_of_layer": [i - 1 for i in cfg.aux_layer_ids],
            "in_file": cfg.extra.get("aux_ids_in_file"),
            "file_convention": {"input": "hidden_state_index", "output": "sglang_output_of_layer",
                                "default": "none named: the target's default (2, L//2, L-3)"}[
                cfg.aux_convention_in_file],
            "verifier_logits_layer": cfg.extra.get("verifier_logits_layer"),
            "note": "hidden_state_index i = the hidden state entering target layer i (HF output_hidden_states[i], "
                    "vLLM/speculators); SGLang/SpecForge store i - 1 (output of layer i - 1) and add 1 when reading"}


# ---------------------------------------------------------------- public API

def load_drafter(path: str | Path, target=None, dtype: torch.dtype | None = None, device=None,
                 validate: bool = True, raw: dict | None = None) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter directory in either layout, in its stored dtype unless `dtype` (or a target) says
    otherwise. With `target` (a loaded model), validate against it and place the drafter on the target's device
    and dtype; with a `TargetFacts` (a target's config.json alone), validate only. `raw`: the directory's
    config.json when the caller has already read it."""
    path = Path(path)
    if not path.is_dir():
        raise SpecscopeError(f"drafter {str(path)!r} is not a directory")
    raw = read_config(path) if raw is None else raw
    facts = target if isinstance(target, TargetFacts) else None
    if facts is not None:
        target = None           # a config-only target: checked against, nothing to place the drafter on
    L = facts.num_hidden_layers if facts else target.config.num_hidden_layers if target is not None else None
    cfg = parse_config(raw, L)
    ours = file_to_ours(weight_reader(path), cfg)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg)     # shapes only: the file's tensors become the parameters (no second copy)
    expected = drafter.state_dict()
    problems = []
    for name, t in ours.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            hint = ""
            if name == "fc.weight" and t.shape[-1] == 4 * cfg.target_hidden_size:
                hint = " (fc fuses 4 target layers; EAGLE-3 drafters here fuse 3)"
            problems.append(f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                            f"{tuple(expected[name].shape)}{hint}")
    missing = [k for k in expected if k not in ours]
    if missing:
        problems.append(f"lacks {missing[:3]}")
    if problems:
        raise SpecscopeError(_one_error("drafter checkpoint", problems) +
                             "; the weights and config.json do not match")
    floats = {t.dtype for t in ours.values() if t.is_floating_point()}
    drafter.load_state_dict(ours, strict=True, assign=True)
    del ours
    drafter.rope = torch.empty(2, 0, cfg.head_dim)      # still on meta; rebuilt below, after any cast
    if dtype is None:
        dtype = target.dtype if target is not None else (
            ours_dtype if len(floats) == 1 and (ours_dtype := next(iter(floats))) else torch.float32)
    if device is None:
        device = target.device if target is not None else "cpu"
    # d2t / t2d are integer / bool buffers: .to(dtype) only casts floating tensors; same dtype: no copy
    drafter = drafter.to(device=device, dtype=dtype)
    drafter.rope_upto(1)                 # the float32 RoPE table, built after any cast
    drafter.source_path = str(path)
    drafter.eval().requires_grad_(False)
    if validate and (bad := nonfinite_tensors(drafter.state_dict())):
        raise SpecscopeError(f"drafter {str(path)!r} has non-finite weights ({_names(bad)} hold NaN or inf; a "
                             f"diverged training run?); it cannot draft anything: retrain it with a lower --lr")
    if target is not None and validate:
        validate_drafter(drafter, target)
    if facts is not None and validate:
        problems = pair_problems(cfg, facts) + map_problems(drafter, facts.vocab_size)
        if problems:
            raise SpecscopeError(_one_error(f"drafter does not fit the target {facts.name_or_path}", problems))
    return drafter


def engine_ignores(cfg: DrafterConfig, fmt: str) -> list[str]:
    """What the engine reading `fmt` would silently not honour (so the served network would differ)."""
    if fmt != "sglang":
        return []
    out = []
    for flag, does in (("norm_before_residual", "adds the un-normed residual"),
                       ("norm_output", "feeds the pre-norm hidden state to the next step"),
                       ("fc_norm", "applies no per-layer norm before fc (and never loads fc_norm.*)"),
                       ("norm_before_fc", "applies no norm over the fc input (and never loads input_norm.weight)")):
        if getattr(cfg, flag):
            out.append(f"{flag}=true (SGLang's llama_eagle3 {does})")
    if cfg.sliding_window:
        out.append(f"sliding_window={cfg.sliding_window} (SGLang's llama_eagle3 attends over the full context)")
    return out


def _decimal(x: float) -> float:
    """A float32-rounded config value (GGUF stores float32: 1e-5 -> 9.999999747378752e-06) back to its decimal."""
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else x


def _speculators_version(cfg: DrafterConfig) -> str:
    if cfg.extra.get("speculators_version"):
        return cfg.extra["speculators_version"]
    try:
        return version("speculators")
    except Exception:
        return SPECULATORS_VERSION


def _proposal_methods(cfg: DrafterConfig, speculative_tokens: int | None) -> tuple[list[dict], str]:
    methods = [dict(m) for m in cfg.extra.get("proposal_methods") or [] if isinstance(m, dict)]
    default = cfg.extra.get("default_proposal_method") or "greedy"
    if not methods:
        methods = [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
                    "accept_tolerance": 0.0, "verifier_accept_k": 1}]
    elif speculative_tokens:
        for m in methods:
            m["speculative_tokens"] = speculative_tokens
    return methods, default


def config_dict(drafter: Eagle3Drafter, fmt: str, target_info: dict | None = None, dtype: str | None = None,
                speculative_tokens: int | None = None) -> dict:
    cfg = drafter.config
    dtype = dtype or dtype_name(drafter.dtype)
    layer = {
        "attention_bias": cfg.attention_bias, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": _decimal(cfg.rms_norm_eps),
        "rope_scaling": cfg.rope_scaling, "rope_theta": cfg.rope_theta, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.sliding_window:
        layer.update(use_sliding_window=True, sliding_window=cfg.sliding_window, layer_types=["sliding_attention"])
    flags = {"norm_before_residual": cfg.norm_before_residual, "norm_output": cfg.norm_output,
             "fc_norm": cfg.fc_norm, "norm_before_fc": cfg.norm_before_fc}
    if fmt == "sglang":
        ignored = engine_ignores(cfg, fmt)
        if ignored:
            raise SpecscopeError(f"SGLang would serve a different network: it ignores {'; '.join(ignored)}. "
                                 f"Export with --format speculators (vLLM reads these) instead")
        if min(cfg.aux_layer_ids) < 1:
            raise SpecscopeError(f"aux layer ids {cfg.aux_layer_ids} include the embedding output (layer 0), which "
                                 f"the SGLang output-of-layer convention cannot name; save as speculators")
        del flags["norm_before_fc"]
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size, "torch_dtype": dtype,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                                 "use_aux_hidden_state": True},
                **flags}
    if fmt == "speculators":
        verifier = dict(cfg.extra.get("verifier") or {})
        verifier.update({k: v for k, v in (target_info or {}).items()
                         if k in ("name_or_path", "architectures") and v})
        if not verifier.get("name_or_path"):
            raise SpecscopeError("a speculators drafter must name its verifier (vLLM serves "
                                 "verifier.name_or_path as the target); pass --model TARGET")
        if not verifier.get("architectures"):
            raise SpecscopeError(f"the verifier's architectures are unknown; pass --model with the target's config.json "
                                 f"(recording {verifier['name_or_path']!r})")
        ids = list(cfg.aux_layer_ids)
        if "verifier_logits_layer" in cfg.extra:
            ids.append(cfg.extra["verifier_logits_layer"])
        methods, default = _proposal_methods(cfg, speculative_tokens)
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": _speculators_version(cfg), "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": ids, **flags,
                "transformer_layer_config": layer, "torch_dtype": dtype,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": default,
                                       "proposal_methods": methods,
                                       "verifier": {"name_or_path": verifier["name_or_path"],
                                                    "architectures": list(verifier["architectures"])}}}
    raise SpecscopeError(f"unknown drafter format {fmt!r}; use one of {', '.join(FORMATS)}")


def save_drafter(drafter: Eagle3Drafter, path: str | Path, format: str = "sglang", target_info: dict | None = None,
                 dtype: torch.dtype | None = None, extra_files: dict[str, str] | None = None,
                 speculative_tokens: int | None = None) -> Path:
    """Write config.json + model.safetensors in the given layout (the target embedding is never written)."""
    if format not in FORMATS:
        raise SpecscopeError(f"unknown drafter format {format!r}; use one of {', '.join(FORMATS)}")
    wdtype = dtype_name(dtype or drafter.dtype)
    cfg = config_dict(drafter, format, target_info, wdtype, speculative_tokens)   # refusals before any write
    bad = nonfinite_tensors(drafter.state_dict())
    if bad:
        raise SpecscopeError(f"refusing to write a drafter whose weights are not finite ({_names(bad)} hold NaN or "
                             f"inf): it would propose garbage; retrain it (a lower --lr)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = ours_to_file(drafter, format)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    # each file atomically (readable by all: a drafter is meant to be shared), weights first, config last
    with atomic_output(path / "model.safetensors", "drafter weights") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    for stale in [path / "model.safetensors.index.json", *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)    # an earlier sharded copy would shadow the file just written
    write_atomic(path / "config.json", json.dumps(cfg, indent=2) + "\n", "drafter config")
    for name, text in (extra_files or {}).items():
        write_atomic(path / name, text, "drafter file")
    return path


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating tensors in `state` holding NaN or inf: what a diverged training run leaves."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.device.type != "meta"
            and not _finite(v)]


def _finite(t: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """All of `t` finite, checked a slice at a time: a whole-tensor isfinite() would allocate a mask as large as
    the tensor's element count, on top of the weights being loaded."""
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def map_problems(drafter: Eagle3Drafter, vocab_size: int) -> list[str]:
    """d2t / t2d / lm_head consistency against a target vocabulary of `vocab_size`."""
    c = drafter.config
    out = []
    d2t, t2d = drafter.d2t.cpu(), drafter.t2d.cpu()
    if d2t.numel() != c.draft_vocab_size:
        out.append(f"d2t has {d2t.numel()} entries but draft_vocab_size is {c.draft_vocab_size}")
    if t2d.numel() != vocab_size:
        out.append(f"t2d has {t2d.numel()} entries but the target vocabulary has {vocab_size}")
    if drafter.lm_head.weight.shape[0] != c.draft_vocab_size:
        out.append(f"lm_head has {drafter.lm_head.weight.shape[0]} rows but draft_vocab_size is "
                   f"{c.draft_vocab_size}")
    ids = torch.arange(d2t.numel()) + d2t
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        out.append(f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocabulary "
                   f"0..{vocab_size - 1}")
    elif ids.unique().numel() != ids.numel():
        out.append(f"d2t maps {ids.numel()} draft ids onto only {ids.unique().numel()} distinct target "
                   f"ids; the map must be one-to-one")
    elif t2d.numel() == vocab_size and (int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all())):
        out.append(f"t2d marks {int(t2d.sum())} target ids but d2t maps {d2t.numel()} draft ids (or marks "
                   f"different ones); d2t and t2d are inconsistent")
    return out


def validate_drafter(drafter: Eagle3Drafter, target) -> None:
    """Refuse a drafter that cannot serve `target`, naming every reason at once (each with both values)."""
    problems = pair_problems(drafter.config, TargetFacts.from_model(target))
    problems += map_problems(drafter, target.config.vocab_size)
    if problems:
        raise SpecscopeError(_one_error("drafter does not fit the target", problems))
