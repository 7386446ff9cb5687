"""The `specscope` command line: a thin layer over the library.

Subcommands are imported lazily so `specscope --help` does not pay for torch.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from specscope import __version__
from specscope.errors import SpecscopeError

# command name -> "module:attribute" (a click.Command)
COMMANDS = {
    "generate": "specscope.cli.generate:generate",
    "models": "specscope.cli.models:models",
    "tune": "specscope.cli.economics:tune",
    "runs": "specscope.cli.runs:runs",
    "compare": "specscope.cli.compare:compare",
    "verify-curve": "specscope.cli.economics:verify_curve",
    "breakeven": "specscope.cli.economics:breakeven",
    "serve": "specscope.cli.serve:serve",
    "bench-serve": "specscope.cli.bench_serve:bench_serve",
    "ingest": "specscope.cli.ingest:ingest",
    "train": "specscope.cli.train:train",
    "export": "specscope.cli.train:export",
    "check-drafter": "specscope.cli.check:check_drafter",
    "demo": "specscope.cli.demo:demo",
    "report": "specscope.cli.report:report",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="specscope")
def cli():
    """specscope: fast, lossless and explainable speculative decoding (EAGLE-3)."""


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="specscope", standalone_mode=False)
    except SpecscopeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # usage errors: one line, exit 2, like click's standalone mode
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # a bug, not a user error: one line, the traceback kept for the report
        if os.environ.get("SPECSCOPE_TRACEBACK"):
            raise
        where = save_traceback(e)
        click.echo(f"internal error: {type(e).__name__}: {_first_line(e)} — full traceback in {where}; "
                   f"please report it", err=True)
        sys.exit(INTERNAL_ERROR)


INTERNAL_ERROR = 70  # EX_SOFTWARE (sysexits.h)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def save_traceback(e: BaseException) -> str:
    """Write the traceback to $XDG_STATE_HOME/specscope/crash-*.txt (else the temp dir); returns the path."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    text = (f"specscope {__version__}\nargv: {sys.argv!r}\n\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "specscope"
    for d in (state, Path(tempfile.gettempdir())):
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
            return str(d / name)
        except OSError:
            continue
    return "(nowhere: no writable state or temp directory)"
