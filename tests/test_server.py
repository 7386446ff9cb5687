"""In-process tests of `specscope serve`'s app: OpenAI shapes, validation, auth, queue limit, stop strings,
cancellation through on_tokens. The model is a tiny random Llama with a real WordLevel tokenizer."""

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from tiny import make_hf_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_serve")
    make_hf_model(d, "llama", vocab=101, layers=2)
    make_tiny_tokenizer(d, 101)
    return d


def _engine(model_dir, draft=None, **kw):
    from specscope.server.worker import ServedModel, ServeConfig

    return ServedModel(ServeConfig(model=str(model_dir), device="cpu", dtype="fp32", draft=draft, **kw))


@pytest.fixture(scope="module")
def engine(model_dir):
    return _engine(model_dir)


def _offline(engine, prompt_ids, n):
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams

    return generate(engine.model, prompt_ids, n, SamplingParams(), engine.stop_ids).token_ids


def _sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completions_match_offline_greedy_and_report_usage(engine):
    from specscope.server.app import create_app

    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0,
                                            "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = engine.tokenizer.encode("the quick brown fox")
        want = _offline(engine, ids, 12)
        ch = body["choices"][0]
        assert ch["token_ids"] == want
        assert ch["text"] == engine.tokenizer.decode(want)
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                                 "total_tokens": len(ids) + len(want)}
        assert body["object"] == "text_completion" and body["model"] == engine.name
        m = c.get("/v1/models").json()
        assert m["data"][0]["id"] == engine.name
        assert c.get("/health").json() == {"status": "ok"}


def test_chat_stream_concatenates_to_non_stream_text(engine):
    from specscope.server.app import create_app

    msgs = [{"role": "user", "content": "what is the capital of france"}]
    with TestClient(create_app(engine)) as c:
        full = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0}).json()
        with c.stream("POST", "/v1/chat/completions",
                      json={"messages": msgs, "max_tokens": 10, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] == full["choices"][0]["finish_reason"] and set(finishes[:-1]) == {None}
    assert events[-2]["usage"] == full["usage"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2, 9999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
])
def test_invalid_requests_get_400_with_openai_error_body(engine, path, body, param):
    from specscope.server.app import create_app

    with TestClient(create_app(engine)) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_other_client_errors(engine):
    from specscope.server.app import create_app
    from specscope.server.worker import ServedModel

    with TestClient(create_app(engine)) as c:
        assert c.post("/v1/completions", content=b"{not json").status_code == 400
        assert c.post("/v1/completions", content=b"[1, 2]").status_code == 400
        r = c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert c.get("/v1/nothing").status_code == 404
        assert c.get("/v1/completions").status_code == 405
        # prompt + max_tokens beyond the 256-token context
        r = c.post("/v1/completions", json={"prompt": "the " * 200, "max_tokens": 100})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        big = b'{"prompt": "' + b"a" * (engine.cfg.max_body_bytes + 10) + b'"}'
        assert c.post("/v1/completions", content=big).status_code == 413
    # the prompt cap is separate from the context
    capped = ServedModel.__new__(ServedModel)
    capped.__dict__.update(engine.__dict__, max_prompt=3)
    with TestClient(create_app(capped)) as c:
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 2})
        assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]


def test_api_key_required_on_v1_routes_only(model_dir):
    from specscope.server.app import create_app

    eng = _engine(model_dir, api_key="s3cret")
    with TestClient(create_app(eng)) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_full_queue_answers_429_with_retry_after_then_drains(model_dir):
    from specscope.server.app import create_app

    eng = _engine(model_dir, max_queue=1)
    app = create_app(eng)
    c = TestClient(app)  # no lifespan yet: the engine thread is not running, so the first job waits in the queue
    first = {}
    t = threading.Thread(target=lambda: first.update(r=c.post("/v1/completions",
                                                                json={"prompt": "hi", "max_tokens": 3, "temperature": 0})))
    t.start()
    deadline = time.time() + 20
    while app.state.worker.q.qsize() < 1 and time.time() < deadline:
        time.sleep(0.02)
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert "specscope:requests_rejected_total 1.0" in c.get("/metrics").text
    app.state.worker.start()
    t.join(20)
    body = first["r"].json()
    assert first["r"].status_code == 200 and body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["completion_tokens"] == 3 or body["choices"][0]["finish_reason"] == "stop"
    app.state.worker.stop()


