"""One `specscope tune` end to end, under the command line: the run to tune from (stored, or profiled here), what
prices other shapes and batch sizes (a verify curve and surface, or a serving engine's own steps), the ranked
predictions and the best shape per concurrency level, then what was asked on top: a policy table, the top picks
measured for real, plots.

Models load only when something is measured, once (`TuneContext`), through the loader the caller passes: loading a
target for a run belongs to the session layer, above this one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specscope.economics.tune import (AcceptanceModel, CostModel, HybridModel, best_by_draft_tokens, by_concurrency,
                                      candidate_configs, crossover, error_summary, hybrid_configs, rank)
from specscope.economics.verify_curve import DEFAULT_BATCHES
from specscope.errors import SpecscopeError
from specscope.speculative.decode import DraftOptions
from specscope.registry.metrics import RunMetrics


def read_prompts(dataset: str | None, limit: int) -> list[str]:
    """First turns of a packaged set ('mt_bench' by default, 'spec_bench') or of a prompt file."""
    from specscope.prompts import load_prompts

    return [r["prompt"] for r in load_prompts(dataset or "mt_bench", num_prompts=limit)["prompts"]]


def label(r: dict) -> str:
    """A prediction's shape in short: s<steps> k<topk> n<draft tokens> (g<n-gram tokens> for a hybrid)."""
    g = f" g{r['ngram_tokens']}" if "ngram_tokens" in r else ""
    return f"s{r['steps']} k{r['topk']} n{r['draft_tokens']}{g}"


# ------------------------------------------------------------------------------------------------ what was asked

@dataclass
class TuneRequest:
    """What to tune from, what to consider, and what to measure and write (the `specscope tune` flags, parsed)."""

    run_ref: str | None = None           # a stored run; None with `profile`
    baseline_ref: str | None = None      # default: the one recorded with the run
    curve_ref: str | None = None
    decode_ms: float | None = None       # plain decoding, instead of a baseline run
    profile: bool = False                # first make the profiled pair, at this shape (the tuner measures every
    # cycle in full: a fixed budget); its draft is --draft as given, the context's drafter when given
    drafting: DraftOptions = field(default_factory=lambda: DraftOptions(steps=5, topk=4, draft_tokens=24,
                                                                        budget="fixed"))
    max_steps: int | None = None
    max_topk: int | None = None
    max_draft_tokens: int = 64
    top: int = 10
    stat: str = "mean"
    n_validate: int = 0
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_BATCHES))
    concurrency: str = ",".join(map(str, DEFAULT_BATCHES))    # the levels as given, for messages
    save_policy: str | None = None       # a path, "auto" (the default place) or None
    output: str | None = None            # the plot directory
    db: str | None = None

    @property
    def batched(self) -> bool:
        return max(self.levels) > 1

    @property
    def measures(self) -> bool:
        """Whether this tune times decoding itself (the profiled pair, a quick verify curve, the picks)."""
        return self.profile or bool(self.n_validate)


@dataclass
class Workload:
    """What tune measures on, loaded: the target, the drafter, the encoded prompts, the stop ids, the target's
    directory."""

    target: object
    drafter: object
    ids: list
    stop: list
    path: object


# ------------------------------------------------------------------------------------------------ the workload

