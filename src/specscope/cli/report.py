"""`specscope report RUN... [-o report.html]`: one self-contained HTML file for stored runs."""

from __future__ import annotations

import click

from specscope.cli.common import db_option, emit_json, json_option


@click.command()
@click.argument("run_ids", nargs=-1)
@click.option("-o", "--output", default="report.html", show_default=True, help="HTML file to write.")
@click.option("--title", default=None, help="Page title (default: the runs' labels).")
@db_option
@json_option("Print {path, runs, linked, bytes} as JSON.")
def report(run_ids, output, title, db, as_json):
    """Write an HTML report of stored runs: cycle time breakdown, τ histogram, per-position acceptance, the verify
    curve, the break-even chart, the compare table (several runs) and the environment fingerprint.

    Ids may be prefixes, `last` or `last~N`. A speculative run's baseline and verify-curve runs are pulled in
    for the break-even and verify-curve charts."""
    from specscope.fileio import check_writable, refuse_overlap
    from specscope.registry import open_registry
    from specscope.registry.db import registry_path
    from specscope.report import load_runs, write_report

    check_writable(output, "--output")
    refuse_overlap(output, {"--db": registry_path(db)})
    with open_registry(db, create=False) as reg:
        runs, linked = load_runs(reg, run_ids)
    path = write_report(runs, output, linked=linked, title=title)
    if as_json:
        emit_json({"path": str(path), "runs": [r["id"] for r in runs], "linked": sorted(linked),
                   "bytes": path.stat().st_size})
    else:
        click.echo(f"wrote {path} ({len(runs)} run(s){', ' + str(len(linked)) + ' linked' if linked else ''})")
