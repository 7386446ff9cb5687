"""JSON in and out: parsing what a user handed us (config files, datasets, prompt files) into one clear error, and
the one writer of the JSON we print (`--json`, `runs export`), which is strict JSON.

`json.loads` raises three different things on hostile input: JSONDecodeError, UnicodeDecodeError on bytes, and
RecursionError for deeply nested arrays (`[[[[...` 100,000 deep), which no `except ValueError` catches.
"""

from __future__ import annotations

import json
import math

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


def dumps(obj, indent: int | None = 2) -> str:
    """Strict JSON (RFC 8259) text of `obj`: NaN and ±Infinity, which only Python's parser reads, are written as
    null (a value that was not measured, or not measurable); what json cannot encode is written as its str()."""
    try:
        return json.dumps(obj, indent=indent, default=str, allow_nan=False)
    except ValueError:      # a non-finite float somewhere: only then pay for the walk
        return json.dumps(_finite(obj), indent=indent, default=str, allow_nan=False)


def _finite(obj):
    """`obj` with every non-finite float (also as a key) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {_finite(k) if isinstance(k, float) else k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


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
