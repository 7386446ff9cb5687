"""What `train --capture` and specscope's vLLM plugin (plugins/capture.py) exchange, in one place: the environment
variable that turns the plugin's capture mode on, the request fields that mark a request for capture, and the files
the plugin writes per request (DIR/KEY.safetensors, or DIR/KEY.error with one line), each written whole under a
temporary name and renamed, so a reader never sees half of one."""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_DIR = "SPECSCOPE_CAPTURE"
XARG_KEY, XARG_LAYERS = "specscope_capture", "specscope_layers"     # /v1/completions `vllm_xargs` fields
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
TENSORS = ("aux", "hidden", "argmax", "input_ids")


def write_capture(out: Path, key: str, aux, hidden, argmax, ids: list[int], meta: dict) -> Path:
    """One request's features: aux [T, k, H] and hidden [T, H] in the model's dtype, argmax and input_ids int32."""
    import torch
    from safetensors.torch import save_file

    tensors = {"aux": aux.contiguous(), "hidden": hidden.contiguous(), "argmax": argmax.to(torch.int32),
               "input_ids": torch.tensor(ids, dtype=torch.int32)}
    tmp = Path(out) / f".{key}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, Path(out) / f"{key}.safetensors")
    return Path(out) / f"{key}.safetensors"


def write_error(out: Path, key: str, why: str) -> None:
    tmp = Path(out) / f".{key}.{os.getpid()}.err.tmp"
    tmp.write_text(" ".join(why.split()) + "\n")
    os.replace(tmp, Path(out) / f"{key}.error")
