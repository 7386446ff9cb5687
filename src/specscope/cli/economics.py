"""`specscope breakeven`, `specscope tune` (and `verify-curve`, from cli/verify_curve.py): the economics of speculation."""

from __future__ import annotations

import math

import click

from specscope.cli.common import (FiniteFloat, alias_option, check_writable, db_option, device_option, draft_option,
                                  dtype_option, emit_json, json_option, output_option, setup_runtime, spec_options,
                                  stderr_console, stdout_console)
# verify-curve lives in its own module; named here too, where the command table and older imports look for it
from specscope.cli.verify_curve import verify_curve  # noqa: F401
from specscope.economics.verify_curve import DEFAULT_BATCHES, MAX_BATCH
from specscope.errors import SpecscopeError
from specscope.jsonio import dtype_name

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
                   "verify times not given.")
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
                                               inputs_from_runs)
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
    surface = engine = no_engine = None
    if curve_ref:
        from specscope.economics.verify_curve import VerifySurface

        with _open(db) as reg:
            surface = VerifySurface.from_run(reg.get_run(curve_ref, samples=False))
    if run_ref:
        with _open(db) as reg:
            run = reg.get_run(run_ref, samples=False)
            # a run may name the baseline it was measured against
            bref = baseline_ref or (run.get("config") or {}).get("baseline_run")
            base = reg.get_run(bref, samples=False) if bref else None
        if run.get("kind") in ("baseline",) and base is None:
            raise SpecscopeError(f"run {run['id']} is a baseline run; pass the speculative run as --run and this one "
                                 f"as --baseline-run")
        if surface is None:     # a serving engine's plugin run prices itself by batch size from its own steps
            from specscope.economics.engine_steps import EngineCosts

            engine, no_engine = EngineCosts.from_runs(run, base)   # means, as the run's phases are read
        inp = inputs_from_runs(run, base, given, surface, engine)
    else:
        inp = given
    res = compute(at_batch(inp, surface, engine, no_engine))
    if as_json:
        emit_json(res)
        return
    for line in describe(res, inp):
        click.echo(line)
    if inp.sources:
        click.echo("from runs: " + ", ".join(f"{k.replace('_ms', '')} ← {v}" for k, v in inp.sources.items()))


# ------------------------------------------------------------------------------------------------ tune

def read_prompts(dataset: str | None, limit: int) -> list[str]:
    """First turns of a packaged set ('mt_bench' by default, 'spec_bench') or of a prompt file."""
    from specscope.prompts import load_prompts

    return [r["prompt"] for r in load_prompts(dataset or "mt_bench", num_prompts=limit)["prompts"]]


@click.command()
@click.option("--run", "run_ref", default=None, help="A profiled speculative run to tune from (id, prefix or last).")
@click.option("--baseline-run", "baseline_ref", default=None,
              help="Baseline run for T_decode (default: the one recorded with the run).")
