"""Serving under load, serial beside batched: C concurrent streaming clients drive `specscope serve` on loopback
for D seconds, once against the serial server (`--max-num-seqs 1`) and once against the batched one.

    .venv/bin/python bench/serve_concurrency.py [--model smollm2-135m] [--clients 16,32] [--duration 60]
                                                [--max-num-seqs 16] [--max-seq-len N] [--spec-policy always]
                                                [--max-tokens 32] [--threads 2] [--draft ''] [--prompts 80]
                                                [--prefix-caching on|off]
                                                [--out bench/results/serve_concurrency.json]

For each --clients value both servers run in turn (serial first), with the same prompts, clients and duration.
Each client sends greedy chat requests back to back (streamed, with token ids) until the deadline, the requests
taking the --prompts distinct prompts in turn (so a prompt comes back only after --prompts others: what the
prefix cache can reuse is the chat template's system prompt, not a client's previous prompt); the serial
server decodes one request at a time, so most of a request's latency is its wait in the queue, while the batched
one decodes up to --max-num-seqs together and admits a new request whenever one leaves. /metrics reports the
wait as request_queue_time_seconds. At the deadline the clients still waiting hang up: each server must cancel
what runs and drop what is queued, i.e. be idle within seconds. Then every completed response of every run is
compared with offline greedy decoding of the same prompt (same model, threads and token budget), in this process
after the servers are gone.

Reports per run: completed requests, output tok/s, time_to_first_token (client side, ms), e2e_request_latency,
request_queue_time (the server's histogram: mean and bucket quantiles, ms), prefix-cache hits / queries (prompt
tokens reused / admitted), errors; per --clients value the
batched/serial ratios; one JSON at --out. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import finish, prompts as load_prompt_list, start_server, stop_server  # noqa: E402

PERCENTILES = (50, 90, 99)


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
            while time.perf_counter() < deadline:
                p = prompts[started["n"] % len(prompts)]   # the prompts in turn, across clients
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
    """What plain greedy decoding (`generate`, one sequence) gives for each prompt, in this process."""
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


# ---- pure functions: what a run's numbers are ---------------------------------------------------------------------

def parse_clients(text: str) -> list[int]:
    """'16,32' -> [16, 32]: positive integers, in the order given, each once."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"--clients takes positive integers separated by commas, got {text!r}")
        if int(part) not in out:
            out.append(int(part))
    return out


def dist(values_s, name: str) -> dict | None:
    """mean / p50 / p90 / p99 / max in milliseconds of values in seconds (None ignored), named as vLLM's bench
    serve names them (mean_ttft_ms, p99_ttft_ms, ...); None when there is no value."""
    v = sorted(x * 1e3 for x in values_s if x is not None)
    if not v:
        return None
    out = {f"mean_{name}_ms": sum(v) / len(v)}
    out.update({f"p{p}_{name}_ms": _percentile(v, p) for p in PERCENTILES})
    out[f"max_{name}_ms"] = v[-1]
    return out


