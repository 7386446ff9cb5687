"""One verify-curve measurement end to end, under `specscope verify-curve` (and `tune`'s quick curve): the plan,
checked against the model's context before it loads; the forwards timed under one progress bar; the record the
curve is stored as; its conclusions in words."""

from __future__ import annotations

from dataclasses import dataclass

from specscope.cpuload import Contention, ContentionMeter

from specscope.economics.verify_curve import (cheap_words, check_plan, check_surface_plan, knee_words,
                                              surface_results)


@dataclass
class CurvePlan:
    """What one measurement times: every context × tokens at batch 1 and, with `batches`, one forward over B
    sequences × n tokens each at `batch_context` (KV regions of `max_seq_len`, None: just the batch context)."""

    contexts: list[int]
    tokens: list[int]
    warmup: int = 1
    repeats: int = 5
    batches: list[int] | None = None
    batch_context: int | None = None
    max_seq_len: int | None = None

    @property
    def points(self) -> int:
        """Points measured: one per (context, n) and per (batch size, n)."""
        return len(self.tokens) * (len(self.contexts) + len(self.batches or ()))

    def check(self, max_position_embeddings: int) -> None:
        """Refuse a plan the model's context cannot hold (before it loads and minutes of measuring)."""
        check_plan(self.contexts, self.tokens, self.warmup, self.repeats, max_position_embeddings)
        if self.batches is not None:
            check_surface_plan(self.batches, self.batch_context, self.tokens, max_position_embeddings,
                               self.max_seq_len)


def measure_with_progress(model, plan: CurvePlan, as_json: bool):
    """measure_curve (and measure_surface with plan.batches) under one progress bar counting forwards; each
    point's numbers are printed above it as its context finishes (not under --json). `tune --profile` measures
    its quick curve through this too. -> (curve results, surface results or None)."""
    from specscope.economics.verify_curve import measure_curve, measure_surface
    from specscope.progress import Progress

    total = (plan.warmup + plan.repeats) * plan.points
    done = [0]
    meter = ContentionMeter()
    with Progress("verify-curve", total, "forward", json_mode=as_json) as bar, meter:
        def point(row):
            done[0] += 1
            if not as_json:
                where = f"batch {row['batch']:>4} × n = {row['tokens']:>3} at context {row['context']}" \
                    if "batch" in row else f"context {row['context']:>5}, n = {row['tokens']:>3}"
                bar.note(f"[{done[0]}/{plan.points}] {where}: {row['median_ms']:8.2f} "
                         f"ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})")

        res = measure_curve(model, plan.contexts, plan.tokens, plan.warmup, plan.repeats, point, tick=bar.advance)
        surface = None
        if plan.batches is not None:
            surface = measure_surface(model, plan.batches, plan.batch_context, plan.tokens, plan.warmup,
                                      plan.repeats, plan.max_seq_len, point, tick=bar.advance)
    if meter.result is not None:     # what else ran meanwhile: a loaded curve is stored marked, never priced from
        res["contention"] = meter.result.to_dict()
    return res, surface


def curve_record(plan: CurvePlan, res: dict, surface: dict | None, machine: dict) -> tuple[dict, dict, dict]:
    """A verify_curve run's (config, results, samples): `machine` (where and what was measured) and the plan; the
    points and fits, with the one-token time per context as decode_ms; the surface beside them."""
    config = {**machine, "contexts": plan.contexts, "tokens": plan.tokens, "warmup": plan.warmup,
              "repeats": plan.repeats}
    results = {"points": res["points"], "fits": res["fits"],
               "decode_ms": {str(L): next(p["median_ms"] for p in res["points"] if p["context"] == L
                                          and p["tokens"] == min(plan.tokens)) for L in plan.contexts}}
    if res.get("contention"):
        results["contention"] = res["contention"]
    samples = {"verify_ms": res["samples"]}
    if surface is not None:
        config.update({"batches": plan.batches, "batch_context": plan.batch_context,
                       "max_seq_len": plan.max_seq_len})
        results["surface"] = surface_results(surface)
        samples["batch_verify_ms"] = surface["samples"]
    return config, results, samples


def curve_words(res: dict, tokens: list[int]) -> tuple[dict, dict]:
    """Per context (as a string): where the curve stops being flat, and how many tokens verify within 10% of
    one (none when too noisy to say) -> (knee words, within-10% words)."""
    by_ctx = {L: [p for p in res["points"] if str(p["context"]) == L] for L in res["fits"]}
    words = {L: knee_words(f, max(tokens), by_ctx[L]) for L, f in res["fits"].items()}
    cheap = {L: cheap_words(by_ctx[L], f) for L, f in res["fits"].items()}
    return words, cheap


def loaded_words(run: dict) -> str | None:
    """Why a stored verify curve is no basis for pricing (measured while other processes took the CPUs), or None."""
    c = Contention.from_dict(((run.get("results") or {}).get("contention")))
    return c.words() if c is not None and c.loaded else None