@click.option("--verify-curve", "curve_ref", default=None, help="A verify_curve run to scale verify cost by n.")
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
    from specscope.economics import tune as T
    from specscope.economics.verify_curve import parse_int_list

    if not do_profile and not run_ref:
        raise SpecscopeError("pass --run ID (a profiled speculative run) or --profile to make one")
    # what flags and files decide, decided before a model loads (and before minutes of measuring)
    levels = parse_int_list(concurrency, "--max-concurrency")
    if max(levels) > MAX_BATCH:
        raise SpecscopeError(f"--max-concurrency values must be <= {MAX_BATCH}, got {max(levels)}")
    batched = max(levels) > 1
    if save_policy is not None and save_policy != "auto":
        check_writable(save_policy, "--save-policy")
    if save_policy is not None and batched and not (curve_ref or do_profile or n_validate):
        raise SpecscopeError("--save-policy needs predictions above batch 1: pass --verify-curve SURFACE (from "
                             "`specscope verify-curve --batch 1,2,4,8,16`), or --profile to measure one")
    if output:
        check_writable(output, "--output", is_dir=True)
    if do_profile:
        from specscope.speculative.decode import DraftSpec, SpecConfig

        if not draft:
            raise SpecscopeError("--profile needs --draft (e.g. smollm2-135m-eagle3 or ngram)")
        if DraftSpec.parse(draft).ngram_only and topk != 1:     # every n-gram spelling, before the model loads
            raise SpecscopeError(f"n-gram drafting proposes a chain: profile it with --topk 1 --draft-tokens "
                                 f"{steps + 1} (got --topk {topk}; tune profiles a --topk 4 tree by default)")
        SpecConfig.from_knobs(steps, topk, draft_tokens)      # the profiled shape is one the drafter can propose
    if do_profile or n_validate:        # these store runs (the profiled pair, a verify curve)
        from specscope.registry import check_registry

        check_registry(db)
    err = stderr_console()
    say = (lambda m: None) if as_json else err.print
    ctx = _TuneContext(model_name, draft, dtype, device, threads, prompts_file, num_prompts, max_new_tokens, as_json)
    if prompts_file is not None or do_profile:
        ctx.prompts = read_prompts(prompts_file, num_prompts)
    if do_profile:
        run, base = ctx.profile(steps, topk, draft_tokens, ngram_tokens, db, say)
    else:
        with _open(db) as reg:
            run = reg.get_run(run_ref, samples=False)
            bref = baseline_ref or (run.get("config") or {}).get("baseline_run")
            base = reg.get_run(bref, samples=False) if bref else None
            curve_run = reg.get_run(curve_ref, samples=False) if curve_ref else None
        engine = (run.get("config") or {}).get("engine")
        phases = (run.get("results") or {}).get("phases") or {}
        if run.get("kind") == "ingest" and {"draft", "verify"} <= set(phases):
            # a serving engine's run with per-step phases (the vLLM plugin's JSONL, a profiler trace): its costs,
            # its acceptance; the engine's own plain decoding, not ours, is the baseline
            if n_validate:
                raise SpecscopeError(f"run {run['id']} was measured inside {engine}; --validate runs specscope's own "
                                     f"engine. Measure the picks in {engine} (bench-serve) instead")
            if base is None and decode_ms is None:
                raise SpecscopeError(f"run {run['id']} was measured inside {engine}: pass --baseline-run (a plain "
                                     f"run of the same engine, e.g. the plugin's JSONL without speculation) or "
                                     f"--decode-ms")
            if engine == "vllm" and max_topk is None:
                max_topk = 1           # vLLM's EAGLE-3 proposes chains (num_speculative_tokens)
        elif run.get("kind") not in ("speculative", "bench", "generate"):
            raise SpecscopeError(f"run {run['id']} is a {run.get('kind')!r} run without draft and verify timings; "
                                 f"tune needs a profiled speculative run")
        else:
            ctx.adopt_run(run)
    acc = T.AcceptanceModel.from_run(run)
    from specscope.economics.verify_curve import VerifySurface

    curve = surface = steps_cost = no_engine = None
    if curve_ref and not do_profile:
        curve, surface = VerifySurface.curve_and_surface(curve_run)
    elif do_profile or n_validate:
        curve, surface = ctx.quick_curve(run, max_draft_tokens, levels, db, say)
    else:       # a serving engine's plugin run: its own steps price it by batch size
        from specscope.economics.engine_steps import EngineCosts

        steps_cost, no_engine = EngineCosts.from_runs(run, base, stat)
    policy_file = None
    if save_policy is not None:
        if batched and not (surface is not None and surface.covers(max(levels))):
            have = ", ".join(map(str, surface.batches)) if surface is not None else "1"
            raise SpecscopeError(f"--save-policy needs predictions at every --max-concurrency level; verify curve "
                                 f"{curve_ref} covers batch sizes {have}: measure one with `specscope verify-curve "
                                 f"--batch {concurrency}`")
        policy_file = _policy_file(save_policy, ctx, run)
    if base is None and decode_ms is None:
        # a run made without a baseline (e.g. `specscope generate --draft ...`): measure plain decoding here
        decode_ms = ctx.plain_decode_ms(say)
    cost = T.CostModel.from_runs(run, base, curve, decode_ms, stat, surface if batched else None, steps_cost)
    if no_engine:
        cost.notes.append(no_engine)
    configs = T.candidate_configs(acc, max_steps, max_topk, max_draft_tokens)
    hyb = T.HybridModel.from_run(run) if (run.get("results") or {}).get("hybrid_cycles") else None
    if hyb is not None:      # a hybrid: the drafter ran in the tree cycles only; choose the n-gram budget too
        cost = cost.drafted_only(1.0 - hyb.copy_share)
        configs = T.hybrid_configs(configs, hyb)
    rows = T.rank(acc, cost, configs, hyb)
    out = {"run": run.get("id"), "baseline_run": (base or {}).get("id"), "verify_curve": getattr(curve, "run_id", None),
           "acceptance": {"source": acc.source, "rates": acc.rates}, "cost_notes": cost.notes,
           "decode_ms": cost.decode(1) if cost.covers(1) else cost.decode_ms, "predictions": rows[:top],
           "engine_surface": (steps_cost.summary() if steps_cost is not None
                              else {"unavailable": no_engine} if no_engine else None)}
    conc, skipped = T.by_concurrency(acc, cost, configs, levels, hyb)
    cross = T.crossover([r["batch"] for r in conc], [r["speedup"] for r in conc])
    out.update({"concurrency": conc, "crossover": cross, "concurrency_not_predicted": skipped})
    if policy_file:
        from specscope.economics.policy import make_table, save_table
        from specscope.jsonio import short_dtype

        out["policy"] = save_table(make_table(conc, cross, _model_named(run, ctx), ctx.draft, run=run.get("id"),
                                              verify_curve=getattr(surface, "run_id", None),
                                              dtype=short_dtype((run.get("config") or {}).get("dtype"))),
                                   policy_file)
    validation = None
    if n_validate:
        picks = [(r["steps"], r["topk"], r["draft_tokens"], r.get("ngram_tokens", 0)) for r in rows[:n_validate]]
        measured = ctx.validate(picks, say, as_json)
        validation = []
        for r, m in zip(rows[:n_validate], measured):
            validation.append({**m, "predicted": r["speedup"], "predicted_tau": r["tau"],
                               "label": _label(r)})
        out["validation"] = validation
        out["validation_error"] = T.error_summary(validation)
    if do_profile or n_validate:        # this command timed decoding itself: say what load it ran under
        from specscope.registry.fingerprint import timing_warning

        out["load_warning"] = timing_warning(run.get("env") if do_profile else None)
    plot_dir = output
    if plot_dir:
        from pathlib import Path

        from specscope.economics.plots import plot_pred_vs_measured, plot_tau_needed

        out["plots"] = [plot_tau_needed(T.best_by_draft_tokens(rows), Path(plot_dir) / "tau-needed.png")]
        if validation:
            out["plots"].append(plot_pred_vs_measured(validation, Path(plot_dir) / "predicted-vs-measured.png"))
        if len(conc) > 1:
            from specscope.economics.plots import plot_speedup_by_concurrency

            series = [{"label": "best shape per level (predicted)", "style": "predicted", "crossover": cross,
                       "levels": [r["batch"] for r in conc], "speedups": [r["speedup"] for r in conc]}]
            out["plots"].append(plot_speedup_by_concurrency(series, Path(plot_dir) / "spec-by-concurrency.png"))
    if as_json:
        emit_json(out)
        return
    _print_tune(out, rows[:top], acc, cost, validation)
    if batched:
        _print_concurrency(out, surface, steps_cost)
    for p in out.get("plots", []):
        click.echo(f"plot: {p}")
    if out.get("policy"):
        click.echo(f"policy table: {out['policy']} (serve --spec-policy "
                   + ("auto" if save_policy == "auto" else out["policy"]) + ")")
    if out.get("load_warning"):
        click.echo(out["load_warning"], err=True)


