"""`specscope ingest`: SGLang / vLLM logs, Prometheus scrapes and specscope profile output -> registry runs."""

from __future__ import annotations

import os
import sys

import click

from specscope.cli.common import alias_option, db_option, emit_json
from specscope.errors import SpecscopeError

PROGRESS_MIN_BYTES = 16 << 20   # smaller files ingest in about a second: no bar


def _fmt(v, spec=".2f"):
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    return format(v, spec)


def _tau(r: dict) -> str:
    """τ with how it was averaged when that is not obvious (SGLang weights its per-line means by running requests)."""
    s = f"τ {_fmt(r.get('accept_length'), '.3f')}"
    if r.get("accept_length_weighting"):
        s += (f" (mean of per-line accept len weighted by {r['accept_length_weighting']}; "
              f"plain mean {_fmt(r.get('accept_length_unweighted'), '.3f')})")
    return s


def _progress_for(path: str, show: bool | None):
    """A rich progress bar on stderr for large files on a terminal (or when --progress forces it); else None."""
    if path == "-" or show is False:
        return None, None
    try:
        size = os.path.getsize(path)
    except OSError:
        return None, None
    if show is None and not (sys.stderr.isatty() and size >= PROGRESS_MIN_BYTES):
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from specscope.cli.common import stderr_console

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=stderr_console(), transient=True)
    task = bar.add_task(os.path.basename(path), total=size)
    return bar, lambda done: bar.update(task, completed=done)


def _print_report(kinds: dict) -> None:
    """Per kind of line: read / used / skipped, and why."""
    from rich.console import Console
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("lines", "read", "used", "skipped", "why"):
        t.add_column(col, justify="right" if col in ("read", "used", "skipped") else "left")
    for kind, k in kinds.items():
        reasons = [f"{n} {why}" for why, n in k["skipped"].items()]
        reasons += [f"{n} partly used: {why}" for why, n in k["partial"].items()]
        t.add_row(kind, str(k["read"]), str(k["used"]), str(sum(k["skipped"].values())), "; ".join(reasons))
    Console(stderr=True, width=None if sys.stderr.isatty() else 160).print(t)


def _echo_run(s: dict) -> None:
    """One file's summary: what was read, the figures (a trace's as the profile report), the line report, notes."""
    r, i = s["results"], s["results"]["ingest"]
    rec = ", ".join(f"{k} {v}" for k, v in i["recognised"].items() if v)
    model = s["config"].get("model")
    click.echo(f"{s['file']}: {s['format']}" + (f" ({s['engine']})" if s["engine"] != s["format"] else "")
               + (f", model {model}" if model else "")
               + f" — {i['lines']} {i.get('unit', 'lines')} ({rec}; {i['malformed']} malformed, "
                 f"{i['other']} other)"
               + (f" -> run {s['run_id']}" if s["run_id"] else ""))
    if s["format"] == "torch-trace":      # per-phase timing: the profile report's own lines
        from specscope.ingest.torch_trace import phase_lines

        for line in phase_lines(r):
            click.echo("  " + line)
        _print_report(i.get("kinds") or {})
    else:
        _echo_figures(r)
        _print_report(i.get("kinds") or {})
        for ex in i["malformed_examples"][:3]:
            click.echo(f"  malformed line {ex['line']}: {ex['reason']}", err=True)
    if r.get("components"):          # what the profiled steps' phases spent their time on
        from specscope.profile.components import lines

        unknown = {k: v * 1e3 for k, v in (r.get("components_unclassified") or {}).items()}
        for line in lines(r["components"], unknown=unknown):
            click.echo(line)
    for w in i["warnings"]:
        click.echo(f"  note: {w}", err=True)


def _echo_figures(r: dict) -> None:
    """A log's figures on one line (τ, tok/s, acceptance, batch, ...), then τ per segment."""
    parts = [_tau(r), f"tok/s {_fmt(r.get('tok_per_s'), '.1f')}"]
    if r.get("draft_acceptance_rate") is not None:
        parts.append(f"acceptance per draft token {r['draft_acceptance_rate']:.3f}")
    if r.get("per_position_acceptance"):
        parts.append("per-position " + ", ".join("-" if x is None else f"{x:.3f}"
                                                 for x in r["per_position_acceptance"]))
    if r.get("batch_size"):
        parts.append(f"batch mean {r['batch_size']['mean']:.1f} max {r['batch_size']['max']}")
    if "cuda_graph" in r:
        parts.append(f"cuda graph {r['cuda_graph']}")
    if r.get("phases"):
        parts.append("phases " + ", ".join(f"{k} {v['mean_ms']:.2f} ms" for k, v in r["phases"].items()))
    click.echo("  " + "; ".join(parts))
    for seg in r.get("segments") or []:
        click.echo(f"  segment k={seg['k']} ({seg['form']}, {seg['lines']} lines from line "
                   f"{seg['first_line']}): τ {_fmt(seg['accept_length'], '.3f')}")


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, allow_dash=True))
@alias_option("--format", "engine", hidden=("--engine",),
              type=click.Choice(["auto", "sglang", "vllm", "specscope", "prometheus", "torch-trace"]), default="auto",
              show_default=True, help="Format of the files; auto detects it line by line (a torch-profiler trace, "
              "*.pt.trace.json[.gz], by its name or first bytes).")
@click.option("--tag", "tags", multiple=True, help="Tag the stored runs (repeatable).")
@click.option("--name", default=None, help="Run name (default: '<format> <file name>').")
@click.option("--no-record", is_flag=True, help="Parse and report only; do not store runs.")
@click.option("--progress/--no-progress", "progress", default=None,
              help="Progress bar (default: on a terminal, for files over 16 MB).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def ingest(files, engine, tags, name, no_record, progress, db, as_json):
    """Read engine logs / metric scrapes (streamed; bad lines are counted, not fatal); one run per file ('-' reads
    standard input, .gz files are decompressed on the fly). Each figure follows the engine's own definition, as
    tabled in docs/engine-metrics.md; a per-file report says which lines were used, skipped, and why. A vLLM
    torch-profiler trace (*.pt.trace.json[.gz], recorded with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1) becomes per-phase
    cycle timing, one cycle per decode step."""
    from specscope.ingest.core import ingest_files, refusal

    runs, failed = ingest_files(files, engine=engine, tags=tags, name=name, record=not no_record, db=db,
                                progress_for=lambda f: _progress_for(f, progress))
    if failed:          # a refused command changes nothing: no file's run is stored when any file failed
        if as_json:
            emit_json({"runs": [], "errors": failed})
        raise SpecscopeError(refusal(failed, len(files)))
    if as_json:
        emit_json({"runs": runs, "errors": failed})
        return
    for s in runs:
        _echo_run(s)
