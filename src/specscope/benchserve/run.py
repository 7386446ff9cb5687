"""Run bench-serve: each concurrency level sends every prompt once; /metrics is scraped around each level."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np

from specscope.benchserve.client import RequestResult, request_body, stream_one
from specscope.errors import SpecscopeError
from specscope.ingest.prometheus import Scrape, parse_text, spec_delta

PCTS = (50, 90, 99)


def dist(values) -> dict | None:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None
    out = {"mean": float(v.mean())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PCTS})
    out["max"] = float(v.max())
    return out


def level_summary(c: int, results: list[RequestResult], wall_s: float, metrics: dict | None) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    s = {"concurrency": c, "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
         "duration_s": wall_s, "output_tokens": toks,
         "output_tok_per_s": toks / wall_s if wall_s > 0 else 0.0,
         "request_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
         "ttft_s": dist(r.ttft_s for r in ok), "itl_s": dist(x for r in ok for x in r.itl_s),
         "tpot_s": dist(r.tpot_s for r in ok), "e2e_s": dist(r.e2e_s for r in ok)}
    verify = [r.spec["verify_ct"] for r in ok if r.spec and r.spec.get("verify_ct")]
    if verify and len(verify) == len(ok):
        # SGLang's per-request definition: τ = completion_tokens / verify count
        s["accept_length_client"] = toks / sum(verify)
    if metrics is not None:
        s["server_metrics"] = metrics
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
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise SpecscopeError(f"{base}/v1/models gave no model (HTTP {r.status_code}); pass --model") from None


async def run_levels(base: str, prompts: list[str], levels: list[int], endpoint: str, model: str | None,
                     max_tokens: int, temperature: float, api_key: str | None, timeout_s: float,
                     progress=None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    limits = httpx.Limits(max_connections=max(levels) + 2, max_keepalive_connections=max(levels) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = model or await _discover_model(client, base, headers)
        out_levels, per_request = [], []
        for c in levels:
            before = await _scrape(client, base, headers)
            sem = asyncio.Semaphore(c)

            async def one(i, p):
                async with sem:
                    res = await stream_one(client, base + path, request_body(endpoint, model, p, max_tokens,
                                                                             temperature), endpoint, i, headers)
                    if progress:
                        progress(c, res)
                    return res

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - t0
            after = await _scrape(client, base, headers)
            metrics = spec_delta(before, after) if after is not None else None
            out_levels.append(level_summary(c, results, wall, metrics))
            per_request += [dict(r.to_dict(), concurrency=c) for r in results]
    return {"model": model, "levels": out_levels, "per_request": per_request}
