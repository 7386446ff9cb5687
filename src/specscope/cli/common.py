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
