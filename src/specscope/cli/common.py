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


def stdout_console(**kw):
    """Rich console for tables on stdout: without a terminal (a pipe, a log) rich would cut them at 80 columns,
    so they get a wide fixed width instead."""
    from rich.console import Console

    return Console(**kw) if sys.stdout.isatty() else Console(width=200, **kw)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def is_tty() -> bool:
    return sys.stdout.isatty()


# ------------------------------------------------------------------------------------------------ flag conventions
# One meaning per flag across commands, spelled as Hugging Face / vLLM / SGLang spell it. Old spellings stay as
# hidden aliases for one release (AliasOption), so scripts keep working while --help shows one name.

class AliasOption(click.Option):
    """A click option whose `hidden_aliases` still parse but are left out of --help."""

    def __init__(self, *args, hidden_aliases=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_aliases = set(hidden_aliases)

    def get_help_record(self, ctx):
        saved = self.opts
        self.opts = [o for o in self.opts if o not in self.hidden_aliases] or saved
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = saved


def alias_option(*names, hidden=(), **kwargs):
    """click.option with old spellings `hidden` (they parse, --help does not show them)."""
    return click.option(*names, *hidden, cls=AliasOption, hidden_aliases=hidden, **kwargs)


# HF / vLLM / SGLang dtype spellings -> ours
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def dtype_option(*names, short=("fp32", "bf16", "fp16", "auto"), default="auto", help=None):
    """--dtype accepting the short forms and torch / Hugging Face / vLLM spellings (bfloat16, float16, float32,
    half, float); the command sees the short form."""
    names = names or ("--dtype",)
    longs = [k for k, v in DTYPE_ALIASES.items() if v in short]

    def norm(ctx, param, value):
        return DTYPE_ALIASES.get(value, value) if value is not None else value

    return click.option(*names, type=click.Choice([*short, *longs], case_sensitive=False), default=default,
                        show_default=default is not None, callback=norm,
                        help=help or ("auto = fp32 on CPU, bf16 on CUDA. bfloat16 / float16 / float32 also accepted."
                                      if "auto" in short else "bfloat16 / float16 / float32 also accepted."))


def device_option(default="auto"):
    return click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default=default, show_default=True,
                        help="auto = CUDA when available, else CPU.")


def json_option(help="Print one JSON object instead of the human-readable output."):
    return click.option("--json", "as_json", is_flag=True, help=help)


def db_option(f):
    return click.option("--db", default=None,
                        help="Registry database (default: $SPECSCOPE_DB or $XDG_DATA_HOME/specscope/runs.db).")(f)


def output_option(help, default=None, hidden=(), file_okay=True, dir_okay=True, show_default=False):
    """-o/--output: the one spelling of "where to write" in every command."""
    return alias_option("-o", "--output", "output", hidden=hidden, default=default, show_default=show_default,
                        type=click.Path(file_okay=file_okay, dir_okay=dir_okay), help=help)


def spec_options(steps_help="Draft depth: drafter steps per cycle (tree depth / chain length).",
                 steps_default=None, topk_default=None, draft_tokens_default=None, draft_tokens_help=None):
    """--steps / --topk / --draft-tokens with SGLang's and vLLM's spellings as aliases:
    --speculative-num-steps (SGLang) and --num-speculative-tokens (vLLM, a chain) = --steps;
    --speculative-eagle-topk = --topk; --speculative-num-draft-tokens = --draft-tokens."""
    def deco(f):
        for opt in reversed([
            click.option("--steps", "--speculative-num-steps", "--num-speculative-tokens", "steps",
                         type=click.IntRange(min=1), default=steps_default, show_default=steps_default is not None,
                         help=steps_help + " SGLang --speculative-num-steps; vLLM num_speculative_tokens."),
            click.option("--topk", "--speculative-eagle-topk", "topk", type=click.IntRange(min=1),
                         default=topk_default, show_default=topk_default is not None,
                         help="Tree branching; 1 = chain. SGLang --speculative-eagle-topk."),
            click.option("--draft-tokens", "--speculative-num-draft-tokens", "draft_tokens",
                         type=click.IntRange(min=2), default=draft_tokens_default,
                         show_default=draft_tokens_default is not None,
                         help=(draft_tokens_help or "Tokens verified per cycle (tree nodes + root).")
                         + " SGLang --speculative-num-draft-tokens."),
            click.option("--ngram-tokens", "ngram_tokens", type=click.IntRange(min=0), default=None,
                         help="Hybrid drafters (--draft DRAFTER+ngram): copied tokens grafted onto the tree and "
                              "verified on top of --draft-tokens (default 6)."),
        ]):
            f = opt(f)
        return f
    return deco


def draft_option(help="Drafter: EAGLE-3 directory or name, 'ngram' (n-gram copying; 'ngram-lookup' for prompt "
                      "lookup), a small HF model, or DRAFTER+ngram (both in one tree). "
                      "SGLang --speculative-draft-model-path."):
    return click.option("--draft", "--speculative-draft-model-path", "draft", default=None, help=help)
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
