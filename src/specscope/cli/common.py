"""Shared CLI helpers: output, option types, runtime setup."""

from __future__ import annotations

import json
import sys

import click

from specscope.errors import SpecscopeError


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def setup_runtime(threads: int | None, device: str | None):
    import torch

    from specscope.models.loader import resolve_device

    if threads is not None:
        if threads < 1:
            raise SpecscopeError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return resolve_device(device)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def is_tty() -> bool:
    return sys.stdout.isatty()


class SamplingParam(click.ParamType):
    """A click type checked by the sampling schema (engine/params.py), so the CLI refuses exactly what the server
    and SamplingParams refuse: `--temperature nan`, `--seed 99999999999999999999`, ..."""

    def __init__(self, field: str):
        self.field = field
        self.name = "integer" if field in ("seed", "top_k") else "float"

    def convert(self, value, param, ctx):
        from specscope.engine.params import check_field

        if isinstance(value, str):
            try:
                value = int(value) if self.name == "integer" else float(value)
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.name == 'integer' else 'a number'}", param, ctx)
        return check_field(self.field, value, style="cli")  # ParamError: "error: --seed must be ..." exit 2


TEMPERATURE = SamplingParam("temperature")
TOP_P = SamplingParam("top_p")
TOP_K = SamplingParam("top_k")
SEED = SamplingParam("seed")


def read_stdin_text(what: str) -> str:
    """Standard input as UTF-8 text; invalid bytes are a user error naming the offset, not a tokenizer crash."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecscopeError(f"{what}: standard input is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
                             f"{e.start}); convert it, e.g. with iconv -t UTF-8") from None


def write_output(path: str, text: str) -> None:
    """Write a command's output file whole (a temp file renamed into place); any OS refusal is one line."""
    import os
    from pathlib import Path

    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    if p.is_dir():
        raise SpecscopeError(f"cannot write {path}: it is a directory; pass a file name to -o")
    try:
        if p.exists() and not p.is_file():  # /dev/stdout, a fifo: write through, never rename over it
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
            return
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise SpecscopeError(f"cannot write {path} ({e.strerror or e}); pick a writable path for -o") from None


def check_writable(path, flag: str, is_dir: bool = False) -> None:
    """Fail before the work, not after it: `path` (a file, or a directory if is_dir) could be created where it is
    asked for. Nothing is left behind; a probe file in the nearest existing directory proves it (permission bits
    alone say yes for root in /proc, or on a read-only mount)."""
    import os
    import tempfile
    from pathlib import Path

    p = Path(path).expanduser()
    if p.exists():
        if is_dir and not p.is_dir():
            raise SpecscopeError(f"{flag} {str(p)!r} exists and is not a directory")
        if not is_dir and p.is_dir():
            raise SpecscopeError(f"{flag} {str(p)!r} is a directory; pass a file name")
        if not os.access(p, os.W_OK):
            raise SpecscopeError(f"{flag} {str(p)!r} is not writable")
        return
    anc = p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise SpecscopeError(f"{flag} {str(p)!r} cannot be created: {str(anc)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=anc, prefix=".specscope-probe-"):
            pass
    except OSError as e:
        raise SpecscopeError(f"{flag} {str(p)!r} cannot be created in {str(anc)!r} ({e.strerror or e}); "
                             f"pick a writable location") from None
