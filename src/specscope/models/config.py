"""Model configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

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
    def from_hf(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:
            mt = d.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}.get(mt)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecscopeError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        flags = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta_of(d)),
                rope_scaling=rope_scaling_of(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=flags.get("qkv_bias", False) or bool(d.get("attention_bias", False)),
                qk_norm=flags.get("qk_norm", False),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                sliding_window=_sliding_window(d, arch),
                hidden_act=d.get("hidden_act", "silu"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=_as_list(d.get("eos_token_id")),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            )
        except KeyError as e:
            raise SpecscopeError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise SpecscopeError(f"config.json has an invalid value: {e}") from None
        if cfg.hidden_act not in ("silu", "swish"):
            raise SpecscopeError(f"unsupported hidden_act {cfg.hidden_act!r}; only silu (SwiGLU) is supported")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise SpecscopeError(
                f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})")
        rt = (cfg.rope_scaling or {}).get("rope_type", "default")
        if rt not in ("default", "llama3", "linear"):
            raise SpecscopeError(f"unsupported rope scaling {rt!r}; supported: default, linear, llama3")
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


def _as_list(x):
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def rope_theta_of(d: dict) -> float:
    """rope_theta from a HF config (transformers 5 moved it into rope_parameters)."""
    if "rope_theta" in d:
        return d["rope_theta"]
    rp = d.get("rope_parameters") or {}
    return rp.get("rope_theta", 10000.0)


def rope_scaling_of(d: dict) -> dict | None:
    """The RoPE scaling dict with its rope_type, or None for plain RoPE (either config key)."""
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    rs.setdefault("rope_type", rs.get("type", "default"))
    return rs if rs["rope_type"] != "default" else None


def _sliding_window(d, arch):
    if arch == "MistralForCausalLM":
        return d.get("sliding_window")
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not d.get("use_sliding_window"):
        return None
    # Qwen: layers from max_window_layers on slide (transformers' layer_types); one window for all layers only
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types") or ["sliding_attention" if i >= int(d.get("max_window_layers", 28)) else
                                     "full_attention" for i in range(n)]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return d.get("sliding_window")
    raise SpecscopeError("checkpoints mixing sliding-window and full-attention layers are not supported "
                         "(config.json: use_sliding_window with max_window_layers / layer_types)")
