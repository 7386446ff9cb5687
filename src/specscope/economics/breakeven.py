"""Break-even analysis: how much acceptance a configuration needs before speculation beats plain decoding.

From numbers (`breakeven(...)`) or from stored runs (`inputs_from_runs(...)` then `breakeven(...)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specscope.economics.cost import CycleCost, check_positive, iid_alpha_for
from specscope.errors import SpecscopeError
from specscope.registry.metrics import RunMetrics


@dataclass
class BreakevenInputs:
    decode_ms: float | None = None
    verify_ms: float | None = None
    draft_ms: float | None = None
    steps: int | None = None
    other_ms: float | None = None                    # None = not given (0 from numbers, the phases from a run)
    measured_tok_s: float | None = None
    measured_accept_length: float | None = None
    measured_speedup: tuple | None = None            # (ratio, how it was measured), from two stored runs
    sources: dict = field(default_factory=dict)   # which run (or the command line) each number came from
    notes: list = field(default_factory=list)
    batch: int = 1                                   # sequences per target forward (decode_ms, verify_ms: all of them)
    verify_tokens: float | None = None               # tokens one sequence verifies per cycle (to read a surface)
    context: float | None = None                     # per-sequence context (to read a surface)
    measured_positions: int | None = None            # draft positions the run measured acceptance at

    def fill(self, attr: str, value, origin: str) -> None:
        """Set `attr` to a run's `value`, said to come from `origin`, unless the command line gave it (it wins)."""
        if getattr(self, attr) is None and value is not None:
            setattr(self, attr, value)
            self.sources[attr] = origin


def breakeven(inp: BreakevenInputs) -> dict:
    """The JSON result: cycle_ms, break_even_accept_length, break_even_alpha (None when impossible),
    max_accept_length, and speedup when a measured τ or tok/s is given."""
    missing = [flag for flag, v in (("--decode-ms", inp.decode_ms), ("--verify-ms", inp.verify_ms),
                                    ("--draft-ms", inp.draft_ms), ("--steps", inp.steps)) if v is None]
    if missing:
        hint = (" (or --verify-curve RUN for the decode and verify times)"
                if {"--decode-ms", "--verify-ms"} & set(missing) else "")
        raise SpecscopeError(f"break-even needs {', '.join(missing)}{hint}" + _note_suffix(inp))
    if inp.draft_ms <= 0 or not math.isfinite(inp.draft_ms):
        raise SpecscopeError(f"draft time must be a positive number of milliseconds, got {inp.draft_ms}")
    if inp.steps < 1:
        raise SpecscopeError(f"steps must be >= 1, got {inp.steps}")
    if inp.other_ms is None:
        inp.other_ms = 0.0
    tau = inp.measured_accept_length
    if tau is not None and math.isfinite(tau) and tau > inp.steps + 1 + 1e-9:
        src = inp.sources.get("measured_accept_length", "--measured-accept-length")
        raise SpecscopeError(f"measured accept length τ = {tau:g} ({src}) is impossible with steps = {inp.steps}: "
                             f"a cycle yields at most {inp.steps + 1} tokens (the drafts + the bonus token); "
                             f"check τ and --steps")
    cost = CycleCost(inp.decode_ms, inp.draft_ms, inp.verify_ms, inp.other_ms, inp.batch)
    need = cost.break_even_tau
    out = {
        "cycle_ms": cost.cycle_ms,
        "break_even_accept_length": need,
        "break_even_alpha": iid_alpha_for(need, inp.steps),
        "max_accept_length": float(inp.steps + 1),  # a cycle yields at most depth drafts + the bonus token
    }
    if inp.batch != 1:      # batch-1 results keep their keys as they were
        out.update({"batch": inp.batch, "decode_ms": inp.decode_ms, "verify_ms": inp.verify_ms,
                    "plain_ms_per_token": cost.plain_ms_per_token})
    sp = (inp.measured_speedup[0] if inp.measured_speedup is not None
          else achieved_speedup(cost, inp.measured_tok_s, inp.measured_accept_length))
    if sp is not None:
        out["speedup"] = sp
    overflow = [k for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)]
    if overflow:  # e.g. 1e308 ms timings: their sum is inf, which is no answer (and not JSON)
        raise SpecscopeError(f"these inputs overflow the arithmetic ({', '.join(overflow)} would be infinite); "
                             f"pass timings in milliseconds as measured, e.g. --decode-ms 12.1")
    return out


