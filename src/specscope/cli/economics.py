"""`specscope breakeven`, `specscope tune` (and `verify-curve`, from cli/verify_curve.py): the economics of speculation."""

from __future__ import annotations

import dataclasses
import math

import click

from specscope.cli.common import (FiniteFloat, alias_option, check_writable, db_option, device_option, draft_option,
                                  dtype_option, emit_json, json_option, output_option, setup_runtime, spec_options,
                                  stderr_console, stdout_console)
# verify-curve lives in its own module; named here too, where the command table and older imports look for it
from specscope.cli.verify_curve import verify_curve  # noqa: F401
# read_prompts lives with the tuner's session; bench/tune.py imports it from here too
from specscope.economics.tune_session import read_prompts
from specscope.economics.verify_curve import DEFAULT_BATCHES, MAX_BATCH
from specscope.errors import SpecscopeError

_DB = db_option


def _open(db):
    """The registry to read stored runs from: never created by reading it."""
    from specscope.registry import open_registry

    return open_registry(db, create=False)


# ------------------------------------------------------------------------------------------------ breakeven

MAX_BREAKEVEN_STEPS = 10**9   # closed-form arithmetic: a billion steps cost what two do


@click.command()
@click.option("--decode-ms", type=float, default=None, help="Plain decoding, ms per token.")
@click.option("--verify-ms", type=float, default=None, help="Target verify forward, ms per cycle.")
@click.option("--draft-ms", type=float, default=None, help="Drafting, ms per cycle (all steps).")
@click.option("--other-ms", type=float, default=None, help="Accept + commit + bookkeeping, ms per cycle (default 0).")
@click.option("--steps", "--speculative-num-steps", "steps", type=int, default=None,
              help="Draft depth: a cycle yields at most steps + 1 tokens.")
@click.option("--measured-tok-s", type=float, default=None, help="Measured speculative tok/s (gives the speedup).")
@click.option("--measured-accept-length", type=float, default=None,
              help="Measured τ (accepted + 1 per cycle; gives the speedup).")
@click.option("--run", "run_ref", default=None, help="A stored speculative run (id, prefix or last).")
@click.option("--baseline-run", "baseline_ref", default=None, help="A stored baseline run for T_decode.")
@click.option("--batch", type=int, default=1, show_default=True,
              help="Sequences decoded together. --decode-ms, --verify-ms and --draft-ms are then one step's forwards "
                   "over all of them (the engine drafts them together), --other-ms per sequence; a run's times "
                   "(batch 1) are scaled by --verify-curve.")
@click.option("--verify-curve", "curve_ref", default=None,
              help="A verify_curve run (with --batch: one measured with `verify-curve --batch`) for the decode and "
                   "verify times not given; or a run of an engine's own steps (a sweep's engine surface): every "
                   "time from it at --batch, no --run needed.")
@click.option("--verify-tokens", type=float, default=None,
              help="Tokens one sequence verifies per cycle, to read --verify-curve at (default: the run's mean, "
                   "else steps + 1).")
