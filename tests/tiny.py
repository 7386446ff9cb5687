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


TINY_SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts a few tokens and the target verifies them in one forward pass",
    "a small model proposes and a large model disposes",
    "write a short poem about the sea and the sky",
    "what is the capital of france",
    "explain how a cache works in simple words",
)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tiny_tokenizer(path, vocab_size: int = 101):
    """A real (WordLevel) fast tokenizer with exactly `vocab_size` ids and a chat template, saved into `path`.

    Ids 0..2 are <pad>, <s>, </s> to match `hf_config`'s pad/bos/eos; words from TINY_SENTENCES come next and
    filler words `w<i>` pad the vocabulary so every id a random model emits decodes to something.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    words = []
    for s in TINY_SENTENCES:
        for w in s.split():
            if w not in words:
                words.append(w)
    words += [".", ",", "?", "!"]
    vocab_list = specials + words
    if len(vocab_list) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab_list)} built-in tokens")
    vocab_list += [f"w{i}" for i in range(vocab_size - len(vocab_list))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab_list)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_served_model(path):
    """The servers' tiny model: a 2-layer llama over a 101-token tokenizer (tests/test_server*.py)."""
    make_hf_model(path, "llama", vocab=101, layers=2)
    make_tiny_tokenizer(path, 101)
    return path