def test_stop_strings_cut_text_in_stream_and_full(engine):
    from specscope.server.app import create_app

    with TestClient(create_app(engine)) as c:
        base = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 12,
                                               "temperature": 0}).json()["choices"][0]["text"]
        words = base.split()
        assert len(words) >= 3
        stop = " " + words[2]
        want = base[:base.index(stop)]
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0,
                                            "stop": [stop]}).json()
        assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
        with c.stream("POST", "/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 12,
                                                       "temperature": 0, "stop": stop, "stream": True}) as s:
            ev = _sse(s.iter_lines())
        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == want


def test_cancel_aborts_generation_via_on_tokens(engine):
    """A job cancelled mid-decode stops at the next token: the callback raises, the worker counts it."""
    from specscope.server.metrics import ServerMetrics
    from specscope.server.protocol import GenParams
    from specscope.server.worker import Cancelled, Job
    import asyncio

    class CancelAfterTwo(Job):
        n = 0

        def post(self, *ev):
            if ev[0] == "tokens":
                self.n += 1
                if self.n == 2:
                    self.cancel()

    loop = asyncio.new_event_loop()
    try:
        job = CancelAfterTwo(GenParams(kind="completion", prompt="hi", max_tokens=200, temperature=0.0),
                             engine.tokenizer.encode("the quick"), loop)
        m = ServerMetrics()
        with pytest.raises(Cancelled):
            engine.run(job, m)
    finally:
        loop.close()
    assert job.n == 2
    gen = m.registry.get_sample_value("specscope:generation_tokens_total")
    assert gen == 2  # decoding stopped right after the cancel, far from max_tokens=200


def test_speculative_engine_counts_match_response(model_dir):
    pytest.importorskip("specscope.speculative.decode")
    from specscope.server.app import create_app

    eng = _engine(model_dir, draft="ngram", steps=3)
    with TestClient(create_app(eng)) as c:
        ids = eng.tokenizer.encode("the quick brown fox")
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0,
                                            "return_token_ids": True}).json()
        assert r["choices"][0]["token_ids"] == _offline(eng, ids, 40)  # lossless
        spec = r["spec"]
        reg = c.app.state.metrics.registry
        assert reg.get_sample_value("specscope:spec_decode_num_drafts_total") == spec["verify_ct"] > 0
        assert reg.get_sample_value("specscope:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
        assert reg.get_sample_value("specscope:spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
        per_pos = [reg.get_sample_value("specscope:spec_decode_num_accepted_tokens_per_pos_total",
                                        {"position": str(i)}) for i in range(3)]
        assert sum(per_pos) == spec["accepted_tokens"]
        assert reg.get_sample_value("specscope:cycle_phase_seconds_count", {"phase": "verify"}) == spec["verify_ct"]


def test_chat_without_max_tokens_runs_to_the_context_end(engine):
    from specscope.server.app import create_app

    msgs = [{"role": "user", "content": "the quick brown fox"}]
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0}).json()
    n_prompt = len(engine.tokenizer.encode_messages(msgs))
    u = r["usage"]
    assert u["prompt_tokens"] == n_prompt
    # either the model stopped on its own or it filled the 256-token context exactly
    assert (r["choices"][0]["finish_reason"] == "length") == (u["total_tokens"] == engine.context)
    assert u["total_tokens"] <= engine.context


