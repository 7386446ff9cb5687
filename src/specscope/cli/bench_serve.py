"""`specscope bench-serve`: benchmark a live OpenAI-compatible endpoint (see specscope.benchserve), a drop-in for
`vllm bench serve` (vLLM 0.32): its options, defaults where they decide the workload's shape (backend, number of
prompts, output lengths), its result JSON's field names and units. Where specscope's defaults differ (Spec-Bench
prompts, temperature 0) --help says so."""

from __future__ import annotations

import math

import click

from specscope.cli.checks import FiniteRange
from specscope.cli.common import (SEED, TEMPERATURE, FiniteFloat, alias_option, check_writable, db_option, emit_json,
                                  json_option)
from specscope.errors import SpecscopeError

MAX_COUNT = 1 << 20      # prompts, tokens per request: beyond this the prompt list alone would not fit in memory
# --backend: vLLM's spellings, and SGLang bench_serving's for the same two APIs
CHAT_BACKENDS = ("openai-chat", "vllm-chat", "sglang-oai-chat")
COMPLETION_BACKENDS = ("openai", "vllm", "sglang-oai")
BACKENDS = COMPLETION_BACKENDS + CHAT_BACKENDS
UNSUPPORTED_BACKENDS = {  # what they would need instead of one line "not one of"
    "sglang": "SGLang's native /generate", "sglang-native": "SGLang's native /generate",
    "openai-responses": "the Responses API", "openai-audio": "audio transcription",
    "openai-embeddings": "embeddings", "openai-embeddings-chat": "embeddings",
    "openai-embeddings-clip": "embeddings", "openai-embeddings-vlm2vec": "embeddings",
    "infinity-embeddings": "embeddings", "infinity-embeddings-clip": "embeddings", "vllm-pooling": "pooling",
    "vllm-rerank": "reranking", "lmdeploy": "", "lmdeploy-chat": "", "trt": "", "truss": ""}
NARGS = ("--goodput", "--header", "--metadata")   # argparse nargs options in vLLM: KEY:VALUE / KEY=VALUE ...


class VllmArgs(click.Command):
    """vLLM spells several values after one flag (--goodput ttft:500 tpot:50, --metadata a=1 b=2): each value
    after the first gets the flag again, so click sees repeated options and any other stray word is an error."""

    def parse_args(self, ctx, args):
        out, cur, have = [], None, False
        for a in args:
            if a == "--":
                cur = None
            elif a.startswith("-") and len(a) > 1:
                name = a.split("=", 1)[0]
                cur, have = (name, "=" in a) if name in NARGS else (None, False)
            elif cur is not None:
                if have:
                    out.append(cur)
                have = True
            out.append(a)
        return super().parse_args(ctx, out)


def resolve_api(backend: str | None, endpoint: str | None) -> tuple[str, str, str]:
    """(backend, "chat" | "completions", URL path) from --backend and --endpoint, either or both; vLLM's default
    is openai on /v1/completions. Both given and disagreeing is one error, not a guess."""
    from specscope.benchserve.run import PATHS

    if backend is not None and backend not in BACKENDS:
        if backend not in UNSUPPORTED_BACKENDS:
            raise SpecscopeError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        what = UNSUPPORTED_BACKENDS[backend]
        raise SpecscopeError(f"--backend {backend}{f' ({what})' if what else ''} is not supported by specscope "
                             f"bench-serve; use one of {', '.join(BACKENDS)}")
    b_kind = None if backend is None else "chat" if backend in CHAT_BACKENDS else "completions"
    e_kind = path = None
    if endpoint is not None:
        e = endpoint.strip()
        if e in PATHS:
            e_kind, path = e, PATHS[e]
        elif e.startswith("/") and e.rstrip("/").endswith("/chat/completions"):
            e_kind, path = "chat", e.rstrip("/")
        elif e.startswith("/") and e.rstrip("/").endswith("/completions"):
            e_kind, path = "completions", e.rstrip("/")
        else:
            raise SpecscopeError(f"--endpoint must be an API path ending in /chat/completions or /completions (e.g. "
                                 f"/v1/chat/completions), or chat / completions; got {endpoint!r}")
    if b_kind and e_kind and b_kind != e_kind:
        raise SpecscopeError(f"--backend {backend} sends {b_kind} requests but --endpoint {endpoint} is the {e_kind} "
                             f"API; make them agree or give only one")
    kind = b_kind or e_kind or "completions"
    return backend or ("openai-chat" if kind == "chat" else "openai"), kind, path or PATHS[kind]


