"""`specscope compare A B [C ...]` and `specscope compare --by K1,K2 RUNS...`."""

from __future__ import annotations

import json

import click

from specscope.cli.checks import FiniteRange
from specscope.cli.common import db_option, emit_json, json_option
from specscope.errors import SpecscopeError


def _console():
    """Rich console; piped output gets a wide fixed width instead of wrapping tables at 80 columns."""
    from specscope.cli.common import stdout_console

    return stdout_console()


VERDICT_STYLE = {"better": "green", "worse": "red", "no significant change": "dim"}


@click.command()
@click.argument("run_ids", nargs=-1)
@click.option("--by", default=None, help="Matrix mode: lay runs out along one or two keys, e.g. NCCL_PROTO,steps.")
@click.option("--metric", default="tok_per_s", show_default=True,
              help="Matrix mode: the value per cell (a results field, e.g. accept_length).")
@click.option("--tag", default=None, help="Add every run with this tag to RUN_IDS.")
@click.option("--min-effect", type=FiniteRange(0, 1000), default=2.0, show_default=True,
              help="Smallest change (%, 0..1000) called a change, however significant.")
@json_option("Print the comparison as one JSON object.")
@db_option
def compare(run_ids, by, metric, tag, min_effect, as_json, db):
    """Compare runs: per-phase side by side with noise-aware verdicts, what differs, and the likely causes.

    The first run is the reference. Ids may be prefixes, `last` or `last~N`.
    """
    from specscope.registry import open_registry
    from specscope.registry.compare import compare_runs, matrix

    with open_registry(db, create=False) as reg:
        ids = [reg.resolve(i) for i in run_ids]
        if tag:
            ids += [r["id"] for r in reversed(reg.list_runs(tag=tag)) if r["id"] not in ids]
        runs = [reg.get_run(i) for i in ids]
    if by:
        keys = [k.strip() for k in by.split(",") if k.strip()]
        if not runs:
            raise SpecscopeError("compare --by needs runs: give ids or --tag")
        m = matrix(runs, keys, metric)
        emit_json(m) if as_json else _print_matrix(m)
        return
    if len(runs) < 2:
        raise SpecscopeError("compare needs at least two runs (ids, prefixes, last, last~1, or --tag)")
    result = compare_runs(runs, min_effect=min_effect / 100)
    if as_json:
        emit_json(result)
    else:
        _print(result)


def _v(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.2f}"
    return json.dumps(x) if isinstance(x, (list, dict)) else str(x)


def _print(res: dict) -> None:
    from rich.table import Table

    con = _console()
    ids = [r["id"] or f"#{i}" for i, r in enumerate(res["runs"])]
    from specscope.registry.labels import change_label, has_intervals, intervals_note

    t = Table(box=None, header_style="bold",
              caption=intervals_note(res) + (" The intervals cover noise within a run; drift between runs (load, "
                                             "heat) shows only across repeats (--by, matrix mode)"
                                             if has_intervals(res) else ""),
              caption_justify="left")
    t.add_column("metric")
    t.add_column(f"{ids[0]} (ref)", justify="right")
    for rid in ids[1:]:
        t.add_column(rid, justify="right")
        t.add_column("Δ", justify="right")
        t.add_column("verdict")
    from specscope.registry.compare import one_sided

    rows, only = one_sided(res["rows"])
    for row in rows:
        cells = [row["label"], _v(row["values"][0])]
        for i in range(1, len(ids)):
            delta = change_label(row["changes"][i], sep=",")
            verdict = row["verdicts"][i] or ""
            style = VERDICT_STYLE.get(verdict, "yellow")
            cells += [_v(row["values"][i]), delta, f"[{style}]{verdict}[/{style}]"]
        t.add_row(*cells)
    con.print(t)
    for rid, labels in only.items():     # one line per run, not a row of "only in ..." per metric
        con.print(f"only in {rid} (nothing to compare with): {', '.join(labels)}", highlight=False)
    for rid, w in (res.get("load_warnings") or {}).items():
        con.print(f"[bold yellow]warning:[/bold yellow] run {rid} was {w}")
    for title, diff in (("configuration differences", res["config_diff"]),
                        ("environment differences", res["env_diff"])):
        if not diff:
            con.print(f"[bold]{title}:[/bold] none")
            continue
        d = Table(title=title, box=None, title_justify="left", title_style="bold")
        d.add_column("key")
        for rid in ids:
            d.add_column(rid)
        for k, vals in diff.items():
            d.add_row(k, *[_v(v) for v in vals])
        con.print(d)
    for att in res["attribution"]:
        con.print(f"\n[bold]{att['run'] or 'run'} vs {att['against'] or 'reference'}:[/bold] {att['summary']}")
        if att.get("note"):
            con.print(f"  ({att['note']})")
        causes = att["likely_causes"][:6]
        if causes:
            con.print("  likely causes, most likely first:" if att.get("judgeable", True) else
                      "  settings that differ (what could explain a difference, if there is one):")
            for c in causes:
                con.print(f"   {c['score']:.2f}  {c['key']}: {_v(c['a'])} -> {_v(c['b'])}  ({c['why']})")


def _print_matrix(m: dict) -> None:
    from rich.table import Table

    t = Table(box=None, header_style="bold", title=f"{m['metric']} by {' × '.join(m['by'])}", title_justify="left")
    t.add_column(m["by"][0])
    for c in m["cols"]:
        t.add_column(f"{m['by'][1]}={c}" if len(m["by"]) > 1 else m["metric"], justify="right")
    for r, line in zip(m["rows"], m["cells"]):
        cells = []
        for cell in line:
            if cell["value"] is None:
                cells.append("-")
            else:
                sd = f" ±{cell['stdev']:.2f}" if cell["stdev"] is not None else ""
                cells.append(f"{cell['value']:.2f}{sd} (n={cell['n']})")
        t.add_row(r, *cells)
    _console().print(t)