def achieved_speedup(cost: CycleCost, tok_s: float | None, tau: float | None) -> float | None:
    """Measured throughput beats a τ-based estimate: it includes everything the cycle model leaves out. At batch B
    tok/s counts every sequence's tokens, as a server's output throughput does."""
    if tok_s is not None:
        check_positive(tok_s, "measured tok/s")
        return tok_s * cost.plain_ms_per_token / 1e3
    if tau is not None:
        if not (tau >= 1.0 and math.isfinite(tau)):
            raise SpecscopeError(f"measured accept length τ must be >= 1 (accepted drafts + the bonus token), "
                                 f"got {tau}")
        return cost.speedup(tau)
    return None


def describe(res: dict, inp: BreakevenInputs) -> list[str]:
    """The verdict in words."""
    need, mx, a = res["break_even_accept_length"], res["max_accept_length"], res["break_even_alpha"]
    B = inp.batch
    if B == 1:
        lines = [f"cycle: draft {inp.draft_ms:.2f} + verify {inp.verify_ms:.2f} + other {inp.other_ms:.2f} "
                 f"= {res['cycle_ms']:.2f} ms; plain decoding: {inp.decode_ms:.2f} ms/token"]
    else:
        lines = [f"at batch {B}: cycle = verify {inp.verify_ms:.2f} + draft {inp.draft_ms:.2f} (one forward each over "
                 f"the {B} sequences) + {B} × other {inp.other_ms:.2f} = {res['cycle_ms']:.2f} ms; plain decoding: "
                 f"{inp.decode_ms:.2f} ms a step = {inp.decode_ms / B:.2f} ms per sequence-token"]
    if need > mx:
        lines.append(f"break-even is impossible: it needs τ = {need:.2f} tokens per cycle, but {inp.steps} draft "
                     f"step(s) yield at most {mx:.0f}. Make the cycle cheaper than {mx * inp.decode_ms:.2f} ms "
                     f"(verify or draft) or draft deeper" + (f", or batch fewer than {B} sequences." if B > 1
                                                            else "."))
    elif need <= 1.0:
        lines.append(f"break-even needs τ = {need:.2f}: the cycle costs no more than one decode step, "
                     f"so any acceptance pays (max τ {mx:.0f}).")
    else:
        lines.append(f"break-even needs τ = {need:.2f} tokens per cycle ({_max_words(mx, inp)}), "
                     f"i.e. a per-token acceptance α = {a:.3f} if acceptance were i.i.d.")
    if "speedup" in res:
        sp = res["speedup"]
        if inp.measured_speedup is not None:
            basis = inp.measured_speedup[1]
        elif inp.measured_tok_s is not None:
            basis = f"measured {inp.measured_tok_s:.2f} tok/s vs {1e3 * B / inp.decode_ms:.2f} tok/s plain"
        else:
            basis = f"measured τ = {inp.measured_accept_length:.2f}"
        verdict = "faster" if sp > 1 else "slower"
        lines.append(f"achieved speedup: {sp:.2f}x ({basis}): {verdict} than plain decoding")
        if inp.measured_accept_length is not None and (inp.measured_speedup or inp.measured_tok_s):
            tau_sp = inp.measured_accept_length / res["break_even_accept_length"]
            lines.append(f"the cycle model gives {tau_sp:.2f}x from τ = {inp.measured_accept_length:.2f} "
                         f"(decode loop only; the measured figure includes prefill and everything else)")
    for n in inp.notes:
        lines.append(f"note: {n}")
    return lines


