"""Speculation by concurrency: plain vs speculative decoding with the batched engine at 1, 2, 4, 8, 16 sequences.

    .venv/bin/python bench/spec_concurrency.py [--concurrency 1,2,4,8,16] [--requests 48] [--max-new-tokens 64]
        [--drafts smollm2-135m-eagle3,smollm2-135m-eagle3+ngram] [--threads 2] [--policy]
        [--out bench/results/spec_concurrency.json] [--plot bench/results/spec_concurrency.png]

Closed loop (engine/batch.py's BatchEngine): C requests in flight, the next prompt added as one finishes, until
--requests are done; MT-bench first turns (chat template), greedy, fp32. At each C plain decoding and every drafter
(at the shape it declares; the hybrid with its default n-gram budget) run the same prompts one after another, and
every output is compared with offline `generate`. Measured speedup = speculative tok/s ÷ plain tok/s at the same C,
prefill included on both sides; the measured crossover is where it falls to 1 (interpolated in log2 C, as the
tuner's is).

Beside it, the tuner's prediction from the same run: a verify surface T(B, n) measured here (at the requests' mean
context, regions as wide as the engine's) and each drafter's acceptance and per-cycle costs from one profiled
batch-1 pass (as `tune --profile` makes it) give the predicted speedup per C of the benchmarked shape, and the best
shape per C with its crossover (what `tune --save-policy` saves). --policy also runs each drafter under that table
(`economics.policy`: the best shape per batch size, plain past the crossover).

Writes --out (JSON: config, environment fingerprint, the surface, per level and mode tok/s, τ, speedups, both
crossovers, the tuned table) and --plot. Exit 1 if an output differs from offline generate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SURFACE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def base_draft(mode: str) -> str:
    """The drafter a mode runs: 'D', 'D (tuned)' and 'D (policy)' -> 'D'."""
    return mode.removesuffix(" (policy)").removesuffix(" (tuned)")


def parse_levels(text: str) -> list[int]:
    from specscope.economics.verify_curve import parse_int_list

    return parse_int_list(text, "--concurrency")


def closed_loop(engine, prompts: list[list[int]], max_new_tokens: int, stop_ids, concurrency: int) -> dict:
    """Run every prompt through `engine` keeping `concurrency` requests in flight: the first C are added at once,
    then one more each time one finishes. Returns outputs (in prompt order), tokens, wall seconds, engine steps,
    tok/s and τ pooled over every speculative cycle (None for plain decoding)."""
    from specscope.engine import Request

    outputs: dict[int, list[int]] = {}
    acc = cycles = steps = 0
    nxt = 0

    def add():
        nonlocal nxt
        engine.add(Request(str(nxt), list(prompts[nxt]), max_new_tokens, stop_ids=tuple(stop_ids)))
        nxt += 1

    t0 = time.perf_counter()
    while nxt < min(concurrency, len(prompts)):
        add()
    while engine.busy:
        for f in engine.step():
            if f.stop_reason not in ("eos", "length"):
                raise RuntimeError(f"request {f.id} ended {f.stop_reason}: {f.exc!r}")
            outputs[int(f.id)] = f.token_ids
            if f.stats is not None:
                acc += sum(f.stats.accept_lengths)
                cycles += f.stats.cycles
            if nxt < len(prompts):
                add()
        steps += 1
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    return {"outputs": [outputs[i] for i in range(len(prompts))], "tokens": tokens, "wall_s": wall, "steps": steps,
            "tok_per_s": tokens / wall if wall > 0 else float("nan"),
            "accept_length": acc / cycles if cycles else None}


def mismatches(outputs: list[list[int]], refs: list[list[int]]) -> list[int]:
    """Indices of the requests whose tokens differ from offline generate's."""
    return [i for i, (a, b) in enumerate(zip(outputs, refs)) if a != b]


