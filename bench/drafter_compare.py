"""Several EAGLE-3 drafters side by side on the same prompts: real greedy decoding τ per task and MT-bench category.

τ (accept_length: accepted draft tokens + 1 per cycle, pooled over cycles) does not depend on how fast or busy the
machine is, so this is the bench for "is drafter B better than drafter A" — no timing; bench/speculative.py turns a
drafter into tok/s. Every output is checked token-identical to plain greedy decoding.

    .venv/bin/python bench/drafter_compare.py --draft smollm2-135m-eagle3 --draft ~/.cache/.../drafter
    .venv/bin/python bench/drafter_compare.py --draft A --draft B --tasks mt_bench --mt-bench-limit 16   # a quick look

Resumable like bench/speculative.py (one state line per finished prompt in the cache directory).
Writes bench/results/drafter_compare.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import TASKS, code_version, draft_files, pick_prompts  # noqa: E402  (one prompt selection for both benches)

ROOT = Path(__file__).resolve().parents[1]


def shape(s: str):
    from specscope.speculative.decode import SpecConfig

    try:
        a, b, c = (int(x) for x in s.split(","))
    except ValueError:
        raise SystemExit(f"--shape {s!r}: expected steps,topk,draft_tokens, e.g. 3,2,6") from None
    return SpecConfig(a, b, c)


def summarise(per: list[dict]) -> dict:
    """Pooled τ per task, per MT-bench category and overall, for each (drafter, shape) column."""
    groups: dict[str, list[dict]] = {}
    for it in per:
        groups.setdefault(it["task"], []).append(it)
        if it["task"] == "mt_bench":
            groups.setdefault(f"mt_bench/{it['category']}", []).append(it)
    groups["overall"] = per
    out = {}
    for g, items in groups.items():
        acc = [a for it in items for a in it["accept_lengths"]]
        out[g] = {"accept_length": sum(acc) / len(acc) if acc else 1.0, "cycles": len(acc),
                  "identical": sum(it["identical"] for it in items), "prompts": len(items)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", required=True, help="a shipped drafter name or a directory; repeat")
    ap.add_argument("--shape", action="append", default=None,
                    help="steps,topk,draft_tokens; repeat (default: chain 3,1,4 and tree 3,2,6 and 5,4,12)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=10, help="prompts per task (other than MT-bench)")
    ap.add_argument("--mt-bench-limit", type=int, default=80, help="MT-bench first turns (80 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="ignore the state file of an earlier, killed run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "drafter_compare.json"))
    args = ap.parse_args(argv)
    args.shape = args.shape or ["3,1,4", "3,2,6", "5,4,12"]
    torch.set_num_threads(args.threads)

    import transformers
    from rich.console import Console
    from rich.table import Table

    from specscope.generate import generate
    from specscope.session import load_target, stop_ids_for
    from specscope.models.hub import cache_dir
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import build_drafter
    from specscope.train.data import open_for_append, read_jsonl

    transformers.logging.set_verbosity_error()
    console = Console(stderr=True)
    target, tok, path = load_target("smollm2-135m", "fp32", "cpu")
    stop = stop_ids_for(target, tok)
    prompts = pick_prompts(args.tasks.split(","), args.limit, args.mt_bench_limit)
    shapes = {s: shape(s) for s in args.shape}          # a bad --shape fails before any decoding
    if len(set(args.draft)) != len(args.draft):
        sys.exit("--draft: each drafter once")
    drafters = {d: build_drafter(d, target) for d in args.draft}
    # a column per (drafter, shape), named by the drafter's folder; two folders named alike (two work directories'
    # `drafter/`) are told apart by their parent
    short = {d: Path(d).name for d in args.draft}
    if len(set(short.values())) < len(short):
        short = {d: "/".join(Path(d).expanduser().resolve().parts[-2:]) if Path(d).exists() else d for d in args.draft}
    columns = [(d, s) for d in args.draft for s in args.shape]
    name = {c: f"{short[c[0]]} {c[1].replace(',', 'x')}" for c in columns}
    if len(set(name.values())) < len(name):
        sys.exit("--draft: two drafters would share a column name; give their directories distinct names")

    # the state file is keyed by what changes the numbers, drafter files included (a retrained drafter, new state)
    key = {k: v for k, v in vars(args).items() if k not in ("out", "fresh", "threads")}
    key["files"] = {d: draft_files(d) for d in args.draft}
    key["code"] = code_version()
    state = cache_dir() / "bench" / f"drafter_compare-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}.jsonl"
    state.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and state.exists():
        state.unlink()
    done = {rec["question_id"]: rec["per"] for rec in read_jsonl(state) if "question_id" in rec}
    if done:
        console.print(f"resuming: {len(done)} of {len(prompts)} prompts already decoded ({state})")

    per = {name[c]: [] for c in columns}
    from specscope.progress import Progress

    # the shared progress: a bar on a terminal, a line every 30 s in a log; resumed prompts are not in the rate
    with Progress("prompts", len(prompts), "prompt", start=sum(p["question_id"] in done for p in prompts),
                  every_s=30) as prog:
        for p in prompts:
            if p["question_id"] not in done:
                ids = tok.encode(p["prompt"], chat=True)
                base = generate(target, ids, args.max_new_tokens, stop_ids=stop).token_ids
                rec = {}
                for c in columns:
                    r = speculative_generate(target, drafters[c[0]], ids, args.max_new_tokens, stop_ids=stop,
                                             cfg=shapes[c[1]])
                    rec[name[c]] = {"question_id": p["question_id"], "task": p["task"], "category": p["category"],
                                    "accept_lengths": r.stats.accept_lengths, "identical": r.token_ids == base}
                with open_for_append(state) as f:        # a line torn by a kill is cut first
                    f.write(json.dumps({"question_id": p["question_id"], "per": rec}) + "\n")
                done[p["question_id"]] = rec
                prog.advance()
            for c in columns:
                per[name[c]].append(done[p["question_id"]][name[c]])

    summary = {col: summarise(items) for col, items in per.items()}
    groups = list(next(iter(summary.values())))
    table = Table(title=f"τ by drafter and shape (greedy, fp32, {args.max_new_tokens} new tokens; identical = "
                        "outputs equal to plain greedy decoding)")
    table.add_column("task")
    for col in summary:
        table.add_column(col, justify="right")
    for g in groups:
        table.add_row(g, *(f"{summary[col][g]['accept_length']:.2f}" for col in summary))
    table.add_row("identical", *(f"{summary[col]['overall']['identical']}/{summary[col]['overall']['prompts']}"
                                 for col in summary))
    Console().print(table)
    from specscope.registry.fingerprint import collect

    result = {"config": {**vars(args), "model": str(path)}, "env": collect(), "summary": summary, "per_prompt": per}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}", file=sys.stderr)
    if not all(v["overall"]["identical"] == v["overall"]["prompts"] for v in summary.values()):
        sys.exit("some speculative output differs from plain greedy decoding (see per_prompt)")


if __name__ == "__main__":
    main()
