"""Run bench-serve: each concurrency level sends every request once, paced like `vllm bench serve` (a Poisson /
gamma arrival process at --request-rate, at most --max-concurrency in flight); /metrics is scraped around each
level for the speculative section. Results use vLLM's field names and units (ms)."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import numpy as np

from specscope.benchserve.client import RequestResult, request_body, stream_one
from specscope.engines import sglang
from specscope.errors import SpecscopeError
from specscope.ingest.prometheus import Scrape, parse_text, spec_delta

# vLLM's --percentile-metrics names (the last two only mean something under --max-concurrency, as in vLLM)
METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
DEFAULT_METRICS = ("ttft", "tpot", "itl", "e2el")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DEFAULT_PERCENTILES = (99.0,)        # vLLM's default; median and mean are always there


def pct_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's p99_ttft_ms / p99.9_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def intervals(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request, in seconds: gamma-distributed with shape = burstiness and mean 1 / rate (a
    Poisson process at burstiness 1; burstier below 1, more even above). An infinite rate sends all at once."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


def _ms_stats(values, name: str, percentiles) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=float) * 1e3
    if v.size == 0:
        v = np.zeros(1)          # vLLM reports 0 for a metric nothing produced (e.g. TPOT of 1-token outputs)
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    out.update({f"p{pct_word(p)}_{name}_ms": float(np.percentile(v, p)) for p in percentiles})
    return out


def _good(r: RequestResult, slos: dict) -> bool:
    vals = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2e_s}
    return all(vals[k] is not None and vals[k] * 1e3 <= ms or (k == "tpot" and vals[k] is None)
               for k, ms in slos.items())


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: token chunks and requests in flight per
    one-second bucket from the first send, the busiest bucket of each."""
    starts = [r.start_s for r in ok if r.start_s is not None and r.ttft_s is not None]
    if not starts:
        return 0.0, 0
    t0 = min(starts)
    end = max(r.start_s + (r.e2e_s or 0.0) for r in ok if r.start_s is not None)
    n = int(math.ceil(end - t0)) + 1
    toks, busy = np.zeros(n), np.zeros(n)
    for r in ok:
        if r.start_s is None or r.ttft_s is None:
            continue
        t = r.start_s + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        for tt in times:
            b = int(tt - t0)
            if 0 <= b < n:
                toks[b] += 1
        for b in range(int(r.start_s - t0), min(int(r.start_s + (r.e2e_s or 0.0) - t0), n - 1) + 1):
            busy[b] += 1
    return float(toks.max()), int(busy.max())


def vllm_spec_keys(spec: dict | None) -> dict:
    """`vllm bench serve`'s top-level spec_decode_* fields from specscope's spec_decode block: all six when the
    counters gave drafts and draft tokens (acceptance rate in PERCENT, per-position rates as fractions), only the
    acceptance length when τ came from a server's own average (SGLang's gauges or /get_server_info); none for
    counters read only after the run."""
    if not spec or spec.get("accept_length") is None or spec.get("window") == "lifetime":
        return {}     # lifetime counters (no scrape before the run) are not this run's acceptance
    drafts, dtoks, acc = spec.get("num_drafts"), spec.get("num_draft_tokens"), spec.get("num_accepted_tokens")
    if spec.get("window") == "delta" and drafts and dtoks and acc is not None:
        return {"spec_decode_acceptance_rate": 100.0 * acc / dtoks,
                "spec_decode_acceptance_length": 1.0 + acc / drafts,
                "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(dtoks),
                "spec_decode_accepted_tokens": int(acc),
                "spec_decode_per_position_acceptance_rates": [x or 0.0 for x in
                                                              spec.get("per_position_acceptance") or []]}
    return {"spec_decode_acceptance_length": spec["accept_length"]}


# vLLM's per-request lists: the first seven only with --save-detailed, latencies and queue_times always
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")
LISTS = DETAILED + ("latencies", "queue_times")


def request_lists(results: list[RequestResult], prompt_lens: list | None = None) -> dict:
    """vLLM's per-request lists in request order, seconds as it writes them (failed requests: 0 / [] / their
    error). input_lens: the server's usage, else the client-side count (prompt_lens, a --tokenizer's), else 0."""
    lens = prompt_lens or [None] * len(results)
    return {"input_lens": [r.prompt_tokens if r.prompt_tokens is not None else (lens[i] or 0)
                           for i, r in enumerate(results)],
            "output_lens": [r.completion_tokens if r.ok else 0 for r in results],
            "ttfts": [r.ttft_s or 0.0 for r in results], "itls": [list(r.itl_s) for r in results],
            "start_times": [r.start_s or 0.0 for r in results], "generated_texts": [r.text for r in results],
            "errors": [r.error or "" for r in results], "latencies": [r.e2e_s if r.ok else 0.0 for r in results],
            "queue_times": [r.queue_s for r in results]}