def test_serve_cli_rejects_bad_setups_with_one_line_errors(model_dir, capsys):
    import socket

    from specscope.cli import main

    def run(argv):
        try:
            main(argv)
        except SystemExit as e:
            return e.code
        return 0

    assert run(["serve", "--model", str(model_dir), "--steps", "3"]) == 2
    assert "--draft" in capsys.readouterr().err
    with socket.socket() as s:  # a port that is taken
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert run(["serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1") and err.count("\n") == 1


def test_metrics_prefix_vllm_gives_vllm_names(model_dir):
    pytest.importorskip("specscope.speculative.decode")
    from specscope.ingest.prometheus import parse_text, spec_delta
    from specscope.server.app import create_app

    eng = _engine(model_dir, draft="ngram", steps=2, metrics_prefix="vllm")
    with TestClient(create_app(eng)) as c:
        before = parse_text(c.get("/metrics").text)
        r = c.post("/v1/completions", json={"prompt": "the quick", "max_tokens": 12, "temperature": 0}).json()
        text = c.get("/metrics").text
    assert "vllm:spec_decode_num_drafts_total" in text and "specscope:" not in text
    d = spec_delta(before, parse_text(text))
    assert d["engine"] == "vllm" and d["num_drafts"] == r["spec"]["verify_ct"]


def test_speculative_stream_with_a_wide_tree_at_the_context_end(model_dir):
    """A wide, low-budget tree (steps 5, topk 4, 12 draft tokens: more drafter-cache writes than verified tokens)
    streamed up to the last position of the context: HTTP 200, every token, no error event, lossless."""
    import torch

    from specscope.server.app import create_app

    eng = _engine(model_dir, draft=str(model_dir), steps=5, topk=4, draft_tokens=12)  # the model drafts for itself
    g = torch.Generator().manual_seed(0)
    for n_new in (20, 23):
        ids = torch.randint(3, eng.vocab, (eng.context - n_new,), generator=g).tolist()
        want = _offline(eng, ids, n_new)
        with TestClient(create_app(eng)) as c:
            with c.stream("POST", "/v1/completions",
                          json={"prompt": ids, "max_tokens": n_new, "temperature": 0, "stream": True,
                                "return_token_ids": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                events = _sse(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1]), events[-3:]
        got = [t for e in events[:-1] if e.get("choices") for t in e["choices"][0].get("token_ids") or []]
        assert got == want
        spec = events[-2]["spec"]
        assert spec["accepted_tokens"] > 0 and spec["verify_ct"] < len(want)


def test_queue_time_is_its_own_histogram(model_dir):
    """Like vLLM's request_queue_time_seconds: waiting for the batch-1 engine is reported apart from decoding."""
    from specscope.server.app import create_app
    from specscope.ingest.prometheus import parse_text

    with TestClient(create_app(_engine(model_dir))) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}).status_code == 200
        s = parse_text(c.get("/metrics").text)
    assert s.total("specscope:request_queue_time_seconds_count") == 2
    assert s.total("specscope:request_inference_time_seconds_count") == 2
    assert s.total("specscope:request_queue_time_seconds_sum") >= 0
    e2e = s.total("specscope:e2e_request_latency_seconds_sum")
    assert s.total("specscope:request_queue_time_seconds_sum") <= e2e


def test_clients_that_hang_up_stop_their_work(model_dir, monkeypatch):
    """Real HTTP on loopback: a streaming client that disconnects mid-decode stops its decode at the next token,
    and a queued request whose client left is dropped without decoding."""
    import httpx
    import uvicorn

    from specscope.cli.serve import bind_socket
    from specscope.ingest.prometheus import parse_text
    from specscope.server.app import create_app

    eng = _engine(model_dir)
    slow = eng._emit

    def emit_slowly(*a, **k):  # ~20 tokens/s so a hang-up lands mid-decode
        time.sleep(0.05)
        return slow(*a, **k)

    monkeypatch.setattr(eng, "_emit", emit_slowly)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(eng), log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        body = {"prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0, "stream": True}
        got = {}

        def queued():  # waits behind the first request, then hangs up before its turn
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=0.5) as r:
                    got["queued"] = r.status_code
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                got["queued"] = "hung up"

        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # decoding has started
            t = threading.Thread(target=queued)
            t.start()
            t.join(5)
        # both clients are gone: the server must be idle soon, having cancelled both
        deadline = time.time() + 10
        while time.time() < deadline:
            s = parse_text(httpx.get(url + "/metrics").text)
            if (s.total("specscope:request_failed_total", reason="cancelled") or 0) >= 2 and \
                    not s.total("specscope:num_requests_running"):
                break
            time.sleep(0.05)
        assert s.total("specscope:request_failed_total", reason="cancelled") == 2
        assert (s.total("specscope:generation_tokens_total") or 0) < 100  # far from 2 x 200 decoded
        assert not s.total("specscope:num_requests_waiting")
    finally:
        server.should_exit = True
        th.join(20)
