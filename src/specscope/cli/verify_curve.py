"""`specscope verify-curve`: the target's forward time by query tokens (and batch size), fitted, stored, plotted."""

from __future__ import annotations

import click

from specscope.cli.common import (check_writable, db_option, device_option, dtype_option, emit_json, json_option,
                                  output_option, setup_runtime, stdout_console)
from specscope.economics.verify_curve import DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_TOKENS, MAX_BATCH, MAX_REPEATS
from specscope.errors import SpecscopeError

_DB = db_option


@click.command("verify-curve")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a Hugging Face checkpoint directory, a Hugging Face id (org/name[@revision]) or a "
                   "known name.")
@click.option("--context", "contexts", default=",".join(map(str, DEFAULT_CONTEXTS)), show_default=True,
              help="Context lengths (cached tokens), comma-separated.")
@click.option("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), show_default=True,
              help="Query tokens per forward (what a cycle verifies), comma-separated.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help=f"Untimed forwards per point (0..{MAX_REPEATS}).")
@click.option("--repeats", type=int, default=5, show_default=True,
              help=f"Timed forwards per point (1..{MAX_REPEATS}).")
@click.option("--batch", "batches", default=None, metavar="B,B,...",
              help=f"Also measure the batch axis: one forward over B sequences each verifying n tokens, as the "
                   f"batched engine runs it, for each B (e.g. {','.join(map(str, DEFAULT_BATCHES))}; at most "
                   f"{MAX_BATCH}); stored beside the batch-1 curve, printed and plotted per batch size.")
@click.option("--batch-context", type=click.IntRange(min=1), default=None,
              help="Cached tokens per sequence for --batch (default: the first --context).")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="With --batch: tokens each sequence's KV region holds, as the engine's --max-seq-len (capped at "
                   "the model's context); wider regions widen every row's mask. Default: just the batch context.")
@dtype_option()
@device_option()
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@output_option("PNG to write (default: verify-curve-<run id>.png in the current directory; with --batch the "
               "batch plot goes beside it, <name>-batch.png).", hidden=("--plot",), dir_okay=False)
@click.option("--no-plot", is_flag=True, help="Do not write a PNG.")
@click.option("--no-record", is_flag=True, help="Do not store the curve in the registry.")
@click.option("--name", default="", help="Run name in the registry.")
@_DB
@json_option()
def verify_curve(model_name, contexts, tokens, warmup, repeats, batches, batch_context, max_seq_len, dtype, device,
                 threads, output, no_plot, no_record, name, db, as_json):
    """Measure the target's forward time for n query tokens at each context length, fit where it stops being
    flat (the knee), store the curve as a run and plot it; with --batch, also T(B, n) over B sequences at once."""
    from specscope.economics.curve_session import curve_record, curve_words, loaded_words, measure_with_progress
    from specscope.models.loader import load_model, parse_dtype
    from specscope.registry import machine_config
    from specscope.registry.fingerprint import timing_warning

    # before the model loads and minutes of measuring, not after: the plot path, the registry, the plan
    _check_outputs(output, no_plot, no_record, db, model_name)
    plan = _plan(contexts, tokens, warmup, repeats, batches, batch_context, max_seq_len)
    path = _checked_model(model_name, plan)
    dev = setup_runtime(threads, device)
    dt = parse_dtype(dtype, str(dev))
    model = load_model(path, dtype=dt, device=dev)
    res, surface = measure_with_progress(model, plan, as_json)
    config, results, samples = curve_record(plan, res, surface,
                                            {**machine_config(path, dt, dev), "model_name": model_name})
    run_id = rec = None
    if not no_record:
        from specscope.registry import make_record, store_record

        rec = make_record("verify_curve", name or f"verify curve {model_name}", config=config, results=results,
                          samples=samples)
        run_id = store_record(rec, db)
    png, bpng = (None, None) if no_plot else _plots(res, surface, output, run_id, model_name, config["dtype"], dev,
                                                     plan.batch_context)
    words, cheap = curve_words(res, plan.tokens)
    loaded = loaded_words({"results": results})
    warning = (f"warning: measured while {loaded}: stored marked as loaded, and tune and breakeven refuse it as a "
               f"basis for pricing; measure again on a quieter machine") if loaded else \
        timing_warning(rec["env"] if rec else None)
    if as_json:
        emit_json({"run_id": run_id, "config": config, **results, "knee": words, "within_10pct": cheap,
                   "plot": png, **({"batch_plot": bpng} if surface is not None else {}), "load_warning": warning})
        return
    _print_curve_table(res, plan.contexts, plan.tokens)
    _print_conclusions(res, plan.contexts, words, cheap)
    if surface is not None:
        _print_surface(surface)
    if run_id:
        click.echo(f"stored as run {run_id}")
    for p in (png, bpng):
        if p:
            click.echo(f"plot: {p}")
    if warning:
        click.echo(warning, err=True)