def level_summary(c: int | None, results: list[RequestResult], wall_s: float, metrics: dict | None,
                  metric_names=DEFAULT_METRICS, percentiles=DEFAULT_PERCENTILES, goodput: dict | None = None,
                  request_rate: float = math.inf, burstiness: float = 1.0, prompt_lens: list | None = None,
                  server_info: dict | None = None) -> dict:
    """One level in `vllm bench serve`'s result layout (durations in s, latencies in ms; its per-request lists
    come from request_lists), plus specscope's spec_decode block from the server's /metrics deltas (or SGLang's
    /get_server_info) and vLLM's top-level spec_decode_* fields.

    prompt_lens: the client-side token counts of each request's prompt (a --tokenizer's), used where the server
    reports no usage, as vLLM does."""
    ok = [r for r in results if r.ok]
    lists = request_lists(results, prompt_lens)
    out_toks = sum(lists["output_lens"])
    in_toks = sum(n for n, r in zip(lists["input_lens"], results) if r.ok)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    s = {"max_concurrency": c, "request_rate": request_rate if not math.isinf(request_rate) else "inf",
         "burstiness": burstiness, "num_prompts": len(results), "duration": wall_s, "completed": len(ok),
         "failed": len(results) - len(ok), "total_input_tokens": in_toks, "total_output_tokens": out_toks,
         "request_throughput": per_s(len(ok)),
         "request_goodput": per_s(sum(_good(r, goodput) for r in ok)) if goodput else None,
         "output_throughput": per_s(out_toks), "total_token_throughput": per_s(in_toks + out_toks)}
    if goodput:
        s["goodput_slos_ms"] = dict(goodput)
    s["max_output_tokens_per_s"], s["max_concurrent_requests"] = _peaks(ok)
    s["rtfx"] = 0.0                      # audio input only (vLLM's inverse real-time factor)
    values = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok],
              "itl": [x for r in ok for x in r.itl_s], "e2el": [r.e2e_s for r in ok]}
    if c is not None:   # as vLLM: queueing only means something with a concurrency cap
        values["client_queue_time"] = [r.queue_s for r in ok]
        if not math.isinf(request_rate):
            values["e2el_including_client_queue"] = [r.e2e_s + r.queue_s for r in ok]
    for m in metric_names:
        if m in values:
            s.update(_ms_stats(values[m], m, percentiles))
    verify = [v for r in ok if r.spec and isinstance(v := r.spec.get("verify_ct"), int) and v > 0]
    if metrics is not None:
        s["server_metrics"] = metrics
    spec = {k: metrics[k] for k in ("engine", "window", "accept_length", "draft_acceptance_rate",
                                    "per_position_acceptance", "num_drafts", "num_draft_tokens",
                                    "num_accepted_tokens") if k in (metrics or {})}
    if spec.get("accept_length") is not None:
        spec["source"] = "/metrics"
    elif server_info and server_info.get("accept_length") is not None:
        # SGLang without spec metrics: its own average from /get_server_info (not this run's window)
        spec = dict(server_info)
    if verify and len(verify) == len(ok):
        # SGLang's per-request definition: τ = completion_tokens / verify count
        spec["accept_length_client"] = out_toks / sum(verify)
    if spec.get("accept_length") is not None or spec.get("accept_length_client") is not None:
        s["spec_decode"] = spec
        s.update(vllm_spec_keys(spec))
    else:
        why = ("the server has no /metrics" if metrics is None else
               "its /metrics has no speculative-decoding counters (none for this run)")
        s["spec_decode_unavailable"] = (f"τ unavailable: {why}, and no {sglang.SERVER_INFO_PATHS[0]} with "
                                        f"{sglang.SERVER_INFO_FIELD}")
    first_errors = sorted({r.error for r in results if r.error})[:3]
    if first_errors:
        s["error_examples"] = first_errors
    return s