def base_url_of(ctx, base_url: str | None, host: str, port: int) -> str:
    """--base-url, else http://HOST:PORT (vLLM's defaults 127.0.0.1:8000); both kinds at once is refused."""
    from click.core import ParameterSource

    given = [f"--{n}" for n in ("host", "port") if ctx.get_parameter_source(n) != ParameterSource.DEFAULT]
    if base_url is not None:
        if given:
            raise SpecscopeError(f"give --base-url or {' / '.join(given)}, not both")
        return parse_base_url(base_url)
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    try:
        return parse_base_url(f"http://{h}:{port}")
    except SpecscopeError:
        raise SpecscopeError(f"--host {host!r} is not a host name or address") from None


def parse_pairs(items, flag: str) -> dict:
    """--header / --metadata KEY=VALUE ..."""
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise SpecscopeError(f"{flag} takes KEY=VALUE pairs, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def parse_extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    import json

    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise SpecscopeError(f"--extra-body must be a JSON object, e.g. '{{\"top_k\": 20}}'; got {text!r}")
    return body


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


def _dataset_defaults_help() -> str:
    return ("spec_bench (default; specscope's: vLLM defaults to random): the packaged Spec-Bench questions' first "
            "turns, or --dataset-path in its format; mt_bench: their 80 MT-bench first turns; random: --random-* "
            "lengths (no file); custom: a .jsonl/.json/.txt file of prompts; sharegpt: a ShareGPT JSON file.")


@click.command("bench-serve", cls=VllmArgs)
# ---- server: vLLM's --backend/--endpoint/--base-url/--host/--port/--model/--tokenizer
@click.option("--backend", default=None,
              help="openai / vllm = /v1/completions (the default, as vLLM); openai-chat = /v1/chat/completions. "
                   "SGLang bench_serving's sglang-oai, sglang-oai-chat, vllm-chat also work.")
@click.option("--endpoint", default=None,
              help="API path as vLLM takes it (e.g. /v1/chat/completions), or chat / completions; it must agree "
                   "with --backend (default: the backend's).")
@alias_option("--base-url", "url", hidden=("--url",), default=None,
              help="Server base URL (a trailing /v1 is dropped). Default http://HOST:PORT.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Server host, when no --base-url.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="Server port, when no --base-url.")
@click.option("--model", default=None, help="Model id to request (default: the first of /v1/models).")
@click.option("--tokenizer", default=None,
              help="Tokenizer (directory, known name or Hugging Face id) to count tokens as vLLM does: prompt lengths "
                   "(random prompts cut to exactly --random-input-len), outputs of servers that send no usage, and "
                   "the client-side chat template of custom / spec_bench prompts on a completions backend. Without "
                   "it the server's usage counts.")
@click.option("--tokenizer-mode", type=click.Choice(["auto", "hf"]), default="auto", show_default=True,
              help="vLLM's; both load the Hugging Face fast tokenizer.")
@click.option("--header", "headers", multiple=True, help="HTTP headers as KEY=VALUE ... for every request.")
# ---- dataset: vLLM's --dataset-name / --dataset-path (separate options) and lengths
@click.option("--dataset-name", default=None, help=_dataset_defaults_help())
@click.option("--dataset-path", default=None,
              help="The dataset's file (custom and sharegpt need one; spec_bench / mt_bench default to the "
                   "packaged copy). Alone it means --dataset-name custom.")
@click.option("--dataset", "legacy_dataset", default=None, hidden=True,
              help="Old spelling: a dataset name or file; no shuffling or oversampling.")
@alias_option("--category", "category", hidden=("--spec-bench-category",), multiple=True,
              help="Only prompts of this category (repeatable). vLLM --spec-bench-category.")
@click.option("--num-prompts", type=click.IntRange(1, MAX_COUNT), default=1000, show_default=True,
              help="Requests per concurrency level (file datasets are oversampled up to it, as in vLLM).")
@click.option("--no-oversample", is_flag=True, help="Send each prompt of a smaller dataset once.")
@click.option("--disable-shuffle", is_flag=True, help="Keep the file's order (vLLM shuffles with --seed).")
@click.option("--skip-chat-template", is_flag=True,
              help="With --tokenizer on a completions backend: send custom / spec_bench prompts without the chat "
                   "template.")
@click.option("--input-len", type=click.IntRange(1, MAX_COUNT), default=None,
              help="vLLM's general input length (= --random-input-len).")
@alias_option("--output-len", "--max-new-tokens", "max_tokens", hidden=("--max-tokens",),
              type=click.IntRange(1, MAX_COUNT), default=None,
              help="max_tokens of every request, over each dataset's default (vLLM's general --output-len).")
@click.option("--random-input-len", type=click.IntRange(1, MAX_COUNT), default=1024, show_default=True,
              help="Random dataset: prompt length in tokens (exact with --tokenizer, else about: common words).")
@click.option("--random-output-len", type=click.IntRange(1, MAX_COUNT), default=128, show_default=True,
              help="Random dataset: output tokens per request (exact: random sets ignore_eos, as vLLM).")
@click.option("--random-range-ratio", type=FiniteRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Random dataset: lengths drawn uniformly from [len·(1-r), len·(1+r)].")
@click.option("--spec-bench-output-len", type=click.IntRange(1, MAX_COUNT), default=256, show_default=True,
              help="spec_bench / mt_bench: output tokens per request.")
@click.option("--custom-output-len", type=click.IntRange(1, MAX_COUNT), default=256, show_default=True,
              help="custom: output tokens per request.")
@click.option("--sharegpt-output-len", type=click.IntRange(1, MAX_COUNT), default=None,
              help="sharegpt: output tokens per request (default: the reply's length, which needs --tokenizer).")
# ---- traffic
@click.option("--request-rate", type=FiniteRange(min=0.001, allow_inf=True), default=math.inf, show_default=True,
              help="Requests per second, at least 0.001 (arrivals paced by a Poisson/gamma process); inf = all at "
                   "once.")
@click.option("--burstiness", type=FiniteRange(0.01, 100), default=1.0, show_default=True,
              help="Gamma shape of the inter-arrival times, 0.01..100: 1 = Poisson, < 1 burstier, > 1 more even.")
@alias_option("--max-concurrency", "concurrency", hidden=("--concurrency",), default=None,
              help="Most requests in flight; a comma list (e.g. 1,4,16) runs one level each. Default: unbounded.")
@click.option("--ignore-eos", is_flag=True, help="Ask the server to decode exactly max_tokens (vLLM/SGLang field).")
@click.option("--num-warmups", type=click.IntRange(0, 100), default=0, show_default=True,
              help="Warm-up requests before measuring (the first request, one at a time, not measured), as vLLM's; "
                   "then more until two in a row take the same time per output token (at most 8 more).")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the random dataset, shuffling, oversampling and arrivals.")
# ---- sampling (vLLM sends only those given; specscope sends temperature 0 unless told otherwise)
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True,
              help="Sampling temperature of every request (0 = greedy; specscope's default: vLLM sends none).")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None, help="top_p of every request.")
@click.option("--top-k", type=int, default=None, help="top_k of every request.")
@click.option("--min-p", type=FiniteFloat(0, 1), default=None, help="min_p of every request.")
@click.option("--frequency-penalty", type=FiniteFloat(-2, 2), default=None,
              help="frequency_penalty of every request.")
@click.option("--presence-penalty", type=FiniteFloat(-2, 2), default=None, help="presence_penalty of every request.")
@click.option("--repetition-penalty", type=FiniteFloat(0, min_open=True), default=None,
              help="repetition_penalty of every request.")
@click.option("--extra-body", default=None, help="JSON object merged into every request body.")
# ---- metrics
@click.option("--percentile-metrics", default="ttft,tpot,itl,e2el", show_default=True,
              help="Metrics to report percentiles of: ttft, tpot, itl, e2el, client_queue_time, "
                   "e2el_including_client_queue.")
@click.option("--metric-percentiles", default="99", show_default=True,
              help="Percentiles to report, comma-separated (e.g. 25,50,75,99); mean/median/std always.")
@click.option("--goodput", multiple=True,
              help="SLOs as KEY:MS ... (ttft, tpot, e2el), e.g. --goodput ttft:500 tpot:50; adds "
                   "request_goodput (requests/s meeting all of them).")
# ---- results: vLLM's names
@click.option("--save-result", is_flag=True, help="Write each level's result JSON (vLLM's layout) to --result-dir.")
@click.option("--append-result", is_flag=True,
              help="Append each level's result as one JSON line to the result file instead (vLLM's).")
@click.option("--save-detailed", is_flag=True,
              help="Also save per-request lists (input_lens, output_lens, ttfts, itls, start_times, "
                   "generated_texts, errors).")
@click.option("--result-dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the result files (default: the current one).")
@click.option("--result-filename", default=None,
              help="File name (default: {label}-{rate}qps[-concurrency{c}]-{model}-{date}.json).")
@click.option("--label", default=None, help="Result label and file-name prefix (default: the backend).")
@click.option("--metadata", multiple=True, help="KEY=VALUE ... written into each result JSON.")
# ---- specscope
@click.option("--disable-tqdm", is_flag=True, help="No progress lines.")
@click.option("--api-key", envvar="SPECSCOPE_API_KEY", default=None, help="Bearer key (env SPECSCOPE_API_KEY).")
@click.option("--timeout", "timeout_s", type=FiniteRange(1, 86400), default=600.0, show_default=True,
              help="Per-request timeout in seconds.")
@click.option("--name", default=None, help="Run name in the registry.")
@click.option("--tag", "tags", multiple=True, help="Tag the stored run (repeatable).")
@click.option("--no-record", is_flag=True, help="Do not store the run in the registry.")
@db_option
@json_option("Print {run_id, config, results, result_files} as JSON instead of the table.")
@click.pass_context
def bench_serve(ctx, backend, endpoint, url, host, port, model, tokenizer, tokenizer_mode, headers, dataset_name,
                dataset_path, legacy_dataset, category, num_prompts, no_oversample, disable_shuffle,
                skip_chat_template, input_len, max_tokens, random_input_len, random_output_len, random_range_ratio,
                spec_bench_output_len, custom_output_len, sharegpt_output_len, request_rate, burstiness, concurrency,
                ignore_eos, num_warmups, seed, temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty,
                repetition_penalty, extra_body, percentile_metrics, metric_percentiles, goodput, save_result,
                append_result, save_detailed, result_dir, result_filename, label, metadata, disable_tqdm, api_key,
                timeout_s, name, tags, no_record, db, as_json):
    """Benchmark a live OpenAI-compatible endpoint (specscope, vLLM, SGLang) like `vllm bench serve`, with its
    options and result JSON: TTFT, TPOT, ITL and end-to-end latency (ms), throughput and goodput, per concurrency
    level, plus τ and acceptance from the server's /metrics deltas (SGLang: /get_server_info when /metrics has
    none)."""
    from specscope.benchserve.bench import (BenchSetup, Metrics, Output, Prompts, Target, Traffic, load_workload,
                                            run_bench)
    from specscope.benchserve.datasets import check_dataset

    backend, kind, path = resolve_api(backend, endpoint)
    base = base_url_of(ctx, url, host, port)
    levels = parse_levels(concurrency)
    metrics = Metrics(parse_metrics(percentile_metrics), parse_percentiles(metric_percentiles), parse_goodput(goodput))
    target = Target(base, backend, kind, path, model, api_key, timeout_s, parse_pairs(headers, "--header"))
    meta = parse_pairs(metadata, "--metadata")
    sampling = {k: v for k, v in {"top_p": top_p, "top_k": top_k, "min_p": min_p,
                                  "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
                                  "repetition_penalty": repetition_penalty}.items() if v is not None}
    extra = {**sampling, **parse_extra_body(extra_body)}
    dataset_name, dataset_path, legacy = dataset_of(legacy_dataset, dataset_name, dataset_path)
    check_dataset(dataset_name, dataset_path)
    if result_filename is not None:
        check_result_filename(result_filename)
    if save_result or append_result:  # refused before the benchmark, not after it
        check_writable(result_dir or ".", "--result-dir", is_dir=True)
    # vLLM: random prompts decode to exactly their output length
    traffic = Traffic(levels, request_rate, burstiness, seed, ignore_eos or dataset_name == "random", temperature,
                      extra, num_warmups)
    prompts = Prompts(dataset_name, dataset_path, num_prompts, tuple(category), max_tokens, input_len,
                      random_input_len, random_output_len, random_range_ratio, spec_bench_output_len,
                      custom_output_len, sharegpt_output_len, shuffle=not (disable_shuffle or legacy),
                      oversample=not (no_oversample or legacy), skip_chat_template=skip_chat_template,
                      tokenizer=tokenizer)
    output = Output(label, meta, name, tags, record=not no_record, db=db, save=save_result or append_result,
                    append=append_result, detailed=save_detailed, result_dir=result_dir,
                    result_filename=result_filename)
    setup = BenchSetup(target, traffic, metrics, prompts, output)
    work = load_workload(setup)
    bar = _LevelBars(len(work.requests), len(levels), json_mode=as_json, enabled=not disable_tqdm)
    run = run_bench(setup, work, bar)
    if not run.succeeded:
        # nothing to measure: no table of zeros, no stored run, no result files, and a failing exit status
        if as_json:
            emit_json({"run_id": None, "config": run.config, "results": run.results, "result_files": []})
        raise no_success(run)
    if as_json:
        emit_json(run.to_json())
        return
    _print_run(run, setup)


def dataset_of(legacy_dataset: str | None, name: str | None, path: str | None) -> tuple[str, str | None, bool]:
    """(--dataset-name, --dataset-path, legacy) from the new options or the old --dataset (a name or a file, read
    without shuffling or oversampling); spec_bench when neither is given, custom for a path alone."""
    legacy = legacy_dataset is not None
    if legacy:
        if name is not None or path is not None:
            raise SpecscopeError("--dataset is the old spelling of --dataset-name / --dataset-path; give only the "
                                 "new ones")
        named = legacy_dataset in ("spec_bench", "mt_bench", "random")
        name, path = (legacy_dataset, None) if named else ("custom", legacy_dataset)
    return name or ("custom" if path is not None else "spec_bench"), path, legacy


def no_success(run) -> NoRequestSucceeded:
    """The error of a run where no request of any level succeeded, with the first error the server gave."""
    failed = run.results["failed"]
    examples = sorted({e for lv in run.out["levels"] for e in lv.get("error_examples", [])})
    return NoRequestSucceeded(f"no request succeeded ({failed} of {failed} failed; first error: "
                              f"{examples[0] if examples else 'none reported'}); check that the base URL is an "
                              f"OpenAI-compatible server and --model a model it serves")


def _print_run(run, setup) -> None:
    """The table of levels on stdout; each level's errors, the result files, the stored run and the load
    warning on stderr."""
    m = setup.metrics
    _print_table(setup.target.base, run.out, run.config["num_prompts"], m.names, m.percentiles, m.goodput)
    for lv in run.out["levels"]:
        for e in lv.get("error_examples", []):
            click.echo(f"max concurrency {lv['max_concurrency'] or 'unbounded'}: {e}", err=True)
        if lv.get("spec_decode_unavailable"):
            click.echo(f"max concurrency {lv['max_concurrency'] or 'unbounded'}: {lv['spec_decode_unavailable']}",
                       err=True)
    for f in run.files:
        click.echo(f"result: {f}", err=True)
    if run.run_id:
        click.echo(f"stored run {run.run_id}", err=True)
    if run.load_warning:
        click.echo(run.load_warning, err=True)
    warm = run.results.get("warmup")
    if warm:
        click.echo(f"warm-up: {warm['requests']} request(s), " + ("steady" if warm["steady"] else "not steady") +
                   " (ms per output token: " + ", ".join(f"{t:.1f}" for t in warm["tpot_ms"]) + ")", err=True)


class _LevelBars:
    """One progress bar per concurrency level (requests, their rate, the level's time left), as `vllm bench
    serve`'s tqdm bar shows per run; see specscope.progress for where it is drawn."""

    def __init__(self, per_level: int, levels: int, json_mode: bool, enabled: bool):
        self.per_level, self.levels = per_level, levels
        self.json_mode, self.enabled, self.bar, self.failed = json_mode, enabled, None, 0

    def level(self, i: int, c) -> None:
        from specscope.progress import Progress

        self.close()
        where = f" (level {i + 1}/{self.levels})" if self.levels > 1 else ""
        self.bar = Progress(f"max concurrency {c or 'unbounded'}{where}", self.per_level, "req",
                            json_mode=self.json_mode, enabled=self.enabled)

    def request(self, c, res) -> None:
        if self.bar is not None:
            self.failed += not getattr(res, "ok", True)
            self.bar.advance(info=f"{self.failed} failed" if self.failed else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.failed = None, 0


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
