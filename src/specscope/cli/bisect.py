"""`specscope bisect`: the first value of one ordered sweep axis (builds, an environment variable's values, a flag's
values) at which a metric changes beyond launch noise, in about log2(n) launches (specscope.sweep.bisect). It
takes the sweep's own options (the launch command, the axis, the workload, the timeouts): its cells are a sweep's
cells, stored and resumed the same way."""

from __future__ import annotations

import copy

import click

from specscope.cli.common import emit_json
from specscope.cli.sweep import sweep as _sweep
from specscope.errors import SpecscopeError

# the sweep's options that make no sense for a search over one axis (and --json, whose help says what bisect prints)
NOT_HERE = ("baseline_without", "baseline_run", "max_cells", "output", "as_json")
HELP = {"repeats": "Launches of each end (default 2, at least 2): their spread is the launch noise a change must "
                   "leave. Probes between the ends launch once.",
        "workdir": "The bisection's directory, a sweep workdir: its sweep file (run the command again to continue; "
                   "`sweep -w DIR` shows the same runs), each launch's engine log and steps.",
        "retry_failed": "Launch again the values whose engine failed before (else they stay skipped)."}


def _options() -> list[click.Parameter]:
    out = []
    for p in _sweep.params:
        if p.name in NOT_HERE:
            continue
        q = copy.copy(p)
        if p.name in HELP:
            q.help = HELP[p.name]
        if isinstance(q, click.Argument):       # the launch command comes last, after bisect's own options
            out += [click.Option(["--metric"], required=True, metavar="METRIC",
                                 help="What to follow: verify (ms/cycle), a verify component (verify.forward), "
                                      "draft, tau, tok/s, ms/cycle or ms/token."),
                    click.Option(["--json", "as_json"], is_flag=True,
                                 help="Print the answer (first bad, last good, probes, launches, compare's "
                                      "attribution) as JSON.")]
        out.append(q)
    return out


def _run(workdir, serve_cmd, command, metric, startup_timeout, workload_timeout, stop_timeout, retry_failed, name,
         no_progress, db, as_json, **opts):
    """Find the first value of one ordered axis where a metric changes beyond launch noise: both ends launched
    --repeats times (their spread is the noise), then the middle of what is left, once per probe, until the last
    good value and the first bad one are neighbours; compare's attribution between them. The axis's values go
    from the good end to the bad one.

    \b
      specscope bisect -w /tmp/bis --metric verify --env BUILD=0,1,2,3,4,5,6,7 -- engine --port {port}
    """
    from specscope.cli.sweep import _spec
    from specscope.registry import check_registry
    from specscope.sweep import SweepState
    from specscope.sweep.bisect import check_spec, metric_key
    from specscope.sweep.workload import build_workload

    metric_key(metric)
    for k in ("baseline_without", "baseline_run"):
        opts.setdefault(k, () if k == "baseline_without" else None)
    spec = _spec(serve_cmd, command, opts, db)
    if spec is not None:        # everything checked before the workdir is touched
        check_spec(spec)
        metric_key(metric, spec.resolved_phases())
    check_registry(db)
    workload = build_workload(spec.workload) if spec is not None else None
    with SweepState.open(workdir, spec, name) as state:
        check_spec(state.spec)
        key = metric_key(metric, state.spec.resolved_phases())
        res = _search(state, key, workload, db, (startup_timeout, workload_timeout, stop_timeout), retry_failed,
                      quiet=no_progress or as_json)
    if as_json:
        emit_json(res.to_dict())
    else:
        from specscope.sweep.bisect import text_lines

        for line in text_lines(res):
            click.echo(line)
    if res.status == "ends failed":
        raise _EndsFailed(f"the ends gave no runs to judge: {res.reason}")


class _EndsFailed(SpecscopeError):
    exit_code = 1       # the launches ran and failed; 2 is for bad input


def _search(state, key, workload, db, timeouts, retry_failed, quiet):
    from specscope.progress import Progress
    from specscope.sweep.bisect import Launches, bisect, probe_bound
    from specscope.sweep.cell import Context
    from specscope.sweep.run import interruptible
    from specscope.sweep.workload import build_workload

    spec = state.spec
    state.adopt(db)         # a run stored just before a kill, the sweep file not yet told: not launched twice
    ctx = Context(spec, workload or build_workload(spec.workload), state.path.parent, state.id, state.name, db,
                  *timeouts, on_start=state.engine_up)
    most = 2 * spec.repeats + probe_bound(len(spec.axes[0].values))
    bar = Progress(f"bisect {state.name}", most, "launch", enabled=not quiet, every_s=0.0)
    note = None if quiet else bar.note
    try:
        with interruptible():
            return bisect(state, key, Launches(state, ctx, retry_failed=retry_failed, note=note,
                                               advance=bar.advance), note)
    finally:
        bar.set_total(bar.done)      # the search ended where it ended: its last line says done
        bar.close()


bisect = click.Command("bisect", callback=_run, params=_options(), help=_run.__doc__,
                       short_help="The first value of an ordered axis where a metric changes beyond noise.")
