"""Tuner check: predict speedups from ONE profiled run, then measure chain and tree configurations for real.

    .venv/bin/python bench/tune.py [--draft smollm2-135m-eagle3] [--threads 2] [--out bench/results/tune.json]

Goal (issue #6): median |predicted − measured| / measured speedup <= 10 % over >= 6 configurations, chain and tree,
in one run. Steps: (1) one profiled baseline + speculative run at a wide tree (rank-wise acceptance, phase costs),
(2) a verify curve at the run's mean context, (3) predictions for every (steps, topk, draft_tokens) with no further
measurement, (4) the best predicted chains and trees measured with the real engine, plain decoding alternated
prompt by prompt so that load drift on a shared CPU cancels in the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layerskip_drafter(model_dir: Path, layers: int, cache: Path) -> Path:
    """A stand-in draft model for when no trained drafter is shipped: the target's first `layers` decoder layers
    with its final norm and lm_head (early exit, as in LayerSkip / Draft & Verify). Written once to `cache`."""
    from safetensors.torch import load_file, save_file

    out = cache / f"{model_dir.name}-layerskip{layers}"
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    if not 1 <= layers < cfg["num_hidden_layers"]:
        raise SystemExit(f"layerskip:{layers}: the target has {cfg['num_hidden_layers']} layers")
    cfg["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    st = load_file(str(model_dir / "model.safetensors"))
    keep = {k: v for k, v in st.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def pick(rows, n_chain: int, n_tree: int):
    """The best predicted chains and trees (each list best first)."""
    chains = [r for r in rows if r["topk"] == 1][:n_chain]
    trees = [r for r in rows if r["topk"] > 1][:n_tree]
    return chains + trees


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-eagle3",
                    help="drafter name or directory; layerskip:K = the target's first K layers as a stand-in")
    ap.add_argument("--prompts", default="spec_bench",
                    help="'spec_bench' (the packaged question file, in file order), 'mt_bench' or a prompt file")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--profile", default="5,4,16", help="steps,topk,draft_tokens of the one profiled run")
    ap.add_argument("--chains", type=int, default=3, help="chain configurations to measure")
    ap.add_argument("--trees", type=int, default=4, help="tree configurations to measure")
    ap.add_argument("--max-draft-tokens", type=int, default=32)
    # one thread: on a shared, oversubscribed CPU two torch threads wait on each other and amplify stalls
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stat", default="mean", choices=["mean", "median"])
    ap.add_argument("--profile-rounds", type=int, default=2,
                    help="times the profiled run goes over the prompts (more data for its costs and acceptance)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--passes", type=int, default=1,
                    help="measure the chosen configurations this many times, alternating their order, and average "
                         "(cancels load that drifts over the run)")
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tune.json"))
    ap.add_argument("--plot-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    import torch

    from specscope.cli.economics import read_prompts
    from specscope.economics import tune as T
    from specscope.economics.plots import plot_pred_vs_measured, plot_tau_needed
    from specscope.economics.probe import encode_prompts, profile, validate
    from specscope.economics.verify_curve import VerifyCurve, measure_curve
    from specscope.progress import Progress
    from specscope.session import load_target, stop_ids_for
    from specscope.registry import default_db_path, make_record, prompt_set_hash, store_record
    from specscope.registry.fingerprint import collect, timing_warning
    from specscope.speculative.decode import SpecConfig, build_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    log = lambda m: print(f"[{time.time() - t_start:6.0f}s] {m}", file=sys.stderr, flush=True)  # noqa: E731
    target, tok, path = load_target(args.model, args.dtype, args.device)
    draft = args.draft
    if draft.startswith("layerskip:"):
        from specscope.models.hub import cache_dir

        draft = str(layerskip_drafter(Path(path), int(draft.split(":")[1]), cache_dir() / "standin"))
    drafter = build_drafter(draft, target)
    prompts = read_prompts(args.prompts, args.num_prompts)
    ids = encode_prompts(tok, prompts)
    stop = stop_ids_for(target, tok)
    s, k, n = (int(x) for x in args.profile.split(","))
    cfg = SpecConfig(s, k, n)
    cfg.validate()
    config = {"model": str(path), "draft": draft, "draft_spec": args.draft, "dtype": args.dtype, "device": args.device,
              "threads": torch.get_num_threads(), "prompts": prompts, "prompt_set_hash": prompt_set_hash(prompts),
              "max_new_tokens": args.max_new_tokens, "sampling": {"temperature": 0.0}}

    log(f"profiling one run: steps {s} topk {k} draft tokens {n}, {len(ids)} prompts x {args.max_new_tokens} tokens")
    brec, srec = profile(target, drafter, ids, cfg, args.max_new_tokens, stop, config, args.db,
                         rounds=args.profile_rounds)
    log(f"profiled: baseline {brec['results']['decode_ms_per_token']:.2f} ms/token, τ "
        f"{srec['results']['accept_length']:.2f}, cycle {srec['results']['cycle_ms']['mean_ms']:.2f} ms")

    L = int(srec["results"]["mean_context"])
    widths = sorted({w for w in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32) if w <= args.max_draft_tokens})
    log(f"verify curve at context {L} for n = {widths}")
    curve_res = measure_curve(target, [L], widths, warmup=1, repeats=5)
    crec = make_record("verify_curve", f"bench tune verify curve L{L}",
                       config={"model": str(path), "dtype": args.dtype, "device": args.device, "contexts": [L],
                               "tokens": widths, "warmup": 1, "repeats": 5},
                       results={"points": curve_res["points"], "fits": curve_res["fits"]},
                       samples={"verify_ms": curve_res["samples"]})
    crec["id"] = store_record(crec, args.db)
    curve = VerifyCurve.from_run(crec)

    acc = T.AcceptanceModel.from_run(srec)
    cost = T.CostModel.from_runs(srec, brec, curve, stat=args.stat)
    rows = T.rank(acc, cost, T.candidate_configs(acc, max_draft_tokens=args.max_draft_tokens))
    chosen = pick(rows, args.chains, args.trees)
    log(f"{len(rows)} configurations predicted; measuring {len(chosen)}: "
        + ", ".join(f"s{r['steps']}k{r['topk']}n{r['draft_tokens']}={r['speedup']:.2f}x" for r in chosen))
    picks = [(r["steps"], r["topk"], r["draft_tokens"]) for r in chosen]
    passes = []
    # the shared progress over every validation prompt (plain + speculative), all passes
    with Progress("validate", max(1, args.passes) * len(picks) * len(ids), "prompt", every_s=30) as prog:
        for i in range(max(1, args.passes)):
            order = picks if i % 2 == 0 else picks[::-1]
            got = validate(target, drafter, ids, order, args.max_new_tokens, stop, tick=lambda knobs: prog.advance(),
                           progress=lambda m: prog.note(f"measured s{m['steps']}k{m['topk']}n{m['draft_tokens']}: "
                                                        f"{m['measured']:.2f}x, τ {m['measured_tau']:.2f}"))
            passes.append({(m["steps"], m["topk"], m["draft_tokens"]): m for m in got})
    measured = []
    for c in picks:
        ms = [p[c] for p in passes]
        avg = {k_: statistics.mean(m[k_] for m in ms) for k_ in ("measured", "measured_tau", "ms_per_token",
                                                                  "baseline_ms_per_token")}
        measured.append({**ms[0], **avg, "passes": [m["measured"] for m in ms]})
    table = []
    for r, m in zip(chosen, measured):
        table.append({"label": f"s{r['steps']} k{r['topk']} n{r['draft_tokens']}", "shape": r["shape"],
                      "steps": r["steps"], "topk": r["topk"], "draft_tokens": r["draft_tokens"],
                      "predicted": r["speedup"], "measured": m["measured"],
                      "rel_error": abs(r["speedup"] - m["measured"]) / m["measured"],
                      "predicted_tau": r["tau"], "measured_tau": m["measured_tau"],
                      "predicted_cycle_ms": r["cycle_ms"],
                      "measured_cycle_ms": m["ms_per_token"] * m["measured_tau"],
                      "baseline_ms_per_token": m["baseline_ms_per_token"], "spec_ms_per_token": m["ms_per_token"],
                      "measured_per_pass": m["passes"]})
    err = T.error_summary(table)
    tau_errs = [abs(r["predicted_tau"] - r["measured_tau"]) / r["measured_tau"] for r in table]
    plots = [plot_tau_needed(T.best_by_draft_tokens(rows), Path(args.plot_dir) / "tune-tau-needed.png"),
             plot_pred_vs_measured(table, Path(args.plot_dir) / "tune-predicted-vs-measured.png")]
    ok = err["median_rel_error"] <= 0.10 and len(table) >= 6 and {r["shape"] for r in table} == {"chain", "tree"}
    out = {
        "goal": "median |predicted - measured| / measured speedup <= 10% over >= 6 configurations, chain and tree",
        "met": ok, "median_rel_error": err["median_rel_error"], "max_rel_error": err["max_rel_error"],
        "median_tau_rel_error": statistics.median(tau_errs), "configurations": table,
        "profiled": {"registry": str(args.db or default_db_path()), "run": srec["id"], "baseline_run": brec["id"],
                     "verify_curve_run": crec["id"],
                     "config": {"steps": s, "topk": k, "draft_tokens": n},
                     "accept_length": srec["results"]["accept_length"],
                     "acceptance_by_depth_rank": acc.rates, "phases": srec["results"]["phases"],
                     "baseline_decode_ms_per_token": brec["results"]["decode_ms_per_token"],
                     "verify_fit": curve_res["fits"]},
        "top_predictions": rows[:10], "cost_notes": cost.notes,
        "setup": {k_: v for k_, v in config.items() if k_ != "prompts"} | {"num_prompts": len(prompts)},
        "env": {"cpu": collect()["cpu"], "torch_threads": torch.get_num_threads()},
        "plots": [str(Path(p).relative_to(ROOT)) if Path(p).is_relative_to(ROOT) else p for p in plots],
        "wall_s": round(time.time() - t_start, 1),
        "load_warning": timing_warning(srec.get("env")),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"{'config':<14}{'predicted':>10}{'measured':>10}{'error':>8}{'τ pred':>8}{'τ meas':>8}")
    for r in table:
        print(f"{r['label']:<14}{r['predicted']:>9.2f}x{r['measured']:>9.2f}x{r['rel_error'] * 100:>7.1f}%"
              f"{r['predicted_tau']:>8.2f}{r['measured_tau']:>8.2f}")
    print(f"median |pred - meas| / meas = {err['median_rel_error'] * 100:.1f}% over {err['n']} configurations "
          f"-> goal {'met' if ok else 'NOT met'}; wrote {args.out}")
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
