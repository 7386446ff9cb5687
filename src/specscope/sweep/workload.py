"""A sweep's workload: bench-serve's requests (its datasets, lengths and concurrency) sent to each cell's engine
with bench-serve's own client (`benchserve.run.run_levels`), so a cell's tok/s, TTFT and τ mean what
`specscope bench-serve` means by them."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from specscope.errors import SpecscopeError

DEFAULTS = {"dataset_name": "spec_bench", "dataset_path": None, "num_prompts": 8, "output_len": 64,
            "max_concurrency": 1, "request_rate": "inf", "endpoint": "chat", "temperature": 0.0, "seed": 0,
            "ignore_eos": False, "tokenizer": None, "warmup": 1}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class WorkloadFailed(SpecscopeError):
    exit_code = 1


@dataclass
class Workload:
    spec: dict                # DEFAULTS' keys, as stored in the sweep file
    requests: list            # benchserve.datasets.Request
    dataset: dict             # name, path, hash
    tokenizer: object = None

    @property
    def levels(self) -> list[int]:
        return concurrency_levels(self.spec["max_concurrency"])

    @property
    def headline(self) -> int:
        """The level whose tok/s and latencies are the run's own (what the matrix compares): the highest."""
        return max(self.levels)

    @property
    def rate(self) -> float:
        r = self.spec["request_rate"]
        return math.inf if r == "inf" else float(r)


def workload_spec(**given) -> dict:
    """The stored form of the workload options (what makes two sweeps the same), every option checked."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown workload options {sorted(unknown)}")
    w = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    from specscope.benchserve.datasets import check_dataset

    check_workload(w)
    check_dataset(w["dataset_name"], w["dataset_path"])      # before the sweep file is written, not after
    return w


# the range of each whole-number option, as the command line's option has it
_INT_RANGES = {"num_prompts": (1, 100_000), "output_len": (1, 1 << 20), "warmup": (0, 100)}
CONCURRENCY = (1, 1024)


def concurrency_levels(stored) -> list[int]:
    """--max-concurrency's levels: one whole number (as sweeps always stored it) or a list of several."""
    return list(stored) if isinstance(stored, list) else [stored]


def parse_levels(text: str) -> int | list[int]:
    """`--max-concurrency 1,2,4,8` -> [1, 2, 4, 8]; one value -> that int (stored as a sweep always stored it, so a
    sweep of one level is the same sweep as before levels existed). Checked as check_workload checks it."""
    words = [w.strip() for w in str(text).split(",")]
    try:
        vals = [int(w) for w in words]
    except ValueError:
        raise SpecscopeError(f"--max-concurrency takes whole numbers in {CONCURRENCY[0]}..{CONCURRENCY[1]}, one or "
                             f"comma-separated (e.g. 1,2,4,8); got {text!r}") from None
    out = vals[0] if len(vals) == 1 else vals
    _check_levels(out)
    return out


def _check_levels(v) -> None:
    lo, hi = CONCURRENCY
    vals = v if isinstance(v, list) else [v]
    if (isinstance(v, list) and len(v) < 2) or not all(type(x) is int and lo <= x <= hi for x in vals):
        raise SpecscopeError(f"--max-concurrency takes whole numbers in {lo}..{hi}, one or comma-separated (e.g. "
                             f"1,2,4,8); got {','.join(map(str, vals)) if isinstance(v, list) else v!r}")
    dup = sorted({x for x in vals if vals.count(x) > 1})
    if dup:
        raise SpecscopeError(f"--max-concurrency repeats {dup[0]}; give each level once, e.g. 1,2,4,8")


def check_workload(w: dict) -> None:
    """The workload options' types and ranges, in the options' words: the command line's, or a stored sweep
    file's (whose workload the reader checks the same way). Runs nothing and reads no dataset."""
    from specscope.runtime.params import check_field

    def flag(k):
        return "--" + k.replace("_", "-")
    for k, (lo, hi) in _INT_RANGES.items():
        if type(w[k]) is not int or not lo <= w[k] <= hi:
            raise SpecscopeError(f"{flag(k)} must be a whole number in {lo}..{hi}, got {w[k]!r}")
    _check_levels(w["max_concurrency"])
    for k in ("dataset_name", "dataset_path", "tokenizer"):
        if not (isinstance(w[k], str) or (w[k] is None and k != "dataset_name")):
            raise SpecscopeError(f"{flag(k)} must be text, got {w[k]!r}")
    if type(w["ignore_eos"]) is not bool:
        raise SpecscopeError(f"--ignore-eos must be true or false, got {w['ignore_eos']!r}")
    if w["endpoint"] not in PATHS:
        raise SpecscopeError(f"--endpoint must be chat or completions, got {w['endpoint']!r}")
    rate = w["request_rate"]
    if rate != "inf" and not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
                              and math.isfinite(rate)):
        raise SpecscopeError(f"--request-rate must be a positive number or inf, got {rate!r}")
    check_field("temperature", w["temperature"], style="cli")
    check_field("seed", w["seed"], style="cli")
    if w["seed"] is None:
        raise SpecscopeError("--seed must be an integer from 0, got None")


