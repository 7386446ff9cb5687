"""`specscope bench-serve` as a drop-in for `vllm bench serve` (vLLM 0.32): its options (--backend / --endpoint,
--host / --port, --tokenizer, separate --dataset-name / --dataset-path, --num-prompts 1000, --append-result,
--metadata, ...), its result JSON's top-level keys and units, and SGLang's /get_server_info when /metrics has no
speculative counters.

The server here is a real HTTP server on loopback (http.server in a thread) that streams OpenAI-shaped chunks for
both APIs, counts vLLM-style speculative counters per request on /metrics, and can play SGLang (/get_server_info);
it records every request it gets. The end-to-end runs against `specscope serve` are in test_bench_serve.py."""

import http.server
import json
import threading

import pytest

from cli_util import cli, one_error_line
from serve_util import LoopbackThread, QuietHandler

# one request's speculative work on the fake server: 2 verify cycles, 6 drafted, 3 accepted (2 at pos 0, 1 at 1)
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = 2, 6, 3, (2, 1, 0)
VLLM_TOP_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                 "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                 "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                 "output_throughput", "total_token_throughput", "latencies", "queue_times",
                 "max_output_tokens_per_s", "max_concurrent_requests", "rtfx")
SPEC_KEYS = ("spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
             "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates")
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


