"""How much does the cycle profiler cost? Measured on SmolLM2-135M (baseline decode; speculative with the n-gram
drafter when `specscope.speculative` is available).

Two measurements, because each alone is weak on a shared 2-core machine:

1. direct: the profiler times its own enter/exit and end_cycle calls (calibrated in-process, `profiler_overhead`
   in the summary) × calls per cycle, against the mean cycle time. This is the number the < 2 % budget is about.
   Checked in situ: per cycle, the engine's own wall time around profiled code minus what the profiler measured
   inside it (`in_situ_us_per_cycle`).
2. A/B: alternating runs with and without a profiler, median per-cycle wall time of each (`step_ms` of the
   GenerationResult, timed the same way in both paths). Its noise (shown as the spread between repeats) is
   usually larger than the overhead itself, so it bounds the overhead rather than measures it.

    .venv/bin/python bench/profiler_overhead.py [--tokens 64] [--pairs 4] [--threads 2] [--out bench/results/...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

FLOOR_MS = 11.0
PROMPT = "Explain in a few sentences how a CPU cache works and why it makes programs faster."


def _median_step(res) -> float:
    return statistics.median(res.step_ms)


def in_situ_us(res, prof, column: str | None) -> float:
    """Median over cycles of (the engine's own wall time around profiled code) - (what the profiler measured
    inside it): the profiler's cost as the loop sees it, an upper bound (a few Python statements included)."""
    sm = prof.samples()
    inner = sm["cycle_ms"][column] if column else sm["cycle_total_ms"]
    if len(inner) != len(res.step_ms):
        return float("nan")
    return statistics.median((w - i) * 1e3 for w, i in zip(res.step_ms, inner))


def measure(run, pairs: int, column: str | None, tick=None) -> dict:
    """run(profiler) -> GenerationResult. Alternates with/without to cancel drift. tick(): after each run."""
    from specscope.profile import CycleProfiler

    tick = tick or (lambda: None)
    run(None)                                  # warm-up (allocator, kernels, caches)
    tick()
    with_ms, without_ms, direct = [], [], []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        for use in order:
            prof = CycleProfiler() if use else None
            res = run(prof)
            tick()
            (with_ms if use else without_ms).append(_median_step(res))
            if use:
                s = prof.summary()
                direct.append({"cycles": s["cycles"], "mean_cycle_ms": s["cycle_ms"]["mean_ms"],
                               "phases_per_cycle": s["profiler_overhead"]["phases_per_cycle"],
                               "us_per_phase": s["profiler_overhead"]["us_per_phase"],
                               "us_per_end_cycle": s["profiler_overhead"]["us_per_end_cycle"],
                               "overhead_ms_per_cycle": s["profiler_overhead"]["ms_per_cycle"],
                               "overhead_share": s["profiler_overhead"]["share"],
                               "in_situ_us_per_cycle": round(in_situ_us(res, prof, column), 2),
                               "phases": {k: v["mean_ms"] for k, v in s["phases"].items()}})
    w, wo = statistics.median(with_ms), statistics.median(without_ms)
    return {
        "direct": {"overhead_share_max": max(d["overhead_share"] for d in direct),
                   "overhead_us_per_cycle_median": statistics.median(d["overhead_ms_per_cycle"] * 1e3
                                                                     for d in direct),
                   "mean_cycle_ms_median": statistics.median(d["mean_cycle_ms"] for d in direct),
                   "in_situ_us_per_cycle_median": statistics.median(d["in_situ_us_per_cycle"] for d in direct),
                   "runs": direct},
        "ab": {"with_profiler_step_ms": [round(x, 3) for x in with_ms],
               "without_profiler_step_ms": [round(x, 3) for x in without_ms],
               "median_with": round(w, 3), "median_without": round(wo, 3),
               "delta_pct": round((w / wo - 1) * 100, 3),
               # spread of repeats within each arm: the A/B delta means something only well above this
               "noise_pct": round(max((max(v) - min(v)) / statistics.median(v) * 100 for v in (with_ms, without_ms)),
                                  3)},
    }


