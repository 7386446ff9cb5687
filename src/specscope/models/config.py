"""Model configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict

from specscope.errors import SpecscopeError

# architecture name -> family flags
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    attention_bias: bool = False  # Llama's o_proj/qkv bias flag
    mlp_bias: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @classmethod
    def from_hf(cls, d: dict, any_architecture: bool = False) -> "ModelConfig":
        """any_architecture: read the fields a drafter is shaped by from any causal LM's config (MoE, multimodal's
        text_config), for the training stages that never run the target's forward (its hidden states come from an
        engine: train --capture)."""
        if any_architecture:
            return cls._any(d)
        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            raise _bad("config.json", "architectures", archs, 'a list such as ["LlamaForCausalLM"]')
        arch = archs[0] if archs else None
        if arch is None:
            mt = d.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}.get(mt)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecscopeError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        flags = SUPPORTED_ARCHITECTURES[arch]
        hidden = cfg_int(d, "hidden_size", hi=MAX_HIDDEN)
        heads = cfg_int(d, "num_attention_heads", hi=MAX_HEADS)
        vocab = cfg_int(d, "vocab_size", hi=MAX_VOCAB)
        cfg = cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=cfg_int(d, "intermediate_size", hi=MAX_HIDDEN * 16),
            num_hidden_layers=cfg_int(d, "num_hidden_layers", hi=MAX_LAYERS),
            num_attention_heads=heads,
            num_key_value_heads=cfg_int(d, "num_key_value_heads", heads, hi=heads),
            head_dim=cfg_int(d, "head_dim", max(hidden // heads, 1), hi=MAX_HEAD_DIM),
            rms_norm_eps=cfg_float(d, "rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
            rope_theta=float(rope_theta_of(d)),
            rope_scaling=rope_scaling_of(d),
            max_position_embeddings=cfg_int(d, "max_position_embeddings", 4096, hi=MAX_POSITIONS),
            tie_word_embeddings=cfg_bool(d, "tie_word_embeddings", False),
            qkv_bias=flags.get("qkv_bias", False) or cfg_bool(d, "attention_bias", False),
            qk_norm=flags.get("qk_norm", False),
            attention_bias=cfg_bool(d, "attention_bias", False),
            mlp_bias=cfg_bool(d, "mlp_bias", False),
            sliding_window=_sliding_window(d, arch),
            hidden_act=cfg_str(d, "hidden_act", "silu"),
            bos_token_id=cfg_int(d, "bos_token_id", None, lo=0),
            eos_token_id=_eos_ids(d),
            torch_dtype=cfg_str(d, "torch_dtype", None) or cfg_str(d, "dtype", None),
        )
        if cfg.hidden_act not in ("silu", "swish"):
            raise SpecscopeError(f"unsupported hidden_act {cfg.hidden_act!r}; only silu (SwiGLU) is supported")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise SpecscopeError(
                f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})")
        return cfg

    @classmethod
    def _any(cls, raw: dict) -> "ModelConfig":
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        d = {**raw, **{k: v for k, v in text.items() if k not in raw}}     # multimodal: the LM under text_config
        archs = raw.get("architectures") or [d.get("model_type") or "unknown"]
        arch = str(archs[0]) if isinstance(archs, list) and archs else "unknown"
        if arch in SUPPORTED_ARCHITECTURES and not text:
            return cls.from_hf(raw)
        hidden = cfg_int(d, "hidden_size", hi=MAX_HIDDEN)
        heads = cfg_int(d, "num_attention_heads", hi=MAX_HEADS)
        return cls(architecture=arch, vocab_size=cfg_int(d, "vocab_size", hi=MAX_VOCAB), hidden_size=hidden,
                   intermediate_size=cfg_int(d, "intermediate_size", hidden * 4, hi=MAX_HIDDEN * 16),
                   num_hidden_layers=cfg_int(d, "num_hidden_layers", hi=MAX_LAYERS), num_attention_heads=heads,
                   num_key_value_heads=cfg_int(d, "num_key_value_heads", heads, hi=heads),
                   head_dim=cfg_int(d, "head_dim", max(hidden // heads, 1), hi=MAX_HEAD_DIM),
                   rms_norm_eps=cfg_float(d, "rms_norm_eps", 1e-6, lo=0.0, hi=1.0, lo_open=True),
                   rope_theta=float(rope_theta_of(d)), rope_scaling=rope_scaling_of(d),
                   max_position_embeddings=cfg_int(d, "max_position_embeddings", 4096, hi=MAX_POSITIONS),
                   tie_word_embeddings=cfg_bool(d, "tie_word_embeddings", False),
                   bos_token_id=cfg_int(d, "bos_token_id", None, lo=0), eos_token_id=_eos_ids(d),
                   torch_dtype=cfg_str(d, "torch_dtype", None) or cfg_str(d, "dtype", None))

    def to_dict(self) -> dict:
        return asdict(self)


# ---- field readers: every bad value is one message naming the file, the field, the value and what is allowed.
# Upper bounds are far above any published model and keep a corrupt value from sizing an allocation (the RoPE
# table is max_position_embeddings x head_dim floats) before the weights are checked against the config.
MAX_HIDDEN = 1 << 17
MAX_HEADS = 1 << 10
MAX_HEAD_DIM = 1 << 12
MAX_LAYERS = 1 << 10
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 22
REQUIRED = object()


def _bad(where: str, key: str, v, want: str) -> SpecscopeError:
    return SpecscopeError(f"{where}: {key} must be {want}, got {v!r}; fix the file or re-export the checkpoint")


def cfg_int(d: dict, key: str, default=REQUIRED, lo: int = 1, hi: int = 2**31 - 1, where: str = "config.json"):
    """An integer field; a missing or null optional field gives `default`."""
    v = d.get(key)
    if v is None:
        if default is REQUIRED:
            raise SpecscopeError(f"{where} is missing required field {key!r}" if key not in d else
                                 f"{where}: {key} is null; it must be an integer in {lo}..{hi}")
        return default
    ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        raise _bad(where, key, v, f"an integer in {lo}..{hi}")
    return int(v)


def cfg_float(d: dict, key: str, default=REQUIRED, lo: float = 0.0, hi: float = float("inf"), lo_open=False,
              where: str = "config.json") -> float:
    v = d.get(key)
    if v is None:
        if default is REQUIRED:
            raise SpecscopeError(f"{where} is missing required field {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo or \
            (lo_open and v == lo):
        rng = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi)
               else f"{'>' if lo_open else '>='} {lo:g}")
        raise _bad(where, key, v, f"a finite number {rng}")
    return float(v)


def cfg_bool(d: dict, key: str, default: bool, where: str = "config.json") -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(where, key, v, "true or false")
    return v


def cfg_str(d: dict, key: str, default, where: str = "config.json"):
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(where, key, v, "a string")
    return v


def _eos_ids(d: dict) -> list[int]:
    v = d.get("eos_token_id")
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    return [cfg_int({"eos_token_id": x}, "eos_token_id", lo=0) for x in items]


def rope_theta_of(d: dict, where: str = "config.json") -> float:
    """rope_theta from a HF config (transformers 5 moved it into rope_parameters)."""
    if d.get("rope_theta") is not None:
        return cfg_float(d, "rope_theta", lo=0.0, lo_open=True, where=where)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return cfg_float(rp, "rope_theta", lo=0.0, lo_open=True, where=f"{where} rope_parameters")
    return 10000.0


ROPE_TYPES = ("default", "linear", "llama3")


def rope_scaling_of(d: dict, where: str = "config.json") -> dict | None:
    """The RoPE scaling dict with its rope_type, or None for plain RoPE (either config key); validated, so a
    malformed one is a clear error here rather than a KeyError when the RoPE table is built."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rs = d.get(key)
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise _bad(where, key, rs, 'an object such as {"rope_type": "linear", "factor": 2.0}')
    rs = dict(rs)
    rt = rs.setdefault("rope_type", rs.get("type", "default"))
    w = f"{where} {key}"
    if rt not in ROPE_TYPES:
        raise SpecscopeError(f"unsupported rope scaling {rt!r} ({w}); supported: {', '.join(ROPE_TYPES)}")
    if rt == "default":
        return None
    if rs.get("factor") is None:
        raise SpecscopeError(f"{w}: rope_type {rt!r} needs a 'factor' (the context extension ratio, e.g. 8.0); "
                             f"add it, or use rope_type 'default' for plain RoPE")
    rs["factor"] = cfg_float(rs, "factor", lo=0.0, hi=1e6, lo_open=True, where=w)
    if rt == "llama3":
        low = cfg_float(rs, "low_freq_factor", 1.0, lo=0.0, lo_open=True, where=w)
        high = cfg_float(rs, "high_freq_factor", 4.0, lo=0.0, lo_open=True, where=w)
        if high <= low:
            raise SpecscopeError(f"{w}: high_freq_factor ({high:g}) must be greater than low_freq_factor ({low:g})")
        cfg_int(rs, "original_max_position_embeddings", 8192, hi=MAX_POSITIONS, where=w)
    return rs


def _sliding_window(d, arch):
    if arch == "MistralForCausalLM":
        return cfg_int(d, "sliding_window", None)
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not d.get("use_sliding_window"):
        return None
    # Qwen: layers from max_window_layers on slide (transformers' layer_types); one window for all layers only
    n = cfg_int(d, "num_hidden_layers", hi=MAX_LAYERS)
    mwl = cfg_int(d, "max_window_layers", 28, lo=0)
    types = d.get("layer_types") or ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    if not isinstance(types, list):
        raise _bad("config.json", "layer_types", types, "a list of 'full_attention' / 'sliding_attention'")
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return cfg_int(d, "sliding_window", None)
    raise SpecscopeError("checkpoints mixing sliding-window and full-attention layers are not supported "
                         "(config.json: use_sliding_window with max_window_layers / layer_types)")