def _max_words(mx: float, inp: BreakevenInputs) -> str:
    """The most a cycle can yield, bounded by what the run measured: with acceptance measured at fewer positions
    than the configured steps, the steps' bound is named as the extrapolation it is."""
    p = inp.measured_positions
    if p is not None and 0 < p < inp.steps:
        return (f"max {p + 1} as measured: acceptance at {p} draft position(s); {mx:.0f} with all {inp.steps} "
                f"step(s) is an extrapolation past them")
    return f"max {mx:.0f} with {inp.steps} step(s)"


def _note_suffix(inp: BreakevenInputs) -> str:
    return ("; " + "; ".join(inp.notes)) if inp.notes else ""


# ---------------------------------------------------------------------------------------------- at batch size B

def at_batch(inp: BreakevenInputs, surface=None, engine=None, no_engine: str | None = None) -> BreakevenInputs:
    """The plain step and verify forward at inp.batch sequences. Times given on the command line are taken as
    measured at that batch size; times from a run (measured at batch 1) are scaled by a verify surface,
    T(B, n)/T(1, n); times nobody gave are read off the surface. n is --verify-tokens, else the run's mean verify
    width, else steps + 1 (a chain).

    With no surface, `engine` (EngineCosts: a serving engine's own steps, from its plugin run) gives every time the
    command line did not at the batch sizes it covers; `no_engine` says why a plugin run has none."""
    B = inp.batch
    if B < 1:
        raise SpecscopeError(f"--batch must be >= 1, got {B}")
    from_run = [k for k in ("decode_ms", "verify_ms") if k in inp.sources]
    missing = [k for k in ("decode_ms", "verify_ms") if getattr(inp, k) is None]
    if B > 1 and inp.measured_speedup is not None:
        inp.measured_speedup = None
        inp.notes.append(f"the runs' measured speedup is at batch 1; the one shown is the cycle model's at batch {B}, "
                         f"from the run's τ")
    if surface is None and engine is not None and (engine.covers(B) or B > 1 or engine.sole):
        return _from_engine(inp, engine)
    if surface is None and no_engine and B > 1:
        raise SpecscopeError(f"--batch {B}: {no_engine}")
    if surface is None:
        if B > 1 and from_run:
            raise SpecscopeError(f"--batch {B}: the run's {' and '.join(k[:-3] for k in from_run)} time(s) were "
                                 f"measured at batch 1; pass --verify-curve RUN (a surface from `specscope "
                                 f"verify-curve --batch ...`) to scale them, or --decode-ms and --verify-ms "
                                 f"measured at batch {B}")
        return inp
    if not from_run and not missing:
        return inp                         # both given for this batch size: nothing to read off the surface
    n = inp.verify_tokens or (inp.steps + 1 if inp.steps is not None else None)
    if n is None:
        raise SpecscopeError("reading verify times off a verify curve needs the tokens verified per cycle: pass "
                             "--verify-tokens or --steps")
    ctx = inp.context or surface.context or 0
    sid = surface.run_id or "the verify curve"
    # the drafter's batched forwards grow with rows as the target's does: ~2 rows a sequence (its catch-up)
    for key, width in (("decode_ms", 1), ("verify_ms", n), ("draft_ms", 2)):
        if key in inp.sources and B > 1:
            scale = surface(B, width, ctx) / surface(1, width, ctx)
            setattr(inp, key, getattr(inp, key) * scale)
            inp.sources[key] += f" × T({B}, {width:g})/T(1, {width:g}) = {scale:.2f} from {sid}"
        elif getattr(inp, key) is None and key != "draft_ms":
            setattr(inp, key, surface(B, width, ctx))
            inp.sources[key] = f"{sid}: T({B}, {width:g})"
    return inp