@dataclass
class TuneContext:
    """The target, drafter and prompts, loaded once, on first need, by `loader` (this context -> Workload);
    measures under the shared progress (specscope.progress), as verify-curve and bench-serve do. as_json: the
    command prints --json (no log lines)."""

    model_name: str
    draft: str | None
    dtype: str
    device: str | None
    threads: int | None
    prompts_file: str | None
    num_prompts: int
    max_new_tokens: int
    as_json: bool = False
    loader: Callable | None = None
    prompts: list | None = None
    _loaded: Workload | None = field(default=None, init=False, repr=False)
    curve_loaded: str | None = field(default=None, init=False)    # the quick curve's load, when it had one

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

    def load(self) -> Workload:
        if self._loaded is None:
            if not self.draft:
                raise SpecscopeError("no drafter: pass --draft (e.g. smollm2-135m-eagle3 or ngram)")
            self._loaded = self.loader(self)
        return self._loaded

    def profile(self, shape: DraftOptions, db, say):
        """The profiled pair at `shape`'s knobs, measured and stored -> (speculative record, baseline record)."""
        from specscope.economics.probe import profile
        from specscope.models.loader import compute_dtype
        from specscope.progress import Progress
        from specscope.registry import machine_config, prompt_set_hash
        from specscope.speculative.decode import HYBRID_NGRAM_TOKENS, DraftSpec, SpecConfig

        steps, topk, draft_tokens, ngram_tokens = shape.steps, shape.topk, shape.draft_tokens, shape.ngram_tokens
        if ngram_tokens is None and self.draft and DraftSpec.parse(self.draft).hybrid:
            ngram_tokens = 2 * HYBRID_NGRAM_TOKENS    # a hybrid: longer copies profiled than used, to choose from
        SpecConfig.for_drafter(self.draft, steps, topk, draft_tokens, ngram_tokens)   # refuses a misplaced knob
        cfg = SpecConfig.from_knobs(steps, topk, draft_tokens, ngram_tokens)
        w = self.load()
        say(f"profiling {len(w.ids)} prompt(s) × {self.max_new_tokens} tokens: baseline, then "
            f"steps {cfg.steps} topk {cfg.topk} draft tokens {cfg.draft_tokens}"
            + (f" n-gram tokens {cfg.ngram_tokens}" if cfg.ngram_tokens else ""))
        config = {**machine_config(w.path, compute_dtype(w.target), w.target.device), "model_name": self.model_name,
                  "draft": self.draft, "prompts": self.prompts,
                  "prompt_set_hash": prompt_set_hash(self.prompts), "max_new_tokens": self.max_new_tokens,
                  "sampling": {"temperature": 0.0}}
        with Progress("tune --profile", len(w.ids), "prompt", json_mode=self.as_json) as bar:   # plain + speculative
            brec, srec = profile(w.target, w.drafter, w.ids, cfg, self.max_new_tokens, w.stop, config, db,
                                 tick=bar.advance)
        say(f"stored baseline run {brec['id']} and speculative run {srec['id']} "
            f"(τ {RunMetrics.of(srec).accept_length:.2f})")
        return srec, brec

    def plain_decode_ms(self, say) -> float:
        from specscope.economics.probe import plain_decode_ms
        from specscope.progress import Progress

        w = self.load()
        say(f"no baseline run recorded with this run: measuring plain decoding on {len(w.ids)} prompt(s)")
        with Progress("plain decoding", len(w.ids), "prompt", json_mode=self.as_json) as bar:
            return plain_decode_ms(w.target, w.ids, self.max_new_tokens, w.stop, tick=bar.advance)

    def quick_curve(self, run, max_tokens, levels, db, say):
        """A verify curve at the run's mean context, over the widths the candidates need, and the surface over
        the concurrency levels above 1 -> (VerifyCurve, VerifySurface or None)."""
        from specscope.economics.curve_session import CurvePlan, curve_record, loaded_words, measure_with_progress
        from specscope.economics.verify_curve import VerifyCurve, VerifySurface
        from specscope.jsonio import dtype_name
        from specscope.models.loader import compute_dtype
        from specscope.registry import make_record, store_record

        target = self.load().target
        L = int(RunMetrics.of(run).mean_context or 256)
        L = max(1, min(L, target.config.max_position_embeddings - max_tokens - 1))
        toks = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= max_tokens})
        batched = max(levels) > 1
        say(f"measuring the verify curve at context {L} for n = {', '.join(map(str, toks))}"
            + (f", and the verify surface at batch sizes {', '.join(map(str, levels))}" if batched else ""))
        # verify-curve's own bar and per-point lines (one rule for both commands)
        plan = CurvePlan([L], toks, 1, 5, levels if batched else None, L, None)
        res, surf = measure_with_progress(target, plan, self.as_json)
        machine = {"model": str(self.load().path), "dtype": dtype_name(compute_dtype(target)),
                   "device": str(target.device)}
        config, results, samples = curve_record(plan, res, surf, machine)
        rec = make_record("verify_curve", f"tune verify curve L{L}", config=config, results=results,
                          samples=samples)
        rec["id"] = store_record(rec, db)
        self.curve_loaded = loaded_words(rec)
        if self.curve_loaded:
            say(f"warning: the verify curve was measured while {self.curve_loaded}: these predictions are this "
                f"machine's under that load, and no policy table is saved from them")
        return (VerifyCurve.from_run(rec, loaded_ok=True),
                VerifySurface.from_run(rec, loaded_ok=True) if batched else None)

    def validate(self, picks):
        """The picks measured for real, with a bar over their prompts (each: plain and speculative)."""
        from specscope.economics.probe import validate
        from specscope.progress import Progress

        w = self.load()
        with Progress("tune --validate", len(picks) * len(w.ids), "prompt", json_mode=self.as_json) as bar:
            def tick(knobs):
                s, k, n, *g = knobs
                bar.advance(info=f"s{s} k{k} n{n}" + (f" g{g[0]}" if g and g[0] else ""))

            def measured(r):
                if not self.as_json:
                    bar.note(f"measured {label(r)}: {r['measured']:.2f}x (τ {r['measured_tau']:.2f})")

            return validate(w.target, w.drafter, w.ids, picks, self.max_new_tokens, w.stop, progress=measured,
                            tick=tick)


