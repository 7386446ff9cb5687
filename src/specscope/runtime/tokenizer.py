"""Tokenizer and chat template, via transformers' fast tokenizer loaded from the model directory."""

from __future__ import annotations

import logging
from pathlib import Path

from specscope.errors import SpecscopeError


def check_tokenizer_files(path: Path) -> None:
    """Cheap check (no transformers import) that a model directory carries a tokenizer."""
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise SpecscopeError(f"{str(path)!r} has no tokenizer.json; copy the tokenizer files next to the weights")


class Tokenizer:
    def __init__(self, path: str | Path):
        import transformers   # slow to import: check_tokenizer_files (preflight) runs without it
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        path = Path(path)
        check_tokenizer_files(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise SpecscopeError(f"cannot load the tokenizer in {path} ({type(e).__name__}: {e})") from None

    @property
    def eos_ids(self) -> list[int]:
        ids = []
        if self.tok.eos_token_id is not None:
            ids.append(int(self.tok.eos_token_id))
        return ids

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            if not self.tok.chat_template:
                raise SpecscopeError("this tokenizer has no chat template; drop --chat")
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return self.encode_messages(msgs)
        return self.tok.encode(text, add_special_tokens=False)

    def encode_messages(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        try:
            out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # a broken or strict template (jinja errors, raise_exception) is the file's fault
            raise SpecscopeError(f"the tokenizer's chat template failed on this conversation ({type(e).__name__}: "
                                 f"{e}); check chat_template in tokenizer_config.json") from None
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class StreamDecoder:
    """Incremental detokenisation: emits only text that can no longer change (handles multi-token characters)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted:]
        self.emitted = len(text)
        return new