def _from_engine(inp: BreakevenInputs, engine) -> BreakevenInputs:
    """Every time the command line left out (or a run gave: its means mix the server's batch sizes) from the engine's
    own steps at inp.batch: the plain step, the verify forward, the batch's drafting and the rest of the step per
    sequence."""
    B = inp.batch
    if not engine.covers(B):
        raise SpecscopeError(f"--batch {B}: {engine.uncovered([B])}")
    n = inp.verify_tokens or (inp.steps + 1 if inp.steps is not None else None)
    if n is None:
        raise SpecscopeError("reading verify times off the engine's steps needs the tokens verified per cycle: pass "
                             "--verify-tokens or --steps")
    if inp.steps is None:       # no run, no --steps: the engine verifies a chain of n - 1 drafts
        if n < 2:
            raise SpecscopeError(f"--verify-tokens {n:g} verifies no draft token; pass 2 or more")
        inp.fill("steps", math.ceil(n) - 1, f"--verify-tokens {n:g} (a chain)")
    steps = f"the steps of run {engine.run_id}"
    at_n = f", {n:g} token(s)" if engine.by_width is not None else ""
    for key, value, what in (("decode_ms", engine.decode(B), f"the plain steps of run {engine.plain_id} at batch {B}"),
                             ("verify_ms", engine.verify(n, B), f"{steps}: T({B}, {n:g})"),
                             ("draft_ms", engine.drafting(B, n), f"{steps} at batch {B}{at_n}, the batch's"),
                             ("other_ms", engine.other_per_seq(B), f"{steps} at batch {B} (all but forward and "
                                                                   f"draft), per sequence")):
        if key in inp.sources or getattr(inp, key) is None:
            setattr(inp, key, value)
            inp.sources[key] = what
    return inp


def prices_for(run: dict | None, base: dict | None, curve_run: dict | None) -> tuple:
    """What prices the times the command line left out -> (verify surface, EngineCosts, why a plugin run has no
    costs): a --verify-curve run of an engine's own steps (a sweep's engine surface) prices everything from them;
    another --verify-curve run is a verify surface; without one a plugin run prices itself from its own steps."""
    from specscope.economics.engine_steps import EngineCosts, engine_surface, surface_costs

    if curve_run is not None and engine_surface(curve_run) is not None:
        return None, surface_costs(curve_run, run, "mean"), None     # means, as a run's phases are read
    if curve_run is not None:
        from specscope.economics.verify_curve import VerifySurface

        return VerifySurface.from_run(curve_run), None, None
    if run is not None:
        return (None, *EngineCosts.from_runs(run, base))
    return None, None, None


# ---------------------------------------------------------------------------------------------- from stored runs

OTHER_PHASES = ("accept", "commit", "other")


def draft_ms_of(m: RunMetrics) -> float | None:
    d = m.phase_ms("draft")
    if d is not None:
        return d
    # a profiler may record only the per-step sub-phases
    steps = [m.phase_ms(k) for k in (m.phases or {}) if k.startswith("draft.step")]
    steps = [s for s in steps if s is not None]
    return sum(steps) if steps else None


def other_ms_of(m: RunMetrics) -> float | None:
    vals = [m.phase_ms(k) for k in OTHER_PHASES]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def decode_ms_of(m: RunMetrics) -> float | None:
    v = _num(m.decode_ms_per_token)
    if v is not None and v > 0:
        return v
    return m.phase_ms("decode")


def inputs_from_runs(run: dict, baseline: dict | None, given: BreakevenInputs,
                     surface=None, engine=None) -> BreakevenInputs:
    """Fill what the command line left out from a speculative run (and a baseline run for T_decode); with a
    verify `surface` the decode and verify times may be left for `at_batch` to read off it.

    Numbers given on the command line win, so a run lacking phases (e.g. ingested from SGLang/vLLM) can be
    completed by hand."""
    inp = BreakevenInputs(**{k: getattr(given, k) for k in ("decode_ms", "verify_ms", "draft_ms", "steps",
                                                             "other_ms", "measured_tok_s", "measured_accept_length",
                                                             "batch", "verify_tokens", "context")})
    inp.notes = list(given.notes)
    rid = run.get("id") or run.get("run_id") or "?"
    priced = surface is not None or engine is not None     # either gives the decode and verify times
    _fill_from_run(inp, run, rid, priced)
    if baseline is not None:
        _fill_from_baseline(inp, run, rid, baseline, given)
    elif inp.decode_ms is None:
        # a speculative run may carry the baseline it was compared against
        inp.fill("decode_ms", _num(RunMetrics.of(run).baseline_decode_ms_per_token), f"run {rid}")
    _check_complete(inp, run, rid, priced)
    return inp