# ------------------------------------------------------------------------------------------------ the runs

@dataclass
class TuneRuns:
    """The runs a tune reads: the speculative run, its baseline and the verify curve (either may be None)."""

    run: dict
    base: dict | None = None
    curve_run: dict | None = None


def _engine_run(run: dict) -> bool:
    """A serving engine's run with per-step phases (the vLLM plugin's JSONL, a profiler trace): its costs, its
    acceptance; the engine's own plain decoding, not ours, is the baseline."""
    phases = RunMetrics.of(run).phases or {}
    return run.get("kind") == "ingest" and {"draft", "verify"} <= set(phases)


def read_runs(req: TuneRequest, ctx: TuneContext) -> TuneRuns:
    """The stored run, its baseline (given, or the one recorded with it) and the verify curve; refuses a run tune
    cannot read, and takes a specscope run's own workload (model, drafter, prompts, tokens, dtype) into ctx."""
    from specscope.registry import open_registry

    with open_registry(req.db, create=False) as reg:     # never created by reading it
        run = reg.get_run(req.run_ref, samples=False)
        bref = req.baseline_ref or (run.get("config") or {}).get("baseline_run")
        base = reg.get_run(bref, samples=False) if bref else None
        curve_run = reg.get_run(req.curve_ref, samples=False) if req.curve_ref else None
    engine = (run.get("config") or {}).get("engine")
    if _engine_run(run):
        if req.n_validate:
            raise SpecscopeError(f"run {run['id']} was measured inside {engine}; --validate runs specscope's own "
                                 f"engine. Measure the picks in {engine} (bench-serve) instead")
        if base is None and req.decode_ms is None and not _priced_by_surface(req, curve_run):
            raise SpecscopeError(f"run {run['id']} was measured inside {engine}: pass --baseline-run (a plain "
                                 f"run of the same engine, e.g. the plugin's JSONL without speculation) or "
                                 f"--decode-ms")
    elif run.get("kind") == "engine_surface":
        from specscope.economics.engine_steps import surface_as_run

        raise SpecscopeError(surface_as_run(run))
    elif run.get("kind") not in ("speculative", "bench", "generate"):
        raise SpecscopeError(f"run {run['id']} is a {run.get('kind')!r} run without draft and verify timings; "
                             f"tune needs a profiled speculative run")
    else:
        ctx.adopt_run(run)
    return TuneRuns(run, base, curve_run)


def _priced_by_surface(req: TuneRequest, curve_run: dict | None) -> bool:
    """Whether --verify-curve is a run of an engine's own steps (a sweep's engine surface), which prices plain
    decoding itself."""
    from specscope.economics.engine_steps import engine_surface

    return bool(req.curve_ref and not req.profile and engine_surface(curve_run) is not None)


