"""A drafter checkpoint's config.json, in either EAGLE-3 layout (speculative/formats.py describes both), read and
validated into a `DrafterConfig`: every problem with a config is reported in one error. Aux layer ids are kept in
the entering-layer convention, with the file's own recorded in `DrafterConfig.aux_convention_in_file` ("input",
"output" or "default" when the file named none).
"""

from __future__ import annotations

from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.models.config import (MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
                                     cfg_bool, cfg_float, cfg_int, cfg_str, rope_scaling_of, rope_theta_of)
from specscope.models.loader import read_json_object
from specscope.speculative.eagle3 import DrafterConfig, FileMeta

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHS = ("Eagle3Speculator", "Eagle3DraftModel")
FORMATS = ("sglang", "speculators")
DRAFTER_CFG = "drafter config.json"


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


def _speculators_meta(raw: dict) -> FileMeta:
    """The speculators file's metadata kept for re-export: verifier, proposal methods, format version."""
    meta = FileMeta()
    sc = raw.get("speculators_config") or {}
    if isinstance(sc, dict):
        if isinstance(sc.get("verifier"), dict):
            meta.verifier = {k: sc["verifier"].get(k) for k in ("name_or_path", "architectures")}
        if isinstance(sc.get("proposal_methods"), list):
            meta.proposal_methods = sc["proposal_methods"]
            meta.default_proposal_method = sc.get("default_proposal_method")
    if raw.get("speculators_version"):
        meta.speculators_version = str(raw["speculators_version"])
    return meta


def _layout(raw: dict, fmt: str, target_layers: int | None, problems: list[str]):
    """(the layer's fields, aux layer ids, their convention in the file, the norm_before_residual default, the
    file's metadata) of either layout; aux-id problems go to `problems`."""
    if fmt == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpecscopeError("speculators config.json lacks 'transformer_layer_config'")
        file_ids = raw.get("eagle_aux_hidden_state_layer_ids")
        ids, conv, fourth = _aux_ids(file_ids, "input", target_layers, problems)
        nbr_default = True       # vLLM assumes True when a speculators config omits it
        meta = _speculators_meta(raw)
    else:
        layer = raw
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise SpecscopeError(f"{DRAFTER_CFG}: eagle_config must be an object, got {eagle!r}")
        file_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        ids, conv, fourth = _aux_ids(file_ids, "output", target_layers, problems)
        nbr_default = False      # the original EAGLE layer adds the un-normed residual
        meta = FileMeta()
    meta.aux_ids_in_file = file_ids
    meta.verifier_logits_layer = fourth     # entering-layer convention, like aux_layer_ids
    ours = raw.get("specscope")
    tau = ours.get("predicted_tau") if isinstance(ours, dict) else None
    meta.predicted_tau = tau if isinstance(tau, dict) and isinstance(tau.get("tau"), dict) else None
    return layer, ids, conv, nbr_default, meta


def parse_config(raw: dict, target_layers: int | None = None) -> DrafterConfig:
    """A drafter config.json (either layout) -> DrafterConfig. Every problem is reported in one error."""
    fmt = detect_format(raw)
    problems: list[str] = []
    layer, ids, conv, nbr_default, meta = _layout(raw, fmt, target_layers, problems)
    problems += _problems_of(layer, raw)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer]
    if missing:
        problems.append(f"missing required field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    if problems:
        raise SpecscopeError(one_error("drafter config.json", problems))
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
        meta=meta,
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                        f"num_key_value_heads ({cfg.num_key_value_heads})")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        problems.append(f"draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size ({cfg.vocab_size})")
    if problems:
        raise SpecscopeError(one_error("drafter config.json", problems))
    return cfg


def one_error(what: str, problems: list[str]) -> str:
    """`what: the problem`, or every problem numbered in one line."""
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    return f"{what}: {len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))


def aux_conventions(cfg: DrafterConfig) -> dict:
    """The aux layer ids in both conventions, saying which is which."""
    return {"hidden_state_index": list(cfg.aux_layer_ids),
            "sglang_output_of_layer": [i - 1 for i in cfg.aux_layer_ids],
            "in_file": cfg.meta.aux_ids_in_file,
            "file_convention": {"input": "hidden_state_index", "output": "sglang_output_of_layer",
                                "default": "none named: the target's default (2, L//2, L-3)"}[
                cfg.aux_convention_in_file],
            "verifier_logits_layer": cfg.meta.verifier_logits_layer,
            "note": "hidden_state_index i = the hidden state entering target layer i (HF output_hidden_states[i], "
                    "vLLM/speculators); SGLang/SpecForge store i - 1 (output of layer i - 1) and add 1 when reading"}