class LoopbackServer:
    """OpenAI streaming on /v1/completions and /v1/chat/completions (4 one-word chunks, then usage unless
    usage=False); /metrics with vLLM's spec-decode counters (metrics="vllm"), none ("none") or a 404 ("off");
    /get_server_info as SGLang's when sglang_tau is set."""

    def __init__(self, metrics="vllm", sglang_tau=None, usage=True):
        self.requests: list[tuple[str, dict]] = []
        self.served = 0
        self.lock = threading.Lock()
        srv = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "org/tiny-model", "root": "org/tiny-model"}]}).encode())
                elif self.path == "/metrics" and metrics != "off":
                    n = srv.served
                    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0\n"
                    if metrics == "vllm":
                        text += (f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {100 + DRAFTS * n}\n'
                                 f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} '
                                 f'{300 + DRAFT_TOKENS * n}\n'
                                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} '
                                 f'{150 + ACCEPTED * n}\n')
                        for pos, a in enumerate(PER_POS):
                            text += (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
                                     f'position="{pos}"}} {10 + a * n}\n')
                    self._send(200, text.encode(), "text/plain")
                elif self.path == "/get_server_info" and sglang_tau is not None:
                    self._send(200, json.dumps({"internal_states": [{"avg_spec_accept_length": sglang_tau,
                                                                     "last_gen_throughput": 12.5}]}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with srv.lock:
                    srv.requests.append((self.path, body, dict(self.headers)))
                chat = self.path.endswith("/chat/completions")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def event(obj):
                    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                words = ["alpha", " beta", " gamma", " delta"][:body.get("max_tokens", 4)]
                for w in words:
                    event({"choices": [{"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}]})
                if usage:
                    prompt = body["messages"][0]["content"] if chat else body["prompt"]
                    event({"choices": [], "usage": {"prompt_tokens": len(prompt.split()) + (3 if chat else 0),
                                                    "completion_tokens": len(words)}})
                with srv.lock:
                    srv.served += 1
                event(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 1024        # a burst of unbounded-concurrency requests must not be refused

        self.loop = LoopbackThread(Handler, Server)
        self.port, self.url = self.loop.port, self.loop.url

    def paths(self):
        return [p for p, _, _ in self.requests]

    def bodies(self):
        return [b for _, b, _ in self.requests]

    def close(self):
        self.loop.close()


@pytest.fixture
def server():
    s = LoopbackServer()
    yield s
    s.close()


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"question number {i}", "category": "c" if i % 2 else "d"}) + "\n"
                         for i in range(5)))
    return p


def bench(capsys, server, *args):
    """bench-serve against `server` with the registry off; (exit code, stdout, stderr)."""
    return cli(capsys, "bench-serve", "--base-url", server.url, "--no-record", "--disable-tqdm", *args)


def saved(result_dir):
    files = sorted(result_dir.glob("*.json"))
    return [json.loads(f.read_text()) for f in files], files


# ------------------------------------------------------------------------------ --backend / --endpoint / URL


@pytest.mark.parametrize("args,path,chat", [
    ([], "/v1/completions", False),                                   # vLLM's default backend: openai
    (["--backend", "openai"], "/v1/completions", False),
    (["--backend", "vllm"], "/v1/completions", False),
    (["--backend", "sglang-oai"], "/v1/completions", False),
    (["--backend", "openai-chat"], "/v1/chat/completions", True),
    (["--backend", "sglang-oai-chat"], "/v1/chat/completions", True),
    (["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"], "/v1/chat/completions", True),
    (["--endpoint", "/v1/chat/completions"], "/v1/chat/completions", True),
    (["--endpoint", "chat"], "/v1/chat/completions", True),
    (["--endpoint", "completions"], "/v1/completions", False),
])
def test_backend_and_endpoint_pick_the_api(args, path, chat, server, prompts_file, capsys):
    code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 2, *args)
    assert code == 0, err
    assert server.paths() == [path, path]
    body = server.bodies()[0]
    assert ("messages" in body) == chat and ("prompt" in body) == (not chat)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("args,needle", [
    (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "make them agree"),
    (["--backend", "openai-chat", "--endpoint", "completions"], "make them agree"),
    (["--backend", "sglang"], "SGLang's native /generate"),
    (["--backend", "openai-embeddings"], "embeddings"),
    (["--backend", "tgi"], "--backend must be one of"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must be an API path"),
    (["--port", "9"], "give --base-url or --port, not both"),
    (["--dataset-name", "hf"], "vLLM's but not supported"),
    (["--dataset-name", "random", "--dataset-path", "x.jsonl"], "takes no --dataset-path"),
    (["--dataset-name", "custom"], "needs --dataset-path"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "spec_bench", "--dataset", "random"], "old spelling"),
    (["--dataset", "random", "--dataset-path", "x.jsonl"], "old spelling"),
    (["--dataset-path", "org/some-dataset"], "Hugging Face dataset ids are not supported"),
    (["--metadata", "novalue"], "--metadata takes KEY=VALUE"),
    (["--header", "x"], "--header takes KEY=VALUE"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--goodput", "ttft:5", "stray"], "--goodput takes KEY:MS"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode"),
])
def test_bad_vllm_flags_are_one_line_before_any_request(args, needle, server, capsys):
    line = one_error_line(*bench(capsys, server, *args)[::2])
    assert needle in line, line
    assert server.requests == []


def test_host_and_port_build_the_url_without_base_url(server, prompts_file, capsys):
    code, out, err = cli(capsys, "bench-serve", "--host", "127.0.0.1", "--port", server.port, "--dataset-path",
                         prompts_file, "--num-prompts", 1, "--no-record", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["config"]["url"] == server.url and len(server.requests) == 1


# ------------------------------------------------------------------------------ datasets


def test_num_prompts_defaults_to_vllms_1000_with_oversampling(server, prompts_file, capsys):
    code, out, err = bench(capsys, server, "--dataset-path", prompts_file, "--json", "--output-len", 1,
                           "--max-concurrency", 32)
    assert code == 0, err
    assert len(server.requests) == 1000                            # 5 prompts, oversampled to 1000 as vLLM does
    sent = [b["prompt"] for b in server.bodies()]
    assert set(sent) == {f"question number {i}" for i in range(5)}
    res = json.loads(out)
    assert res["config"]["num_prompts"] == 1000 and res["results"]["levels"][0]["completed"] == 1000


def test_no_oversample_and_disable_shuffle(server, prompts_file, capsys):
    code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 50, "--no-oversample",
                         "--disable-shuffle", "--max-concurrency", 1)
    assert code == 0, err
    assert [b["prompt"] for b in server.bodies()] == [f"question number {i}" for i in range(5)]


def test_dataset_name_and_path_are_separate_options_in_either_order(server, prompts_file, capsys):
    runs = []
    for args in (["--dataset-name", "custom", "--dataset-path", prompts_file],
                 ["--dataset-path", prompts_file, "--dataset-name", "custom"],
                 ["--dataset-path", prompts_file]):                    # a path alone is a custom file
        server.requests.clear()
        code, _, err = bench(capsys, server, *args, "--num-prompts", 5, "--max-concurrency", 1)
        assert code == 0, err
        runs.append([b["prompt"] for b in server.bodies()])
    assert runs[0] == runs[1] == runs[2]
    assert sorted(runs[0]) == sorted(f"question number {i}" for i in range(5))
    assert runs[0] != sorted(runs[0])            # shuffled with --seed, as vLLM
    # a Spec-Bench-format file under the spec_bench name, with vLLM's --spec-bench-category and output length
    sb = prompts_file.parent / "sb.jsonl"
    sb.write_text("".join(json.dumps({"question_id": i, "category": "writing" if i < 2 else "math",
                                      "turns": [f"turn one {i}", "turn two"]}) + "\n" for i in range(4)))
    for order in (["--dataset-path", sb, "--dataset-name", "spec_bench"],
                  ["--dataset-name", "spec_bench", "--dataset-path", sb]):
        server.requests.clear()
        code, _, err = bench(capsys, server, *order, "--spec-bench-category", "math", "--num-prompts", 2,
                             "--spec-bench-output-len", 3)
        assert code == 0, err
        assert sorted(b["prompt"] for b in server.bodies()) == ["turn one 2", "turn one 3"]
        assert {b["max_tokens"] for b in server.bodies()} == {3}


def test_legacy_dataset_spelling_keeps_its_meaning(server, prompts_file, capsys):
    """--dataset FILE: the file in order, each prompt once (no shuffle, no oversampling to 1000)."""
    code, _, err = bench(capsys, server, "--dataset", prompts_file, "--max-concurrency", 1, "--max-tokens", 2)
    assert code == 0, err
    assert [b["prompt"] for b in server.bodies()] == [f"question number {i}" for i in range(5)]
    assert {b["max_tokens"] for b in server.bodies()} == {2}


def test_random_dataset_ignores_eos_and_takes_vllms_lengths(server, capsys):
    code, _, err = bench(capsys, server, "--dataset-name", "random", "--num-prompts", 3, "--input-len", 12,
                         "--output-len", 4)
    assert code == 0, err
    bodies = server.bodies()
    assert len(bodies) == 3 and all(b["ignore_eos"] is True and b["max_tokens"] == 4 for b in bodies)
    assert all(len(b["prompt"].split()) == 12 for b in bodies)


def test_tokenizer_counts_prompt_tokens_like_vllm(tmp_path, capsys):
    """No usage from the server: input_lens are the --tokenizer's counts, random prompts are exactly
    --random-input-len tokens with the special tokens the server adds, outputs are counted from the text."""
    from tiny import make_tiny_tokenizer

    tok_dir = tmp_path / "tok"
    fast = make_tiny_tokenizer(tok_dir, 101)
    srv = LoopbackServer(usage=False)
    try:
        code, _, err = bench(capsys, srv, "--dataset-name", "random", "--random-input-len", 20,
                             "--random-output-len", 3, "--num-prompts", 4, "--tokenizer", tok_dir,
                             "--save-result", "--save-detailed", "--result-dir", tmp_path / "res")
        assert code == 0, err
        (res,), _ = saved(tmp_path / "res")
        want = 20 - fast.num_special_tokens_to_add()
        assert all(len(fast(b["prompt"], add_special_tokens=False).input_ids) == want for b in srv.bodies())
        assert res["input_lens"] == [20] * 4 and res["total_input_tokens"] == 80
        # the server's text "alpha beta gamma" is three words; the tiny tokenizer's <unk> each: 3 tokens
        assert res["output_lens"] == [3] * 4 and res["tokenizer_id"] == str(tok_dir)
        # a completions backend gets the chat template client-side for custom prompts (vLLM's custom dataset)
        f = tmp_path / "p.jsonl"
        f.write_text(json.dumps({"prompt": "what is the capital of france"}) + "\n")
        srv.requests.clear()
        code, _, err = bench(capsys, srv, "--dataset-path", f, "--num-prompts", 1, "--tokenizer", tok_dir)
        assert code == 0, err
        assert srv.bodies()[0]["prompt"] == "<|user|> what is the capital of france </s> <|assistant|> "
        srv.requests.clear()
        code, _, err = bench(capsys, srv, "--dataset-path", f, "--num-prompts", 1, "--tokenizer", tok_dir,
                             "--skip-chat-template")
        assert code == 0, err
        assert srv.bodies()[0]["prompt"] == "what is the capital of france"
        # and so does a chat backend: vLLM sends the templated text as the message (the server templates again)
        srv.requests.clear()
        code, _, err = bench(capsys, srv, "--dataset-path", f, "--num-prompts", 1, "--tokenizer", tok_dir,
                             "--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
        assert code == 0, err
        assert srv.bodies()[0]["messages"][-1]["content"] == "<|user|> what is the capital of france </s> <|assistant|> "
    finally:
        srv.close()


def test_tokenizer_from_a_hub_id_needs_only_its_tokenizer_files(tmp_path, monkeypatch, capsys):
    """--tokenizer org/name: the tokenizer files from the Hugging Face cache (offline here), no config.json or
    weights needed."""
    from hub_util import dir_files, write_hub_repo
    from tiny import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path / "tok", 101)
    cache = tmp_path / "hf-cache"
    write_hub_repo(cache, "org/tiny-tok", dir_files(tmp_path / "tok"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    srv = LoopbackServer(usage=False)
    try:
        code, out, err = bench(capsys, srv, "--dataset-name", "random", "--random-input-len", 9, "--num-prompts", 2,
                               "--tokenizer", "org/tiny-tok", "--json")
    finally:
        srv.close()
    assert code == 0, err
    res = json.loads(out)
    assert res["config"]["tokenizer"] == "org/tiny-tok" and res["results"]["levels"][0]["total_input_tokens"] == 18
    code, _, err = bench(capsys, srv, "--tokenizer", "org/not-cached")
    assert "org/not-cached" in one_error_line(code, err)


def test_sharegpt_file(server, tmp_path, capsys):
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"ask {i}"},
                                                {"from": "gpt", "value": "reply words here"}]} for i in range(3)]
                            + [{"conversations": [{"from": "human", "value": "lonely"}]}]))
    code, _, err = bench(capsys, server, "--dataset-name", "sharegpt", "--dataset-path", f, "--num-prompts", 3)
    assert "pass --tokenizer" in one_error_line(code, err)
    code, _, err = bench(capsys, server, "--dataset-name", "sharegpt", "--dataset-path", f, "--num-prompts", 3,
                         "--sharegpt-output-len", 2)
    assert code == 0, err
    assert sorted(b["prompt"] for b in server.bodies()) == ["ask 0", "ask 1", "ask 2"]
    assert {b["max_tokens"] for b in server.bodies()} == {2}