def _policy_file(save_policy: str, ctx, run) -> str:
    """--save-policy's path: as given, or (alone) the default place for the run's model and drafter."""
    if save_policy != "auto":
        return save_policy
    from specscope.economics.policy import policy_path

    if not ctx.draft:
        raise SpecscopeError("--save-policy without a path files the table by model and drafter, and this run names "
                             "no drafter: pass --draft, or --save-policy PATH")
    return str(policy_path(_model_named(run, ctx), ctx.draft, (run.get("config") or {}).get("dtype")))


def _model_named(run, ctx) -> str:
    """The target as the user named it (a hub id, a known name), which serve will name it by too; runs store the
    resolved directory as "model" and, since tables exist, the name as "model_name"."""
    return (run.get("config") or {}).get("model_name") or ctx.model_name


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


class _TuneContext:
    """Loads the target, drafter and prompts once, on first need; measures under the shared progress
    (specscope.progress), as verify-curve and bench-serve do. as_json: the command prints --json (no log lines)."""

    def __init__(self, model_name, draft, dtype, device, threads, prompts_file, num_prompts, max_new_tokens,
                 as_json=False):
        self.model_name, self.draft, self.dtype, self.device, self.threads = model_name, draft, dtype, device, threads
        self.prompts_file, self.num_prompts, self.max_new_tokens = prompts_file, num_prompts, max_new_tokens
        self.as_json = as_json
        self.prompts = None
        self._loaded = None

    def adopt_run(self, run):
        cfg = run.get("config") or {}
        self.model_name = cfg.get("model") or self.model_name
        self.draft = self.draft or cfg.get("draft")
        if cfg.get("prompts") and self.prompts_file is None:
            self.prompts = list(cfg["prompts"])
        if cfg.get("max_new_tokens"):
            self.max_new_tokens = int(cfg["max_new_tokens"])
        if cfg.get("dtype") and self.dtype == "auto":
            self.dtype = cfg["dtype"]

    def load(self):
        if self._loaded is None:
            from specscope.economics.probe import encode_prompts
            from specscope.session import load_target, preflight, stop_ids_for
            from specscope.speculative.decode import build_drafter

            if not self.draft:
                raise SpecscopeError("no drafter: pass --draft (e.g. smollm2-135m-eagle3 or ngram)")
            # the target's and the drafter's files, and the token budget against the context: before loading
            preflight(self.model_name, self.max_new_tokens, self.draft)
            prompts = self.prompts = self.prompts or read_prompts(self.prompts_file, self.num_prompts)
            dev = setup_runtime(self.threads, self.device)
            target, tok, path = load_target(self.model_name, self.dtype, str(dev))
            drafter = build_drafter(self.draft, target)
            self._loaded = (target, drafter, encode_prompts(tok, prompts), stop_ids_for(target, tok), path)
        return self._loaded

    def profile(self, steps, topk, draft_tokens, ngram_tokens, db, say):
        from specscope.economics.probe import profile
        from specscope.models.loader import compute_dtype
        from specscope.progress import Progress
        from specscope.registry import machine_config, prompt_set_hash
        from specscope.speculative.decode import HYBRID_NGRAM_TOKENS, DraftSpec, SpecConfig

        if ngram_tokens is None and self.draft and DraftSpec.parse(self.draft).hybrid:
            ngram_tokens = 2 * HYBRID_NGRAM_TOKENS    # a hybrid: longer copies profiled than used, to choose from
        SpecConfig.for_drafter(self.draft, steps, topk, draft_tokens, ngram_tokens)   # refuses a misplaced knob
        cfg = SpecConfig.from_knobs(steps, topk, draft_tokens, ngram_tokens)
        target, drafter, ids, stop, path = self.load()
        say(f"profiling {len(ids)} prompt(s) × {self.max_new_tokens} tokens: baseline, then "
            f"steps {cfg.steps} topk {cfg.topk} draft tokens {cfg.draft_tokens}"
            + (f" n-gram tokens {cfg.ngram_tokens}" if cfg.ngram_tokens else ""))
        config = {**machine_config(path, compute_dtype(target), target.device), "model_name": self.model_name,
                  "draft": self.draft, "prompts": self.prompts,
                  "prompt_set_hash": prompt_set_hash(self.prompts), "max_new_tokens": self.max_new_tokens,
                  "sampling": {"temperature": 0.0}}
        with Progress("tune --profile", len(ids), "prompt", json_mode=self.as_json) as bar:   # plain + speculative
            brec, srec = profile(target, drafter, ids, cfg, self.max_new_tokens, stop, config, db, tick=bar.advance)
        say(f"stored baseline run {brec['id']} and speculative run {srec['id']} "
            f"(τ {srec['results']['accept_length']:.2f})")
        return srec, brec

    def plain_decode_ms(self, say) -> float:
        from specscope.economics.probe import plain_decode_ms
        from specscope.progress import Progress

        target, _, ids, stop, _ = self.load()
        say(f"no baseline run recorded with this run: measuring plain decoding on {len(ids)} prompt(s)")
        with Progress("plain decoding", len(ids), "prompt", json_mode=self.as_json) as bar:
            return plain_decode_ms(target, ids, self.max_new_tokens, stop, tick=bar.advance)

    def quick_curve(self, run, max_tokens, levels, db, say):
        """A verify curve at the run's mean context, over the widths the candidates need, and the surface over
        the concurrency levels above 1 -> (VerifyCurve, VerifySurface or None)."""
        from specscope.cli.verify_curve import measure_with_progress
        from specscope.economics.verify_curve import VerifyCurve, VerifySurface, surface_results
        from specscope.models.loader import compute_dtype
        from specscope.registry import make_record, store_record

        target = self.load()[0]
        L = int((run.get("results") or {}).get("mean_context") or 256)
        L = max(1, min(L, target.config.max_position_embeddings - max_tokens - 1))
        toks = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= max_tokens})
        batched = max(levels) > 1
        say(f"measuring the verify curve at context {L} for n = {', '.join(map(str, toks))}"
            + (f", and the verify surface at batch sizes {', '.join(map(str, levels))}" if batched else ""))
        # verify-curve's own bar and per-point lines (one rule for both commands)
        res, surf = measure_with_progress(target, [L], toks, 1, 5, levels if batched else None, L, None,
                                          self.as_json)
        config = {"model": str(self.load()[4]), "dtype": dtype_name(compute_dtype(target)),
                  "device": str(target.device),
                  "contexts": [L], "tokens": toks, "warmup": 1, "repeats": 5}
        results, samples = {"points": res["points"], "fits": res["fits"]}, {"verify_ms": res["samples"]}
        if batched:
            config.update({"batches": list(levels), "batch_context": L})
            results["surface"] = surface_results(surf)
            samples["batch_verify_ms"] = surf["samples"]
        rec = make_record("verify_curve", f"tune verify curve L{L}", config=config, results=results,
                          samples=samples)
        rec["id"] = store_record(rec, db)
        return VerifyCurve.from_run(rec), (VerifySurface.from_run(rec) if batched else None)

    def validate(self, picks, say, as_json=False):
        """The picks measured for real, with a bar over their prompts (each: plain and speculative)."""
        from specscope.economics.probe import validate
        from specscope.progress import Progress

        target, drafter, ids, stop, _ = self.load()
        with Progress("tune --validate", len(picks) * len(ids), "prompt", json_mode=as_json) as bar:
            def tick(knobs):
                s, k, n, *g = knobs
                bar.advance(info=f"s{s} k{k} n{n}" + (f" g{g[0]}" if g and g[0] else ""))

            def measured(r):
                if not as_json:
                    bar.note(f"measured {_label(r)}: {r['measured']:.2f}x (τ {r['measured_tau']:.2f})")

            return validate(target, drafter, ids, picks, self.max_new_tokens, stop, progress=measured, tick=tick)


def _label(r: dict) -> str:
    g = f" g{r['ngram_tokens']}" if "ngram_tokens" in r else ""
    return f"s{r['steps']} k{r['topk']} n{r['draft_tokens']}{g}"


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