def _max_topk(req: TuneRequest, run: dict, prices: "Pricing") -> int | None:
    vllm = (_engine_run(run) and (run.get("config") or {}).get("engine") == "vllm") or \
        (prices.engine is not None and prices.engine.engine == "vllm")
    if req.max_topk is None and vllm:
        return 1           # vLLM's EAGLE-3 proposes chains (num_speculative_tokens)
    return req.max_topk


# ------------------------------------------------------------------------------------------------ the prices

@dataclass
class Pricing:
    """What prices shapes and batch sizes the run did not measure: a verify curve (and surface), or a serving
    engine's own steps by batch size (`no_engine`: why a plugin run has none)."""

    curve: object = None
    surface: object = None
    engine: object = None
    no_engine: str | None = None


def pricing(req: TuneRequest, ctx: TuneContext, runs: TuneRuns, say) -> Pricing:
    """The verify curve given; else, when this tune measures anyway, a quick one measured here; else a serving
    engine's plugin run prices itself by batch size from its own steps."""
    if _priced_by_surface(req, runs.curve_run):
        return _surface_pricing(req, runs)
    if req.curve_ref and not req.profile:
        from specscope.economics.verify_curve import VerifySurface

        return Pricing(*VerifySurface.curve_and_surface(runs.curve_run))
    if req.measures:
        return Pricing(*ctx.quick_curve(runs.run, req.max_draft_tokens, req.levels, req.db, say))
    from specscope.economics.engine_steps import EngineCosts

    engine, no_engine = EngineCosts.from_runs(runs.run, runs.base, req.stat)
    return Pricing(engine=engine, no_engine=no_engine)


def _surface_pricing(req: TuneRequest, runs: TuneRuns) -> Pricing:
    """Every cost from the engine's own steps given as --verify-curve (acceptance stays the run's); refused where
    they cannot price what was asked."""
    from specscope.economics.engine_steps import surface_costs

    sid = runs.curve_run.get("id")
    engine = surface_costs(runs.curve_run, runs.run, req.stat)
    name = engine.engine or "the engine"
    if req.n_validate:
        raise SpecscopeError(f"--validate measures specscope's own engine, and --verify-curve {sid} prices "
                             f"{name}'s steps: measure the picks in {name} instead")
    if req.save_policy is not None:
        raise SpecscopeError(f"--save-policy writes a table for `specscope serve`, and --verify-curve {sid} prices "
                             f"{name}'s steps: leave --save-policy out (tune prints {name}'s own form where it has "
                             f"one)")
    if not any(engine.covers(B) for B in req.levels):
        raise SpecscopeError(f"--verify-curve {sid}: {engine.uncovered(req.levels, 'concurrency')}")
    return Pricing(engine=engine)


def _plain_at_one(prices: Pricing) -> float:
    """Plain decoding at batch 1 from an engine surface given as --verify-curve (nothing else gives it)."""
    e = prices.engine
    if not e.covers(1):
        raise SpecscopeError(f"{e.uncovered([1])}; tune ranks shapes at batch 1: pass --baseline-run or "
                             f"--decode-ms for plain decoding there")
    return e.decode(1)


def cost_model(req: TuneRequest, ctx: TuneContext, runs: TuneRuns, prices: Pricing, say) -> CostModel:
    decode_ms = req.decode_ms
    if runs.base is None and decode_ms is None and prices.engine is not None and prices.engine.sole:
        decode_ms = _plain_at_one(prices)
    elif runs.base is None and decode_ms is None:
        # a run made without a baseline (e.g. `specscope generate --draft ...`): measure plain decoding here
        decode_ms = ctx.plain_decode_ms(say)
    cost = CostModel.from_runs(runs.run, runs.base, prices.curve, decode_ms, req.stat,
                               prices.surface if req.batched else None, prices.engine)
    if prices.no_engine:
        cost.notes.append(prices.no_engine)
    return cost


# ------------------------------------------------------------------------------------------------ the tune

@dataclass
class TuneResult:
    """The --json document (`out`), every prediction best first, and what the printed tables read."""

    out: dict
    rows: list[dict]
    acc: AcceptanceModel
    cost: CostModel
    prices: Pricing


