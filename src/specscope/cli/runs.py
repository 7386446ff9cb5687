"""`specscope runs list | show | export | tag | delete`: the run registry from the command line."""

from __future__ import annotations

import csv
import io
import json

import click

from specscope.cli.common import check_writable, emit_json, json_option, output_option, write_atomic


def _console():
    """Rich console; piped output gets a wide fixed width instead of wrapping tables at 80 columns."""
    from specscope.cli.common import stdout_console

    return stdout_console()


from specscope.cli.common import db_option  # noqa: E402


def _open(db):
    """The registry these commands read or edit: never created by them (an empty one would only hide a typo)."""
    from specscope.registry import open_registry

    return open_registry(db, create=False)


@click.group()
def runs():
    """Stored runs: every generate / benchmark run with its config, environment and results."""


def _fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


@runs.command("list")
@click.option("--kind", default=None, help="Only runs of this kind (generate, bench, ...).")
@click.option("--tag", default=None, help="Only runs with this tag.")
@click.option("--name", default=None, help="Only runs whose name contains this.")
@click.option("--model", default=None, help="Only runs whose model path contains this.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option("Print the runs as a JSON list.")
@db_option
def list_cmd(kind, tag, name, model, limit, as_json, db):
    """Newest runs first."""
    from specscope.registry.db import damage_fix, registry_path

    if registry_path(db).exists():
        with _open(db) as reg:
            rows = reg.list_runs(kind=kind, tag=tag, name=name, model=model, limit=limit)
    else:
        rows = []           # nothing stored yet: an empty list, and no empty registry file left behind
    for r in rows:          # listed and marked, so the good runs stay reachable and the bad one gets fixed
        if r.get("damaged"):
            click.echo(f"warning: run {r['id']} is damaged ({r['damaged']}); "
                       f"{damage_fix(r['id'], registry_path(db))}", err=True)
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no runs stored yet (they are recorded by `specscope generate` and the benchmarks)", err=True)
        return
    from rich.table import Table

    t = Table(box=None, header_style="bold")
    for col in ("id", "created (UTC)", "kind", "name", "model", "tok/s", "τ", "tags"):
        t.add_column(col, justify="right" if col in ("tok/s", "τ") else "left")
    for r in rows:
        model_name = str(r["model"] or "-").rstrip("/").rsplit("/", 1)[-1]
        name_cell = ("(damaged) " if r.get("damaged") else "") + str(r["name"] or "-")
        t.add_row(r["id"], str(r["created_at"])[:19].replace("T", " "), str(r["kind"]), name_cell, model_name,
                  _fmt(r["tok_per_s"]), _fmt(r["accept_length"]), ",".join(r["tags"]))
    _console().print(t)


@runs.command()
@click.argument("run_id")
@click.option("--samples", is_flag=True, help="Include per-cycle samples (JSON only).")
@json_option("Print the whole record as JSON.")
@db_option
def show(run_id, samples, as_json, db):
    """One run: configuration, results, per-phase profile and environment."""
    with _open(db) as reg:
        rec = reg.get_run(run_id, samples=samples)
    if as_json:
        emit_json(rec)
        return
    from rich.table import Table

    con = _console()
    con.print(f"[bold]{rec['id']}[/bold]  {rec['kind']}  {rec['name']}  {rec['created_at']}  "
              f"tags: {', '.join(rec['tags']) or '-'}")
    res = rec.get("results") or {}
    for title, d in (("config", rec.get("config") or {}),
                     ("results", {k: v for k, v in res.items() if not isinstance(v, (dict, list))})):
        t = Table(title=title, box=None, show_header=False, title_justify="left", title_style="bold")
        for k, v in d.items():
            t.add_row(k, json.dumps(v, default=str) if isinstance(v, (dict, list)) else _fmt(v, 4))
        con.print(t)
    phases = res.get("phases") or {}
    if phases:
        t = Table(title="phases (per cycle)", box=None, title_justify="left", title_style="bold")
        for col in ("phase", "mean ms", "median ms", "p90 ms", "share"):
            t.add_column(col, justify="left" if col == "phase" else "right")
        for p, v in phases.items():
            t.add_row(p, _fmt(v.get("mean_ms"), 3), _fmt(v.get("median_ms"), 3), _fmt(v.get("p90_ms"), 3),
                      f"{v.get('share', 0) * 100:.1f}%")
        con.print(t)
    if res.get("per_position_acceptance"):
        con.print("per-position acceptance: " + ", ".join(f"{x:.3f}" for x in res["per_position_acceptance"]))
    env = rec.get("env") or {}
    if env:
        from specscope.registry.fingerprint import flatten

        keys = ("host", "cpu.model", "cpu.cores_usable", "memory.total_mib", "os.kernel", "python.version",
                "packages.torch", "packages.transformers", "packages.specscope", "git.commit", "git.dirty",
                "torch.threads", "gpu.name", "gpu.driver_version", "gpu.sm_clock_max_mhz", "gpu.reason")
        flat = flatten(env)
        t = Table(title="environment", box=None, show_header=False, title_justify="left", title_style="bold")
        for k in keys:
            if flat.get(k) is not None:
                t.add_row(k, str(flat[k]))
        for k, v in (env.get("vars") or {}).items():
            t.add_row(k, str(v))
        con.print(t)


def _csv_rows(records: list[dict]) -> tuple[list[str], list[dict]]:
    from specscope.registry.fingerprint import flatten

    rows = []
    for r in records:
        row = {"id": r["id"], "created_at": r["created_at"], "kind": r["kind"], "name": r["name"],
               "tags": ";".join(r["tags"])}
        for sect in ("config", "results", "env"):
            for k, v in flatten(r.get(sect) or {}).items():
                if not isinstance(v, (list, dict)):       # arrays live in the JSON export
                    row[f"{sect}.{k}"] = v
        rows.append(row)
    cols = list(dict.fromkeys(k for row in rows for k in row))
    return cols, rows


@runs.command()
@click.argument("run_ids", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["json", "csv"]), default=None,
              help="json: full records with samples (default; also from an -o name ending .csv/.json); csv: one row "
                   "per run, scalar fields flattened to columns.")
