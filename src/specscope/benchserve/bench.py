"""One `specscope bench-serve` run end to end: the requests from the dataset options, every concurrency level sent
(benchserve.run), the run's results and config, the run stored in the registry and vLLM's result files
(benchserve.results). The CLI parses the options into the dataclasses here and prints what run_bench returns."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from specscope.benchserve.run import DEFAULT_METRICS, DEFAULT_PERCENTILES, run_levels
from specscope.benchserve.warmup import warm_up

# the first level's /metrics deltas that become the run's results (what `compare` and the report read)
# "phases" (specscope serve's engine-step phases, ingest/prometheus.py step_phases) in the profiler's shape, so a
# served run is shown, compared and reported like a `generate` run
SERVER_METRIC_KEYS = ("accept_length", "per_position_acceptance", "draft_acceptance_rate", "phases", "engine_steps",
                      "drafted_step_share")


@dataclass
class Target:
    """The server and the API the requests go to."""
    base: str                            # scheme://host[:port][/path], no trailing /v1
    backend: str                         # vLLM's --backend spelling, as the result files name it
    endpoint: str                        # "chat" | "completions": the request shape
    path: str                            # the URL path, e.g. /v1/completions
    model: str | None = None             # None: the first of /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0             # per request
    headers: dict = field(default_factory=dict)


@dataclass
class Traffic:
    """How the requests are sent: every request once per level (max concurrency, None = unbounded), arriving at
    request_rate, with these sampling fields."""
    levels: list
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra: dict = field(default_factory=dict)    # sampling parameters, then --extra-body
    warmups: int = 0                             # at least this many warm-up requests, then until steady


@dataclass
class Metrics:
    """What is reported of each level: percentiles of these metrics, and goodput under these SLOs (ms)."""
    names: tuple = DEFAULT_METRICS
    percentiles: tuple = DEFAULT_PERCENTILES
    goodput: dict | None = None


@dataclass
class Prompts:
    """The dataset options (build_requests' arguments) and the --tokenizer that counts and shapes the prompts."""
    name: str
    path: str | None
    num_prompts: int
    categories: tuple = ()
    output_len: int | None = None        # --output-len: every request's max_tokens, over the dataset's default
    input_len: int | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    spec_bench_output_len: int = 256
    custom_output_len: int = 256
    sharegpt_output_len: int | None = None
    shuffle: bool = True
    oversample: bool = True
    skip_chat_template: bool = False
    tokenizer: str | None = None


@dataclass
class Output:
    """Where the run goes: the registry (record=False: nowhere) and vLLM's result files (save), with its label and
    metadata."""
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    name: str | None = None              # the run's name in the registry (default: bench-serve MODEL)
    tags: tuple = ()
    record: bool = True
    db: str | None = None
    save: bool = False
    append: bool = False                 # one JSON line per level added to the file (vLLM's --append-result)
    detailed: bool = False               # the per-request lists too (vLLM's --save-detailed)
    result_dir: str | None = None
    result_filename: str | None = None


@dataclass
class BenchSetup:
    target: Target
    traffic: Traffic
    metrics: Metrics
    prompts: Prompts
    output: Output


@dataclass
class Workload:
    requests: list                       # datasets.Request
    dataset: dict                        # build_requests' name, path, hash
    tokenizer: object = None


@dataclass
class BenchRun:
    out: dict                            # run_levels': model, levels, lists, per_request
    results: dict
    config: dict
    run_id: str | None = None
    files: list = field(default_factory=list)
    load_warning: str | None = None

    @property
    def succeeded(self) -> bool:
        """Did any request of any level succeed (is there anything measured)?"""
        return any(lv["completed"] for lv in self.out["levels"])

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "config": self.config, "results": self.results, "result_files": self.files,
                "load_warning": self.load_warning}


def load_workload(setup: BenchSetup) -> Workload:
    """The run's requests: the --tokenizer (when given) and the dataset options through build_requests."""
    from specscope.benchserve.datasets import build_requests, load_tokenizer

    p = setup.prompts
    tok = load_tokenizer(p.tokenizer) if p.tokenizer is not None else None
    ds = build_requests(p.name, p.path, p.num_prompts, chat=setup.target.endpoint == "chat", tokenizer=tok,
                        seed=setup.traffic.seed, categories=p.categories, output_len=p.output_len,
                        input_len=p.input_len, random_input_len=p.random_input_len,
                        random_output_len=p.random_output_len, random_range_ratio=p.random_range_ratio,
                        spec_bench_output_len=p.spec_bench_output_len, custom_output_len=p.custom_output_len,
                        sharegpt_output_len=p.sharegpt_output_len, shuffle=p.shuffle, oversample=p.oversample,
                        skip_chat_template=p.skip_chat_template)
    return Workload(ds["requests"], ds, tok)


