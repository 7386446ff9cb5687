"""Tiny random Hugging Face checkpoints for oracle tests (transformers writes them, we read them)."""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def hf_config(arch: str = "llama", vocab: int = 101, hidden: int = 64, layers: int = 3, tie: bool = False, **kw):
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "mistral": tf.MistralConfig}[arch]
    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        base["head_dim"] = 16
    base.update(kw)
    return cls(**base)


def make_hf_model(path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **kw):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch, **kw)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "mistral": tf.MistralForCausalLM}[arch]
    model = cls(cfg).eval()
    # random init has tiny weights; scale up so logits are not near-uniform (makes argmax comparisons meaningful)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model = model.to(dtype)
    model.save_pretrained(str(path))
    return model