@click.option("--json", "legacy_fmt", flag_value="json", hidden=True)   # old spellings of --format
@click.option("--csv", "legacy_fmt", flag_value="csv", hidden=True)
@output_option("Write to this file instead of standard output.")
@db_option
def export(run_ids, fmt, legacy_fmt, output, db):
    """Export runs as JSON or CSV."""
    fmt = fmt or legacy_fmt or ("csv" if output and str(output).lower().endswith(".csv") else "json")
    if output:
        from specscope.fileio import refuse_overlap
        from specscope.registry.db import registry_path

        check_writable(output, "--output")       # before reading a large registry, not after
        refuse_overlap(output, {"--db": registry_path(db)})
    with _open(db) as reg:
        recs = [reg.get_run(i) for i in run_ids]
    if fmt == "csv":
        cols, rows = _csv_rows(recs)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    else:
        from specscope.jsonio import dumps

        text = dumps(recs) + "\n"      # strict JSON: a NaN in a record is written as null
    if output:
        write_atomic(output, text)
        click.echo(f"wrote {len(recs)} run(s) to {output}", err=True)
    else:
        click.echo(text, nl=False)


@runs.command()
@click.argument("run_id")
@click.argument("tag")
@click.option("--remove", is_flag=True, help="Remove the tag instead.")
@json_option("Print {id, tags} as JSON.")
@db_option
def tag(run_id, tag, remove, as_json, db):
    """Add (or --remove) a tag on a run."""
    with _open(db) as reg:
        rid = reg.tag(run_id, tag, remove=remove)
        tags = reg.tags_of(rid)     # not get_run: a damaged run can still be tagged (e.g. "broken")
    if as_json:
        emit_json({"id": rid, "tags": tags})
    else:
        click.echo(f"{rid}: {', '.join(tags) or '(no tags)'}")


@runs.command()
@click.argument("run_ids", nargs=-1, required=True)
@json_option("Print the deleted ids as JSON.")
@db_option
def delete(run_ids, as_json, db):
    """Delete runs."""
    with _open(db) as reg:
        ids = [reg.resolve(i) for i in run_ids]      # all or nothing on a typo
        gone = [reg.delete_run(i) for i in ids]
    if as_json:
        emit_json({"deleted": gone})
    else:
        click.echo("deleted " + " ".join(gone))
