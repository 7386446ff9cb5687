"""`specscope verify-curve`, `specscope breakeven`, `specscope tune`: the economics of speculation."""

from __future__ import annotations

import click

from specscope.cli.common import emit_json, setup_runtime, stderr_console
from specscope.errors import SpecscopeError

_DB = click.option("--db", default=None, help="Registry database (default: SPECSCOPE_DB or the XDG data dir).")


def _open(db):
    from specscope.registry import open_registry

    return open_registry(db)


# ------------------------------------------------------------------------------------------------ verify-curve

@click.command("verify-curve")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a Hugging Face checkpoint directory or a known name.")
@click.option("--context", "contexts", default="256,1024", show_default=True,
              help="Context lengths (cached tokens), comma-separated.")
@click.option("--tokens", default="1,2,4,8,16,32,64", show_default=True,
              help="Query tokens per forward (what a cycle verifies), comma-separated.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed forwards per point.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed forwards per point.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16", "auto"]), default="auto", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@click.option("--plot", "plot_path", default=None,
              help="PNG to write (default: verify-curve-<run id>.png in the current directory).")
@click.option("--no-plot", is_flag=True, help="Do not write a PNG.")
@click.option("--no-record", is_flag=True, help="Do not store the curve in the registry.")
@click.option("--name", default="", help="Run name in the registry.")
@_DB
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify_curve(model_name, contexts, tokens, warmup, repeats, dtype, device, threads, plot_path, no_plot,
                 no_record, name, db, as_json):
    """Measure the target's forward time for n query tokens at each context length, fit where it stops being
    flat (the knee), store the curve as a run and plot it."""
    from specscope.economics.verify_curve import knee_words, measure_curve, parse_int_list
    from specscope.models.hub import resolve_model
    from specscope.models.loader import load_model, parse_dtype

    ctxs = parse_int_list(contexts, "--context")
    toks = parse_int_list(tokens, "--tokens")
    dev = setup_runtime(threads, device)
    dt = parse_dtype(dtype, str(dev))
    path = resolve_model(model_name)
    model = load_model(path, dtype=dt, device=dev)
    err = stderr_console()
    total = len(ctxs) * len(toks)
    done = [0]

    def progress(row):
        done[0] += 1
        if not as_json:
            err.print(f"[{done[0]}/{total}] context {row['context']:>5}, n = {row['tokens']:>3}: "
                      f"{row['median_ms']:8.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})")

    res = measure_curve(model, ctxs, toks, warmup, repeats, progress)
    import torch

    config = {"model": str(path), "model_name": model_name, "dtype": str(dt).replace("torch.", ""),
              "device": str(dev), "threads": torch.get_num_threads(), "contexts": ctxs, "tokens": toks,
              "warmup": warmup, "repeats": repeats}
    results = {"points": res["points"], "fits": res["fits"],
               "decode_ms": {str(L): next(p["median_ms"] for p in res["points"] if p["context"] == L
                                          and p["tokens"] == min(toks)) for L in ctxs}}
    run_id = None
    if not no_record:
        from specscope.registry import make_record, store_record

        rec = make_record("verify_curve", name or f"verify curve {model_name}", config=config, results=results,
                          samples={"verify_ms": res["samples"]})
        run_id = store_record(rec, db)
    png = None
    if not no_plot:
        from specscope.economics.plots import plot_verify_curve

        png = plot_verify_curve(res, plot_path or f"verify-curve-{run_id or 'unrecorded'}.png",
                                title=f"verify cost: {model_name} {config['dtype']} {dev}")
    words = {L: knee_words(f, max(toks)) for L, f in res["fits"].items()}
    if as_json:
        emit_json({"run_id": run_id, "config": config, **results, "knee": words, "plot": png})
        return
    _print_curve_table(res, ctxs, toks)
    for L in ctxs:
        d1 = res["fits"][str(L)]
        click.echo(f"context {L}: {words[str(L)]} (fit error {d1['rel_rmse'] * 100:.0f}%)")
    base = {L: next(p["median_ms"] for p in res["points"] if p["context"] == L and p["tokens"] == min(toks))
            for L in ctxs}
    for L in ctxs:
        cheap = [p["tokens"] for p in res["points"] if p["context"] == L and p["median_ms"] <= 1.1 * base[L]]
        click.echo(f"context {L}: up to {max(cheap)} tokens verify within 10% of one decode step "
                   f"({base[L]:.2f} ms)")
    if run_id:
        click.echo(f"stored as run {run_id}")
    if png:
        click.echo(f"plot: {png}")