def _fill_from_run(inp: BreakevenInputs, run: dict, rid: str, priced: bool) -> None:
    """The run's phases, its depth and its τ; with a surface (or an engine's steps) to read, where to read it: this
    run's verify width and context."""
    m, cfg = RunMetrics.of(run), run.get("config") or {}
    inp.fill("verify_ms", m.phase_ms("verify"), f"run {rid}")
    inp.fill("draft_ms", draft_ms_of(m), f"run {rid}")
    inp.fill("other_ms", other_ms_of(m), f"run {rid} (accept + commit + other)")
    steps = cfg.get("steps") if cfg.get("steps") is not None else (cfg.get("drafting") or {}).get("steps")
    ngram = cfg.get("ngram_tokens") or 0
    if steps is not None and ngram:
        # a hybrid's copy cycles verify a chain of its whole budget: that, not the drafter's depth, bounds τ.
        # Copied tokens cost no drafting; their verify cost is in the measured verify phase.
        steps = max(int(steps), int(cfg.get("draft_tokens") or 1) - 1 + int(ngram))
    inp.fill("steps", int(steps) if steps is not None else None,
             f"run {rid}" + (" (deepest copy chain of the hybrid)" if ngram else ""))
    inp.fill("measured_accept_length", _num(m.accept_length), f"run {rid}")
    pos = m.per_position_acceptance
    inp.fill("measured_positions", len(pos) if isinstance(pos, list) and pos else None, f"run {rid}")
    if priced:
        inp.fill("verify_tokens", _num(m.verify_tokens_mean), f"run {rid}")
        inp.fill("context", _num(m.mean_context), f"run {rid}")


def _fill_from_baseline(inp: BreakevenInputs, run: dict, rid: str, baseline: dict, given: BreakevenInputs) -> None:
    """T_decode from the baseline run, and the speedup measured between the two when nothing measured was given."""
    bid = baseline.get("id") or baseline.get("run_id") or "?"
    base = RunMetrics.of(baseline)
    inp.fill("decode_ms", decode_ms_of(base), f"baseline run {bid}")
    # tok/s is comparable only between a run and its baseline, so it is used as "measured" only with one
    if given.measured_tok_s is None and given.measured_accept_length is None:
        t_run, t_base = _num(RunMetrics.of(run).tok_per_s), _num(base.tok_per_s)
        if t_run and t_base:
            inp.measured_speedup = (t_run / t_base, f"run {rid} {t_run:.2f} tok/s vs baseline {bid} "
                                                    f"{t_base:.2f} tok/s")


def _check_complete(inp: BreakevenInputs, run: dict, rid: str, priced: bool) -> None:
    """Refuse, naming what the run has and what it lacks, inputs break-even cannot be computed from."""
    m = RunMetrics.of(run)
    missing = []
    if (inp.verify_ms is None and not priced) or inp.draft_ms is None:
        missing.append("per-phase timings (pass --verify-ms and --draft-ms)")
    if inp.steps is None:
        missing.append("the draft depth (pass --steps)")
    if inp.decode_ms is None and not priced:
        missing.append("the plain decode time per token (pass --baseline-run ID or --decode-ms)")
    if missing:
        have = [f"τ = {m.accept_length:.2f}" if _num(m.accept_length) else None,
                f"{m.tok_per_s:.2f} tok/s" if _num(m.tok_per_s) else None]
        have = ", ".join(h for h in have if h) or "no timings"
        engine = (run.get("config") or {}).get("engine") or run.get("kind", "?")
        raise SpecscopeError(f"run {rid} ({engine}) has {have} but lacks {'; '.join(missing)}")


def _num(v):
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
