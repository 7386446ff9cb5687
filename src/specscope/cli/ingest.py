"""`specscope ingest`: SGLang / vLLM logs, Prometheus scrapes and specscope profile output -> registry runs."""

from __future__ import annotations

import click

from specscope.cli.common import alias_option, emit_json
from specscope.errors import SpecscopeError


def _fmt(v, spec=".2f"):
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    return format(v, spec)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, allow_dash=True))
@alias_option("--format", "engine", hidden=("--engine",),
              type=click.Choice(["auto", "sglang", "vllm", "specscope", "prometheus"]), default="auto",
              show_default=True, help="Format of the files; auto detects it line by line.")
@click.option("--tag", "tags", multiple=True, help="Tag the stored runs (repeatable).")
@click.option("--name", default=None, help="Run name (default: '<format> <file name>').")
@click.option("--no-record", is_flag=True, help="Parse and report only; do not store runs.")
@click.option("--db", default=None, help="Registry database (default: SPECSCOPE_DB or the XDG data dir).")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
def ingest(files, engine, tags, name, no_record, db, as_json):
    """Read engine logs / metric scrapes (streamed; bad lines are counted, not fatal); one run per file ('-' reads
    standard input, .gz files are decompressed on the fly)."""
    from specscope.ingest.core import ingest_file

    done, failed = [], []
    for f in files:
        try:
            done.append(ingest_file(f, engine=engine, tags=tags, name=name, record=not no_record, db=db))
        except SpecscopeError as e:
            failed.append(str(e))
            if not as_json and len(files) > 1:
                click.echo(f"error: {e}", err=True)
    if as_json:
        emit_json({"runs": done, "errors": failed})
    else:
        for s in done:
            r, i = s["results"], s["results"]["ingest"]
            rec = ", ".join(f"{k} {v}" for k, v in i["recognised"].items() if v)
            click.echo(f"{s['file']}: {s['format']} — {i['lines']} lines ({rec}; {i['malformed']} malformed, "
                       f"{i['other']} other)" + (f" -> run {s['run_id']}" if s["run_id"] else ""))
            parts = [f"τ {_fmt(r.get('accept_length'))}", f"tok/s {_fmt(r.get('tok_per_s'), '.1f')}"]
            if r.get("per_position_acceptance"):
                parts.append("per-position " + ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"]))
            if r.get("batch_size"):
                parts.append(f"batch mean {r['batch_size']['mean']:.1f} max {r['batch_size']['max']}")
            if "cuda_graph" in r:
                parts.append(f"cuda graph {r['cuda_graph']}")
            if r.get("phases"):
                parts.append("phases " + ", ".join(f"{k} {v['mean_ms']:.2f} ms" for k, v in r["phases"].items()))
            click.echo("  " + "; ".join(parts))
            for ex in i["malformed_examples"][:3]:
                click.echo(f"  malformed line {ex['line']}: {ex['reason']}", err=True)
            for w in i["warnings"]:
                click.echo(f"  note: {w}", err=True)
    if failed:
        if len(files) == 1:
            raise SpecscopeError(failed[0])
        raise SpecscopeError(f"{len(failed)} of {len(files)} files could not be ingested (see above)")