def run_bench(setup: BenchSetup, work: Workload, progress=None) -> BenchRun:
    """Every level of `work` sent to the server, then the run stored and its result files written, as setup.output
    asks; neither when no request succeeded (BenchRun.succeeded). progress: the CLI's bars, told of each level's
    start (level(i, c)) and each request (request(c, result)), closed when the levels end (close())."""
    o = setup.output
    if o.record:       # before minutes of requests: a registry that cannot take the run is refused now
        from specscope.registry import check_registry

        check_registry(o.db)
    warm = warm_up(lambda k: send(setup, work, levels=[1], requests=work.requests[:1] * k),
                   setup.traffic.warmups) if work.requests else None
    out = send(setup, work, progress)
    run = BenchRun(out, summarize(out), run_config(setup, work, out))
    if warm is not None:
        run.results["warmup"] = warm.to_dict()
    if not run.succeeded:
        return run
    env = None
    if o.record:
        run.run_id, env = record_run(run, o)
    # the client's clock (and a server on this machine) shared the CPUs with whatever else ran
    from specscope.registry.fingerprint import timing_warning

    run.load_warning = timing_warning(env)
    if o.save:
        from specscope.benchserve.results import save_results

        run.files = save_results(out, run.config, run.run_id, o.result_dir or ".", o.result_filename, o.detailed,
                                 num_prompts=setup.prompts.num_prompts, append=o.append)
    return run


def send(setup: BenchSetup, work: Workload, progress=None, levels=None, requests=None) -> dict:
    """run_levels over every level of the setup (or `levels`, with `requests`: the warm-up's); the progress bars
    are closed however it ends."""
    t, tr, m = setup.target, setup.traffic, setup.metrics
    try:
        return asyncio.run(run_levels(t.base, work.requests if requests is None else requests,
                                      tr.levels if levels is None else levels, t.endpoint, t.model, 0, tr.temperature,
                                      t.api_key, t.timeout_s, progress.request if progress else None,
                                      request_rate=tr.request_rate, burstiness=tr.burstiness, seed=tr.seed,
                                      ignore_eos=tr.ignore_eos, metric_names=m.names, percentiles=m.percentiles,
                                      goodput=m.goodput, path=t.path, extra_body=tr.extra, extra_headers=t.headers,
                                      tokenizer=work.tokenizer, on_level=progress.level if progress else None))
    finally:
        if progress:
            progress.close()


def summarize(out: dict) -> dict:
    """The run's results: every level; the first level's throughput; the failures of all levels; and the
    server's speculative numbers of the first level (SERVER_METRIC_KEYS of its /metrics deltas, else τ from
    SGLang's /get_server_info)."""
    first = out["levels"][0]
    results = {"levels": out["levels"], "tok_per_s": first["output_throughput"],
               "request_throughput": first["request_throughput"], "failed": sum(lv["failed"] for lv in out["levels"])}
    sm = first.get("server_metrics") or {}
    for key in SERVER_METRIC_KEYS:
        if key in sm:
            results[key] = sm[key]
    if "accept_length" not in results and (first.get("spec_decode") or {}).get("accept_length") is not None:
        results["accept_length"] = first["spec_decode"]["accept_length"]      # SGLang's /get_server_info
    return results


def run_config(setup: BenchSetup, work: Workload, out: dict) -> dict:
    """The run's config as stored (and as the result files' setup fields read it)."""
    t, tr, p = setup.target, setup.traffic, setup.prompts
    first = out["levels"][0]
    sm = first.get("server_metrics") or {}
    config = {"url": t.base, "backend": t.backend, "endpoint": t.endpoint, "endpoint_path": t.path,
              "model": out["model"], "engine": sm.get("engine") or (first.get("spec_decode") or {}).get("engine"),
              "tokenizer": p.tokenizer, "prompt_set": work.dataset["name"], "dataset_path": work.dataset["path"],
              "prompt_set_hash": work.dataset["hash"], "categories": list(p.categories),
              "num_prompts": len(work.requests), "max_tokens": p.output_len, "max_concurrency": tr.levels,
              "request_rate": "inf" if math.isinf(tr.request_rate) else tr.request_rate, "burstiness": tr.burstiness,
              "ignore_eos": tr.ignore_eos, "seed": tr.seed, "goodput": setup.metrics.goodput,
              "label": setup.output.label, "metadata": setup.output.metadata,
              "sampling": {"temperature": tr.temperature, **tr.extra}}
    if p.name == "random":
        config.update(random_input_len=p.input_len or p.random_input_len, random_output_len=p.random_output_len,
                      random_range_ratio=p.random_range_ratio)
    # what a specscope server drafts with (its spec_decode_info): the drafter and shape under a generate run's
    # names, so the run's τ is shown beside its drafter; vLLM and SGLang export none, their runs name no drafter
    config.update(sm.get("server_spec") or {})
    return config


def record_run(run: BenchRun, o: Output) -> tuple[str, dict]:
    """(run id, env): the run stored in the registry as one bench_serve record, its per-request results as
    samples."""
    from specscope.registry import make_record, store_record

    rec = make_record("bench_serve", o.name or f"bench-serve {run.out['model']}", config=run.config,
                      results=run.results, samples={"per_request": run.out["per_request"]}, tags=o.tags)
    # the model is remote: its "hash" is whatever the server calls it, not a local file
    rec["config"].pop("model_hash", None)
    return store_record(rec, o.db), rec["env"]