# ------------------------------------------------------------------------------ request options


def test_sampling_headers_extra_body_and_nargs_flags(server, prompts_file, tmp_path, capsys):
    code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 1, "--top-p", 0.9,
                         "--top-k", 20, "--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}',
                         "--header", "x-a=1", "x-b=2", "--goodput", "ttft:60000", "tpot:60000",
                         "--metadata", "tp=1", "version=0.32", "--save-result", "--result-dir", tmp_path)
    assert code == 0, err
    _, body, headers = server.requests[0]
    assert body["top_p"] == 0.9 and body["top_k"] == 20 and body["temperature"] == 0.0
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert headers["x-a"] == "1" and headers["x-b"] == "2"
    (res,), _ = saved(tmp_path)
    assert res["tp"] == "1" and res["version"] == "0.32"           # --metadata: top-level keys, as vLLM
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])


# ------------------------------------------------------------------------------ the result JSON


def test_result_json_has_vllms_top_level_keys_and_units(server, prompts_file, tmp_path, capsys):
    code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 4, "--save-result",
                         "--result-dir", tmp_path, "--metric-percentiles", "50,99")
    assert code == 0, err
    (res,), files = saved(tmp_path)
    assert files[0].name.startswith("openai-infqps-tiny-model-")   # vLLM's {label}-{rate}qps-{model}-{date}.json
    for k in VLLM_TOP_KEYS + SPEC_KEYS:
        assert k in res, k
    for m in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{m}_ms" in res, (stat, m)
    assert not any(k in res for k in DETAILED)                    # only with --save-detailed
    assert res["backend"] == res["endpoint_type"] == "openai" and res["label"] is None
    assert res["model_id"] == "org/tiny-model" and res["tokenizer_id"] is None
    assert res["num_prompts"] == res["completed"] == 4 and res["failed"] == 0
    assert res["request_rate"] == "inf" and res["max_concurrency"] is None and res["request_goodput"] is None
    assert res["total_output_tokens"] == 16 and res["total_input_tokens"] == 4 * 3
    # acceptance over this run's /metrics deltas: rate in PERCENT, per-position rates as fractions
    assert res["spec_decode_num_drafts"] == 4 * DRAFTS and res["spec_decode_draft_tokens"] == 4 * DRAFT_TOKENS
    assert res["spec_decode_accepted_tokens"] == 4 * ACCEPTED
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100.0 * ACCEPTED / DRAFT_TOKENS)   # 50.0
    assert res["spec_decode_acceptance_length"] == pytest.approx(1 + ACCEPTED / DRAFTS)           # 2.5
    assert res["spec_decode_per_position_acceptance_rates"] == pytest.approx([a / DRAFTS for a in PER_POS])
    # specscope's nested block stays, as fractions
    assert res["spec_decode"]["draft_acceptance_rate"] == pytest.approx(0.5)
    assert res["spec_decode"]["source"] == "/metrics"
    # seconds in the lists, milliseconds in the statistics
    assert len(res["latencies"]) == 4 and res["mean_e2el_ms"] == pytest.approx(
        1e3 * sum(res["latencies"]) / 4, rel=1e-6)
    assert res["duration"] < 60 and res["mean_ttft_ms"] > 0