@_DB
@json_option()
def breakeven(decode_ms, verify_ms, draft_ms, other_ms, steps, measured_tok_s, measured_accept_length, run_ref,
              baseline_ref, batch, curve_ref, verify_tokens, db, as_json):
    """The τ (and i.i.d. acceptance α) a configuration needs to beat plain decoding, the most it can reach, and
    the speedup actually achieved — from numbers or from stored runs; --batch B: the τ needed at B sequences."""
    from specscope.economics.breakeven import (BreakevenInputs, at_batch, breakeven as compute, describe,
                                               inputs_from_runs, prices_for)
    from specscope.economics.verify_curve import MAX_BATCH

    real = math.isfinite   # nan and inf pass every comparison below the wrong way
    for flag, v in (("--decode-ms", decode_ms), ("--verify-ms", verify_ms), ("--draft-ms", draft_ms)):
        if v is not None and not (v > 0 and real(v)):
            raise SpecscopeError(f"{flag} must be a positive number of milliseconds, got {v}")
    if other_ms is not None and not (other_ms >= 0 and real(other_ms)):
        raise SpecscopeError(f"--other-ms must be >= 0 and finite, got {other_ms}")
    if steps is not None and not 1 <= steps <= MAX_BREAKEVEN_STEPS:
        raise SpecscopeError(f"--steps must be >= 1 and at most {MAX_BREAKEVEN_STEPS}, got {steps}")
    if measured_tok_s is not None and not (measured_tok_s > 0 and real(measured_tok_s)):
        raise SpecscopeError(f"--measured-tok-s must be positive and finite, got {measured_tok_s}")
    if not 1 <= batch <= MAX_BATCH:
        raise SpecscopeError(f"--batch must be >= 1 and at most {MAX_BATCH}, got {batch}")
    if verify_tokens is not None and not (verify_tokens >= 1 and real(verify_tokens)):
        raise SpecscopeError(f"--verify-tokens must be >= 1 (the root at least) and finite, got {verify_tokens}")
    given = BreakevenInputs(decode_ms, verify_ms, draft_ms, steps, other_ms, measured_tok_s, measured_accept_length,
                            batch=batch, verify_tokens=verify_tokens)
    if baseline_ref and not run_ref:
        raise SpecscopeError("--baseline-run needs --run (the speculative run to analyse)")
    run, base, curve_run = _breakeven_runs(run_ref, baseline_ref, curve_ref, db)
    surface, engine, no_engine = prices_for(run, base, curve_run)
    sole = engine is not None and engine.sole          # an engine surface as --verify-curve prices everything
    if sole and run is None and steps is None and verify_tokens is None:
        return _breakeven_by_width(given, engine, as_json)
    inp = inputs_from_runs(run, base, given, surface, engine) if run is not None else given
    if sole:
        inp.notes.extend(engine.notes())
    res = compute(at_batch(inp, surface, engine, no_engine))
    if as_json:
        emit_json({**res, "engine_surface": engine.summary()} if sole else res)
        return
    for line in describe(res, inp):
        click.echo(line)
    if inp.sources:
        click.echo("from runs: " + ", ".join(f"{k.replace('_ms', '')} ← {v}" for k, v in inp.sources.items()))


def _breakeven_by_width(given, engine, as_json) -> None:
    """No draft depth asked and no run: the τ needed at each chain width the engine surface measured."""
    from specscope.economics.breakeven import at_batch, breakeven as compute

    rows = []
    for n in (n for n in engine.tokens if n > 1):
        inp = dataclasses.replace(given, verify_tokens=float(n), sources={}, notes=[])
        rows.append({"verify_tokens": n, "steps": n - 1, **compute(at_batch(inp, None, engine))})
    if as_json:
        emit_json({"batch": given.batch, "by_tokens": rows, "engine_surface": engine.summary()})
        return
    click.echo(f"at batch {given.batch}, τ needed per chain width (pass --steps or --verify-tokens for one):")
    for r in rows:
        a = f"α {r['break_even_alpha']:.3f}" if r["break_even_alpha"] is not None else "out of reach"
        click.echo(f"  n = {r['verify_tokens']} ({r['steps']} draft token(s)): τ needed "
                   f"{r['break_even_accept_length']:.2f} of at most {r['max_accept_length']:.0f} ({a}); cycle "
                   f"{r['cycle_ms']:.2f} ms")
    for note in engine.notes():
        click.echo(f"note: {note}")


