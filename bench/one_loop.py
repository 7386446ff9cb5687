"""The decoding loop against an older commit's, single stream: is one request through the batched engine as fast
as the loops it replaced?

    .venv/bin/python bench/one_loop.py [--old d15cae3] [--prompts 16] [--max-new-tokens 112] [--rounds 2]
                                       [--draft smollm2-135m-eagle3+ngram] [--draft-budget priced|fixed]
                                       [--prompt-set mt-bench|speculative] [--methods plain,speculative]
                                       [--out bench/results/one_loop.json]

The source tree at --old (`git archive`, into a temporary directory) and this checkout's each run in a worker
process of their own that loads SmolLM2-135M-Instruct and the demo's drafter (priced, its declared shape) once;
the driver then asks them in turn, prompt by prompt and method by method (plain `generate`, the demo's
`speculative_generate`), the order alternating, so one process computes while the other waits and the machine's
drift hits both alike. Same prompts (MT-bench first turns, chat template, greedy), 2 threads each. Reports per
method old and new tok/s (end to end, prefill included, and decode only) and new / old; checks every answer is
the same in both. One JSON at --out; exit 1 if an answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# as the user set it, before our import of specscope sets its default: each tree's worker gets the user's
# environment and its own specscope's default (an old tree's OpenMP kernels must not run with the new default)
USER_ENV = dict(os.environ)
METHODS = ("plain", "speculative")

WORKER = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
from specscope import session
from specscope.generate import generate
from specscope.speculative import decode
from specscope.speculative.decode import SpecConfig
try:                                  # generate.py's since the drafting options were declared once
    from specscope.generate import speculative_generate
except ImportError:
    from specscope.speculative.decode import speculative_generate
target, tok, _ = session.load_target(sys.argv[1], "auto", "cpu")
stop = session.stop_ids_for(target, tok)
draft = sys.argv[2]
if hasattr(decode, "DraftOptions"):   # this checkout (the flags checked once, into the DecodeSpec that builds)
    spec = session.decode_spec(sys.argv[1], decode.DraftOptions(draft, budget=sys.argv[5]))
    drafter, cfg = spec.drafter(target), spec.shape
elif hasattr(session, "Drafting"):    # one DecodeSpec builds every drafter
    drafting = session.Drafting.from_flags(draft, budget=sys.argv[5])
    drafter, cfg = drafting.build(target), drafting.shape
else:                                 # an older one
    drafter, cfg = session.drafter_for(draft, target, sys.argv[5]), SpecConfig.for_drafter(draft)
ids = [tok.encode(p, chat=True) for p in json.load(open(sys.argv[4]))]
def run(method, i, n):
    if method == "plain":
        return generate(target, ids[i], n, None, stop)
    return speculative_generate(target, drafter, ids[i], n, None, stop, cfg)
run("plain", 0, 8); run("speculative", 0, 8)       # first calls pay for allocator and kernel warm-up
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    method, i, n = json.loads(line)
    r = run(method, i, n)
    print(json.dumps({"tokens": r.token_ids, "seconds": r.seconds, "decode_s": r.decode_s}), flush=True)
"""


class Worker:
    def __init__(self, src: Path, args, prompts: Path):
        env = {**USER_ENV, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, args.model, args.draft, str(args.threads),
                                   str(prompts), args.draft_budget],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ask_ready()

    def ask_ready(self):
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit("a worker died while loading (see its error above)")

    def run(self, method: str, i: int, n: int) -> dict:
        self.p.stdin.write(json.dumps([method, i, n]) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"a worker died on {method} prompt {i}")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def prompt_texts(name: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "src"))
    if name == "speculative":
        sys.path.insert(0, str(ROOT / "bench"))
        from speculative import TASKS, pick_prompts

        return [p["prompt"] for p in pick_prompts(TASKS, 10, 80)]
    from specscope.prompts import mt_bench_prompts

    return [r["prompt"] for r in mt_bench_prompts()[0]]


def old_tree(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "src"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="d15cae3", help="the commit to compare with (default: the last one with "
                    "separate generate / speculative_generate loops)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-eagle3+ngram")
    ap.add_argument("--draft-budget", choices=("priced", "fixed"), default="priced",
                    help="the drafter's budget (priced: the demo's; fixed: its declared shape every cycle)")
    ap.add_argument("--prompts", type=int, default=16, help="the first N of the prompt set")
    ap.add_argument("--prompt-set", choices=("mt-bench", "speculative"), default="mt-bench",
                    help="MT-bench first turns, or bench/speculative.py's 130 (80 MT-bench + 10 of each other task)")
    ap.add_argument("--methods", default=",".join(METHODS), help="plain, speculative or both")
    ap.add_argument("--max-new-tokens", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/one_loop.json"))
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        raise SystemExit(f"--methods: one or both of {', '.join(METHODS)}")
    prompts = prompt_texts(args.prompt_set)[:args.prompts]
    args.prompts = len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        pfile = Path(tmp) / "prompts.json"
        pfile.write_text(json.dumps(prompts))
        workers = {"old": Worker(old_tree(args.old, Path(tmp)), args, pfile),
                   "new": Worker(ROOT / "src", args, pfile)}
        sums = {(side, m): [0, 0.0, 0, 0.0] for side in workers for m in methods}
        differ, k, t0 = [], 0, time.perf_counter()
        total = args.rounds * args.prompts * len(methods)
        for rnd in range(args.rounds):
            for i in range(args.prompts):
                for m in methods:
                    order = ("old", "new") if k % 2 == 0 else ("new", "old")
                    got = {side: workers[side].run(m, i, args.max_new_tokens) for side in order}
                    k += 1
                    for side, r in got.items():
                        s = sums[side, m]
                        s[0] += len(r["tokens"]); s[1] += r["seconds"]; s[2] += len(r["tokens"]) - 1
                        s[3] += r["decode_s"]
                    if got["old"]["tokens"] != got["new"]["tokens"]:
                        differ.append({"method": m, "prompt": i, "round": rnd})
                    el = time.perf_counter() - t0
                    print(f"\r{k}/{total} pairs, {k / el:.2f}/s, {(total - k) * el / k:.0f} s left", end="",
                          file=sys.stderr, flush=True)
        print(file=sys.stderr)
        for w in workers.values():
            w.close()
    res = {}
    print(f"{'method':<12} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'decode new/old':>15}")
    for m in methods:
        o, n = sums["old", m], sums["new", m]
        row = {"old_tok_per_s": o[0] / o[1], "new_tok_per_s": n[0] / n[1], "ratio": (n[0] / n[1]) / (o[0] / o[1]),
               "old_decode_tok_per_s": o[2] / o[3], "new_decode_tok_per_s": n[2] / n[3],
               "decode_ratio": (n[2] / n[3]) / (o[2] / o[3]), "tokens": n[0]}
        res[m] = {k: round(v, 4) for k, v in row.items()}
        print(f"{m:<12} {row['old_tok_per_s']:>10.2f} {row['new_tok_per_s']:>10.2f} {row['ratio']:>8.3f} "
              f"{row['decode_ratio']:>15.3f}")
    out = {"bench": "one_loop", "old": args.old, "new": subprocess.run(
               ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "model": args.model, "draft": args.draft, "draft_budget": args.draft_budget, "prompt_set": args.prompt_set, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "rounds": args.rounds, "threads": args.threads, "methods": res, "answers_differ": differ,
           "env": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
           "reproduce": "python bench/one_loop.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}" + (f"; {len(differ)} answers differ" if differ else "; every answer identical"))
    if differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
