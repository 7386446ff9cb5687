"""A drafter in `specscope serve` beside plain serving, by concurrency: does speculation pay at every load?

    .venv/bin/python bench/serve_spec.py [--model smollm2-135m] [--draft smollm2-135m-eagle3+ngram]
                                         [--levels 1,4,16] [--requests 32] [--max-tokens 48] [--rounds 1]
                                         [--threads 2] [--spec-policy SERVE_DEFAULT] [--out bench/results/serve_spec.json]

Two servers run side by side on loopback, one plain and one with --draft (its --spec-policy and --draft-budget
left at serve's defaults unless given), each warmed with a few requests. For each level the same client
(bench-serve's, `benchserve.run.run_levels`) sends --requests MT-bench first turns as greedy chat requests,
--max-tokens each with ignore_eos, at that many requests in flight: first to one server, then to the other (the
order alternates by round), so the two are measured minutes apart on the same machine. Reports per level and
server: output tok/s, mean TTFT and time per output token, and for the drafter its acceptance (accept_length),
the share of engine steps that drafted (spec_decode_steps) and the mean per-phase step times; per level the
drafter / plain tok/s ratio. Every drafter answer must equal the plain server's (greedy is lossless). One JSON at
--out; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import finish, start_server, stop_server  # noqa: E402

PHASES = ("draft", "verify", "accept", "commit", "other", "step")


def mt_bench(n: int) -> list[str]:
    from specscope.prompts import mt_bench_prompts

    rows, _ = mt_bench_prompts()
    return [rows[i % len(rows)]["prompt"] for i in range(n)]


def scrape(url: str):
    import httpx

    from specscope.ingest.prometheus import parse_text

    return parse_text(httpx.get(url + "/metrics", timeout=30).text)


def counters(s) -> dict:
    """The drafter server's step counters and phase sums (ms) and counts from one scrape."""
    out = {"steps_" + m: s.total("specscope:spec_decode_steps_total", mode=m) or 0.0 for m in ("draft", "plain")}
    for p in PHASES:
        out[p + "_sum"] = (s.total("specscope:cycle_phase_seconds_sum", phase=p) or 0.0) * 1e3
        out[p + "_count"] = s.total("specscope:cycle_phase_seconds_count", phase=p) or 0.0
    return out


