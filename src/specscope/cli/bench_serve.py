"""`specscope bench-serve`: benchmark a live OpenAI-compatible endpoint (see specscope.benchserve), with
`vllm bench serve`'s options, field names and units."""

from __future__ import annotations

import math
import sys

import click

from specscope.cli.checks import FiniteRange
from specscope.cli.common import SEED, TEMPERATURE, alias_option, check_writable, db_option, emit_json, json_option
from specscope.errors import SpecscopeError

MAX_COUNT = 1 << 20      # prompts, tokens per request: beyond this the prompt list alone would not fit in memory
ENDPOINTS = {"chat": "chat", "completions": "completions", "/v1/chat/completions": "chat",
             "/v1/completions": "completions"}


def parse_levels(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(c < 1 or c > 1024 for c in levels):
        raise SpecscopeError(f"--max-concurrency must be a comma-separated list of integers in 1..1024, got {text!r}")
    return levels


class NoRequestSucceeded(SpecscopeError):
    exit_code = 1   # the benchmark ran and failed; 2 is for bad input


def parse_base_url(url: str) -> str:
    """scheme://host[:port][/path] with a trailing / and /v1 dropped; anything httpx could not connect to (port
    99999, an unclosed [::1) is one line here rather than a crash inside the first request."""
    import httpx

    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise SpecscopeError(f"--base-url must start with http:// or https://, got {url!r}")
    try:
        u = httpx.URL(base)
        problem = ("it names no host" if not u.host else
                   f"port {u.port} is not in 1..65535" if u.port is not None and not 1 <= u.port <= 65535 else
                   "it has a query or fragment" if u.query or u.fragment else None)
    except httpx.InvalidURL as e:
        problem = str(e)
    if problem:
        raise SpecscopeError(f"--base-url {url!r} is not a usable URL ({problem}); pass e.g. http://127.0.0.1:8000")
    return base


def check_result_filename(name: str) -> None:
    """A bare file name: --result-filename ../../x.json would write outside --result-dir."""
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise SpecscopeError(f"--result-filename must be a plain file name (no directories, no '..'), got "
                             f"{name!r}; choose the directory with --result-dir")


def parse_metrics(text: str) -> list[str]:
    from specscope.benchserve.run import METRICS

    got = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in got if m not in METRICS]
    if bad or not got:
        raise SpecscopeError(f"--percentile-metrics takes a comma list of {', '.join(METRICS)}; got {text!r}")
    return got


def parse_percentiles(text: str) -> list[float]:
    try:
        got = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        got = []
    if not got or any(not 0 < p <= 100 for p in got):
        raise SpecscopeError(f"--metric-percentiles takes a comma list of numbers in (0, 100], e.g. 50,90,99; "
                             f"got {text!r}")
    return got


def parse_goodput(items) -> dict | None:
    """vLLM's --goodput KEY:VALUE ... (ms), keys ttft, tpot, e2el; repeatable or space/comma separated."""
    slos = {}
    for item in items:
        for part in item.replace(",", " ").split():
            k, _, v = part.partition(":")
            try:
                ms = float(v)
            except ValueError:
                ms = -1.0
            if k not in ("ttft", "tpot", "e2el") or not ms > 0:
                raise SpecscopeError(f"--goodput takes KEY:MS pairs with KEY in ttft, tpot, e2el and MS > 0, e.g. "
                                     f"--goodput ttft:500 tpot:50; got {part!r}")
            slos[k] = ms
    return slos or None


@click.command("bench-serve", context_settings={"allow_extra_args": True})
@alias_option("--base-url", "url", hidden=("--url",), default="http://127.0.0.1:8000", show_default=True,
              help="Server base URL (a trailing /v1 is dropped).")
@click.option("--model", default=None, help="Model id to request (default: the first of /v1/models).")
@click.option("--endpoint", type=click.Choice(list(ENDPOINTS)), default="chat", show_default=True,
              help="chat = /v1/chat/completions (vLLM backend openai-chat); completions = /v1/completions.")
@alias_option("--dataset", "dataset", hidden=("--dataset-name", "--dataset-path"), default="spec_bench",
              show_default=True,
              help="'spec_bench' / 'mt_bench' (packaged Spec-Bench questions, first turns), 'random' (see "
                   "--random-input-len), or a .jsonl/.json/.txt file of prompts.")
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--num-prompts", type=click.IntRange(1, MAX_COUNT), default=16, show_default=True,
              help="Requests per concurrency level.")