def _percentile(sorted_v: list[float], p: float) -> float:
    """numpy's default (linear) percentile of sorted values."""
    k = (len(sorted_v) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (sorted_v[hi] - sorted_v[lo]) * (k - lo)


def histogram_mean(scrape, name: str) -> float | None:
    s, n = scrape.total(name + "_sum"), scrape.total(name + "_count")
    return (s / n) if s is not None and n else None


def histogram_quantile(scrape, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over a scraped histogram's cumulative buckets (linear within a bucket; in
    the +Inf bucket, the highest finite bound). None without observations."""
    buckets = sorted((float(le), c) for le, c in scrape.by_label(name + "_bucket", "le").items())
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return buckets[-1][0]


def server_histogram(scrape, name: str) -> dict | None:
    """A server histogram in ms: mean and the quantiles its buckets allow (Prometheus' estimate)."""
    mean = histogram_mean(scrape, name)
    if mean is None:
        return None
    out = {"mean_ms": mean * 1e3}
    for p in PERCENTILES:
        v = histogram_quantile(scrape, name, p / 100)
        out[f"p{p}_ms"] = None if v is None else v * 1e3
    out["count"] = scrape.total(name + "_count")
    return out


def summarize(run: dict, duration: float, ref: dict[str, list[int]], scrape, prefix: str = "specscope") -> dict:
    """One server's run -> its numbers: what completed, throughput over the load's duration, latencies, and
    every completed answer checked against the offline greedy ids in `ref` (prompt -> ids)."""
    fin = run["finished"]
    ok = [r for r in fin if r.get("error") is None]
    errors = [r for r in fin if r.get("error") is not None]
    mismatches = [{"prompt": r["prompt"][:80], "server": r["token_ids"][:40], "offline": ref.get(r["prompt"], [])[:40]}
                  for r in ok if r["token_ids"] != ref.get(r["prompt"])]
    toks = sum(len(r["token_ids"]) for r in ok)
    P = prefix + ":"
    return {
        "requests_started": run["started"], "completed": len(ok), "errors": len(errors),
        "hung_up_at_deadline": run["hung_up"],
        "server_cancelled": scrape.total(P + "request_failed_total", reason="cancelled") or 0,
        "rejected_429": scrape.total(P + "requests_rejected_total") or 0,
        "output_tokens": toks, "output_tok_per_s": toks / duration, "completed_per_s": len(ok) / duration,
        "checked_against_offline": len(ok), "mismatches": len(mismatches),
        # vLLM's metric names: client-measured, and the server's own histograms
        "time_to_first_token": dist((r["ttft_s"] for r in ok), "ttft"),
        "e2e_request_latency": dist((r["e2e_s"] for r in ok), "e2el"),
        "request_queue_time": server_histogram(scrape, P + "request_queue_time_seconds"),
        "request_inference_time": server_histogram(scrape, P + "request_inference_time_seconds"),
        "server_time_to_first_token": server_histogram(scrape, P + "time_to_first_token_seconds"),
        "prefix_cache": prefix_cache(scrape, P),
        "mismatch_examples": mismatches[:5],
        "error_examples": [r["error"] for r in errors[:5]],
    }


def prefix_cache(scrape, P: str) -> dict:
    """Prompt tokens admitted (queries) and reused from the prefix cache (hits), vLLM's counters."""
    q = scrape.total(P + "prefix_cache_queries_total") or 0
    h = scrape.total(P + "prefix_cache_hits_total") or 0
    return {"queries": q, "hits": h, "hit_rate": h / q if q else None}


def ratios(serial: dict, batched: dict) -> dict:
    """batched / serial for what batching should raise (completed, tok/s) and lower (TTFT, queue time); None
    where the serial value is 0 or missing."""
    def get(r, *path):
        for k in path:
            r = (r or {}).get(k)
        return r

    def ratio(*path):
        a, b = get(serial, *path), get(batched, *path)
        return None if a in (None, 0) or b is None else b / a

    return {"completed": ratio("completed"), "output_tok_per_s": ratio("output_tok_per_s"),
            "mean_ttft_ms": ratio("time_to_first_token", "mean_ttft_ms"),
            "p50_ttft_ms": ratio("time_to_first_token", "p50_ttft_ms"),
            "p99_ttft_ms": ratio("time_to_first_token", "p99_ttft_ms"),
            "mean_request_queue_time_ms": ratio("request_queue_time", "mean_ms")}


def checks_of(s: dict, idle_after_s: float | None, health: int, exit_code) -> dict:
    return {
        "no_errors": s["errors"] == 0,
        "completed_some": s["completed"] > 0,
        "every_completed_equals_offline_greedy": s["completed"] > 0 and s["mismatches"] == 0,
        "no_429": not s["rejected_429"],
        "idle_within_10s_of_hangup": idle_after_s is not None and idle_after_s < 10,
        "healthy_after_load": health == 200,
        "sigterm_exit_0": exit_code == 0,
    }


# ---- running it ---------------------------------------------------------------------------------------------------

def serve_flags(args, max_num_seqs: int) -> list[str]:
    flags = ["--max-num-seqs", str(max_num_seqs)]
    if args.draft:     # serve refuses a --spec-policy without a drafter to apply it to
        flags += ["--spec-policy", args.spec_policy]
    if args.prefix_caching == "off":
        flags.append("--no-enable-prefix-caching")
    if args.max_seq_len:
        flags += ["--max-seq-len", str(args.max_seq_len)]
    return flags


def run_server(args, prompts: list[str], clients: int, max_num_seqs: int) -> dict:
    """Start a server, load it with `clients` clients for --duration s, let them hang up, scrape, SIGTERM."""
    from specscope.ingest.prometheus import parse_text

    proc, url = start_server(args, serve_flags(args, max_num_seqs), clients)  # queue 2 x clients: no 429 expected
    try:
        run = asyncio.run(drive(url, prompts, clients, args.duration, args.max_tokens))
        run["idle_after_s"] = wait_idle(url)
        run["scrape"] = parse_text(httpx.get(url + "/metrics").text)
        run["health"] = httpx.get(url + "/health").status_code
    finally:
        run_exit = stop_server(proc)
    run["exit_code"] = run_exit
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="", help="drafter for both servers ('' = baseline decoding)")
    ap.add_argument("--clients", type=parse_clients, default=[16, 32], help="client counts, e.g. 16,32")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per server")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the batched server's --max-num-seqs")
    ap.add_argument("--max-seq-len", type=int, default=None, help="both servers' --max-seq-len (default: theirs)")
    ap.add_argument("--spec-policy", default="always", help="both servers' --spec-policy")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=80, help="distinct prompts, taken in turn (each checked "
                    "against offline)")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default="on",
                    help="both servers' prefix caching (--no-enable-prefix-caching when off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_concurrency.json"))
    args = ap.parse_args()
    if args.max_num_seqs < 2:
        ap.error("--max-num-seqs is the batched server's; it must be >= 2 (the serial server is 1)")

    ds, ps = load_prompt_list(args.prompts)
    load_before = os.getloadavg()
    modes = {"serial": 1, "batched": args.max_num_seqs}
    runs = {}
    from specscope.progress import Progress

    # the shared progress (stderr): a bar on a terminal, a line every 30 s in a log; stdout keeps the results
    with Progress("server runs", len(args.clients) * len(modes), "run", every_s=30) as prog:
        for c in args.clients:
            for mode, n in modes.items():
                prog.note(f"{c} clients, {mode} server (--max-num-seqs {n}): {args.duration:g} s ...")
                runs[(c, mode)] = run_server(args, ps, c, n)
                prog.advance()
    load_after = os.getloadavg()

    completed = {r["prompt"] for run in runs.values() for r in run["finished"] if r.get("error") is None}
    ref = offline_greedy(args.model, args.threads, completed, args.max_tokens)
    levels, checks = [], {}
    for c in args.clients:
        level = {"clients": c}
        for mode in modes:
            run = runs[(c, mode)]
            s = summarize(run, args.duration, ref, run["scrape"])
            s["idle_after_hangup_s"] = run["idle_after_s"]
            s["checks"] = checks_of(s, run["idle_after_s"], run["health"], run["exit_code"])
            checks.update({f"{c}_clients_{mode}_{k}": v for k, v in s["checks"].items()})
            level[mode] = s
        level["batched_over_serial"] = ratios(level["serial"], level["batched"])
        levels.append(level)
    import torch

    result = {
        "what": f"{', '.join(map(str, args.clients))} concurrent streaming chat clients for {args.duration:g} s each "
                f"against `specscope serve` on 127.0.0.1, serial (--max-num-seqs 1) beside batched (--max-num-seqs "
                f"{args.max_num_seqs}); every completed answer checked against offline greedy decoding",
        "command": "python bench/serve_concurrency.py " + " ".join(sys.argv[1:]),
        "config": {"model": args.model, "draft": args.draft or None, "clients": args.clients,
                   "duration_s": args.duration, "max_num_seqs": modes, "max_seq_len": args.max_seq_len,
                   "spec_policy": args.spec_policy if args.draft else None, "prefix_caching": args.prefix_caching,
                   "max_tokens": args.max_tokens, "threads": args.threads,
                   "device": args.device, "prompts": ds, "distinct_prompts": len(set(ps)), "temperature": 0.0},
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "machine": platform.machine(), "loadavg_before": load_before, "loadavg_after": load_after},
        "levels": levels,
        "checks": checks,
    }
    from specscope.registry.fingerprint import timing_warning

    # the load average after the runs, with the cores this process may use: a loaded machine slows every level
    result["load_warning"] = timing_warning({"cpu": {"load_1m": round(load_after[0]), "cores_usable": os.cpu_count()}})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)
    for level in levels:
        print(f"{level['clients']} clients:")
        for mode in modes:
            r = level[mode]
            t = r["time_to_first_token"] or {}
            q = r["request_queue_time"] or {}
            hit = r["prefix_cache"]["hit_rate"]
            print(f"  {mode:7s} {r['completed']:4d} completed, {r['errors']} errors, {r['output_tok_per_s']:7.1f} out "
                  f"tok/s, ttft p50 {t.get('p50_ttft_ms') or 0:8.0f} ms, mean queue {q.get('mean_ms') or 0:8.0f} ms, "
                  f"prefix cache {0 if hit is None else hit:.0%} of prompt tokens, "
                  f"{r['mismatches']} of {r['checked_against_offline']} differ from offline greedy")
        x = level["batched_over_serial"]
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}x"   # noqa: E731
        print(f"  batched/serial: completed {fmt(x['completed'])}, tok/s {fmt(x['output_tok_per_s'])}, "
              f"mean ttft {fmt(x['mean_ttft_ms'])}, mean queue time {fmt(x['mean_request_queue_time_ms'])}")
    finish(checks, args.out)


if __name__ == "__main__":
    main()
