"""The `specscope` command line: a thin layer over the library.

Subcommands are imported lazily so `specscope --help` does not pay for torch, and each command module imports the
library inside its command function for the same reason: building a command's options and `--help` loads nothing
heavy. Those function-level imports are on purpose.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

import click

from specscope import __version__
from specscope.errors import SpecscopeError
from specscope.fileio import PATH_HINTS   # one wording for path errors, here and in fileio

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
    "sweep": "specscope.cli.sweep:sweep",
    "bisect": "specscope.cli.bisect:bisect",
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
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not {"-h", "--help", "--version"} & set(argv):
            check_environment()
        cli.main(args=argv, prog_name="specscope", standalone_mode=False)
    except SpecscopeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # usage errors: one line, exit 2, like click's standalone mode (a Choice lists its values one per line)
        click.echo(f"error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:
        # a path the user gave that the OS refuses (a 300-byte name, a file where a directory must be, no
        # permission) is bad input wherever it was first touched; any other OSError is a bug, reported below
        msg = user_path_error(e, argv)
        if msg is None:
            _internal_error(e)
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)
    except Exception as e:  # a bug, not a user error: one line, the traceback kept for the report
        _internal_error(e)


INTERNAL_ERROR = 70  # EX_SOFTWARE (sysexits.h)
TRIVIAL_KERNELS = ("", "auto", "1", "on", "true", "0", "off", "none", "false")


def check_environment() -> None:
    """specscope's own environment variables are refused like flags, before any work: one line naming the
    variable. (torchrun's are checked by `train`, which reads them.)"""
    kernels = os.environ.get("SPECSCOPE_KERNELS", "").strip().lower()
    if kernels not in TRIVIAL_KERNELS:
        from specscope.models import rowgemm     # torch, only when an ISA is forced

        rowgemm.requested_isa()
    tune = os.environ.get("SPECSCOPE_LINEAR_TUNE")
    if tune is not None and tune.strip() not in ("0", "1"):
        raise SpecscopeError(f"SPECSCOPE_LINEAR_TUNE={tune!r} must be 1 (tune the kernels' tiles once per shape, "
                             f"the default) or 0 (untuned: same results, maybe slower)")
    cache = os.environ.get("SPECSCOPE_CACHE")
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise SpecscopeError(f"SPECSCOPE_CACHE={cache!r} is a file, not a directory; point it at a directory "
                             f"(or unset it for ~/.cache/specscope)")


def _internal_error(e: BaseException):
    if os.environ.get("SPECSCOPE_TRACEBACK"):
        raise e
    where = save_traceback(e)
    click.echo(f"internal error: {type(e).__name__}: {_first_line(e)} — full traceback in {where}; "
               f"please report it", err=True)
    sys.exit(INTERNAL_ERROR)


def one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())




def user_path_error(e: OSError, argv: list[str]) -> str | None:
    """One line for an OSError on a path given on the command line (it, a file inside it, or a directory above
    it), naming the flag; None when the failing path is not the user's."""
    failed = [f for f in (e.filename, e.filename2) if isinstance(f, (str, bytes, os.PathLike))]
    if not failed:
        return None
    failed = [os.path.abspath(os.fsdecode(f)) for f in failed]
    valued = _valued_options(argv)
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i > 0 and argv[i - 1] in valued else ""
        if token.startswith("--") and "=" in token:
            flag, token = token.split("=", 1)
        if not token or "\0" in token:
            continue
        given = os.path.abspath(os.path.expanduser(token))
        for f in failed:
            inside = f.startswith(given.rstrip(os.sep) + os.sep)
            # a directory above it counts only when the user typed that component (not the cwd or $HOME)
            above = given.startswith(f.rstrip(os.sep) + os.sep) and os.path.basename(f) in token.split(os.sep)
            if f == given or inside or above:
                hint = PATH_HINTS.get(e.errno) or f"{e.strerror or type(e).__name__}; pass a usable path"
                at = "" if f == given else f" at {_short(f)!r}"
                return f"{flag + ' ' if flag else ''}{_short(token)!r}{at}: {hint}"
    return None


def _valued_options(argv: list[str]) -> set[str]:
    """The option names (e.g. -o, --model) of the invoked command that take a value, to name the flag a path came
    with; a flag like --no-run before a positional path is not it."""
    cmd, names = cli, set()
    for word in argv:
        if not isinstance(cmd, click.Group):
            break
        sub = cmd.get_command(None, word) if not word.startswith("-") else None
        if sub is None:
            break
        cmd = sub
    for p in getattr(cmd, "params", []):
        if isinstance(p, click.Option) and not p.is_flag and not p.count:
            names.update(p.opts, p.secondary_opts)
    return names


def _short(path: str) -> str:
    """A path fit for a one-line message: a 300-character name is shown by its ends."""
    return path if len(path) <= 100 else f"{path[:48]}…{path[-40:]}"


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