@alias_option("--max-new-tokens", "max_tokens", hidden=("--max-tokens",), type=click.IntRange(1, MAX_COUNT),
              default=128, show_default=True, help="max_tokens of each request (the random dataset uses --random-output-len).")
@click.option("--random-input-len", type=click.IntRange(1, MAX_COUNT), default=1024, show_default=True,
              help="Random dataset: prompt length in tokens (about: random common words).")
@click.option("--random-output-len", type=click.IntRange(1, MAX_COUNT), default=128, show_default=True,
              help="Random dataset: output tokens per request (exact with --ignore-eos).")
@click.option("--random-range-ratio", type=FiniteRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Random dataset: lengths drawn uniformly from [len·(1-r), len·(1+r)].")
@click.option("--request-rate", type=FiniteRange(min=0.001, allow_inf=True), default=math.inf, show_default=True,
              help="Requests per second, at least 0.001 (arrivals paced by a Poisson/gamma process); inf = all at "
                   "once.")
@click.option("--burstiness", type=FiniteRange(0.01, 100), default=1.0, show_default=True,
              help="Gamma shape of the inter-arrival times, 0.01..100: 1 = Poisson, < 1 burstier, > 1 more even.")
@alias_option("--max-concurrency", "concurrency", hidden=("--concurrency",), default=None,
              help="Most requests in flight; a comma list (e.g. 1,4,16) runs one level each. Default: unbounded.")
@click.option("--ignore-eos", is_flag=True, help="Ask the server to decode exactly max_tokens (vLLM/SGLang field).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random dataset and arrivals.")
@click.option("--percentile-metrics", default="ttft,tpot,itl,e2el", show_default=True,
              help="Metrics to report percentiles of (ttft, tpot, itl, e2el).")
@click.option("--metric-percentiles", default="99", show_default=True,
              help="Percentiles to report, comma-separated (e.g. 25,50,75,99); mean/median/std always.")
@click.option("--goodput", multiple=True,
              help="SLOs as KEY:MS (ttft, tpot, e2el), e.g. --goodput ttft:500 tpot:50; adds "
                   "request_goodput (requests/s meeting all of them).")
@click.option("--save-result", is_flag=True, help="Write each level's result JSON (vLLM's layout) to --result-dir.")
@click.option("--save-detailed", is_flag=True,
              help="Also save per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, errors).")
@click.option("--result-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Directory for --save-result files.")
@click.option("--result-filename", default=None,
              help="File name (default: {backend}-{rate}qps[-concurrency{c}]-{model}-{date}.json).")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True,
              help="Sampling temperature of every request (0 = greedy).")
@click.option("--api-key", envvar="SPECSCOPE_API_KEY", default=None, help="Bearer key (env SPECSCOPE_API_KEY).")
@click.option("--timeout", "timeout_s", type=FiniteRange(1, 86400), default=600.0, show_default=True,
              help="Per-request timeout in seconds.")