def _breakeven_runs(run_ref, baseline_ref, curve_ref, db) -> tuple:
    """The stored runs breakeven reads -> (run, its baseline, the --verify-curve run), each None when not asked."""
    if not (run_ref or curve_ref):
        return None, None, None
    with _open(db) as reg:
        curve_run = reg.get_run(curve_ref, samples=False) if curve_ref else None
        run = reg.get_run(run_ref, samples=False) if run_ref else None
        # a run may name the baseline it was measured against
        bref = baseline_ref or ((run or {}).get("config") or {}).get("baseline_run")
        base = reg.get_run(bref, samples=False) if run and bref else None
    if run is None:
        return None, None, curve_run
    if run.get("kind") == "baseline" and base is None:
        raise SpecscopeError(f"run {run['id']} is a baseline run; pass the speculative run as --run and this one "
                             f"as --baseline-run")
    if run.get("kind") == "engine_surface":
        from specscope.economics.engine_steps import surface_as_run

        raise SpecscopeError(surface_as_run(run))
    return run, base, curve_run


# ------------------------------------------------------------------------------------------------ tune

@click.command()
@click.option("--run", "run_ref", default=None, help="A profiled speculative run to tune from (id, prefix or last).")
@click.option("--baseline-run", "baseline_ref", default=None,
              help="Baseline run for T_decode (default: the one recorded with the run).")
@click.option("--verify-curve", "curve_ref", default=None,
              help="A verify_curve run to scale verify cost by n; or a run of an engine's own steps (a sweep's "
                   "engine surface): every cost by batch size from it, acceptance still from --run.")
