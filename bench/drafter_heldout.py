"""Real decoding τ of a trained drafter on the *held-out* synthesised prompts of its own training run (never
Spec-Bench): greedy, fp32, chain and tree, with the lossless check against plain greedy decoding.

    .venv/bin/python bench/drafter_heldout.py --workdir ~/.cache/specscope/train/smollm2-135m-eagle3 \
        --draft smollm2-135m-eagle3 --limit 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main():
    import torch

    from specscope.generate import generate
    from specscope.progress import Progress
    from specscope.registry.fingerprint import timing_warning
    from specscope.runtime.sampling import SamplingParams
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter
    from specscope.train.data import read_conversations
    from specscope.train.pipeline import load_target
    from specscope.train.trainer import split_indices

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--draft", default="smollm2-135m-eagle3")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "drafter_heldout.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.workdir.expanduser()
    cfg = torch.load(sorted((work / "train" / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=False)["train_config"]
    convs, _ = read_conversations(work / "conversations.jsonl")
    n = json.loads((work / "data" / "manifest.json").read_text())["sequences"]
    _, held = split_indices(n, cfg["eval_fraction"], cfg["seed"])
    model, tok, _ = load_target("smollm2-135m", "cpu", "fp32")
    drafter = build_drafter(args.draft, model)
    shapes = {"chain": SpecConfig.from_knobs(steps=cfg["ttt_steps"], topk=1),
              "tree": SpecConfig.from_knobs(steps=cfg["ttt_steps"], topk=4, draft_tokens=12)}
    rows = []
    sp = SamplingParams()
    picked = held[:args.limit]
    # plain, then each shape, per prompt: the shared bar on a terminal, lines in a log (stderr)
    with Progress("held-out prompts", len(picked) * (1 + len(shapes)), "decode") as prog:
        for i in picked:
            ids = tok.encode_messages([convs[i][0]])
            base = generate(model, ids, args.max_new_tokens, sp, tok.eos_ids)
            prog.advance(info="plain")
            row = {"index": i, "prompt": convs[i][0]["content"][:80], "baseline_tok_s": base.tok_per_s}
            for name, sc in shapes.items():
                r = speculative_generate(model, drafter, ids, args.max_new_tokens, sp, tok.eos_ids, sc)
                row[name] = {"tau": r.stats.accept_length, "tok_s": r.tok_per_s,
                             "identical": r.token_ids == base.token_ids, "knobs": [sc.steps, sc.topk, sc.draft_tokens]}
                prog.advance(info=name)
            rows.append(row)
            prog.echo(json.dumps(row))
    summary = {name: {"mean_tau": sum(r[name]["tau"] for r in rows) / len(rows),
                      "all_identical": all(r[name]["identical"] for r in rows)} for name in shapes}
    out = {"workdir": str(work), "draft": args.draft, "max_new_tokens": args.max_new_tokens, "dtype": "fp32",
           "note": "held-out synthesised prompts of the drafter's own training run; tok/s on a shared 2-core CPU",
           "summary": summary, "prompts": rows,
           "load_warning": timing_warning()}        # the tok/s above ran under this machine's load
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary))
    if out["load_warning"]:
        print(out["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