@click.option("--name", default=None, help="Run name in the registry.")
@click.option("--tag", "tags", multiple=True, help="Tag the stored run (repeatable).")
@click.option("--no-record", is_flag=True, help="Do not store the run in the registry.")
@db_option
@json_option("Print {run_id, config, results, result_files} as JSON instead of the table.")
@click.pass_context
def bench_serve(ctx, url, model, endpoint, dataset, category, num_prompts, max_tokens, random_input_len, random_output_len,
                random_range_ratio, request_rate, burstiness, concurrency, ignore_eos, seed, percentile_metrics,
                metric_percentiles, goodput, save_result, save_detailed, result_dir, result_filename, temperature,
                api_key, timeout_s, name, tags, no_record, db, as_json):
    """Benchmark a live OpenAI-compatible endpoint (specscope, vLLM, SGLang) like `vllm bench serve`: TTFT, TPOT,
    ITL and end-to-end latency (ms), throughput and goodput, per concurrency level, plus τ and acceptance from the
    server's /metrics deltas."""
    import asyncio

    from specscope.benchserve.run import run_levels
    from specscope.prompts import load_prompts, random_prompts

    endpoint = ENDPOINTS[endpoint]
    levels = parse_levels(concurrency)
    metric_names, percentiles = parse_metrics(percentile_metrics), parse_percentiles(metric_percentiles)
    # vLLM spells several SLOs after one flag (--goodput ttft:500 tpot:50): take the pairs click left over
    extra = list(ctx.args)
    if extra and (not goodput or not all(a.split(":")[0] in ("ttft", "tpot", "e2el") for a in extra)):
        raise SpecscopeError(f"unexpected extra argument(s): {' '.join(extra)}")
    slos = parse_goodput([*goodput, *extra])
    base = parse_base_url(url)
    if result_filename is not None:
        check_result_filename(result_filename)
    if save_result:  # refused before the benchmark, not after it
        check_writable(result_dir, "--result-dir", is_dir=True)
    if dataset == "random":
        if category:
            raise SpecscopeError("--category does not apply to --dataset random")
        rows = random_prompts(num_prompts, random_input_len, random_output_len, random_range_ratio, seed)
        from specscope.registry import prompt_set_hash

        ds = {"name": "random", "hash": prompt_set_hash([r["prompt"] for r in rows])[7:23], "prompts": rows}
        prompts = [(r["prompt"], r["max_tokens"]) for r in rows]
    else:
        ds = load_prompts(dataset, tuple(category), num_prompts)
        prompts = [r["prompt"] for r in ds["prompts"]]
    if not no_record:       # before minutes of requests: a registry that cannot take the run is refused now
        from specscope.registry import check_registry

        check_registry(db)
    total = len(prompts) * len(levels)
    done = {"n": 0}
    tty = sys.stderr.isatty()

    def progress(c, res):
        done["n"] += 1
        if as_json:
            return
        if tty:     # one line redrawn in place on a terminal; nothing per request in a log
            click.echo(f"\r[{done['n']}/{total}] max concurrency {c or 'unbounded'}", nl=False, err=True)
        elif done["n"] % len(prompts) == 0:
            click.echo(f"[{done['n']}/{total}] level max concurrency {c or 'unbounded'} done", err=True)

    out = asyncio.run(run_levels(base, prompts, levels, endpoint, model, max_tokens, temperature, api_key,
                                 timeout_s, progress, request_rate=request_rate, burstiness=burstiness, seed=seed,
                                 ignore_eos=ignore_eos, metric_names=metric_names, percentiles=percentiles,
                                 goodput=slos))
    if tty and not as_json:
        click.echo("", err=True)
    first = out["levels"][0]
    results = {"levels": out["levels"], "tok_per_s": first["output_throughput"],
               "request_throughput": first["request_throughput"], "failed": sum(lv["failed"] for lv in out["levels"])}
    sm = first.get("server_metrics") or {}
    for key in ("accept_length", "per_position_acceptance", "draft_acceptance_rate"):
        if key in sm:
            results[key] = sm[key]
    config = {"url": base, "model": out["model"], "endpoint": endpoint, "engine": sm.get("engine"),
              "prompt_set": ds["name"], "prompt_set_hash": ds["hash"], "categories": list(category),
              "num_prompts": len(prompts), "max_tokens": None if dataset == "random" else max_tokens,
              "max_concurrency": levels, "request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "burstiness": burstiness, "ignore_eos": ignore_eos, "seed": seed, "goodput": slos,
              "sampling": {"temperature": temperature}}
    if dataset == "random":
        config.update(random_input_len=random_input_len, random_output_len=random_output_len,
                      random_range_ratio=random_range_ratio)
    if not any(lv["completed"] for lv in out["levels"]):
        # nothing to measure: no table of zeros, no stored run, no result files, and a failing exit status
        if as_json:
            emit_json({"run_id": None, "config": config, "results": results, "result_files": []})
        examples = sorted({e for lv in out["levels"] for e in lv.get("error_examples", [])})
        raise NoRequestSucceeded(f"no request succeeded ({results['failed']} of {results['failed']} failed; first "
                                 f"error: {examples[0] if examples else 'none reported'}); check that --base-url "
                                 f"is an OpenAI-compatible server and --model a model it serves")
    run_id = None
    if not no_record:
        from specscope.registry import make_record, store_record

        rec = make_record("bench_serve", name or f"bench-serve {out['model']}", config=config, results=results,
                          samples={"per_request": out["per_request"]}, tags=tags)
        # the model is remote: its "hash" is whatever the server calls it, not a local file
        rec["config"].pop("model_hash", None)
        run_id = store_record(rec, db)
    files = []
    if save_result:
        files = save_results(out, config, run_id, result_dir, result_filename, save_detailed)
    if as_json:
        emit_json({"run_id": run_id, "config": config, "results": results, "result_files": files})
        return
    _print_table(base, out, len(prompts), metric_names, percentiles, slos)
    for lv in out["levels"]:
        for e in lv.get("error_examples", []):
            click.echo(f"max concurrency {lv['max_concurrency'] or 'unbounded'}: {e}", err=True)
    for f in files:
        click.echo(f"result: {f}", err=True)
    if run_id:
        click.echo(f"stored run {run_id}", err=True)