def run_tune(req: TuneRequest, ctx: TuneContext, say) -> TuneResult:
    """Tune from req's run (or one profiled here): predictions, the best shape per concurrency level and its
    crossover; then the policy table, the validation and the plots req asks for. say(message): progress lines."""
    if ctx.prompts_file is not None or req.profile:
        ctx.prompts = read_prompts(ctx.prompts_file, ctx.num_prompts)
    if req.profile:
        runs = TuneRuns(*ctx.profile(req.drafting, req.db, say))
    else:
        runs = read_runs(req, ctx)
    acc = AcceptanceModel.from_run(runs.run)
    prices = pricing(req, ctx, runs, say)
    policy_file = _policy_file(req, ctx, runs.run, prices.surface) if req.save_policy is not None else None
    cost = cost_model(req, ctx, runs, prices, say)
    configs = candidate_configs(acc, req.max_steps, _max_topk(req, runs.run, prices), req.max_draft_tokens)
    hyb = HybridModel.from_run(runs.run) if RunMetrics.of(runs.run).hybrid_cycles else None
    if hyb is not None:      # a hybrid: the drafter ran in the tree cycles only; choose the n-gram budget too
        cost = cost.drafted_only(1.0 - hyb.copy_share)
        configs = hybrid_configs(configs, hyb)
    rows = rank(acc, cost, configs, hyb)
    out = _summary(req, runs, acc, cost, prices, rows)
    conc, skipped = by_concurrency(acc, cost, configs, req.levels, hyb)
    cross = crossover([r["batch"] for r in conc], [r["speedup"] for r in conc])
    out.update({"concurrency": conc, "crossover": cross, "concurrency_not_predicted": skipped})
    form = engine_form(runs.run, prices.engine, conc)
    if form is not None:
        out["engine_config"] = form
    if policy_file and ctx.curve_loaded:
        out["policy_not_saved"] = (f"--save-policy: not saved, the verify curve was measured while "
                                   f"{ctx.curve_loaded}; run the tune again on a quieter machine")
        say(f"warning: {out['policy_not_saved']}")
    elif policy_file:
        out["policy"] = _save_policy(ctx, runs.run, prices.surface, out, policy_file)
    if req.n_validate:
        out["validation"] = _validated(ctx, rows[:req.n_validate])
        out["validation_error"] = error_summary(out["validation"])
    if req.measures:        # this command timed decoding itself: say what load it ran under
        from specscope.registry.fingerprint import timing_warning

        out["load_warning"] = timing_warning(runs.run.get("env") if req.profile else None)
    if req.output:
        out["plots"] = _plots(req.output, rows, out)
    return TuneResult(out, rows, acc, cost, prices)


def _summary(req, runs, acc, cost, prices, rows) -> dict:
    """The --json document's head: the runs read, acceptance, costs, the top predictions."""
    no_engine = prices.no_engine
    sole = prices.engine is not None and prices.engine.sole
    return {"run": runs.run.get("id"), "baseline_run": (runs.base or {}).get("id"),
            "verify_curve": prices.engine.run_id if sole else getattr(prices.curve, "run_id", None),
            "acceptance": {"source": acc.source, "rates": acc.rates}, "cost_notes": cost.notes,
            "decode_ms": cost.decode(1) if cost.covers(1) else cost.decode_ms, "predictions": rows[:req.top],
            "engine_surface": (prices.engine.summary() if prices.engine is not None
                               else {"unavailable": no_engine} if no_engine else None)}


def engine_form(run: dict, engine, conc: list[dict]) -> dict | None:
    """The best draft tokens per concurrency level in the engine's own form (vLLM's per-batch-size schedule): k the
    best chain's depth, 0 where plain decoding is predicted faster; None where the costs are not vLLM's or a level's
    best shape is no chain."""
    if engine is None or engine.engine != "vllm" or not conc:
        return None
    if any(r["topk"] != 1 or "ngram_tokens" in r for r in conc):
        return None
    from specscope.engines.vllm import SCHEDULE_RULE, draft_schedule

    sched = draft_schedule([(r["batch"], r["steps"] if r["speedup"] > 1.0 else 0) for r in conc])
    if sched is None:
        return {"engine": "vllm", "speculative_config": None,
                "verdict": "speculation is predicted not to pay at any concurrency level: serve it without "
                           "--speculative-config"}
    cfg = run.get("config") or {}
    # the drafter as vLLM names it: a vLLM run's, else the surface's (a specscope run names it specscope's way)
    keys = _spec_keys(cfg) if cfg.get("engine") == "vllm" else {}
    keys = keys or _spec_keys(engine.config)
    return {"engine": "vllm", "speculative_config": sched.config(keys), "flag": sched.flag(keys),
            "rule": SCHEDULE_RULE}


