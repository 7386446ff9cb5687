"""The `specscope` command line: a thin layer over the library.

Subcommands are imported lazily so `specscope --help` does not pay for torch.
"""

from __future__ import annotations

import importlib
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
