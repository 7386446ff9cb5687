"""Serving under load: C concurrent streaming clients drive `specscope serve` on loopback for D seconds.

    .venv/bin/python bench/serve_concurrency.py [--model smollm2-135m] [--clients 32] [--duration 60]
                                                [--max-tokens 32] [--threads 2] [--draft ''] [--prompts 16]
                                                [--out bench/results/serve_concurrency.json]

Each client sends greedy chat requests back to back (streamed, with token ids) until the deadline; the engine is
batch-1, so most of a request's latency is its wait in the queue, which /metrics reports as its own histogram
(request_queue_time_seconds). At the deadline the clients still waiting hang up: the server must drop their queued
jobs and stop the running one, i.e. be idle within seconds. Then every completed response is compared with offline
greedy decoding of the same prompt (same model, threads and token budget). Reports latency percentiles (TTFT, end
to end, server queue time), errors (there should be none) and writes --out. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import finish, prompts as load_prompt_list, start_server, stop_server  # noqa: E402


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: text, token ids, TTFT, end to end; `error` set on any failure."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    r = {"prompt": prompt, "text": "", "token_ids": [], "ttft_s": None, "e2e_s": None, "error": None,
         "finish": None, "status": None}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        r["status"] = resp.status_code
        if resp.status_code != 200:
            raw = (await resp.aread()).decode(errors="replace")
            r["error"] = f"HTTP {resp.status_code}: {raw[:200]}"
            r["retry_after"] = resp.headers.get("retry-after")
            return r
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                r["error"] = obj["error"].get("message")
                continue
            for ch in obj.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if ch.get("token_ids"):
                    r["token_ids"] += ch["token_ids"]
                    if r["ttft_s"] is None:
                        r["ttft_s"] = time.perf_counter() - t0
                if text:
                    r["text"] += text
                if ch.get("finish_reason"):
                    r["finish"] = ch["finish_reason"]
        if not done and r["error"] is None:
            r["error"] = "the stream ended without [DONE]"
    r["e2e_s"] = time.perf_counter() - t0
    return r


async def drive(url: str, prompts: list[str], clients: int, duration: float, max_tokens: int) -> dict:
    """Clients loop until the deadline; then whoever is still waiting hangs up (cancels its request)."""
    finished: list[dict] = []
    started = {"n": 0}
    deadline = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def worker(c: int):
            k = 0
            while time.perf_counter() < deadline:
                p = prompts[(c + k * clients) % len(prompts)]
                k += 1
                started["n"] += 1
                try:
                    finished.append(await one_request(client, url, p, max_tokens))
                except httpx.HTTPError as e:
                    finished.append({"prompt": p, "error": f"{type(e).__name__}: {e}", "status": None})

        tasks = [asyncio.create_task(worker(c)) for c in range(clients)]
        await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        t_hangup = time.perf_counter()
        for t in tasks:
            t.cancel()  # closes the streams of requests still waiting or running: a client disconnect
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"finished": finished, "started": started["n"], "hung_up": started["n"] - len(finished),
            "t_hangup": t_hangup}


def wait_idle(url: str, timeout: float = 30.0) -> float | None:
    """Seconds until /metrics shows nothing running and nothing waiting (None if it never does)."""
    from specscope.ingest.prometheus import parse_text

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        s = parse_text(httpx.get(url + "/metrics").text)
        if not s.total("specscope:num_requests_running") and not s.total("specscope:num_requests_waiting"):
            return time.perf_counter() - t0
        time.sleep(0.1)
    return None


def offline_greedy(model_name: str, threads: int, prompts: set[str], max_tokens: int) -> dict[str, list[int]]:
    """What batch-1 greedy decoding gives for each prompt, in this process (after the server is gone)."""
    import torch

    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams
    from specscope.session import load_target, stop_ids_for

    torch.set_num_threads(threads)
    model, tok, _ = load_target(model_name, "auto", "cpu")
    stop = stop_ids_for(model, tok)
    out = {}
    for p in sorted(prompts):
        ids = tok.encode_messages([{"role": "user", "content": p}])
        out[p] = generate(model, ids, max_tokens, SamplingParams(), stop).token_ids
    return out


def histogram_mean(scrape, name: str) -> float | None:
    s, n = scrape.total(name + "_sum"), scrape.total(name + "_count")
    return (s / n) if s is not None and n else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="", help="drafter for the server ('' = baseline decoding)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (each checked against offline)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_concurrency.json"))
    args = ap.parse_args()

    import numpy as np

    def dist(values, name):
        """mean / p50 / p90 / p99 / max in milliseconds, named as vLLM's bench serve names them."""
        v = np.asarray([x * 1e3 for x in values if x is not None], dtype=float)
        if v.size == 0:
            return None
        out = {f"mean_{name}_ms": float(v.mean())}
        out.update({f"p{p}_{name}_ms": float(np.percentile(v, p)) for p in (50, 90, 99)})
        out[f"max_{name}_ms"] = float(v.max())
        return out
    from specscope.ingest.prometheus import parse_text

    ds, ps = load_prompt_list(args.prompts)
    load_before = os.getloadavg()
    proc, url = start_server(args)  # --max-queue 2 x clients: nobody should see a 429
    try:
        run = asyncio.run(drive(url, ps, args.clients, args.duration, args.max_tokens))
        idle_after_s = wait_idle(url)
        scrape = parse_text(httpx.get(url + "/metrics").text)
        health_after = httpx.get(url + "/health").status_code
    finally:
        exit_code = stop_server(proc)
    load_after = os.getloadavg()

    fin = run["finished"]
    ok = [r for r in fin if r.get("error") is None]
    errors = [r for r in fin if r.get("error") is not None]
    ref = offline_greedy(args.model, args.threads, {r["prompt"] for r in ok}, args.max_tokens)
    mismatches = [{"prompt": r["prompt"][:80], "server": r["token_ids"][:40], "offline": ref[r["prompt"]][:40]}
                  for r in ok if r["token_ids"] != ref[r["prompt"]]]
    wall = args.duration
    toks = sum(len(r["token_ids"]) for r in ok)
    cancelled = scrape.total("specscope:request_failed_total", reason="cancelled") or 0
    checks = {
        "no_errors": not errors,
        "completed_some": len(ok) > 0,
        "every_completed_equals_offline_greedy": bool(ok) and not mismatches,
        "no_429": not scrape.total("specscope:requests_rejected_total"),
        "idle_within_10s_of_hangup": idle_after_s is not None and idle_after_s < 10,
        "healthy_after_load": health_after == 200,
        "sigterm_exit_0": exit_code == 0,
    }
    import torch

    result = {
        "what": f"{args.clients} concurrent streaming chat clients for {args.duration:g} s against `specscope serve` "
                f"on 127.0.0.1 (batch-1 engine: requests are decoded one at a time, the rest queue)",
        "command": "python bench/serve_concurrency.py " + " ".join(sys.argv[1:]),
        "config": {"model": args.model, "draft": args.draft or None, "clients": args.clients,
                   "duration_s": args.duration, "max_tokens": args.max_tokens, "threads": args.threads,
                   "device": args.device, "prompts": ds, "distinct_prompts": len(set(ps)), "temperature": 0.0},
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "loadavg_before": load_before, "loadavg_after": load_after},
        "results": {
            "requests_started": run["started"], "completed": len(ok), "errors": len(errors),
            "hung_up_at_deadline": run["hung_up"], "server_cancelled": cancelled,
            "output_tokens": toks, "output_tok_per_s": toks / wall, "completed_per_s": len(ok) / wall,
            "ttft": dist((r["ttft_s"] for r in ok), "ttft"), "e2el": dist((r["e2e_s"] for r in ok), "e2el"),
            "server_queue_time_mean_s": histogram_mean(scrape, "specscope:request_queue_time_seconds"),
            "server_inference_time_mean_s": histogram_mean(scrape, "specscope:request_inference_time_seconds"),
            "idle_after_hangup_s": idle_after_s,
        },
        "checks": checks,
        "mismatch_examples": mismatches[:5],
        "error_examples": [r["error"] for r in errors[:5]],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    r = result["results"]
    print(f"{r['completed']} completed, {r['errors']} errors, {r['hung_up_at_deadline']} hung up at the deadline "
          f"({r['server_cancelled']:.0f} cancelled by the server); {r['output_tok_per_s']:.1f} out tok/s, "
          f"{r['completed_per_s']:.2f} req/s with {args.clients} clients")
    for k in ("ttft", "e2el"):
        d = r[k] or {}
        print(f"  {k:5s} ms: " + "  ".join(f"{s} {d.get(f'{s}_{k}_ms', 0):8.0f}" for s in ("p50", "p90", "p99", "max")))
    q, i = r["server_queue_time_mean_s"], r["server_inference_time_mean_s"]
    print(f"  server: mean queue time {q or 0:.2f} s, mean decode time {i or 0:.2f} s per request")
    finish(checks, args.out)


if __name__ == "__main__":
    main()
