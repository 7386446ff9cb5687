"""A tiny chat target for training tests: a random Llama plus a word-level tokenizer with a ChatML template."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"] + [f"w{i}" for i in range(95)]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + ' ' + message['content'] + "
            "' <|im_end|> '}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}")


def make_chat_target(path, layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    from tiny import make_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    make_hf_model(path, "llama", seed=seed, layers=layers, hidden=hidden, vocab=len(WORDS), eos_token_id=2)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<|im_end|>", bos_token="<|im_start|>",
                            chat_template=TEMPLATE).save_pretrained(str(path))
    return path


def write_dataset(path, n: int = 24, seed: int = 0, sharegpt_every: int = 2) -> Path:
    """Conversations whose assistant turns follow a learnable rule (each word's successor), in both forms."""
    rnd = random.Random(seed)
    lines = []
    for i in range(n):
        start = rnd.randrange(0, 80)
        user = " ".join(f"w{rnd.randrange(95)}" for _ in range(rnd.randrange(3, 8)))
        reply = " ".join(f"w{(start + j) % 95}" for j in range(rnd.randrange(10, 20)))
        if i % sharegpt_every == 0:
            lines.append({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]})
        else:
            lines.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]})
    Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return Path(path)