def _check_outputs(output, no_plot, no_record, db, model_name):
    """The plot path and the registry, before anything is measured."""
    if output and not no_plot:
        from specscope.economics.plots import plot_format
        from specscope.fileio import refuse_overlap
        from specscope.registry.db import registry_path

        check_writable(output, "--output")
        refuse_overlap(output, {"--model": model_name, "--db": registry_path(db)})
        plot_format(output)
    if not no_record:
        from specscope.registry import check_registry

        check_registry(db)


def _plan(contexts, tokens, warmup, repeats, batches, batch_context, max_seq_len):
    """The flags' CurvePlan (--batch-context defaults to the first --context)."""
    from specscope.economics.curve_session import CurvePlan
    from specscope.economics.verify_curve import parse_int_list

    ctxs = parse_int_list(contexts, "--context")
    toks = parse_int_list(tokens, "--tokens")
    bs = parse_int_list(batches, "--batch") if batches is not None else None
    if bs is None and (batch_context is not None or max_seq_len is not None):
        raise SpecscopeError("--batch-context and --max-seq-len shape the batch axis; pass --batch too "
                             "(e.g. --batch 1,2,4,8,16)")
    return CurvePlan(ctxs, toks, warmup, repeats, bs, batch_context or ctxs[0], max_seq_len)


def _checked_model(model_name, plan):
    """The model's directory, its plan checked against its context: config.json and the weight files' presence,
    no weights read."""
    from specscope.models.hub import resolve_model
    from specscope.models.loader import load_config, weight_files

    path = resolve_model(model_name)
    mcfg, _ = load_config(path)
    weight_files(path)
    plan.check(mcfg.max_position_embeddings)
    return path


def _print_conclusions(res, ctxs, words, cheap):
    for L in ctxs:
        click.echo(f"context {L}: {words[str(L)]} (fit error {res['fits'][str(L)]['rel_rmse'] * 100:.0f}%)")
    for L in ctxs:
        if cheap[str(L)]:     # none when too noisy: the line above says so, no number read off noise follows
            click.echo(f"context {L}: {cheap[str(L)]}")


def _plots(res, surface, output, run_id, model_name, dtype, dev, bctx):
    """The curve's PNG (and the batch plot beside it with --batch) -> (path, batch path or None)."""
    from pathlib import Path

    from specscope.economics.plots import plot_verify_curve, plot_verify_surface

    target = output or f"verify-curve-{run_id or 'unrecorded'}.png"
    png = plot_verify_curve(res, target, title=f"verify cost: {model_name} {dtype} {dev}")
    bpng = None
    if surface is not None:
        t = Path(target)
        bpng = plot_verify_surface(surface, t.with_name(f"{t.stem}-batch{t.suffix or '.png'}"),
                                   title=f"verify cost by batch size: {model_name} {dtype} {dev}, context {bctx}")
    return png, bpng


def _print_surface(surface):
    """T(B, n) as a table (× the plain step at the same batch size), then per batch size what a plain step costs
    per sequence-token and how many tokens per sequence verify for about its price."""
    from rich.markup import escape
    from rich.table import Table

    bs, toks = surface["batches"], surface["tokens"]
    by = {(p["batch"], p["tokens"]): p for p in surface["points"]}
    t = Table(title=escape(f"one forward over B sequences × n tokens each at context {surface['context']}, ms: "
                           f"median and × the plain step T(B, {toks[0]})"))
    t.add_column("n per seq", justify="right")
    for B in bs:
        t.add_column(f"batch {B}", justify="right")
    for n in toks:
        cells = []
        for B in bs:
            ms = by[(B, n)]["median_ms"]
            cells.append(escape(f"{ms:.2f} {ms / by[(B, toks[0])]['median_ms']:.2f}×"))
        t.add_row(str(n), *cells)
    stdout_console().print(t)
    from specscope.economics.verify_curve import cheap_words, noise_words

    for B in bs:
        base = by[(B, toks[0])]["median_ms"]
        pts = [by[(B, n)] for n in toks]
        fit = ((surface.get("fits") or {}).get(str(B)) or {}).get(str(surface["context"]))
        words = noise_words(pts, fit) or cheap_words(pts, fit, per=" per sequence", ref="a plain step")
        click.echo(f"batch {B}: a plain step {base:.2f} ms = {base / B:.2f} ms per sequence-token"
                   + (f"; {words}" if words else ""))


def _print_curve_table(res, ctxs, toks):
    from rich.table import Table

    from rich.markup import escape

    t = Table(title=escape("target forward time, ms: median [p10–p90], and × the one-token time"))
    t.add_column("n tokens", justify="right")
    for L in ctxs:
        t.add_column(f"context {L}", justify="right")
    by = {(p["context"], p["tokens"]): p for p in res["points"]}
    for n in toks:
        cells = []
        for L in ctxs:
            p, p1 = by[(L, n)], by[(L, toks[0])]
            cells.append(escape(f"{p['median_ms']:.2f} [{p['p10_ms']:.2f}–{p['p90_ms']:.2f}] "
                                f"{p['median_ms'] / p1['median_ms']:.2f}×"))
        t.add_row(str(n), *cells)
    stdout_console().print(t)
