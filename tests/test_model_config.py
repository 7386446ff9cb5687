"""config.json -> ModelConfig: architecture detection, sliding windows, rope scaling, clear errors."""

import pytest

from specscope.errors import SpecscopeError
from specscope.models.config import ModelConfig

BASE = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8}


def cfg(**kw):
    d = dict(BASE)
    d.update(kw)
    return ModelConfig.from_hf(d)


def test_qwen_sliding_window_follows_max_window_layers():
    assert cfg().sliding_window is None  # use_sliding_window off
    assert cfg(use_sliding_window=True, max_window_layers=0).sliding_window == 8
    assert cfg(use_sliding_window=True, max_window_layers=28).sliding_window is None  # no layer reaches 28
    assert cfg(use_sliding_window=True, layer_types=["sliding_attention"] * 3).sliding_window == 8
    with pytest.raises(SpecscopeError, match="mixing sliding-window and full-attention"):
        cfg(use_sliding_window=True, max_window_layers=1)


def test_model_type_fallback_and_flags():
    c = cfg(architectures=None, model_type="qwen3")
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and not c.qkv_bias
    assert cfg().qkv_bias
    assert cfg(architectures=["MistralForCausalLM"]).sliding_window == 8
    assert cfg(num_key_value_heads=None).num_key_value_heads == 4
    assert cfg(eos_token_id=[2, 7]).eos_token_id == [2, 7]


@pytest.mark.parametrize("kw,msg", [
    ({"architectures": ["BertModel"]}, "supported: LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
])
def test_config_errors(kw, msg):
    with pytest.raises(SpecscopeError, match=msg):
        cfg(**kw)


def test_rope_scaling_from_either_key():
    r = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    a = cfg(architectures=["LlamaForCausalLM"], rope_parameters=r)
    b = cfg(architectures=["LlamaForCausalLM"], rope_scaling={"type": "llama3", **{k: v for k, v in r.items()
                                                                                   if k != "rope_type"}},
            rope_theta=500000.0)
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.rope_scaling["rope_type"] == b.rope_scaling["rope_type"] == "llama3"
    assert cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_scaling is None
