"""Parsing JSON a user handed us (config files, datasets, prompt files) into one clear error.

`json.loads` raises three different things on hostile input: JSONDecodeError, UnicodeDecodeError on bytes, and
RecursionError for deeply nested arrays (`[[[[...` 100,000 deep), which no `except ValueError` catches.
"""

from __future__ import annotations

import json

from specscope.errors import SpecscopeError


def loads(text: str | bytes, where: str):
    """The value in `text`; `where` ("data.jsonl:7") starts the error message."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecscopeError(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise SpecscopeError(f"{where} is not UTF-8 text (byte at offset {e.start})") from None
    except RecursionError:
        raise SpecscopeError(f"{where} holds JSON nested too deeply to be a record") from None


# HF / vLLM / SGLang / torch dtype spellings -> ours (fp32, bf16, fp16)
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def short_dtype(dtype) -> str | None:
    """fp32 / bf16 / fp16 for any spelling a run, a flag or torch uses (float32, bfloat16, torch.float16, ...)."""
    if dtype is None:
        return None
    d = str(dtype).replace("torch.", "")
    return DTYPE_ALIASES.get(d, d)


def dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16 (or the string "torch.bfloat16", or "bfloat16"): how records and configs
    spell a dtype."""
    return str(dtype).replace("torch.", "")
