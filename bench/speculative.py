"""Speculative decoding on SmolLM2, Spec-Bench prompts by task, greedy, side by side in one run.

Methods: our baseline, EAGLE-3 (tree and chain, the shipped drafter), n-gram copying (the suffix index, `ngram`, and
prompt lookup, `ngram_lookup`), the hybrid of the EAGLE-3 tree and n-gram copying in one verified tree
(`eagle3_ngram`: the fixed copy-first rule, `CopyFirstHybrid`; `eagle3_ngram_priced` and `ngram_priced`: each
cycle's copy length and whether the
drafter runs chosen from this host's measured verify cost by rows, speculative/budget.py; `eagle3_priced`: EAGLE-3
alone under the same rule, drafting where it has paid and verifying the nodes worth their rows), transformers `generate` and transformers prompt-lookup decoding. For each: tok/s (Spec-Bench: Σ new tokens / Σ wall time per prompt, plain
mean over prompts of a task), speedup over our baseline, τ (accepted + 1 per cycle, pooled over cycles), and whether
the output is token-identical to our baseline greedy output.

    .venv/bin/python bench/speculative.py              # all 80 MT-bench first turns + 10 prompts of every other task
    .venv/bin/python bench/speculative.py --limit 2 --mt-bench-limit 8 --hf      # a quick look, transformers too

Long: every finished prompt is appended to a state file in the cache directory (named after the configuration), so
a killed run started again with the same flags continues where it stopped (`--fresh` starts over).
Writes bench/results/speculative.json: per task and per MT-bench category, tok/s, speedup, τ, identical outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
TASKS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def draft_files(spec: str) -> list:
    """What identifies a drafter's weights in a resume key: its files' names, sizes and mtimes (retrained weights
    under the same name are a new measurement)."""
    from specscope.speculative.decode import DraftSpec, drafter_path

    if DraftSpec.parse(spec).ngram_only:     # n-gram copying has no files
        return []
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in drafter_path(spec).iterdir()
                  if p.is_file())


def code_version() -> str:
    """What identifies the measuring code in a resume key: a hash of specscope's sources (Python and the kernels'
    C++), so a rerun after a change measures afresh instead of resuming numbers an older build produced."""
    import hashlib

    import specscope

    root = Path(specscope.__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def pick_prompts(tasks, limit, mt_limit=None):
    from specscope.prompts import spec_bench_path

    rows = [json.loads(line) for line in spec_bench_path().read_text().splitlines() if line.strip()]
    rows = [dict(r, prompt=r["turns"][0]) for r in rows]
    out = []
    for t in tasks:
        sel = [r for r in rows if task_of(r["category"]) == t]
        if t == "mt_bench":  # spread over the eight MT-bench categories rather than the first few writing ones
            by = {}
            for r in sel:
                by.setdefault(r["category"], []).append(r)
            sel = [r for group in zip(*by.values()) for r in group]
        out += [dict(r, task=t) for r in sel[:(mt_limit or limit) if t == "mt_bench" else limit]]
    return out


def prompt_args(ap: argparse.ArgumentParser) -> None:
    """The Spec-Bench selection flags (pick_prompts) and the answer length, shared by the benches that replay it."""
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=10, help="prompts per task (other than MT-bench)")
    ap.add_argument("--mt-bench-limit", type=int, default=80, help="MT-bench first turns (80 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt_args(ap)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default="smollm2-135m-eagle3")
    ap.add_argument("--tree", default="3,2,6;5,4,12",
                    help="steps,topk,draft_tokens for the EAGLE-3 tree(s); several separated by ';'")
    ap.add_argument("--chain", default="3,1,4", help="steps,topk,draft_tokens for the EAGLE-3 chain")
    ap.add_argument("--ngram", default="4,1,5", help="steps,topk,draft_tokens of both n-gram sources")
    ap.add_argument("--hybrid", default="2,4,8,6",
                    help="steps,topk,draft_tokens,ngram_tokens of the hybrid (--draft + n-gram); '' skips it")
    ap.add_argument("--priced-ngram", default="12,1,13",
                    help="steps,topk,draft_tokens of the priced n-gram (draft_tokens - 1: its longest copy)")
    ap.add_argument("--priced-tree", default="2,4,8",
                    help="steps,topk,draft_tokens of EAGLE-3 alone under priced budgets (the shipped drafter's shape)")
    ap.add_argument("--methods", default="", help="comma-separated methods to run beside the baseline (default: all)")
    ap.add_argument("--hf", action="store_true", help="also run transformers generate and prompt lookup")
    ap.add_argument("--no-hf", action="store_true", help=argparse.SUPPRESS)   # the old default-on spelling
    ap.add_argument("--fresh", action="store_true", help="ignore the state file of an earlier, killed run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculative.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers
    from rich.console import Console
    from rich.table import Table

    from specscope.generate import generate
    from specscope.progress import Progress
    from specscope.session import load_target, stop_ids_for
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter
    from specscope.speculative.hybrid import CopyFirstHybrid
    from specscope.errors import SpecscopeError
    from specscope.train.data import open_for_append, read_jsonl

    transformers.logging.set_verbosity_error()
    console = Console(stderr=True)
    target, tok, path = load_target("smollm2-135m", args.dtype, "cpu")
    stop = stop_ids_for(target, tok)
    prompts = pick_prompts(args.tasks.split(","), args.limit, args.mt_bench_limit)

    def knobs(s):
        return SpecConfig(*(int(x) for x in s.split(",")))

    methods = {"baseline": None}
    try:
        eagle = build_drafter(args.draft, target)
        for t in args.tree.split(";"):      # several trees: one method each, named by shape
            k = knobs(t)
            name = "eagle3_tree" if ";" not in args.tree else f"eagle3_tree_{k.steps}x{k.topk}x{k.draft_tokens}"
            methods[name] = ("eagle", k)
        methods["eagle3_chain"] = ("eagle", knobs(args.chain))
        methods["eagle3_priced"] = ("eagle-priced", knobs(args.priced_tree))
        if args.hybrid:
            methods["eagle3_ngram"] = ("hybrid", knobs(args.hybrid))
            methods["eagle3_ngram_priced"] = ("hybrid-priced", knobs(args.hybrid))
    except SpecscopeError as e:
        console.print(f"[yellow]EAGLE-3 skipped: {e}")
        eagle = None
    methods["ngram"] = ("ngram", knobs(args.ngram))
    methods["ngram_lookup"] = ("ngram-lookup", knobs(args.ngram))
    methods["ngram_priced"] = ("ngram-priced", knobs(args.priced_ngram))
    if args.methods:
        keep = {"baseline", *args.methods.split(",")}
        unknown = keep - set(methods) - {"hf_generate", "hf_prompt_lookup"}
        if unknown:
            ap.error(f"--methods: unknown {sorted(unknown)}; choose from {sorted(methods)}")
        methods = {m: v for m, v in methods.items() if m in keep}
    hf = None
    if args.hf and not args.no_hf:
        from transformers import AutoModelForCausalLM

        from specscope.models.loader import compute_dtype

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=compute_dtype(target)).eval()
        methods["hf_generate"] = "hf"
        methods["hf_prompt_lookup"] = "hf_pld"

    # priced methods (speculative/budget.py): this host's verify cost by rows, measured once; their drafters live
    # across prompts, as a server's would, so what they learn about acceptance carries over
    prices, priced = None, {}
    if any(isinstance(v, tuple) and v[0].endswith("-priced") for v in methods.values()):
        from specscope.economics.prices import measure_prices
        from specscope.speculative.hybrid import HybridDrafter, NgramDrafter, PricedDrafter

        prices = measure_prices(target)
        console.print("verify cost by rows (decode steps): " +
                      " ".join(f"{n}:{r:.2f}" for n, r in prices.verify_ratio.items()) +
                      f" · decode {prices.decode_ms:.1f} ms")
        if "ngram_priced" in methods:
            priced["ngram-priced"] = NgramDrafter(target.device, prices=prices)
        if "eagle3_ngram_priced" in methods:
            priced["hybrid-priced"] = HybridDrafter(eagle, target.config.max_position_embeddings, prices=prices)
        if "eagle3_priced" in methods:
            priced["eagle-priced"] = PricedDrafter(eagle.spawn(), target.config.max_position_embeddings, prices)

    per = {m: [] for m in methods}
    # resume: one line per finished prompt (all methods), keyed by the flags that change the numbers
    import hashlib

    from specscope.models.hub import cache_dir

    key = {k: v for k, v in vars(args).items() if k not in ("out", "fresh")}
    key["code"] = code_version()
    if eagle is not None:
        key["draft_files"] = draft_files(args.draft)
    state = cache_dir() / "bench" / f"speculative-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}.jsonl"
    state.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and state.exists():
        state.unlink()
    done = {rec["question_id"]: rec["per"] for rec in read_jsonl(state) if "question_id" in rec}
    if done:
        console.print(f"resuming: {len(done)} of {len(prompts)} prompts already measured ({state})")
    if len(done) < len(prompts):
        # the first forwards of a process run slow (thread pool, buffers, caches: a first plain decode read 46 tok/s
        # where the next read 68), and the baseline goes first: warm each path up on a few tokens, untimed
        ids = tok.encode(prompts[0]["prompt"], chat=True)
        generate(target, ids, 16, stop_ids=stop)
        if eagle is not None:
            speculative_generate(target, CopyFirstHybrid(eagle, target.config.max_position_embeddings), ids, 16,
                                 stop_ids=stop, cfg=knobs(args.hybrid) if args.hybrid else None)
    # the shared progress (specscope.progress): a bar on a terminal, a line every 30 s in a log; the rate counts
    # only this run's prompts, not the resumed ones
    with Progress("prompts × methods", len(prompts) * len(methods), "decode",
                  start=len(done) * len(methods), every_s=30) as prog:
        for p in prompts:
            if p["question_id"] in done:
                for m in methods:
                    per[m].append(done[p["question_id"]][m])
                continue
            ids = tok.encode(p["prompt"], chat=True)
            base = None
            for m, spec in methods.items():
                t0 = time.perf_counter()
                extra = {}
                if spec is None:
                    r = generate(target, ids, args.max_new_tokens, stop_ids=stop)
                    out, secs = r.token_ids, r.seconds
                elif isinstance(spec, tuple):
                    if spec[0] == "eagle":
                        d = eagle
                    elif spec[0] in priced:
                        d = priced[spec[0]]
                    elif spec[0] == "hybrid":   # fresh n-gram state, EAGLE-3 shared
                        d = CopyFirstHybrid(eagle, target.config.max_position_embeddings)
                    else:
                        d = build_drafter(spec[0], target)
                    r = speculative_generate(target, d, ids, args.max_new_tokens, stop_ids=stop, cfg=spec[1])
                    out, secs = r.token_ids, r.seconds
                    extra = {"accept_lengths": r.stats.accept_lengths,
                             **({"accepted_by_source": r.stats.accepted_by_source} if r.stats.hybrid else {})}
                else:
                    kw = {"prompt_lookup_num_tokens": 10} if spec == "hf_pld" else {}
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        o = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                        eos_token_id=stop, pad_token_id=stop[0], **kw)
                        secs = time.perf_counter() - t0
                    out = o[0, len(ids):].tolist()
                if m == "baseline":
                    base = out
                per[m].append({"question_id": p["question_id"], "task": p["task"], "category": p["category"],
                               "tokens": len(out), "seconds": secs, "tok_per_s": len(out) / secs,
                               "identical": out == base, **extra})
                prog.advance()
            with open_for_append(state) as f:        # a line torn by a kill is cut first
                f.write(json.dumps({"question_id": p["question_id"], "per": {m: per[m][-1] for m in methods}}) + "\n")

    # Spec-Bench aggregation
    rows = []
    summary = {}
    for m, items in per.items():
        by_task = {}
        for it in items:
            by_task.setdefault(it["task"], []).append(it)
            if it["task"] == "mt_bench":
                by_task.setdefault(f"mt_bench/{it['category']}", []).append(it)
        s = {"tasks": {}}
        for t, its in list(by_task.items()) + [("overall", items)]:
            tps = sum(i["tok_per_s"] for i in its) / len(its)
            acc = [a for i in its for a in i.get("accept_lengths", [])]
            s["tasks"][t] = {"tok_per_s": tps, "accept_length": (sum(acc) / len(acc)) if acc else 1.0,
                             "identical": sum(i["identical"] for i in its), "prompts": len(its)}
            by_source = [i["accepted_by_source"] for i in its if "accepted_by_source" in i]
            if by_source:
                s["tasks"][t]["accepted_by_source"] = {k: sum(b.get(k, 0) for b in by_source) for k in by_source[0]}
        summary[m] = s
    base_t = summary["baseline"]["tasks"]
    for m, s in summary.items():
        for t, v in s["tasks"].items():
            v["speedup"] = v["tok_per_s"] / base_t[t]["tok_per_s"]
    table = Table(title=f"Spec-Bench on SmolLM2-135M ({args.dtype}, {args.threads} threads, "
                        f"{args.max_new_tokens} new tokens, greedy)")
    for c in ("method", "task", "tok/s", "speedup", "τ", "identical"):
        table.add_column(c, justify="right" if c not in ("method", "task") else "left")
    for m, s in summary.items():
        for t, v in s["tasks"].items():
            table.add_row(m, t, f"{v['tok_per_s']:.2f}", f"{v['speedup']:.2f}x", f"{v['accept_length']:.2f}",
                          f"{v['identical']}/{v['prompts']}")
    Console().print(table)
    from specscope.registry.fingerprint import collect, timing_warning

    result = {"config": {**vars(args), "model": str(path), **({"prices": prices.to_dict()} if prices else {})},
              "env": collect(), "summary": summary, "per_prompt": per}
    result["load_warning"] = timing_warning(result["env"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}", file=sys.stderr)
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