def speedups(plain: dict, spec: dict) -> dict:
    """{C: spec tok/s ÷ plain tok/s} over the levels both ran."""
    return {C: spec[C]["tok_per_s"] / plain[C]["tok_per_s"] for C in plain if C in spec}


def surface_tokens(widest: float) -> list[int]:
    """The verify widths to measure: the usual grid up to the widest the predictions read (beyond, the fit)."""
    top = max(2, int(-(-widest // 1)))
    return sorted({n for n in SURFACE_TOKENS if n < top} | {top})


def profile_shape(draft: str, text: str):
    """What the tuner profiles a drafter with: a wide tree (`tune --profile`'s), a chain for n-gram copying alone,
    and a hybrid with twice its default n-gram budget (to choose a shorter one from)."""
    from specscope.speculative.decode import HYBRID_NGRAM_TOKENS, DraftSpec, SpecConfig

    steps, topk, dt = (int(x) for x in text.split(","))
    spec = DraftSpec.parse(draft)
    if spec.ngram_only:
        return SpecConfig.from_knobs(steps, 1, steps + 1)
    return SpecConfig.from_knobs(steps, topk, dt, 2 * HYBRID_NGRAM_TOKENS if spec.hybrid else None)


def predictions(target, drafter, model, draft, shape, prompt_ids, max_new_tokens, stop, surface, levels, prof_cfg,
                max_draft_tokens) -> dict:
    """The tuner's view of one drafter: profiled once at batch 1, priced at every level with the surface."""
    from specscope.economics import tune as T
    from specscope.economics.policy import make_table
    from specscope.economics.probe import profile

    brec, srec = profile(target, drafter, prompt_ids, prof_cfg, max_new_tokens, stop, {}, record=False)
    acc = T.AcceptanceModel.from_run(srec)
    cost = T.CostModel.from_runs(srec, brec, surface.curves.get(1), surface=surface)
    hyb = T.HybridModel.from_run(srec) if srec["results"].get("hybrid_cycles") else None
    configs = T.candidate_configs(acc, max_draft_tokens=max_draft_tokens)
    if hyb is not None:
        cost = cost.drafted_only(1.0 - hyb.copy_share)
        configs = T.hybrid_configs(configs, hyb)
    fixed = {C: T.predict(acc, cost, shape.steps, shape.topk, shape.draft_tokens, shape.ngram_tokens, hyb, C)
             for C in levels}
    best, skipped = T.by_concurrency(acc, cost, configs, levels, hyb)
    fixed_cross = T.crossover(list(fixed), [r["speedup"] for r in fixed.values()])
    best_cross = T.crossover([r["batch"] for r in best], [r["speedup"] for r in best])
    return {"profile_shape": vars(prof_cfg), "profiled_tau": srec["results"].get("accept_length"),
            "shape_speedup": {C: r["speedup"] for C, r in fixed.items()},
            "shape_tau": {C: r["tau"] for C, r in fixed.items()}, "shape_crossover": fixed_cross,
            "best": best, "best_crossover": best_cross, "not_predicted": skipped,
            "table": make_table(best, best_cross, model, draft)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafts", default="smollm2-135m-eagle3,smollm2-135m-eagle3+ngram",
                    help="drafters, comma-separated, each at the shape it declares")
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="requests in flight, comma-separated")
    ap.add_argument("--requests", type=int, default=48, help="prompts per level and mode (MT-bench, cycled)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--profile-prompts", type=int, default=4, help="prompts of the profiled batch-1 pass")
    ap.add_argument("--profile-shape", default="5,4,24", help="steps,topk,draft_tokens profiled (tune --profile's)")
    ap.add_argument("--max-draft-tokens", type=int, default=24, help="widest tree the tuner considers")
    ap.add_argument("--surface-repeats", type=int, default=5, help="timed forwards per surface point")
    ap.add_argument("--policy", action="store_true", help="also run each drafter under its tuned policy table")
    ap.add_argument("--tuned", action="store_true",
                    help="also run each drafter at the tuner's best shape for each level, speculating always: the "
                         "measured crossover of the shapes the tuner's own crossover is predicted for")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per level, alternating the order of the modes; the best tok/s of each is kept "
                         "(on a shared machine, disturbance only ever slows a run down)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_concurrency.json"))
    ap.add_argument("--plot", default=str(ROOT / "bench" / "results" / "spec_concurrency.png"))
    args = ap.parse_args(argv)
    from specscope.errors import SpecscopeError

    try:
        levels = parse_levels(args.concurrency)
    except SpecscopeError as e:
        ap.error(str(e))
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.requests < max(levels):
        ap.error(f"--requests {args.requests} is fewer than the largest --concurrency {max(levels)}")

    import torch

    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    from specscope.economics.plots import plot_speedup_by_concurrency
    from specscope.economics.policy import envelope, policy_from_table
    from specscope.economics.tune import crossover
    from specscope.economics.verify_curve import VerifySurface, measure_surface, surface_results
    from specscope.engine import BatchEngine
    from specscope.generate import generate
    from specscope.prompts import load_prompts
    from specscope.registry.fingerprint import collect, timing_warning
    from specscope.session import load_target, stop_ids_for
    from specscope.speculative.decode import SpecConfig, build_drafter

    say = Console(stderr=True).print
    t_start = time.perf_counter()
    target, tok, path = load_target(args.model, args.dtype, "cpu")
    stop = stop_ids_for(target, tok)
    rows = load_prompts("mt_bench")["prompts"]
    texts = [rows[i % len(rows)]["prompt"] for i in range(args.requests)]
    ids = [tok.encode(p, chat=True) for p in texts]
    seq_len = max(len(x) for x in ids) + args.max_new_tokens    # the engine's --max-seq-len: regions that fit
    context = round(sum(map(len, ids)) / len(ids) + args.max_new_tokens / 2)
    drafts = [d for d in args.drafts.split(",") if d]
    shapes = {d: SpecConfig.for_drafter(d) for d in drafts}
    drafters = {d: build_drafter(d, target) for d in drafts}

    say(f"offline generate: {len(ids)} prompts × {args.max_new_tokens} tokens ...")
    refs = [generate(target, x, args.max_new_tokens, None, stop).token_ids for x in ids]

    prof_cfgs = {d: profile_shape(d, args.profile_shape) for d in drafts}
    widest = max([args.max_draft_tokens + c.ngram_tokens for c in prof_cfgs.values()]
                 + [s.verify_tokens for s in shapes.values()])
    toks = surface_tokens(widest)
    say(f"verify surface: batch {', '.join(map(str, levels))} × n = {', '.join(map(str, toks))} at context "
        f"{context} (regions of {seq_len} tokens) ...")
    # batch 1 always: the tuner scales its batch-1 measurements by T(B, n)/T(1, n)
    surf = measure_surface(target, sorted(set(levels) | {1}), context, toks, warmup=1, repeats=args.surface_repeats,
                           max_seq_len=seq_len,
                           progress=lambda r: say(f"  batch {r['batch']:>3} × n {r['tokens']:>3}: "
                                                  f"{r['median_ms']:.2f} ms"))
    surface = VerifySurface.from_results(surf)
    pred = {}
    for d in drafts:
        say(f"profiling {d} at batch 1 ({args.profile_prompts} prompts, shape {vars(prof_cfgs[d])}) ...")
        pred[d] = predictions(target, drafters[d], args.model, d, shapes[d], ids[:args.profile_prompts],
                              args.max_new_tokens, stop, surface, levels, prof_cfgs[d], args.max_draft_tokens)

    modes = ["plain"] + drafts + ([f"{d} (tuned)" for d in drafts] if args.tuned else []) \
        + ([f"{d} (policy)" for d in drafts] if args.policy else [])
    runs: dict[str, dict[int, dict]] = {m: {} for m in modes}
    bad = []

    def engine_for(m: str, C: int):
        # no prefix caching: an EAGLE-3 drafter cannot use it, and plain decoding alone skipping shared prompt
        # prefixes would make the ratio about prefill, not about decoding
        d, kw = base_draft(m), {"prefix_caching": False}
        if m == "plain":
            return BatchEngine(target, None, None, C, seq_len, **kw)
        if m in drafters:
            return BatchEngine(target, drafters[m], shapes[m], C, seq_len, **kw)
        if m.endswith(" (tuned)"):
            b = next(r for r in pred[d]["best"] if r["batch"] == C)
            shape = SpecConfig(b["steps"], b["topk"], b["draft_tokens"], int(b.get("ngram_tokens") or 0))
            return BatchEngine(target, drafters[d], shape, C, seq_len, **kw)
        env = envelope(pred[d]["table"])
        return BatchEngine(target, drafters[d], env, C, seq_len, spec_policy=policy_from_table(pred[d]["table"], env),
                           **kw)

    from specscope.progress import Progress

    # the shared progress: a bar on a terminal, a line every 30 s in a log (rate and time left over all runs)
    with Progress("closed-loop runs", len(levels) * args.rounds * len(modes), "run", every_s=30) as prog:
        for C in levels:
            for rnd in range(args.rounds):
                for m in (modes if rnd % 2 == 0 else modes[::-1]):    # ABBA: drift hits every mode alike
                    eng = engine_for(m, C)
                    r = closed_loop(eng, ids, args.max_new_tokens, stop, C)
                    del eng
                    wrong = mismatches(r.pop("outputs"), refs)
                    r["identical"] = len(ids) - len(wrong)
                    bad += [{"concurrency": C, "mode": m, "round": rnd, "request": i, "prompt": texts[i][:80]}
                            for i in wrong]
                    prev = runs[m].get(C)
                    r["rounds_tok_per_s"] = (prev["rounds_tok_per_s"] if prev else []) + [r["tok_per_s"]]
                    if prev is None or r["tok_per_s"] > prev["tok_per_s"]:
                        runs[m][C] = r
                    else:
                        prev["rounds_tok_per_s"] = r["rounds_tok_per_s"]
                    tau = f", τ {r['accept_length']:.2f}" if r["accept_length"] else ""
                    prog.advance()
                    prog.note(f"C={C:>2} round {rnd + 1} {m}: {r['tok_per_s']:.1f} tok/s{tau}, {r['identical']}/"
                              f"{len(ids)} identical, {r['wall_s']:.1f} s")

    summary = {}
    for m in modes[1:]:
        d = base_draft(m)
        sp = speedups(runs["plain"], runs[m])
        s = {"speedup": sp, "crossover": crossover(list(sp), list(sp.values()))}
        if m.endswith(" (tuned)"):
            s.update({"predicted_speedup": {b["batch"]: b["speedup"] for b in pred[d]["best"]},
                      "predicted_crossover": pred[d]["best_crossover"],
                      "shapes": {b["batch"]: [b["steps"], b["topk"], b["draft_tokens"], b.get("ngram_tokens") or 0]
                                 for b in pred[d]["best"]}})
        if m in drafters:
            p = pred[d]
            s.update({"shape": vars(shapes[d]), "predicted_speedup": p["shape_speedup"],
                      "predicted_crossover": p["shape_crossover"], "tuned": p["best"],
                      "tuned_crossover": p["best_crossover"], "profiled_tau": p["profiled_tau"],
                      "profile_shape": p["profile_shape"], "not_predicted": p["not_predicted"]})
        summary[m] = s

    table = Table(title=f"plain vs speculative decoding by concurrency ({args.model}, {args.dtype}, {args.threads} "
                        f"threads, {args.requests} requests × {args.max_new_tokens} tokens, greedy)")
    for c in ("C", "mode", "tok/s", "τ", "speedup", "predicted", "tuned best (pred)", "identical"):
        table.add_column(c, justify="left" if c in ("mode", "tuned best (pred)") else "right")
    for C in levels:
        for m in modes:
            r = runs[m][C]
            s = summary.get(m, {})
            best = next((b for b in s.get("tuned") or [] if b["batch"] == C), None)
            table.add_row(str(C), m, f"{r['tok_per_s']:.1f}", f"{r['accept_length']:.2f}" if r["accept_length"] else "",
                          f"{s['speedup'][C]:.2f}x" if m != "plain" else "",
                          f"{s['predicted_speedup'][C]:.2f}x" if "predicted_speedup" in s else "",
                          (f"{best['steps']}×{best['topk']}×{best['draft_tokens']}"
                           + (f"+{best['ngram_tokens']}" if best.get("ngram_tokens") else "")
                           + f" {best['speedup']:.2f}x") if best else "",
                          f"{r['identical']}/{len(ids)}")
    Console().print(table)

    def words(x, speedup_at_first):
        if x is None:
            return "none in range (speculation pays at every level)"
        if x == levels[0] and speedup_at_first <= 1.0:
            return f"≤ {x:g} (plain decoding is faster at every level)"
        return f"{x:.1f}"

    for m, s in summary.items():
        line = f"{m}: measured crossover {words(s['crossover'], s['speedup'][levels[0]])}"
        if m.endswith(" (tuned)"):
            line += f"; predicted {words(s['predicted_crossover'], s['predicted_speedup'][levels[0]])}"
        elif "predicted_crossover" in s:
            tuned0 = s["tuned"][0]["speedup"] if s["tuned"] else 0.0
            line += (f"; predicted {words(s['predicted_crossover'], s['predicted_speedup'][levels[0]])} for this "
                     f"shape, {words(s['tuned_crossover'], tuned0)} for the tuner's best shape per level")
        print(line)

    series = []
    for m, s in summary.items():
        d = base_draft(m)
        series.append({"label": f"{m}: measured", "group": d, "style": "policy" if m != d else "measured",
                       "crossover": s["crossover"],
                       "levels": list(s["speedup"]), "speedups": list(s["speedup"].values())})
        if "predicted_speedup" in s:
            series.append({"label": f"{m}: predicted", "group": d, "style": "predicted",
                           "crossover": s["predicted_crossover"], "levels": list(s["predicted_speedup"]),
                           "speedups": list(s["predicted_speedup"].values())})
    plot = plot_speedup_by_concurrency(series, args.plot, title=f"speculation by concurrency: {args.model}, "
                                                               f"{args.threads} threads (dotted: crossovers)")
    result = {
        "what": "plain vs speculative decoding with BatchEngine, closed loop at each concurrency; measured speedup "
                "and crossover beside the tuner's prediction from a verify surface measured in the same run",
        "command": "python bench/spec_concurrency.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {**vars(args), "model_path": str(path), "levels": levels, "seq_len": seq_len,
                   "surface_context": context, "surface_tokens": toks, "temperature": 0.0,
                   "shapes": {d: vars(s) for d, s in shapes.items()}},
        "env": collect(),
        "surface": surface_results(surf),
        "runs": {m: {str(C): r for C, r in v.items()} for m, v in runs.items()},
        "summary": json.loads(json.dumps(summary, default=str)),
        "tables": {d: p["table"] for d, p in pred.items()},
        "checks": {"every_output_identical_to_generate": not bad},
        "mismatches": bad[:20],
        "plot": plot,
        "wall_min": (time.perf_counter() - t_start) / 60,
    }
    result["load_warning"] = timing_warning(result["env"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out} and {plot}", file=sys.stderr)
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)
    if bad:
        print(f"FAIL: {len(bad)} output(s) differ from offline generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
