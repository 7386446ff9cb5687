"""`specscope bench-serve`: benchmark a live OpenAI-compatible endpoint (see specscope.benchserve)."""

from __future__ import annotations

import click

from specscope.cli.common import TEMPERATURE, emit_json
from specscope.errors import SpecscopeError


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 or c > 1024 for c in levels):
        raise SpecscopeError(f"--concurrency must be a comma-separated list of integers in 1..1024, got {text!r}")
    return levels


def _ms(d, key="p50"):
    return "-" if not d else f"{d[key] * 1e3:.1f}"


@click.command("bench-serve")
@click.option("--url", required=True, help="Server base URL, e.g. http://127.0.0.1:8000 (no /v1).")
@click.option("--model", default=None, help="Model id to request (default: the first of /v1/models).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True)
@click.option("--dataset", default="spec_bench", show_default=True,
              help="'spec_bench' (the shared Spec-Bench questions) or a .jsonl/.json/.txt file of prompts.")
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--concurrency", default="1,4,16", show_default=True, help="Concurrency levels, comma-separated.")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True)
@click.option("--api-key", envvar="SPECSCOPE_API_KEY", default=None, help="Bearer key (env SPECSCOPE_API_KEY).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Per-request timeout in seconds.")
@click.option("--name", default=None, help="Run name in the registry.")
@click.option("--tag", "tags", multiple=True, help="Tag the stored run (repeatable).")
@click.option("--no-record", is_flag=True, help="Do not store the run in the registry.")
@click.option("--db", default=None, help="Registry database (default: SPECSCOPE_DB or the XDG data dir).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_serve(url, model, endpoint, dataset, category, num_prompts, max_tokens, concurrency, temperature, api_key,
                timeout_s, name, tags, no_record, db, as_json):
    """Measure TTFT, inter-token latency, end-to-end latency and tok/s of a live endpoint per concurrency level."""
    import asyncio

    from specscope.prompts import load_prompts
    from specscope.benchserve.run import run_levels

    levels = parse_levels(concurrency)
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise SpecscopeError(f"--url must start with http:// or https://, got {url!r}")
    ds = load_prompts(dataset, tuple(category), num_prompts)
    prompts = [r["prompt"] for r in ds["prompts"]]
    total = len(prompts) * len(levels)
    done = {"n": 0}

    def progress(c, res):
        done["n"] += 1
        if not as_json:
            click.echo(f"\r[{done['n']}/{total}] concurrency {c}", nl=False, err=True)

    out = asyncio.run(run_levels(base, prompts, levels, endpoint, model, max_tokens, temperature, api_key,
                                 timeout_s, progress))
    if not as_json:
        click.echo("", err=True)
    results = {"levels": out["levels"]}
    first = out["levels"][0]
    results["tok_per_s"] = first["output_tok_per_s"]
    sm = first.get("server_metrics") or {}
    for key in ("accept_length", "per_position_acceptance", "draft_acceptance_rate"):
        if key in sm:
            results[key] = sm[key]
    results["errors"] = sum(lv["errors"] for lv in out["levels"])
    config = {"url": base, "model": out["model"], "endpoint": endpoint, "engine": sm.get("engine"),
              "prompt_set": ds["name"], "prompt_set_hash": ds["hash"], "categories": list(category),
              "num_prompts": len(prompts), "max_tokens": max_tokens, "concurrency": levels,
              "sampling": {"temperature": temperature}}
    run_id = None
    if not no_record:
        from specscope.registry import make_record, store_record

        rec = make_record("bench_serve", name or f"bench-serve {out['model']}", config=config, results=results,
                          samples={"per_request": out["per_request"]}, tags=tags)
        # the model is remote: its "hash" is whatever the server calls it, not a local file
        rec["config"].pop("model_hash", None)
        run_id = store_record(rec, db)
    if as_json:
        emit_json({"run_id": run_id, "config": config, "results": results})
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"bench-serve {base} ({out['model']}, {len(prompts)} prompts, max_tokens {max_tokens})")
    for col in ("conc", "ok/err", "out tok/s", "req/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "TPOT p50 ms",
                "e2e p50/p99 ms", "τ (server)"):
        t.add_column(col, justify="right")
    for lv in out["levels"]:
        m = lv.get("server_metrics") or {}
        tau = m.get("accept_length")
        t.add_row(str(lv["concurrency"]), f"{lv['completed']}/{lv['errors']}", f"{lv['output_tok_per_s']:.1f}",
                  f"{lv['request_per_s']:.2f}", f"{_ms(lv['ttft_s'])}/{_ms(lv['ttft_s'], 'p99')}",
                  f"{_ms(lv['itl_s'])}/{_ms(lv['itl_s'], 'p99')}", _ms(lv["tpot_s"]),
                  f"{_ms(lv['e2e_s'])}/{_ms(lv['e2e_s'], 'p99')}", "-" if tau is None else f"{tau:.2f}")
    Console().print(t)
    for lv in out["levels"]:
        for e in lv.get("error_examples", []):
            click.echo(f"concurrency {lv['concurrency']}: {e}", err=True)
    if run_id:
        click.echo(f"stored run {run_id}", err=True)