def _print_curve_table(res, ctxs, toks):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="target forward time, ms (median [p10–p90]) and × one-token decode")
    t.add_column("n tokens", justify="right")
    for L in ctxs:
        t.add_column(f"context {L}", justify="right")
    by = {(p["context"], p["tokens"]): p for p in res["points"]}
    for n in toks:
        cells = []
        for L in ctxs:
            p, p1 = by[(L, n)], by[(L, toks[0])]
            cells.append(f"{p['median_ms']:.2f} [{p['p10_ms']:.2f}–{p['p90_ms']:.2f}] "
                         f"{p['median_ms'] / p1['median_ms']:.2f}×")
        t.add_row(str(n), *cells)
    Console().print(t)


# ------------------------------------------------------------------------------------------------ breakeven

@click.command()
@click.option("--decode-ms", type=float, default=None, help="Plain decoding, ms per token.")
@click.option("--verify-ms", type=float, default=None, help="Target verify forward, ms per cycle.")
@click.option("--draft-ms", type=float, default=None, help="Drafting, ms per cycle (all steps).")
@click.option("--other-ms", type=float, default=None, help="Accept + commit + bookkeeping, ms per cycle (default 0).")
@click.option("--steps", type=int, default=None, help="Draft depth: a cycle yields at most steps + 1 tokens.")
@click.option("--measured-tok-s", type=float, default=None, help="Measured speculative tok/s (gives the speedup).")
@click.option("--measured-accept-length", type=float, default=None,
              help="Measured τ (accepted + 1 per cycle; gives the speedup).")
@click.option("--run", "run_ref", default=None, help="A stored speculative run (id, prefix or last).")
@click.option("--baseline-run", "baseline_ref", default=None, help="A stored baseline run for T_decode.")
@_DB
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def breakeven(decode_ms, verify_ms, draft_ms, other_ms, steps, measured_tok_s, measured_accept_length, run_ref,
              baseline_ref, db, as_json):
    """The τ (and i.i.d. acceptance α) a configuration needs to beat plain decoding, the most it can reach, and
    the speedup actually achieved — from numbers or from stored runs."""
    from specscope.economics.breakeven import BreakevenInputs, breakeven as compute, describe, inputs_from_runs

    for flag, v in (("--decode-ms", decode_ms), ("--verify-ms", verify_ms), ("--draft-ms", draft_ms)):
        if v is not None and not v > 0:
            raise SpecscopeError(f"{flag} must be a positive number of milliseconds, got {v}")
    if other_ms is not None and not other_ms >= 0:
        raise SpecscopeError(f"--other-ms must be >= 0, got {other_ms}")
    if steps is not None and steps < 1:
        raise SpecscopeError(f"--steps must be >= 1, got {steps}")
    if measured_tok_s is not None and not measured_tok_s > 0:
        raise SpecscopeError(f"--measured-tok-s must be positive, got {measured_tok_s}")
    given = BreakevenInputs(decode_ms, verify_ms, draft_ms, steps, other_ms, measured_tok_s, measured_accept_length)
    if baseline_ref and not run_ref:
        raise SpecscopeError("--baseline-run needs --run (the speculative run to analyse)")
    if run_ref:
        with _open(db) as reg:
            run = reg.get_run(run_ref, samples=False)
            base = reg.get_run(baseline_ref, samples=False) if baseline_ref else None
        if run.get("kind") in ("baseline",) and base is None:
            raise SpecscopeError(f"run {run['id']} is a baseline run; pass the speculative run as --run and this one "
                                 f"as --baseline-run")
        inp = inputs_from_runs(run, base, given)
    else:
        inp = given
    res = compute(inp)
    if as_json:
        emit_json(res)
        return
    for line in describe(res, inp):
        click.echo(line)
    if inp.sources:
        click.echo("from runs: " + ", ".join(f"{k.replace('_ms', '')} ← {v}" for k, v in inp.sources.items()))
