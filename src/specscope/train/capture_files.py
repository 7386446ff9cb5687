"""What `train --capture` and specscope's vLLM plugin (plugins/capture.py) exchange, in one place: the environment
variable that turns the plugin's capture mode on, the request fields that mark a request for capture, and the files
the plugin writes per request (RUN/KEY.safetensors, or RUN/KEY.error with one line, RUN being the asking run's own
directory under DIR), each written whole under a temporary name and renamed, so a reader never sees half of one.
`read_capture` is the one reader of those files: anything else in them than what was sent is one line."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from specscope.errors import SpecscopeError

ENV_DIR = "SPECSCOPE_CAPTURE"
XARG_KEY, XARG_LAYERS = "specscope_capture", "specscope_layers"     # /v1/completions `vllm_xargs` fields
XARG_RUN = "specscope_run"          # the asking run's directory under DIR (a plugin before it writes into DIR)
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
RUN_PREFIX = ".specscope-run-"
RUN_RE = re.compile(re.escape(RUN_PREFIX) + r"[A-Za-z0-9_-]{1,120}")
TENSORS = ("aux", "hidden", "argmax", "input_ids")


def capture_key(extra: dict) -> str | None:
    """The file a request's vllm_xargs ask for: "KEY", or "RUN/KEY" in the run's directory; None when they ask for
    none, or for a name specscope never makes (no path of the client's choosing)."""
    key, run = extra.get(XARG_KEY), extra.get(XARG_RUN)
    if key is None or not KEY_RE.fullmatch(str(key)):
        return None
    if run is None:
        return str(key)
    return f"{run}/{key}" if RUN_RE.fullmatch(str(run)) else None


def _place(out: Path, key: str) -> tuple[Path, str] | None:
    """(directory, name) of `key`'s files; None when its run's directory is gone: that run was killed and a later
    one removed what it left, so nobody would read the file (and none is left behind)."""
    run, _, name = key.rpartition("/")
    d = Path(out) / run if run else Path(out)
    return (d, name) if d.is_dir() else None


def write_capture(out: Path, key: str, aux, hidden, argmax, ids: list[int], meta: dict) -> Path | None:
    """One request's features: aux [T, k, H] and hidden [T, H] in the model's dtype, argmax and input_ids int32."""
    import torch
    from safetensors.torch import save_file

    place = _place(out, key)
    if place is None:
        return None
    d, name = place
    tensors = {"aux": aux.contiguous(), "hidden": hidden.contiguous(), "argmax": argmax.to(torch.int32),
               "input_ids": torch.tensor(ids, dtype=torch.int32)}
    tmp = d / f".{name}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, d / f"{name}.safetensors")
    return d / f"{name}.safetensors"


def write_error(out: Path, key: str, why: str) -> None:
    place = _place(out, key)
    if place is None:
        return
    d, name = place
    tmp = d / f".{name}.{os.getpid()}.err.tmp"
    tmp.write_text(" ".join(why.split()) + "\n")
    os.replace(tmp, d / f"{name}.error")


@dataclass
class CaptureFile:
    """One request's features as read back: aux [T, k, H], hidden [T, H], argmax [T] (int64), and the file's
    metadata (engine_version, tensor_parallel_size)."""
    aux: object
    hidden: object
    argmax: object
    meta: dict


def read_capture(path: Path, sent: list[int], layers: list[int], hidden_size: int | None, *,
                 server: str) -> CaptureFile:
    """The features of the request that sent `sent` at aux `layers`, from `path`, checked against what was sent
    and the target's `hidden_size`: a damaged file, or one of another sequence or model, is one line."""
    import torch
    from safetensors import SafetensorError, safe_open

    where = f"the capture file {path} from {server}"
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            missing = [k for k in TENSORS if k not in f.keys()]
            t = {k: f.get_tensor(k) for k in TENSORS if k not in missing}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SpecscopeError(f"{where} is damaged ({' '.join(str(e).split())}); rerun to capture it again (if it "
                             f"recurs, install this specscope's plugin in vLLM's environment)") from None
    shapes = {k: tuple(v.shape) for k, v in t.items()}
    if missing or not _well_formed(t):
        raise SpecscopeError(f"{where} is not a specscope capture (tensors {shapes}; expected aux [T, k, H], hidden "
                             f"[T, H], argmax [T], input_ids [T]); install this specscope's plugin in vLLM's "
                             f"environment and rerun")
    _check_sent(t, sent, layers, hidden_size, where, Path(path).parent)
    return CaptureFile(t["aux"], t["hidden"], t["argmax"].to(torch.int64), meta)


def _well_formed(t: dict) -> bool:
    aux, hid, am, ids = (t[k] for k in TENSORS)
    T = ids.shape[0] if ids.dim() == 1 else -1
    return (aux.dim() == 3 and hid.dim() == 2 and am.dim() == 1 and ids.dim() == 1
            and aux.shape[0] == hid.shape[0] == am.shape[0] == T and aux.shape[2] == hid.shape[1]
            and aux.is_floating_point() and hid.is_floating_point()
            and not am.is_floating_point() and not ids.is_floating_point())


def _check_sent(t: dict, sent: list[int], layers: list[int], hidden_size: int | None, where: str,
                folder: Path) -> None:
    """The file holds the sequence sent, at the layers asked for, of the target's width; else one line saying
    which differs and why that happens."""
    got = t["input_ids"].tolist()
    if got != list(sent):
        i = next((j for j, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
        what = (f"token {i} is {got[i]} where {sent[i]} was sent" if i < min(len(got), len(sent))
                else f"it holds {len(got)} tokens where {len(sent)} were sent")
        raise SpecscopeError(f"{where} is not the sequence sent ({what}): the server did not run these token ids as "
                             f"given (its model or tokenizer is not --model's), or another process writes to "
                             f"{folder}")
    k, H = t["aux"].shape[1], t["aux"].shape[2]
    if k != len(layers):
        raise SpecscopeError(f"{where} holds {k} aux layers where {len(layers)} ({layers}) were asked for; install "
                             f"this specscope's plugin in vLLM's environment")
    if hidden_size is not None and H != hidden_size:
        raise SpecscopeError(f"{where} holds hidden states {H} wide but --model's hidden size is {hidden_size}: the "
                             f"server runs another model; point --capture at a server of --model")