def test_save_detailed_lists_and_one_file_per_concurrency_level(server, prompts_file, tmp_path, capsys):
    code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 3, "--save-result",
                         "--save-detailed", "--result-dir", tmp_path, "--max-concurrency", "1,2",
                         "--label", "mine", "--percentile-metrics", "ttft,client_queue_time")
    assert code == 0, err
    results, files = saved(tmp_path)
    assert sorted(f.name.split("-")[2] for f in files) == ["concurrency1", "concurrency2"]
    assert all(f.name.startswith("mine-infqps-") for f in files)
    for res in results:
        assert res["label"] == "mine" and res["max_concurrency"] in (1, 2)
        for k in DETAILED:
            assert len(res[k]) == 3, k
        assert res["output_lens"] == [4, 4, 4] and res["errors"] == ["", "", ""]
        assert all(len(itl) == 3 for itl in res["itls"])         # 4 chunks: 3 gaps, in seconds
        assert "mean_client_queue_time_ms" in res and "mean_tpot_ms" not in res


def test_append_result_adds_json_lines(server, prompts_file, tmp_path, capsys):
    for _ in range(2):
        code, _, err = bench(capsys, server, "--dataset-path", prompts_file, "--num-prompts", 1, "--append-result",
                             "--result-dir", tmp_path, "--result-filename", "all.json", "--max-concurrency", "1,2")
        assert code == 0, err
    lines = (tmp_path / "all.json").read_text().splitlines()
    assert [json.loads(x)["max_concurrency"] for x in lines] == [1, 2, 1, 2]


