"""Shared CLI helpers: output, option types, runtime setup."""

from __future__ import annotations

import math
import sys

import click

from specscope.errors import SpecscopeError
from specscope.fileio import check_writable, decode_utf8, write_atomic  # noqa: F401  (the commands' file helpers)
from specscope.jsonio import DTYPE_ALIASES   # HF / vLLM / SGLang dtype spellings -> ours
from specscope.jsonio import dumps as json_dumps


def emit_json(obj) -> None:
    # strict JSON: a NaN or infinity (a stored record may hold one) is printed as null, never as bare NaN
    click.echo(json_dumps(obj))


def setup_runtime(threads: int | None, device: str | None, fit_load: bool = False):
    """The torch device; `threads` set (bad values refused). fit_load (the decode commands): without --threads, a
    CPU run takes the cores other processes leave free right now (cpuload.choose_threads, said in the fingerprint
    and generate's --json)."""
    import torch

    from specscope.models.loader import resolve_device

    from specscope.cli.checks import MAX_THREADS

    if threads is not None:
        if not 1 <= threads <= MAX_THREADS:
            raise SpecscopeError(f"--threads must be in 1..{MAX_THREADS}, got {threads}")
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    if fit_load and dev.type == "cpu":
        from specscope.cpuload import choose_threads

        torch.set_num_threads(choose_threads(threads, torch.get_num_threads()).threads)
    return dev


def stdout_console(**kw):
    """Rich console for tables on stdout: without a terminal (a pipe, a log) rich would cut them at 80 columns,
    so they get a wide fixed width instead."""
    from rich.console import Console

    return Console(**kw) if sys.stdout.isatty() else Console(width=200, **kw)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


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


def dtype_option(*names, short=("fp32", "bf16", "fp16", "auto"), default="auto", help=None):
    """--dtype accepting the short forms and torch / Hugging Face / vLLM spellings (bfloat16, float16, float32,
    half, float); the command sees the short form."""
    names = names or ("--dtype",)
    longs = [k for k, v in DTYPE_ALIASES.items() if v in short]

    def norm(ctx, param, value):
        return DTYPE_ALIASES.get(value, value) if value is not None else value

    return click.option(*names, type=click.Choice([*short, *longs], case_sensitive=False), default=default,
                        show_default=default is not None, callback=norm,
                        help=help or ("auto = fp32 on CPU, bf16 on CUDA. bf16 on CPU runs through specscope's "
                                      "row-invariant kernels (about half the decode time; speculation stays "
                                      "lossless). bfloat16 / float16 / float32 also accepted."
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


# drafting knobs: far past any useful shape, short of a tree that would not fit in memory
MAX_STEPS, MAX_TOPK, MAX_DRAFT_TOKENS = 64, 64, 1024


def spec_options(steps_help="Draft depth: drafter steps per cycle (tree depth / chain length).",
                 steps_default=None, topk_default=None, draft_tokens_default=None, draft_tokens_help=None):
    """--steps / --topk / --draft-tokens with SGLang's and vLLM's spellings as aliases:
    --speculative-num-steps (SGLang) and --num-speculative-tokens (vLLM, a chain) = --steps;
    --speculative-eagle-topk = --topk; --speculative-num-draft-tokens = --draft-tokens."""
    def deco(f):
        for opt in reversed([
            click.option("--steps", "--speculative-num-steps", "--num-speculative-tokens", "steps",
                         type=click.IntRange(1, MAX_STEPS), default=steps_default,
                         show_default=steps_default is not None,
                         help=steps_help + " SGLang --speculative-num-steps; vLLM num_speculative_tokens."),
            click.option("--topk", "--speculative-eagle-topk", "topk", type=click.IntRange(1, MAX_TOPK),
                         default=topk_default, show_default=topk_default is not None,
                         help="Tree branching; 1 = chain. SGLang --speculative-eagle-topk."),
            click.option("--draft-tokens", "--speculative-num-draft-tokens", "draft_tokens",
                         type=click.IntRange(2, MAX_DRAFT_TOKENS), default=draft_tokens_default,
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


def draft_budget_option(default: str = "priced", note: str = ""):
    # no default here: a budget given without --draft is refused, so the command must see whether it was given
    return click.option("--draft-budget", "draft_budget", type=click.Choice(["priced", "fixed"]), default=None,
                        help=f"[default: {default}] 'priced' verifies, each cycle, the nodes worth their rows at this "
                             "host's verify cost by rows (measured once, cached), within the declared shape, and a "
                             "model drafter sits out (plain steps, or the copy alone in a hybrid) where that has been "
                             "faster; 'fixed' verifies the declared shape every cycle." + note)


def draft_option(help="Drafter: an EAGLE-3 directory, shipped name or Hugging Face id (org/name[@revision]), "
                      "'ngram' (n-gram copying; 'ngram-lookup' for prompt lookup), a small HF model, or "
                      "DRAFTER+ngram (both in one tree). SGLang --speculative-draft-model-path."):
    return click.option("--draft", "--speculative-draft-model-path", "draft", default=None, help=help)
class SamplingParam(click.ParamType):
    """A click type checked by the sampling schema (runtime/params.py), so the CLI refuses exactly what the server
    and SamplingParams refuse: `--temperature nan`, `--seed 99999999999999999999`, ..."""

    def __init__(self, field: str):
        self.field = field
        self.name = "integer" if field in ("seed", "top_k") else "float"

    def convert(self, value, param, ctx):
        from specscope.runtime.params import check_field

        if isinstance(value, str):
            try:
                value = int(value) if self.name == "integer" else float(value)
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.name == 'integer' else 'a number'}", param, ctx)
        return check_field(self.field, value, style="cli")  # ParamError: "error: --seed must be ..." exit 2


class FiniteFloat(click.FloatRange):
    """A float flag that must be a finite number (and in range, with FloatRange's min/max/min_open/max_open).
    click's FloatRange alone lets nan through every bound (nan < min is False) and inf through an open top:
    `train --lr nan` reached the optimizer, `--max-minutes nan` the clock."""

    name = "float"

    def convert(self, value, param, ctx):
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


TEMPERATURE = SamplingParam("temperature")
TOP_P = SamplingParam("top_p")
TOP_K = SamplingParam("top_k")
SEED = SamplingParam("seed")


def read_stdin_text(what: str) -> str:
    """Standard input as UTF-8 text; invalid bytes are a user error naming the offset, not a tokenizer crash."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    return data if isinstance(data, str) else decode_utf8(data, f"{what}: standard input")
