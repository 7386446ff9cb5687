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
from specscope.errors import SpecscopeError
from specscope.ingest.prometheus import Scrape, parse_text, spec_delta

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_METRICS = ("ttft", "tpot", "itl", "e2el")
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


def level_summary(c: int | None, results: list[RequestResult], wall_s: float, metrics: dict | None,
                  metric_names=DEFAULT_METRICS, percentiles=DEFAULT_PERCENTILES, goodput: dict | None = None,
                  request_rate: float = math.inf, burstiness: float = 1.0) -> dict:
    """One level in `vllm bench serve`'s result layout (durations in s, latencies in ms), plus a speculative
    section from the server's /metrics deltas."""
    ok = [r for r in results if r.ok]
    out_toks = sum(r.completion_tokens for r in ok)
    in_toks = sum(r.prompt_tokens or 0 for r in ok)
    s = {"max_concurrency": c, "request_rate": request_rate if not math.isinf(request_rate) else "inf",
         "burstiness": burstiness, "num_prompts": len(results), "duration": wall_s, "completed": len(ok),
         "failed": len(results) - len(ok), "total_input_tokens": in_toks, "total_output_tokens": out_toks,
         "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
         "output_throughput": out_toks / wall_s if wall_s > 0 else 0.0,
         "total_token_throughput": (in_toks + out_toks) / wall_s if wall_s > 0 else 0.0}
    if goodput:
        good = sum(_good(r, goodput) for r in ok)
        s["request_goodput"] = good / wall_s if wall_s > 0 else 0.0
        s["goodput_slos_ms"] = dict(goodput)
    values = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok],
              "itl": [x for r in ok for x in r.itl_s], "e2el": [r.e2e_s for r in ok]}
    for m in metric_names:
        s.update(_ms_stats(values[m], m, percentiles))
    verify = [v for r in ok if r.spec and isinstance(v := r.spec.get("verify_ct"), int) and v > 0]
    if metrics is not None:
        s["server_metrics"] = metrics
    spec = {k: metrics[k] for k in ("engine", "accept_length", "draft_acceptance_rate", "per_position_acceptance",
                                    "num_drafts", "num_draft_tokens", "num_accepted_tokens") if k in (metrics or {})}
    if verify and len(verify) == len(ok):
        # SGLang's per-request definition: τ = completion_tokens / verify count
        spec["accept_length_client"] = out_toks / sum(verify)
    if spec.get("accept_length") is not None or spec.get("accept_length_client") is not None:
        s["spec_decode"] = spec
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


async def run_levels(base: str, prompts: list, levels: list[int | None], endpoint: str, model: str | None,
                     max_tokens: int, temperature: float, api_key: str | None, timeout_s: float,
                     progress=None, *, request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                     ignore_eos: bool = False, metric_names=DEFAULT_METRICS, percentiles=DEFAULT_PERCENTILES,
                     goodput: dict | None = None) -> dict:
    """prompts: strings, or (prompt, max_tokens) pairs (the random dataset's per-request output lengths).
    levels: max concurrency per level, None = unbounded."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    reqs = [(p, max_tokens) if isinstance(p, str) else (p[0], int(p[1])) for p in prompts]
    width = max([c for c in levels if c] or [len(reqs)])
    limits = httpx.Limits(max_connections=width + 2, max_keepalive_connections=width + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = model or await _discover_model(client, base, headers)
        out_levels, per_request = [], []
        for c in levels:
            before = await _scrape(client, base, headers)
            sem = asyncio.Semaphore(c) if c else None
            gaps = intervals(len(reqs), request_rate, burstiness, seed)

            async def one(i, prompt, n):
                body = request_body(endpoint, model, prompt, n, temperature, ignore_eos)
                if sem is None:
                    res = await stream_one(client, base + path, body, endpoint, i, headers)
                else:
                    async with sem:
                        res = await stream_one(client, base + path, body, endpoint, i, headers)
                if progress:
                    progress(c, res)
                return res

            t0 = time.perf_counter()
            tasks = []
            for i, ((prompt, n), gap) in enumerate(zip(reqs, gaps)):
                if gap > 0:
                    await asyncio.sleep(gap)         # the arrival process, as vLLM's get_request()
                tasks.append(asyncio.create_task(one(i, prompt, n)))
            results = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            after = await _scrape(client, base, headers)
            metrics = spec_delta(before, after) if after is not None else None
            out_levels.append(level_summary(c, results, wall, metrics, metric_names, percentiles, goodput,
                                            request_rate, burstiness))
            per_request += [dict(r.to_dict(), concurrency=c) for r in results]
    return {"model": model, "levels": out_levels, "per_request": per_request}