def save_results(out: dict, config: dict, run_id, result_dir, result_filename, detailed: bool) -> list[str]:
    """One JSON per level in `vllm bench serve --save-result`'s layout (+ spec_decode and specscope's run id)."""
    import datetime
    import json
    from pathlib import Path

    from specscope.fileio import write_atomic

    d = Path(result_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecscopeError(f"cannot use --result-dir {str(d)!r}: {e.strerror or e}") from None
    now = datetime.datetime.now()
    backend = "openai-chat" if config["endpoint"] == "chat" else "openai"
    model_base = str(out["model"]).rstrip("/").rsplit("/", 1)[-1]
    files = []
    for lv in out["levels"]:
        c = lv["max_concurrency"]
        rows = [r for r in out["per_request"] if r["concurrency"] == c]
        result = {"date": now.strftime("%Y%m%d-%H%M%S"), "backend": backend, "model_id": out["model"],
                  "tokenizer_id": None, "base_url": config["url"], "dataset_name": config["prompt_set"],
                  "ignore_eos": config["ignore_eos"], "seed": config["seed"], "specscope_run_id": run_id,
                  **{k: v for k, v in lv.items() if k != "server_metrics"}}
        if detailed:
            result.update(input_lens=[r["prompt_tokens"] for r in rows],
                          output_lens=[r["completion_tokens"] for r in rows],
                          ttfts=[r["ttft_s"] for r in rows], itls=[r["itl_s"] for r in rows],
                          generated_texts=[r["text"] for r in rows], errors=[r["error"] or "" for r in rows])
        if result_filename:
            name = result_filename if len(out["levels"]) == 1 else \
                result_filename.removesuffix(".json") + f"-concurrency{c}.json"
        else:
            rate = config["request_rate"]
            name = (f"{backend}-{rate}qps" + (f"-concurrency{c}" if c else "")
                    + f"-{model_base}-{now.strftime('%Y%m%d-%H%M%S')}.json")
        path = write_atomic(d / name, json.dumps(result, indent=2, default=str, allow_nan=False) + "\n",
                            "--save-result file")
        files.append(str(path))
    return files


def _print_table(base, out, n_prompts, metric_names, percentiles, slos):
    from rich.table import Table

    from specscope.benchserve.run import pct_word
    from specscope.cli.common import stdout_console

    hi = pct_word(max(percentiles))
    t = Table(title=f"bench-serve {base} ({out['model']}, {n_prompts} prompts; ms: median / p{hi})")
    cols = ["max conc", "ok/failed", "req/s", "out tok/s"] + (["goodput req/s"] if slos else [])
    cols += [m.upper() for m in metric_names] + ["τ (server)"]
    for col in cols:
        t.add_column(col, justify="right")
    for lv in out["levels"]:
        tau = (lv.get("spec_decode") or {}).get("accept_length")
        cells = [str(lv["max_concurrency"] or "∞"), f"{lv['completed']}/{lv['failed']}",
                 f"{lv['request_throughput']:.2f}", f"{lv['output_throughput']:.1f}"]
        if slos:
            cells.append(f"{lv['request_goodput']:.2f}")
        cells += [f"{lv[f'median_{m}_ms']:.1f} / {lv[f'p{hi}_{m}_ms']:.1f}" for m in metric_names]
        cells.append("-" if tau is None else f"{tau:.2f}")
        t.add_row(*cells)
    # without a terminal (a log, a pipe) rich would cut the table at 80 columns: give it room instead
    stdout_console().print(t)
