"""Load test of `specscope serve`: N concurrent streaming clients send M requests on loopback; every request must
succeed, the server's own counters must agree with what the clients received, and SIGTERM must drain and exit 0.

    .venv/bin/python bench/serve_load.py [--model smollm2-135m] [--draft ngram] [--clients 8] [--requests 32]
                                         [--max-tokens 32] [--threads 2] [--out bench/results/serve_load.json]

Latency percentiles (TTFT, inter-chunk, TPOT, end to end) and output tok/s are written to --out. Exit status 1 if
any request failed or a check did not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
FALLBACK_PROMPTS = ["Explain how a CPU cache works.", "Write a haiku about the sea.", "What is speculative decoding?",
                    "List three uses of a hash map.", "Summarise the plot of Hamlet in two sentences."]


def start_server(args, extra: list[str] = (), clients: int | None = None) -> tuple[subprocess.Popen, str]:
    """`specscope serve` on a free loopback port with a queue of twice the clients; `extra`: more serve flags."""
    clients = args.clients if clients is None else clients
    cmd = [sys.executable, "-m", "specscope", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--threads", str(args.threads), "--device", args.device, "--max-queue", str(max(clients, 1) * 2)]
    if args.draft:
        cmd += ["--draft", args.draft]
    cmd += list(extra)
    err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody drains (which could block the server)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    url = {}
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("listening on "):
                url["u"] = line.split()[-1]
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(args.start_timeout):
        proc.kill()
        err.seek(0)
        sys.exit(f"server did not start: {err.read()[-2000:]}")
    return proc, url["u"]


def stop_server(proc: subprocess.Popen):
    """SIGTERM, as a process manager would; the exit code (or what happened instead)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "killed after 60 s"


def finish(checks: dict, out):
    """Print each check, say where the result went, and exit non-zero when any check failed."""
    for k, v in checks.items():
        print(f"  {'ok ' if v else 'FAIL'} {k}")
    print(f"wrote {out}")
    sys.exit(0 if all(checks.values()) else 1)


def prompts(n: int) -> tuple[str, list[str]]:
    from specscope.prompts import load_prompts
    from specscope.errors import SpecscopeError

    try:
        rows = [r["prompt"] for r in load_prompts("spec_bench")["prompts"]]
        name = "spec_bench"
    except SpecscopeError as e:
        print(f"warning: {e}; falling back to {len(FALLBACK_PROMPTS)} built-in prompts", file=sys.stderr)
        rows, name = FALLBACK_PROMPTS, "builtin"
    return name, [rows[i % len(rows)] for i in range(n)]


def load(url: str, ps: list[str], args) -> dict:
    """The clients' requests (run_levels, as bench-serve sends them) under the shared progress: requests, their
    rate and the time left, on stderr (a bar on a terminal, lines in a log), as `bench-serve` shows a level."""
    from specscope.benchserve.run import run_levels
    from specscope.progress import Progress

    failed = [0]
    with Progress(f"max concurrency {args.clients}", args.requests, "req") as prog:
        def done(c, res):
            failed[0] += not getattr(res, "ok", True)
            prog.advance(info=f"{failed[0]} failed" if failed[0] else "")

        return asyncio.run(run_levels(url, ps, [args.clients], "chat", None, args.max_tokens, 0.0, None, 600.0,
                                      done, percentiles=(50, 90, 99)))


def check(out: dict, scrape, health_after: int, exit_code, requests: int) -> dict:
    """What must hold after the load: every request served and counted alike by both sides, a clean exit."""
    lv = out["levels"][0]
    served = scrape.total("specscope:request_success_total") or 0
    gen = scrape.total("specscope:generation_tokens_total") or 0
    return {
        "all_requests_ok": lv["failed"] == 0 and lv["completed"] == requests,
        "server_counted_every_request": served == requests,
        "server_tokens_match_clients": gen == sum(r["completion_tokens"] for r in out["per_request"]),
        "no_429": scrape.total("specscope:requests_rejected_total") in (0, None),
        "healthy_after_load": health_after == 200,
        "sigterm_exit_0": exit_code == 0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="ngram", help="'' for baseline decoding")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load.json"))
    args = ap.parse_args()

    from specscope.ingest.prometheus import parse_text
    from specscope.registry.fingerprint import timing_warning

    ds, ps = prompts(args.requests)
    load_before = os.getloadavg()
    proc, url = start_server(args)
    try:
        t0 = time.perf_counter()
        out = load(url, ps, args)
        wall = time.perf_counter() - t0
        scrape = parse_text(httpx.get(url + "/metrics").text)
        health_after = httpx.get(url + "/health").status_code
    finally:
        exit_code = stop_server(proc)
    lv = out["levels"][0]
    checks = check(out, scrape, health_after, exit_code, args.requests)
    import torch

    result = {
        "what": "N concurrent streaming clients x M chat requests against `specscope serve` on 127.0.0.1",
        "config": {"model": args.model, "draft": args.draft or None, "clients": args.clients,
                   "requests": args.requests, "max_tokens": args.max_tokens, "threads": args.threads,
                   "device": args.device, "prompts": ds, "temperature": 0.0},
        # the load average says how shared the CPUs were: on a busy 2-core box latencies are mostly queueing
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        # vLLM bench serve's names and units (durations in s, latencies in ms)
        "results": {k: v for k, v in lv.items() if k not in ("server_metrics", "error_examples")},
        "server_metrics": lv.get("server_metrics"),
        "checks": checks,
        "wall_s": wall,
        "error_examples": lv.get("error_examples", []),
        # the server and its clients shared this machine's CPUs with whatever else ran
        "load_warning": timing_warning(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_result(result, args.clients)
    finish(checks, args.out)


def print_result(result: dict, clients: int) -> None:
    r = result["results"]
    print(f"{r['completed']}/{r['num_prompts']} ok, {r['failed']} failed, {r['output_throughput']:.1f} out tok/s, "
          f"{r['request_throughput']:.2f} req/s with {clients} clients")
    for k in ("ttft", "itl", "tpot", "e2el"):
        print(f"  {k:5s} ms: p50 {r[f'p50_{k}_ms']:8.1f}  p90 {r[f'p90_{k}_ms']:8.1f}  p99 {r[f'p99_{k}_ms']:8.1f}")
    sm = result["server_metrics"] or {}
    if sm.get("accept_length"):
        print(f"  τ from /metrics: {sm['accept_length']:.2f}")
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