# ------------------------------------------------------------------------------ SGLang: /get_server_info


def test_sglang_server_info_gives_tau_when_metrics_has_none(prompts_file, tmp_path, capsys):
    srv = LoopbackServer(metrics="off", sglang_tau=2.75)
    try:
        code, out, err = bench(capsys, srv, "--dataset-path", prompts_file, "--num-prompts", 2, "--save-result",
                               "--result-dir", tmp_path, "--backend", "sglang-oai-chat")
    finally:
        srv.close()
    assert code == 0, err
    (res,), _ = saved(tmp_path)
    assert res["spec_decode_acceptance_length"] == 2.75
    assert "spec_decode_acceptance_rate" not in res              # no counters: no rate to report
    assert res["spec_decode"] == {"engine": "sglang", "window": "server", "accept_length": 2.75,
                                  "source": "/get_server_info"}
    assert "2.75" in out and "τ unavailable" not in err


@pytest.mark.parametrize("metrics", ["off", "none"])
def test_no_tau_anywhere_is_said(metrics, prompts_file, tmp_path, capsys):
    srv = LoopbackServer(metrics=metrics)
    try:
        code, _, err = bench(capsys, srv, "--dataset-path", prompts_file, "--num-prompts", 2, "--save-result",
                             "--result-dir", tmp_path)
    finally:
        srv.close()
    assert code == 0, err
    (res,), _ = saved(tmp_path)
    assert not any(k in res for k in SPEC_KEYS) and "spec_decode" not in res
    assert "τ unavailable" in res["spec_decode_unavailable"] and "/get_server_info" in res["spec_decode_unavailable"]
    assert "τ unavailable" in err


def test_vllm_spec_keys_from_each_source():
    from specscope.benchserve.run import vllm_spec_keys

    counters = {"window": "delta", "accept_length": 2.5, "num_drafts": 4, "num_draft_tokens": 12,
                "num_accepted_tokens": 6, "per_position_acceptance": [0.75, None, 0.25]}
    keys = vllm_spec_keys(counters)
    assert set(keys) == set(SPEC_KEYS) and keys["spec_decode_acceptance_rate"] == 50.0
    assert keys["spec_decode_per_position_acceptance_rates"] == [0.75, 0.0, 0.25]   # a missing series: 0, as vLLM
    # SGLang's gauge (no counters) or /get_server_info: the length alone
    assert vllm_spec_keys({"engine": "sglang", "window": "delta", "accept_length": 3.1}) == \
        {"spec_decode_acceptance_length": 3.1}
    assert vllm_spec_keys(dict(counters, window="lifetime")) == {}      # not this run's
    assert vllm_spec_keys(None) == {} and vllm_spec_keys({"window": "delta"}) == {}