def build_workload(spec: dict) -> Workload:
    from specscope.benchserve.datasets import build_requests, check_dataset, load_tokenizer

    check_dataset(spec["dataset_name"], spec["dataset_path"])
    tok = load_tokenizer(spec["tokenizer"]) if spec["tokenizer"] else None
    ignore_eos = spec["ignore_eos"] or spec["dataset_name"] == "random"     # as bench-serve: exact random lengths
    ds = build_requests(spec["dataset_name"], spec["dataset_path"], spec["num_prompts"],
                        chat=spec["endpoint"] == "chat", tokenizer=tok, seed=spec["seed"],
                        output_len=spec["output_len"])
    spec = dict(spec, ignore_eos=ignore_eos)
    return Workload(spec, ds["requests"], {"name": ds["name"], "path": ds["path"], "hash": ds["hash"]}, tok)


def send(w: Workload, base: str, requests: list, timeout_s: float, concurrency: int | None = None) -> dict:
    """bench-serve's run of `requests` against `base` at each concurrency level in turn (the workload's, or the
    one given), bounded by timeout_s in all."""
    from specscope.benchserve.run import run_levels

    s = w.spec
    coro = run_levels(base, requests, [concurrency] if concurrency else w.levels, s["endpoint"], None, 0,
                      s["temperature"], None, timeout_s, request_rate=w.rate, seed=s["seed"],
                      ignore_eos=s["ignore_eos"], path=PATHS[s["endpoint"]], tokenizer=w.tokenizer)
    try:
        return asyncio.run(asyncio.wait_for(coro, timeout_s))
    except asyncio.TimeoutError:
        raise WorkloadFailed(f"the workload did not finish within {timeout_s:.0f} s") from None


def config_of(w: Workload, out: dict) -> dict:
    """The run config's workload keys (bench-serve's names), the same in every cell of a sweep."""
    s = w.spec
    return {"served_model": out["model"], "endpoint": s["endpoint"], "prompt_set": w.dataset["name"],
            "dataset_path": w.dataset["path"], "prompt_set_hash": w.dataset["hash"], "num_prompts": len(w.requests),
            "max_tokens": s["output_len"], "max_concurrency": w.headline, "request_rate": s["request_rate"],
            "ignore_eos": s["ignore_eos"], "seed": s["seed"], "sampling": {"temperature": s["temperature"]},
            **({"concurrency_levels": w.levels} if len(w.levels) > 1 else {})}


SERVE_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "mean_e2el_ms", "median_e2el_ms")


def serve_results(level: dict) -> dict:
    """A level's numbers a run keeps: tok/s (output throughput, as bench-serve stores it) and the latencies."""
    out = {"tok_per_s": level["output_throughput"], "request_throughput": level["request_throughput"],
           "failed": level["failed"], "serve": {k: level[k] for k in SERVE_KEYS if k in level}}
    spec = level.get("spec_decode") or {}
    if spec.get("accept_length") is not None:
        out["serve"]["accept_length"] = spec["accept_length"]
        out["serve"]["accept_length_source"] = spec.get("source")
    return out


def headline_level(w: Workload, out: dict) -> dict:
    """The run's headline level (the highest concurrency) of bench-serve's levels."""
    return out["levels"][w.levels.index(w.headline)]


def levels_results(w: Workload, out: dict) -> list[dict]:
    """Every level's numbers, in the order they ran: results["serve_levels"]."""
    return [{"concurrency": c, **serve_results(level)} for c, level in zip(w.levels, out["levels"])]


def per_prompt(out: dict, concurrency: int | None = None) -> list[dict] | None:
    """Spec-Bench's per-request tok/s (new tokens over the request's wall time, prefill included) at one level,
    so `compare` tests tok/s paired by prompt; None when a request failed (the pairs would not line up)."""
    rows = [r for r in out["per_request"] if concurrency is None or r.get("concurrency") == concurrency]
    if not rows or not all(r.get("ok") and (r.get("e2e_s") or 0) > 0 for r in rows):
        return None
    return [{"index": r["index"], "tokens": r["completion_tokens"], "seconds": round(r["e2e_s"], 6),
             "ttft_s": r.get("ttft_s"), "tok_per_s": round(r["completion_tokens"] / r["e2e_s"], 4)} for r in rows]