def _spec_keys(cfg: dict) -> dict:
    """A run's speculative method and drafter, as keys of vLLM's speculative config."""
    return {k: cfg[c] for k, c in (("method", "method"), ("model", "draft")) if cfg.get(c)}


def _validated(ctx: TuneContext, picks: list[dict]) -> list[dict]:
    """The top predictions measured for real, each beside what was predicted."""
    knobs = [(r["steps"], r["topk"], r["draft_tokens"], r.get("ngram_tokens", 0)) for r in picks]
    measured = ctx.validate(knobs)
    return [{**m, "predicted": r["speedup"], "predicted_tau": r["tau"], "label": label(r)}
            for r, m in zip(picks, measured)]


# ------------------------------------------------------------------------------------------------ what it writes

def _policy_file(req: TuneRequest, ctx: TuneContext, run: dict, surface) -> str:
    """--save-policy's path: as given, or (alone) the default place for the run's model and drafter; refused
    before anything is measured when the verify surface leaves a concurrency level unpredicted."""
    if req.batched and not (surface is not None and surface.covers(max(req.levels))):
        have = ", ".join(map(str, surface.batches)) if surface is not None else "1"
        raise SpecscopeError(f"--save-policy needs predictions at every --max-concurrency level; verify curve "
                             f"{req.curve_ref} covers batch sizes {have}: measure one with `specscope verify-curve "
                             f"--batch {req.concurrency}`")
    if req.save_policy != "auto":
        return req.save_policy
    from specscope.economics.policy import policy_path

    if not ctx.draft:
        raise SpecscopeError("--save-policy without a path files the table by model and drafter, and this run names "
                             "no drafter: pass --draft, or --save-policy PATH")
    return str(policy_path(model_named(run, ctx), ctx.draft, (run.get("config") or {}).get("dtype")))


def model_named(run: dict, ctx: TuneContext) -> str:
    """The target as the user named it (a hub id, a known name), which serve will name it by too; runs store the
    resolved directory as "model" and, since tables exist, the name as "model_name"."""
    return (run.get("config") or {}).get("model_name") or ctx.model_name


def _save_policy(ctx: TuneContext, run: dict, surface, out: dict, path: str) -> str:
    """The per-concurrency table written for `serve --spec-policy` -> where."""
    from specscope.economics.policy import make_table, save_table
    from specscope.jsonio import short_dtype

    table = make_table(out["concurrency"], out["crossover"], model_named(run, ctx), ctx.draft, run=run.get("id"),
                       verify_curve=getattr(surface, "run_id", None),
                       dtype=short_dtype((run.get("config") or {}).get("dtype")))
    return save_table(table, path)


def _plots(plot_dir: str, rows: list[dict], out: dict) -> list[str]:
    """tau-needed.png; with validation predicted-vs-measured.png; over several levels spec-by-concurrency.png."""
    from pathlib import Path

    from specscope.economics.plots import plot_pred_vs_measured, plot_tau_needed

    plots = [plot_tau_needed(best_by_draft_tokens(rows), Path(plot_dir) / "tau-needed.png")]
    if out.get("validation"):
        plots.append(plot_pred_vs_measured(out["validation"], Path(plot_dir) / "predicted-vs-measured.png"))
    conc = out["concurrency"]
    if len(conc) > 1:
        from specscope.economics.plots import plot_speedup_by_concurrency

        series = [{"label": "best shape per level (predicted)", "style": "predicted", "crossover": out["crossover"],
                   "levels": [r["batch"] for r in conc], "speedups": [r["speedup"] for r in conc]}]
        plots.append(plot_speedup_by_concurrency(series, Path(plot_dir) / "spec-by-concurrency.png"))
    return plots