def one_level(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    from specscope.benchserve.run import run_levels

    before = counters(scrape(url))
    t0 = time.perf_counter()
    out = asyncio.run(run_levels(url, prompts, [clients], "chat", None, max_tokens, 0.0, None, 600.0,
                                 ignore_eos=True, percentiles=(50, 90)))
    wall = time.perf_counter() - t0
    after = counters(scrape(url))
    lv, lists = out["levels"][0], out["lists"][0]
    d = {k: after[k] - before[k] for k in after}
    steps = d["step_count"] or 1.0
    res = {"completed": lv["completed"], "failed": lv["failed"], "wall_s": round(wall, 3),
           "output_tok_per_s": lv["output_throughput"], "mean_ttft_ms": lv.get("mean_ttft_ms"),
           "mean_tpot_ms": lv.get("mean_tpot_ms"), "engine_steps": int(d["step_count"]),
           "phase_ms_per_step": {p: round(d[p + "_sum"] / steps, 3) for p in PHASES}}
    if d["steps_draft"] + d["steps_plain"]:
        res["drafted_step_share"] = round(d["steps_draft"] / (d["steps_draft"] + d["steps_plain"]), 4)
    sm = lv.get("server_metrics") or {}
    if "accept_length" in sm:
        res["accept_length"] = sm["accept_length"]
    return res, lists["generated_texts"]


def warm(url: str, prompts: list[str], max_tokens: int) -> None:
    from specscope.benchserve.run import run_levels

    asyncio.run(run_levels(url, prompts, [1], "chat", None, max_tokens, 0.0, None, 600.0, ignore_eos=True))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-eagle3+ngram")
    ap.add_argument("--levels", default="1,4,16", help="requests in flight per level, e.g. 1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="MT-bench first turns per level and server")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the levels (the server order alternates)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--spec-policy", default=None, help="the drafter server's --spec-policy (default: serve's)")
    ap.add_argument("--draft-budget", default=None, help="the drafter server's --draft-budget (default: serve's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_spec.json"))
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    prompts = mt_bench(args.requests)
    base = ["--max-num-seqs", str(args.max_num_seqs), "--max-seq-len", "1024"]
    extra = base + (["--spec-policy", args.spec_policy] if args.spec_policy else []) + \
        (["--draft-budget", args.draft_budget] if args.draft_budget else [])
    srv = SimpleNamespace(model=args.model, threads=args.threads, device=args.device, start_timeout=args.start_timeout,
                          clients=max(levels), draft="")
    plain_proc, plain_url = start_server(srv, base)
    srv.draft = args.draft
    spec_proc, spec_url = start_server(srv, extra)
    servers = {"plain": plain_url, "draft": spec_url}
    rows, texts, mismatches = [], {}, 0
    try:
        for name, url in servers.items():
            warm(url, mt_bench(args.requests + 4)[-4:], args.max_tokens)
        for rnd in range(args.rounds):
            for c in levels:
                order = ["plain", "draft"] if rnd % 2 == 0 else ["draft", "plain"]
                row = {"round": rnd, "clients": c}
                for name in order:
                    row[name], texts[name] = one_level(servers[name], prompts, c, args.max_tokens)
                    print(f"round {rnd} clients {c:3d} {name:5s}: {row[name]['output_tok_per_s']:7.1f} tok/s"
                          + (f", {row[name].get('drafted_step_share', 0):.0%} of steps drafted, τ "
                             f"{row[name].get('accept_length', 0):.2f}" if name == "draft" else ""), flush=True)
                bad = sum(a != b for a, b in zip(texts["plain"], texts["draft"]))
                mismatches += bad
                row["ratio"] = round(row["draft"]["output_tok_per_s"] / row["plain"]["output_tok_per_s"], 4)
                row["draft_answers_equal_plain"] = len(prompts) - bad
                rows.append(row)
    finally:
        exits = {name: stop_server(p) for name, p in (("plain", plain_proc), ("draft", spec_proc))}
    by_level, median_by_level = {}, {}
    for c in levels:   # the machine drifts by +-10 % between levels minutes apart: the median round is the figure
        rs = [r["ratio"] for r in rows if r["clients"] == c]
        by_level[str(c)] = round(sum(rs) / len(rs), 4)
        median_by_level[str(c)] = round(statistics.median(rs), 4)
    print("\nclients  drafter / plain tok/s (mean, median of rounds)")
    for c, r in by_level.items():
        print(f"{c:>7}  {r:.3f}  {median_by_level[c]:.3f}")
    checks = {"no_failed_requests": all(r[n]["failed"] == 0 for r in rows for n in ("plain", "draft")),
              "every_drafter_answer_equals_plain": mismatches == 0,
              "servers_exit_0": all(v == 0 for v in exits.values())}
    out = {"what": f"`specscope serve --draft {args.draft}` beside plain `specscope serve`, {args.requests} MT-bench "
                   f"requests x {args.max_tokens} tokens per level, levels {levels} in flight, interleaved",
           "command": "python bench/serve_spec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "config": {"model": args.model, "draft": args.draft, "levels": levels, "requests": args.requests,
                      "max_tokens": args.max_tokens, "rounds": args.rounds, "threads": args.threads,
                      "max_num_seqs": args.max_num_seqs, "spec_policy": args.spec_policy or "serve default",
                      "draft_budget": args.draft_budget or "serve default"},
           "env": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
           "ratio_by_clients": by_level, "median_ratio_by_clients": median_by_level, "rounds": rows,
           "checks": checks}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    finish(checks, args.out)


if __name__ == "__main__":
    main()