def measure_arms(model, ids, sp, stop, args) -> dict:
    """{"baseline": ..., "speculative": ...}: each arm a warm-up run and `pairs` runs with and without the profiler,
    under the shared progress (specscope.progress: a bar on a terminal, lines in a log; stderr)."""
    from specscope.generate import generate
    from specscope.progress import Progress

    try:
        from specscope.generate import speculative_generate
        from specscope.speculative.decode import SpecConfig, build_drafter
    except ImportError:
        speculative_generate = None
    out = {}
    arms = 1 + (speculative_generate is not None)
    with Progress("profiler overhead", arms * (1 + 2 * args.pairs), "run", every_s=30) as prog:
        # baseline step_ms brackets the "decode" phase; speculative step_ms brackets the whole profiled cycle
        out["baseline"] = measure(lambda prof: generate(model, ids, args.tokens, sp, stop, profiler=prof),
                                  args.pairs, "decode", tick=lambda: prog.advance(info="baseline"))
        if speculative_generate is None:
            out["speculative"] = {"skipped": "specscope.speculative is not available in this checkout"}
            return out
        cfg = SpecConfig.from_knobs(steps=4, topk=1)

        def spec(prof):
            drafter = build_drafter("ngram", model)
            return speculative_generate(model, drafter, ids, args.tokens, sp, stop, cfg, profiler=prof)

        out["speculative"] = {"drafter": "ngram", "steps": 4,
                              **measure(spec, args.pairs, None, tick=lambda: prog.advance(info="speculative"))}
    return out


def verdict(out: dict) -> dict:
    worst = max(out[k]["direct"]["overhead_share_max"] for k in ("baseline", "speculative") if "direct" in out[k])
    # On a loaded machine cycles are slow and the share looks small; also hold the profiler's µs per cycle against
    # the fastest cycle this model can have here (fp32 bandwidth floor ~11 ms on this kind of machine, see
    # the reference notes), which no load can flatter.
    worst_us = max(max(d["overhead_us_per_cycle_median"], d["in_situ_us_per_cycle_median"])
                   for d in (out[k].get("direct") for k in ("baseline", "speculative")) if d)
    floor_share = worst_us / 1e3 / FLOOR_MS
    return {"budget_share": 0.02, "worst_direct_share": worst, "worst_us_per_cycle": worst_us,
            "share_vs_floor_cycle": round(floor_share, 6), "floor_cycle_ms": FLOOR_MS,
            "within_budget": worst < 0.02 and floor_share < 0.02}


def print_result(out: dict, where: str) -> None:
    for k in ("baseline", "speculative"):
        r = out[k]
        if "direct" in r:
            print(f"{k}: cycle {r['direct']['mean_cycle_ms_median']:.2f} ms, profiler "
                  f"{r['direct']['overhead_us_per_cycle_median']:.1f} us/cycle "
                  f"({r['direct']['overhead_share_max'] * 100:.3f}% worst run), in situ "
                  f"{r['direct']['in_situ_us_per_cycle_median']:.1f} us/cycle; A/B {r['ab']['delta_pct']:+.2f}% "
                  f"(run-to-run noise {r['ab']['noise_pct']:.1f}%)")
        else:
            print(f"{k}: {r['skipped']}")
    print(f"against an {FLOOR_MS:.0f} ms floor cycle: {out['verdict']['share_vs_floor_cycle'] * 100:.3f}%; "
          f"within the 2% budget: {out['verdict']['within_budget']}  -> {where}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profiler_overhead.json"))
    args = ap.parse_args(argv)

    from specscope.runtime.sampling import SamplingParams
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models import load_model
    from specscope.models.hub import resolve_model
    from specscope.registry.fingerprint import collect, timing_warning

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = load_model(path, dtype=args.dtype, device="cpu")
    tok = Tokenizer(path)
    ids = tok.encode(PROMPT, chat=True)
    stop = []          # run to the token budget: every run has the same number of cycles

    out = {"model": str(path), "dtype": args.dtype, "threads": args.threads, "new_tokens": args.tokens,
           "pairs": args.pairs, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "env": {k: v for k, v in collect().items() if k in ("cpu", "packages", "torch", "git")}}
    out["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]    # a shared machine: say how busy it was
    t0 = time.time()
    out.update(measure_arms(model, ids, SamplingParams(), stop, args))
    out["seconds"] = round(time.time() - t0, 1)
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["verdict"] = verdict(out)
    out["load_warning"] = timing_warning(out["env"])    # the A/B cycle times ran under this machine's load
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print_result(out, args.out)
    return 0 if out["verdict"]["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