async def _scrape(client: httpx.AsyncClient, base: str, headers: dict) -> Scrape | None:
    try:
        r = await client.get(base + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_text(r.text)


async def _server_info(client: httpx.AsyncClient, base: str, headers: dict) -> dict | None:
    """SGLang's τ without /metrics, its own running average (engines/sglang.py). None when no path answers with a
    number."""
    for path in sglang.SERVER_INFO_PATHS:
        try:
            r = await client.get(base + path, headers=headers)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, RecursionError):
            info = None
        v = sglang.server_info_accept_length(info)
        if v is not None:
            return {"engine": sglang.NAME, "window": "server", "accept_length": v, "source": path}
    return None


async def _discover_model(client: httpx.AsyncClient, base: str, headers: dict) -> str:
    try:
        r = await client.get(base + "/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise SpecscopeError(f"cannot reach {base} ({type(e).__name__}: {e}); is the server running?") from None
    if r.status_code == 401:
        raise SpecscopeError(f"{base} wants an API key; pass --api-key or set SPECSCOPE_API_KEY")
    try:
        model = r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        model = None
    if not isinstance(model, str) or not model.strip():
        raise SpecscopeError(f"{base}/v1/models gave no model id (HTTP {r.status_code}); pass --model")
    return model


def _as_request(p, max_tokens: int) -> tuple[str, int, int | None]:
    if isinstance(p, str):
        return p, max_tokens, None
    if isinstance(p, (tuple, list)):
        return p[0], int(p[1]), None
    return p.prompt, int(p.output_len), p.prompt_len        # benchserve.datasets.Request


async def run_levels(base: str, prompts: list, levels: list[int | None], endpoint: str, model: str | None,
                     max_tokens: int, temperature: float | None, api_key: str | None, timeout_s: float,
                     progress=None, *, request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                     ignore_eos: bool = False, metric_names=DEFAULT_METRICS, percentiles=DEFAULT_PERCENTILES,
                     goodput: dict | None = None, path: str | None = None, extra_body: dict | None = None,
                     extra_headers: dict | None = None, tokenizer=None, on_level=None) -> dict:
    """prompts: strings, (prompt, max_tokens) pairs (per-request output lengths) or datasets.Request.
    levels: max concurrency per level, None = unbounded. endpoint: "chat" or "completions" (the request shape);
    path: the URL path (default /v1/chat/completions or /v1/completions). progress(c, result) after each request;
    on_level(i, c) as level i (max concurrency c) starts: a per-level progress bar's clock."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(extra_headers or {})
    path = path or PATHS[endpoint]
    reqs = [_as_request(p, max_tokens) for p in prompts]
    prompt_lens = [r[2] for r in reqs]
    width = max([c for c in levels if c] or [len(reqs)])
    limits = httpx.Limits(max_connections=width + 2, max_keepalive_connections=width + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = model or await _discover_model(client, base, headers)
        out_levels, out_lists, per_request = [], [], []
        for li, c in enumerate(levels):
            before = await _scrape(client, base, headers)
            if on_level:
                on_level(li, c)
            sem = asyncio.Semaphore(c) if c else None
            gaps = intervals(len(reqs), request_rate, burstiness, seed)

            async def one(i, prompt, n):
                body = request_body(endpoint, model, prompt, n, temperature, ignore_eos, extra_body)
                arrived = time.perf_counter()
                if sem is None:
                    res = await stream_one(client, base + path, body, endpoint, i, headers, tokenizer)
                else:
                    async with sem:
                        res = await stream_one(client, base + path, body, endpoint, i, headers, tokenizer)
                res.queue_s = (res.start_s or arrived) - arrived
                if progress:
                    progress(c, res)
                return res

            t0 = time.perf_counter()
            tasks = []
            for i, ((prompt, n, _), gap) in enumerate(zip(reqs, gaps)):
                if gap > 0:
                    await asyncio.sleep(gap)         # the arrival process, as vLLM's get_request()
                tasks.append(asyncio.create_task(one(i, prompt, n)))
            results = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            after = await _scrape(client, base, headers)
            metrics = spec_delta(before, after) if after is not None else None
            info = None
            if not (metrics or {}).get("accept_length"):
                info = await _server_info(client, base, headers)
            out_levels.append(level_summary(c, results, wall, metrics, metric_names, percentiles, goodput,
                                            request_rate, burstiness, prompt_lens, info))
            out_lists.append(request_lists(results, prompt_lens))
            per_request += [dict(r.to_dict(), concurrency=c) for r in results]
    return {"model": model, "levels": out_levels, "lists": out_lists, "per_request": per_request}