@click.option("--decode-ms", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Plain decoding ms/token (instead of a baseline run).")
@click.option("--profile", "do_profile", is_flag=True,
              help="First make the profiled run (baseline + speculative with rank-wise acceptance) and store it.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="Target (with --profile).")
@draft_option("Drafter (with --profile; default: the run's).")
@spec_options("Profiled depth.", steps_default=5, topk_default=4, draft_tokens_default=24,
              draft_tokens_help="Profiled tokens per verify (a wide tree measures more ranks).")
@alias_option("--dataset", "prompts_file", hidden=("--prompts",), default=None,
              help="Prompts to profile/validate on: 'mt_bench' (packaged MT-bench first turns, the default), "
                   "'spec_bench', or a .jsonl/.json/.txt file. With --run: the run's own prompts.")
@click.option("--num-prompts", type=click.IntRange(1, 10_000), default=3, show_default=True,
              help="Prompts of --dataset to profile / validate on.")
@click.option("--max-new-tokens", type=click.IntRange(2, 1 << 20), default=64, show_default=True,
              help="Most tokens per prompt (with --run: the run's own).")
@click.option("--max-steps", type=click.IntRange(1, 64), default=None,
              help="Deepest configuration to consider (beyond the measured depth the last rate is extrapolated).")
@click.option("--max-topk", type=click.IntRange(1, 64), default=None)
@click.option("--max-draft-tokens", type=click.IntRange(2, 1024), default=64, show_default=True)
@click.option("--top", type=click.IntRange(1, 10_000), default=10, show_default=True, help="Predictions to show.")
@click.option("--stat", type=click.Choice(["mean", "median"]), default="mean", show_default=True,
              help="Per-cycle phase statistic the costs come from (median ignores scheduler stalls).")
@click.option("--validate", "n_validate", type=click.IntRange(0, 1000), default=0,
              help="Measure the top N predictions with the real engine.")
@alias_option("--max-concurrency", "concurrency", hidden=("--concurrency",),
              default=",".join(map(str, DEFAULT_BATCHES)), show_default=True, metavar="B,B,...",
              help="Concurrent sequences to predict the best shape for, and the crossover past which plain decoding "
                   "is faster; levels above 1 need a verify surface (--verify-curve from `verify-curve --batch`; "
                   "--profile and --validate measure one, minutes on a CPU; 1 alone skips it).")
@click.option("--save-policy", is_flag=False, flag_value="auto", default=None, metavar="[PATH]",
              help="Write the per-concurrency table as JSON for `serve --spec-policy`: to PATH, or, given alone, "
                   "where `--spec-policy auto` looks it up: $SPECSCOPE_CACHE/spec-policy/ (default "
                   "~/.cache/specscope/spec-policy/), keyed by the model, the drafter and the dtype.")
@dtype_option()
@device_option()
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@output_option("Directory for tau-needed.png (and predicted-vs-measured.png, spec-by-concurrency.png).",
               hidden=("--plot-dir",), file_okay=False)
@_DB
@json_option()
def tune(run_ref, baseline_ref, curve_ref, decode_ms, do_profile, model_name, draft, steps, topk, draft_tokens,
         ngram_tokens, prompts_file, num_prompts, max_new_tokens, max_steps, max_topk, max_draft_tokens, top, stat,
         n_validate, concurrency, save_policy, dtype, device, threads, output, db, as_json):
    """Predict the best (steps, topk, draft_tokens) from one profiled run, without a sweep; --validate N measures
    the top N predictions and reports predicted vs measured speedup. Per concurrency level: the best shape and the
    crossover concurrency, saved for `serve --spec-policy` with --save-policy."""
    from specscope.economics.tune_session import TuneContext, TuneRequest, run_tune
    from specscope.economics.verify_curve import parse_int_list
    from specscope.speculative.decode import DraftOptions

    if not do_profile and not run_ref:
        raise SpecscopeError("pass --run ID (a profiled speculative run) or --profile to make one")
    # what flags and files decide, decided before a model loads (and before minutes of measuring)
    req = TuneRequest(run_ref=run_ref, baseline_ref=baseline_ref, curve_ref=curve_ref, decode_ms=decode_ms,
                      profile=do_profile, max_steps=max_steps, max_topk=max_topk, max_draft_tokens=max_draft_tokens,
                      top=top, stat=stat,
                      n_validate=n_validate, levels=parse_int_list(concurrency, "--max-concurrency"),
                      concurrency=concurrency, save_policy=save_policy, output=output, db=db,
                      drafting=DraftOptions(draft, steps, topk, draft_tokens, ngram_tokens, budget="fixed"))
    _check_request(req)
    _refuse_overwrite(output, save_policy, {"--model": model_name, "--draft": draft, "--dataset": prompts_file}, db)
    ctx = TuneContext(model_name, draft, dtype, device, threads, prompts_file, num_prompts, max_new_tokens, as_json,
                      loader=_load_workload)
    say = (lambda m: None) if as_json else stderr_console().print
    res = run_tune(req, ctx, say)
    out = res.out
    if as_json:
        emit_json(out)
        return
    _print_tune(out, res.rows[:top], res.acc, res.cost, out.get("validation"))
    if req.batched:
        _print_concurrency(out, res.prices.surface, res.prices.engine)
    if out.get("engine_config"):
        _print_engine_form(out["engine_config"])
    for p in out.get("plots", []):
        click.echo(f"plot: {p}")
    if out.get("policy"):
        click.echo(f"policy table: {out['policy']} (serve --spec-policy "
                   + ("auto" if save_policy == "auto" else out["policy"]) + ")")
    if out.get("load_warning"):
        click.echo(out["load_warning"], err=True)


def _refuse_overwrite(output, save_policy, inputs: dict, db) -> None:
    """Neither the plots' directory nor the policy file is, holds or lies inside a file tune reads."""
    from specscope.fileio import refuse_overlap
    from specscope.registry.db import registry_path

    inputs = {**inputs, "--db": registry_path(db)}
    refuse_overlap(output, inputs)
    refuse_overlap(None if save_policy == "auto" else save_policy, inputs, "--save-policy", "--save-policy")


def _check_request(req):
    """The flags' and files' verdicts on a tune, before a model loads (and before minutes of measuring)."""
    if max(req.levels) > MAX_BATCH:
        raise SpecscopeError(f"--max-concurrency values must be <= {MAX_BATCH}, got {max(req.levels)}")
    if req.save_policy is not None and req.save_policy != "auto":
        check_writable(req.save_policy, "--save-policy")
    if req.save_policy is not None and req.batched and not (req.curve_ref or req.measures):
        raise SpecscopeError("--save-policy needs predictions above batch 1: pass --verify-curve SURFACE (from "
                             "`specscope verify-curve --batch 1,2,4,8,16`), or --profile to measure one")
    if req.output:
        check_writable(req.output, "--output", is_dir=True)
    if req.profile:
        from specscope.speculative.decode import SpecConfig, check_chain

        shape = req.drafting
        if not shape.draft:
            raise SpecscopeError("--profile needs --draft (e.g. smollm2-135m-eagle3 or ngram)")
        # every n-gram spelling, before the model loads
        check_chain(shape.parsed, shape.topk, hint=f" --draft-tokens {shape.steps + 1} to profile it (got --topk "
                                                   f"{shape.topk}; tune profiles a --topk 4 tree by default)")
        # the profiled shape is one the drafter can propose
        SpecConfig.from_knobs(shape.steps, shape.topk, shape.draft_tokens)
    if req.measures:        # these store runs (the profiled pair, a verify curve)
        from specscope.registry import check_registry

        check_registry(req.db)


def _load_workload(ctx):
    """Tune's target, drafter and prompts, loaded as a run loads them (the session layer's loading, and the
    runtime's threads and device), once the tune first measures."""
    from specscope.economics.probe import encode_prompts
    from specscope.economics.tune_session import Workload
    from specscope.session import decode_spec, stop_ids_for
    from specscope.speculative.decode import DraftOptions

    # the target's and the drafter's files, and the token budget against the context: before loading. The tuner
    # searches shapes itself and measures every cycle in full: a fixed budget, whatever the drafter declares
    spec = decode_spec(ctx.model_name, DraftOptions(ctx.draft, budget="fixed"), dtype=ctx.dtype,
                       max_new_tokens=ctx.max_new_tokens)
    prompts = ctx.prompts = ctx.prompts or read_prompts(ctx.prompts_file, ctx.num_prompts)
    dev = setup_runtime(ctx.threads, ctx.device)
    spec = dataclasses.replace(spec, device=str(dev))
    target, tok, path = spec.load()
    drafter = spec.drafter(target)
    return Workload(target, drafter, encode_prompts(tok, prompts), stop_ids_for(target, tok), path)


def _print_concurrency(out, surface, engine=None):
    from rich.table import Table

    conc, cross = out["concurrency"], out["crossover"]
    if len(conc) > 1:
        hybrid = any("ngram_tokens" in r for r in conc)
        t = Table(title="best shape by concurrency (predicted; per-sequence-token times)")
        for c in ("concurrency", "steps", "topk", "draft tok") + (("ngram tok",) if hybrid else ()) + \
                ("τ pred", "τ needed", "plain ms/tok", "spec ms/tok", "speedup"):
            t.add_column(c, justify="right")
        for r in conc:
            t.add_row(str(r["batch"]), str(r["steps"]), str(r["topk"]), str(r["draft_tokens"]),
                      *((str(r["ngram_tokens"]),) if hybrid else ()), f"{r['tau']:.2f}", f"{r['tau_needed']:.2f}",
                      f"{r['plain_ms_per_token']:.2f}", f"{r['spec_ms_per_token']:.2f}", f"{r['speedup']:.2f}x")
        stdout_console().print(t)
    if out["concurrency_not_predicted"]:
        left = ", ".join(map(str, out["concurrency_not_predicted"]))
        if engine is not None:
            click.echo(engine.uncovered(out["concurrency_not_predicted"], "concurrency"))
        elif (out.get("engine_surface") or {}).get("unavailable"):
            click.echo(f"concurrency {left} not predicted: {out['engine_surface']['unavailable']}")
        elif surface is None or surface.batches == [1]:
            click.echo(f"concurrency {left} not predicted: no verify surface; measure one with `specscope "
                       f"verify-curve --batch 1,2,4,8,16` and pass it as --verify-curve")
        else:
            click.echo(f"concurrency {left} not predicted: the verify surface covers batch sizes "
                       f"{', '.join(map(str, surface.batches))}")
    if len(conc) <= 1:
        return
    top = conc[-1]["batch"]
    if cross is None:
        click.echo(f"crossover: none up to concurrency {top}: speculation is predicted to pay at every level")
    elif conc[0]["speedup"] <= 1.0:
        click.echo("crossover: plain decoding is predicted faster at every concurrency level")
    else:
        click.echo(f"crossover: past ~{cross:.1f} concurrent sequences plain decoding is predicted faster; "
                   f"speculate below it")


def _print_engine_form(form: dict) -> None:
    """The best draft tokens per level in the engine's own form, on one line to paste into its launch."""
    if form["speculative_config"] is None:
        click.echo(f"vLLM: {form['verdict']}")
        return
    click.echo("vLLM, draft tokens per batch size (each level's best k, 0 where plain decoding is predicted "
               f"faster; {form['rule']}):")
    click.echo(form["flag"])


def _print_tune(out, rows, acc, cost, validation):
    from rich.table import Table

    con = stdout_console()
    click.echo(f"acceptance: {acc.source}; depth-1 rates by rank: "
               + ", ".join(f"{x:.2f}" for x in acc.rates[0]))
    click.echo(f"plain decoding {out['decode_ms']:.2f} ms/token; measured at k={cost.k0}, n={cost.n0:.1f}: "
               f"draft step0 {cost.step0_ms:.2f} ms, expansion {cost.expand_ms:.2f} ms/step, "
               f"verify {cost.verify_ms:.2f} ms, other {cost.other_ms:.2f} ms")
    for n in cost.notes:
        click.echo(f"note: {n}")
    hybrid = any("ngram_tokens" in r for r in rows)
    if hybrid:
        click.echo(f"hybrid: the drafter sat out {rows[0]['copy_share'] * 100:.0f}% of cycles (long copies); copied "
                   f"tokens are free to draft and cost only verify width")
    t = Table(title="predicted configurations (best first)")
    cols = ("steps", "topk", "draft tok") + (("ngram tok",) if hybrid else ()) + \
        ("τ pred", "τ needed", "draft ms", "verify ms", "cycle ms", "speedup")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["steps"]), str(r["topk"]), str(r["draft_tokens"]),
                  *((str(r["ngram_tokens"]),) if hybrid else ()), f"{r['tau']:.2f}",
                  f"{r['tau_needed']:.2f}", f"{r['draft_ms']:.2f}", f"{r['verify_ms']:.2f}", f"{r['cycle_ms']:.2f}",
                  f"{r['speedup']:.2f}x" + ("*" if r["extrapolated"] else ""))
    con.print(t)
    if any(r["extrapolated"] for r in rows):
        click.echo("* deeper than the profiled run: acceptance past it repeats the deepest measured rate")
    best = rows[0]
    verdict = "beats" if best["speedup"] > 1 else "does not beat"
    click.echo(f"best: --steps {best['steps']} --topk {best['topk']} --draft-tokens {best['draft_tokens']} "
               + (f"--ngram-tokens {best['ngram_tokens']} " if hybrid else "")
               + f"(predicted {best['speedup']:.2f}x; it {verdict} plain decoding)")
    if validation:
        v = Table(title="predicted vs measured speedup")
        for c in ("config", "predicted", "measured", "error", "τ pred", "τ measured"):
            v.add_column(c, justify="right")
        for r in validation:
            v.add_row(r["label"], f"{r['predicted']:.2f}x", f"{r['measured']:.2f}x",
                      f"{(r['predicted'] - r['measured']) / r['measured'] * 100:+.1f}%", f"{r['predicted_tau']:.2f}",
                      f"{r['measured_tau']:.2f}")
        con.print(v)
        e = out["validation_error"]
        click.echo(f"median |predicted − measured| / measured: {e['median_rel_error'] * 100:.1f}% over {e['n']} "
                   f"configuration(s)")
