"""In-process tests of `specscope serve`'s app: OpenAI shapes, validation, auth, queue limit, stop strings,
cancellation through on_tokens. The model is a tiny random Llama with a real WordLevel tokenizer."""

import json
import threading
import time
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from tiny import make_served_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("tiny_serve"))


def _engine(model_dir, draft=None, **kw):
    """A served model; with a drafter, one that drafts every step in its declared shape (these tests count drafts
    and trees on a tiny random model, where the priced defaults soon stop drafting) unless the test says otherwise."""
    from specscope.server.worker import ServedModel, ServeConfig
    from specscope.speculative.decode import DraftOptions

    if draft is not None:
        kw = {"spec_policy": "always", "draft_budget": "fixed", **kw}
    knobs = {k: kw.pop(k) for k in ("steps", "topk", "draft_tokens", "ngram_tokens") if k in kw}
    drafting = DraftOptions(draft, **knobs, budget=kw.pop("draft_budget", "fixed"))
    return ServedModel(ServeConfig(model=str(model_dir), device="cpu", dtype="fp32", drafting=drafting, **kw))


@pytest.fixture(scope="module")
def engine(model_dir):
    return _engine(model_dir)


def _offline(engine, prompt_ids, n, sampling=None):
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams

    return generate(engine.model, prompt_ids, n, sampling or SamplingParams(), engine.stop_ids).token_ids


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
        u = dict(body["usage"])
        assert 0 <= u.pop("prompt_tokens_details")["cached_tokens"] < len(ids)
        assert u == {"prompt_tokens": len(ids), "completion_tokens": len(want), "total_tokens": len(ids) + len(want)}
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
    # the same prompt again: the prefix cache supplies all of it but the last token, the answer is the same
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == full["usage"]["prompt_tokens"] - 1
    assert {k: v for k, v in events[-2]["usage"].items() if k != "prompt_tokens_details"} == \
        {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2, 9999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": ["the lazy dog", 3]}, "prompt"),
    ("/v1/completions", {"prompt": ["the lazy dog", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [7, 9999]]}, "prompt"),
    ("/v1/completions", {"prompt": ["the lazy dog", "the " * 200], "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": ["the lazy dog"] * 9, "n": 8}, "prompt"),    # 72 choices, the queue holds 64
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
    """A job cancelled mid-decode stops at the next token: its callback raises, the engine ends only that sequence
    and the worker answers `cancelled` and counts it."""
    import asyncio

    from specscope.server.metrics import ServerMetrics
    from specscope.server.protocol import GenParams
    from specscope.server.worker import Dropped, Job, Tokens, Worker

    class CancelAfterTwo(Job):
        n = 0

        def post(self, ev):
            if isinstance(ev, Tokens):
                self.n += 1
                if self.n == 2:
                    self.cancel()
            super().post(ev)

    m = ServerMetrics()
    w = Worker(engine, m, 4)
    w.start()

    async def run():
        loop = asyncio.get_running_loop()
        job = CancelAfterTwo(GenParams(kind="completion", prompt="hi", max_tokens=200, temperature=0.0,
                                       ignore_eos=True), engine.tokenizer.encode("the quick"), loop)
        w.submit(job)
        while isinstance(ev := await asyncio.wait_for(job.events.get(), 30), Tokens):
            pass
        return job, ev

    try:
        job, last = asyncio.run(run())
    finally:
        w.stop()
    assert last == Dropped() and job.n == 2
    assert m.registry.get_sample_value("specscope:request_failed_total", {"reason": "cancelled"}) == 1
    gen = m.registry.get_sample_value("specscope:generation_tokens_total")
    assert gen == 2  # dropped by the engine at the step after the cancel, far from max_tokens=200


def test_speculative_engine_counts_match_response(model_dir):
    pytest.importorskip("specscope.speculative.decode")
    from specscope.server.app import create_app

    eng = _engine(model_dir, draft="ngram", steps=3, spec_policy="always", draft_budget="fixed")
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
        # alone in the engine: one step for the prefill, then one per verify cycle
        assert reg.get_sample_value("specscope:cycle_phase_seconds_count", {"phase": "step"}) == spec["verify_ct"] + 1
        assert reg.get_sample_value("specscope:spec_decode_steps_total", {"mode": "draft"}) == spec["verify_ct"]
        # every step's phases are exported and lie inside the step (the worker's stamp also covers the step call,
        # and how much of it a preempted thread spends outside the phases is the machine's, not a rule: no ratio of
        # times is asserted, so the suite holds on a loaded machine)
        phases = {p: reg.get_sample_value("specscope:cycle_phase_seconds_sum", {"phase": p})
                  for p in ("draft", "verify", "accept", "commit", "other", "step")}
        assert all(v > 0 for v in phases.values()), phases
        parts = sum(v for p, v in phases.items() if p != "step")
        assert parts <= phases["step"]


def test_spec_of_several_choices_adds_up(model_dir):
    """n = 2 greedy choices with a drafter: the answer's `spec` (SpecCounts, typed since issue 50) is the two
    choices' counters added up, τ weighted by their cycles, in the keys and order a client always read; the stream's
    usage chunk carries the same."""
    from specscope.server.app import create_app

    eng = _engine(model_dir, draft="ngram", steps=3, spec_policy="always", draft_budget="fixed")
    body = {"prompt": "the quick brown fox", "max_tokens": 30, "temperature": 0}
    with TestClient(create_app(eng)) as c:
        one = c.post("/v1/completions", json=body).json()["spec"]
        two = c.post("/v1/completions", json={**body, "n": 2}).json()["spec"]
        with c.stream("POST", "/v1/completions", json={**body, "n": 2, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            streamed = _sse(r.iter_lines())[-2]["spec"]
    assert list(one) == ["verify_ct", "accepted_tokens", "draft_tokens", "accept_length"] and one["verify_ct"] > 0
    assert two == streamed == {"verify_ct": 2 * one["verify_ct"], "accepted_tokens": 2 * one["accepted_tokens"],
                               "draft_tokens": 2 * one["draft_tokens"], "accept_length": one["accept_length"]}


def test_served_drafter_is_priced_by_default(model_dir):
    """serve --draft without --spec-policy prices each step by batch size: the policy is the live PricedPolicy
    (each sequence verifies its declared shape when it drafts), and the output stays lossless."""
    from specscope.economics.policy import PricedPolicy
    from specscope.server.app import create_app
    from specscope.server.worker import ServeConfig

    eng = _engine(model_dir, draft="ngram", steps=3, spec_policy=ServeConfig.spec_policy,
                  draft_budget=ServeConfig().drafting.budget)      # serve's defaults
    assert ServeConfig.spec_policy == "priced" and ServeConfig().drafting.budget == "fixed"
    assert isinstance(eng.policy, PricedPolicy) and eng.drafter.prices is None
    with TestClient(create_app(eng)) as c:
        ids = eng.tokenizer.encode("the quick brown fox")
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 30, "temperature": 0,
                                            "return_token_ids": True}).json()
        assert r["choices"][0]["token_ids"] == _offline(eng, ids, 30)
        reg = c.app.state.metrics.registry
        steps = [reg.get_sample_value("specscope:spec_decode_steps_total", {"mode": m}) or 0 for m in ("draft", "plain")]
        # one request alone: the prefill, then one step per cycle, drafted or plain as the policy chose
        assert sum(steps) + 1 == reg.get_sample_value("specscope:cycle_phase_seconds_count", {"phase": "step"})
        assert steps[0] == r["spec"]["verify_ct"]


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
    # the batching knobs fail before the model loads, on one line
    for argv, says in ((["--max-seq-len", "300"], "--max-seq-len 300 is over the model's context of 256"),
                       (["--draft", "ngram", "--spec-policy", "sometimes"], "--spec-policy 'sometimes'"),
                       (["--spec-policy", "auto"], "no --draft is given"),
                       (["--max-num-seqs", "0"], "--max-num-seqs"),
                       (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens")):
        assert run(["serve", "--model", str(model_dir), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err, (argv, err)


def test_max_seq_len_caps_requests(model_dir):
    """--max-seq-len is each sequence's KV region: the default max_tokens stops at it, a request past it is a
    400 in the context-length error's style, and /v1/models reports it as max_model_len."""
    from specscope.server.app import create_app

    eng = _engine(model_dir, max_seq_len=40)
    assert eng.max_seq_len == 40 and eng.max_prompt == 39 and eng.context == 256
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    n_prompt = len(eng.tokenizer.encode_messages(msgs))
    with TestClient(create_app(eng)) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 40
        r = c.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 40 - n_prompt and r["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 41 - n_prompt})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens"
        assert "maximum context length is 40 tokens (--max-seq-len" in err["message"]
        r = c.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 1})
        assert r.status_code == 400 and "at most 39" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [5] * 39, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 40
    from specscope.errors import SpecscopeError

    with pytest.raises(SpecscopeError, match="--max-seq-len 257"):
        _engine(model_dir, max_seq_len=257)


def test_spec_policy_off_decodes_plain_with_a_drafter_loaded(model_dir):
    """--spec-policy off: every step is a plain one; the answer is the same greedy one and its counters are 0."""
    from specscope.server.app import create_app

    eng = _engine(model_dir, draft="ngram", steps=3, spec_policy="off")
    ids = eng.tokenizer.encode("the quick brown fox")
    with TestClient(create_app(eng)) as c:
        r = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 20, "temperature": 0,
                                            "return_token_ids": True}).json()
        reg = c.app.state.metrics.registry
        assert not reg.get_sample_value("specscope:spec_decode_num_drafts_total")
    assert r["choices"][0]["token_ids"] == _offline(eng, ids, 20)
    assert r["spec"] == {"verify_ct": 0, "accepted_tokens": 0, "draft_tokens": 0, "accept_length": 0.0}


def test_a_failing_engine_step_fails_its_requests_and_serving_goes_on(model_dir, caplog):
    """A bug in a step itself (not in one request's callback) loses every sequence in it: each client gets a 500
    naming its request, the log has the traceback, and the next request runs on a fresh engine."""
    from specscope.server.app import create_app

    eng = _engine(model_dir)
    app = create_app(eng)
    w = app.state.worker
    broken = w.engine

    def boom():
        raise RuntimeError("simulated step bug")

    broken.step = boom
    with TestClient(app) as c, caplog.at_level("ERROR", logger="specscope.server"):
        r = c.post("/v1/completions", json={"prompt": "the quick", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 500
        rid = r.json()["error"]["message"].split("request id ")[1].split(")")[0]
        assert any(rid in x.getMessage() and x.exc_info for x in caplog.records)
        assert w.engine is not broken
        r = c.post("/v1/completions", json={"prompt": "the quick", "max_tokens": 4, "temperature": 0,
                                            "return_token_ids": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["token_ids"] == _offline(eng, eng.tokenizer.encode("the quick"), 4)
        reg = app.state.metrics.registry
        assert reg.get_sample_value("specscope:request_failed_total", {"reason": "error"}) == 1


def test_a_request_whose_callback_fails_gets_its_own_error(model_dir, monkeypatch):
    """An exception inside one request's streaming ends only that sequence: a SpecscopeError is a 400 error event
    for it, and the request beside it in the batch is untouched."""
    from specscope.errors import SpecscopeError
    from specscope.server.app import create_app

    eng = _engine(model_dir)
    emit = eng._emit

    def picky(job, new_ids):
        if job.params.prompt == "the lazy dog":
            raise SpecscopeError("not this one")
        return emit(job, new_ids)

    monkeypatch.setattr(eng, "_emit", picky)
    app = create_app(eng)
    sizes = _gate_first_step(app.state.worker, 2)
    out = {}
    with _live(app) as url:
        ok = {"prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0, "stream": True,
              "return_token_ids": True}
        t = threading.Thread(target=_stream, args=(url, ok, out, "ok"))
        t.start()
        deadline = time.time() + 30
        while not app.state.worker.jobs and time.time() < deadline:
            time.sleep(0.01)
        _stream(url, dict(ok, prompt="the lazy dog"), out, "bad")
        t.join(60)
    assert out["bad"]["error"]["code"] == 400 and out["bad"]["error"]["message"] == "not this one"
    assert out["ok"]["done"] and out["ok"]["error"] is None
    assert out["ok"]["ids"] == _offline(eng, eng.tokenizer.encode("the quick brown fox"), 10)
    assert max(sizes) == 2


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


def test_prefix_cache_reuses_a_shared_prompt_prefix_and_counts_it(model_dir):
    """A conversation's second turn shares its first turn's prompt and answer: the engine computes only the rest
    (usage's cached_tokens, vLLM's prefix_cache_* counters), and the answer is offline greedy decoding's; with
    --no-enable-prefix-caching nothing is reused."""
    from specscope.ingest.prometheus import parse_text
    from specscope.server.app import create_app

    for enabled in (True, False):
        eng = _engine(model_dir, metrics_prefix="vllm", enable_prefix_caching=enabled)
        with TestClient(create_app(eng)) as c:
            turn = [{"role": "user", "content": "the quick brown fox"}]
            first = c.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 6, "temperature": 0,
                                                         "return_token_ids": True}).json()
            turn += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "the lazy dog"}]
            second = c.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 6, "temperature": 0,
                                                          "return_token_ids": True}).json()
            m = parse_text(c.get("/metrics").text)
        ids = eng.tokenizer.encode_messages(turn)
        assert second["choices"][0]["token_ids"] == _offline(eng, ids, 6)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > first["usage"]["prompt_tokens"]) if enabled else cached == 0, cached
        hits, queries = m.total("vllm:prefix_cache_hits_total"), m.total("vllm:prefix_cache_queries_total")
        assert hits == cached and queries == first["usage"]["prompt_tokens"] + len(ids)


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
    """Like vLLM's request_queue_time_seconds: waiting to join the batch is reported apart from decoding."""
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


@contextmanager
def _live(app):
    """`app` served by uvicorn on a free loopback port in a thread (real HTTP, real disconnects) -> its URL."""
    import uvicorn

    from specscope.cli.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        assert server.started
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(20)


def _slow_emits(monkeypatch, eng, s=0.05):
    """Streaming that takes `s` per emitted chunk (on the worker thread), so a hang-up lands mid-decode."""
    fast = eng._emit

    def emit_slowly(*a, **k):
        time.sleep(s)
        return fast(*a, **k)

    monkeypatch.setattr(eng, "_emit", emit_slowly)


def test_clients_that_hang_up_stop_their_work(model_dir, monkeypatch):
    """Real HTTP on loopback, serial mode (--max-num-seqs 1): a streaming client that disconnects mid-decode stops
    its decode at the next step, and a queued request whose client left is dropped without decoding."""
    import httpx

    from specscope.ingest.prometheus import parse_text
    from specscope.server.app import create_app

    eng = _engine(model_dir, max_num_seqs=1)
    _slow_emits(monkeypatch, eng)  # ~20 tokens/s
    with _live(create_app(eng)) as url:
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
        assert got["queued"] == "hung up"
        assert s.total("specscope:request_failed_total", reason="cancelled") == 2
        assert (s.total("specscope:generation_tokens_total") or 0) < 100  # far from 2 x 200 decoded
        assert not s.total("specscope:num_requests_waiting")
        # the queued one never reached the engine: one prefill counted, one queue time observed
        assert s.total("specscope:request_queue_time_seconds_count") == 1


def _stream(url, body, out: dict, key, started: threading.Event | None = None, hang_up: threading.Event | None = None):
    """A streamed request in this thread -> out[key] = {"ids", "finish", "events", "status"}; with `hang_up`, it
    disconnects once that is set (checked at each line it receives)."""
    import httpx

    res = out[key] = {"ids": [], "finish": None, "done": False, "status": None, "error": None}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                res["error"] = r.json()["error"]
                res["retry_after"] = r.headers.get("retry-after")
                return
            for line in r.iter_lines():
                if started is not None:
                    started.set()
                if hang_up is not None and hang_up.is_set():
                    res["hung_up"] = True
                    return
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res["done"] = True
                    return
                ev = json.loads(line[6:])
                if "error" in ev:
                    res["error"] = ev["error"]
                    continue
                for ch in ev.get("choices") or []:
                    res["ids"] += ch.get("token_ids") or []
                    res["finish"] = ch.get("finish_reason") or res["finish"]
    except Exception as e:  # noqa: BLE001 -- reported through `out`, asserted by the test
        res["error"] = repr(e)


def _gate_first_step(worker, n_jobs):
    """Hold the engine's first step until n_jobs requests are in the server, so they are all in flight together;
    record the batch size of every step (the sequences a step ran = still running + finished in it)."""
    engine = worker.engine
    step, sizes, gate = engine.step, [], threading.Event()

    def gated():
        if not gate.is_set():
            deadline = time.time() + 30
            while worker.q.qsize() + len(worker.jobs) < n_jobs and time.time() < deadline:
                time.sleep(0.01)
            gate.set()
        done = step()
        sizes.append(len(engine.running) + len([f for f in done if f.t_scheduled is not None]))
        return done

    engine.step = gated
    return sizes


CONCURRENT_PROMPTS = [("the quick brown fox", 24), ("what is the capital of france", 40),
                      ("a small model proposes", 7), ("explain how a cache works in simple words", 33),
                      ("write a short poem about the sea and the sky " * 3, 18), ("the lazy dog", 1)]


@pytest.mark.parametrize("draft,max_num_seqs", [(None, 16), ("ngram", 16), ("self", 4), (None, 1)],
                         ids=["plain", "ngram", "model-drafter-4-seqs", "serial"])
def test_concurrent_streams_get_offline_greedy_tokens(model_dir, draft, max_num_seqs):
    """Concurrent streamed requests over real HTTP, decoded together in one batch (prefills joining running
    sequences): each gets exactly the token ids of offline greedy `generate`, and the spec counters of the
    `done` usage chunk add up to the server's. --max-num-seqs 1 is the serial server: one sequence per step."""
    import httpx

    from specscope.ingest.prometheus import parse_text
    from specscope.runtime.sampling import SamplingParams
    from specscope.server.app import create_app

    kw = {}
    if draft is not None:
        # "self": the model drafts for itself; every step drafts (the priced default may stop on a random model)
        kw = dict(draft=str(model_dir) if draft == "self" else "ngram", steps=3, spec_policy="always")
    eng = _engine(model_dir, max_num_seqs=max_num_seqs, **kw)
    app = create_app(eng)
    sizes = _gate_first_step(app.state.worker, len(CONCURRENT_PROMPTS) + (draft is None))
    out = {}
    # plain decoding draws as `generate` does, so a seeded sampled request is reproducible too
    cases = [(p, n, 0.0, None) for p, n in CONCURRENT_PROMPTS] + ([("the quick brown fox", 20, 0.8, 7)]
                                                                  if draft is None else [])
    with _live(app) as url:
        threads = []
        for i, (prompt, n, temperature, seed) in enumerate(cases):
            body = {"prompt": prompt, "max_tokens": n, "temperature": temperature, "seed": seed, "stream": True,
                    "return_token_ids": True, "stream_options": {"include_usage": True}}
            threads.append(threading.Thread(target=_stream, args=(url, body, out, i)))
            threads[-1].start()
            deadline = time.time() + 30
            while i == 0 and not app.state.worker.jobs and time.time() < deadline:
                time.sleep(0.01)   # the first (a long one) is in the engine, held in its first step
        for t in threads:
            t.join(120)
        scrape = parse_text(httpx.get(url + "/metrics").text)
    for i, (prompt, n, temperature, seed) in enumerate(cases):
        r = out[i]
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        want = _offline(eng, eng.tokenizer.encode(prompt), n, SamplingParams(temperature, 0, 1.0, seed))
        assert r["ids"] == want, (i, prompt)
        assert r["finish"] == ("length" if len(want) == n and want[-1] not in eng.stop_ids else "stop")
    assert scrape.total("specscope:request_success_total") == len(cases)
    if max_num_seqs == 1:
        assert set(sizes) == {1}
    else:  # they really ran together: the second step had everyone the first one did not finish
        assert max(sizes) == min(max_num_seqs, len(cases)), sizes
    if draft is not None:
        assert scrape.total("specscope:spec_decode_num_drafts_total") > 0


def test_a_client_that_leaves_frees_its_slot(model_dir, monkeypatch):
    """Two slots, both busy with long streams, a third request queued and a fourth refused (429, the queue holds
    one): when one long client hangs up, its sequence is cancelled in the engine, and the queued request is
    admitted and completes -- with offline greedy tokens -- while the other long one is still running."""
    import httpx

    from specscope.ingest.prometheus import parse_text
    from specscope.server.app import create_app

    eng = _engine(model_dir, max_num_seqs=2, max_queue=1)
    _slow_emits(monkeypatch, eng, 0.02)   # a long stream needs >= 4.8 s of steps, the short one 8 steps
    app = create_app(eng)
    w = app.state.worker
    long = {"prompt": "the quick brown fox", "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    short = {"prompt": "the lazy dog", "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True}
    out, a_started, b_started = {}, threading.Event(), threading.Event()
    a_leave, b_leave = threading.Event(), threading.Event()
    with _live(app) as url:
        a = threading.Thread(target=_stream, args=(url, long, out, "a", a_started, a_leave))
        b = threading.Thread(target=_stream, args=(url, long, out, "b", b_started, b_leave))
        a.start()   # one after the other: sent together, the second could find the 1-place queue still full
        assert a_started.wait(30)
        b.start()
        assert b_started.wait(30), out["b"]
        c = threading.Thread(target=_stream, args=(url, short, out, "c"))
        c.start()
        deadline = time.time() + 30
        while w.q.qsize() < 1 and time.time() < deadline:   # c waits for a slot
            time.sleep(0.01)
        assert w.q.qsize() == 1 and not out["c"]["ids"]
        _stream(url, short, out, "d")
        assert out["d"]["status"] == 429 and int(out["d"]["retry_after"]) >= 1
        a_leave.set()
        c.join(60)
        b_was_running = not out["b"]["done"]
        b_leave.set()
        a.join(10)
        b.join(10)
        deadline = time.time() + 10
        while time.time() < deadline:
            scrape = parse_text(httpx.get(url + "/metrics").text)
            if not scrape.total("specscope:num_requests_running"):
                break
            time.sleep(0.05)
    assert out["a"].get("hung_up") and out["b"].get("hung_up")
    assert out["c"]["done"] and out["c"]["error"] is None
    assert out["c"]["ids"] == _offline(eng, eng.tokenizer.encode("the lazy dog"), 8)
    assert b_was_running, "the queued request only ran once the other long stream had finished"
    assert scrape.total("specscope:request_failed_total", reason="cancelled") == 2
    assert scrape.total("specscope:request_success_total") == 1



def _eos_first(engine, prompts):
    """The first of `prompts` (token-id lists) whose greedy first token is EOS, or None."""
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams

    eos = engine.tokenizer.eos_ids
    return next((ids for ids in prompts if generate(engine.model, ids, 1, SamplingParams(), ()).token_ids[0] in eos),
                None)


def test_a_stream_sends_a_chunk_for_every_token_even_one_of_empty_text(engine):
    """With ignore_eos, a first token that is EOS decodes to no text; vLLM still sends a chunk for it (a client's
    TTFT is then the server's), and so must we: one chunk per generated token, for completions and for chat."""
    from specscope.server.app import create_app

    # the tiny random model answers some two-token prompts (and some chats) with EOS first; find one of each
    ids = _eos_first(engine, ([a, b] for a in range(3, 101) for b in range(3, 101)))
    words = engine.tokenizer.decode(list(range(7, 101))).split()
    # of the 8100 two-word chats, 3 start with EOS: a search that starts from their first words stays short
    chats = ([{"role": "user", "content": f"{a} {b}"}] for a in ("brown", "w9") for b in words)
    with_ids = ((m, engine.tokenizer.encode_messages(m)) for m in chats)
    chat = next((m for m, m_ids in with_ids if _eos_first(engine, [m_ids])), None)
    assert ids is not None and chat is not None
    n = 4
    common = {"max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with TestClient(create_app(engine)) as c:
        for path, body, text_of in (
                ("/v1/completions", {"prompt": ids}, lambda ch: ch["text"]),
                ("/v1/chat/completions", {"messages": chat}, lambda ch: ch["delta"].get("content"))):
            with c.stream("POST", path, json={**body, **common}) as r:
                assert r.status_code == 200
                events = _sse(r.iter_lines())
            tokens = [e["choices"][0] for e in events[:-1] if e["choices"][0]["finish_reason"] is None]
            assert len(tokens) == n, (path, events)
            assert text_of(tokens[0]) == "", (path, tokens[0])      # the EOS: a chunk with empty text
            if path.endswith("chat/completions"):
                assert tokens[0]["delta"]["role"] == "assistant"


BATCH = ["the quick brown fox", "what is the capital of france", "a small model proposes"]


def test_a_batch_of_prompts_gets_a_choice_per_prompt_and_n_decoded_together(engine):
    """`prompt` as a list (OpenAI's and vLLM's batch, lm-eval's --batch_size): prompt k's choice j at index k * n + j,
    each the offline greedy answer of its prompt, usage over all prompts; all 6 sequences ran in one engine batch;
    token-id prompts and a stream of the batch give the same."""
    from specscope.server.app import create_app

    app = create_app(engine)
    sizes = _gate_first_step(app.state.worker, len(BATCH) * 2)
    ids = [engine.tokenizer.encode(t) for t in BATCH]
    want = [_offline(engine, x, 6) for x in ids]
    body = {"max_tokens": 6, "temperature": 0, "n": 2, "return_token_ids": True}
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={**body, "prompt": BATCH})
        assert r.status_code == 200, r.text
        whole = r.json()
        assert max(sizes) == len(BATCH) * 2, sizes     # submitted together, decoded as one batch
        by_ids = c.post("/v1/completions", json={**body, "prompt": ids}).json()
        with c.stream("POST", "/v1/completions", json={**body, "prompt": BATCH, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            events = _sse(r.iter_lines())
        echo = c.post("/v1/completions", json={"prompt": BATCH[:2], "echo": True, "logprobs": 1, "max_tokens": 0})
        alone = [c.post("/v1/completions", json={"prompt": t, "echo": True, "logprobs": 1, "max_tokens": 0}).json()
                 for t in BATCH[:2]]
    assert [ch["index"] for ch in whole["choices"]] == list(range(6))
    assert [ch["token_ids"] for ch in whole["choices"]] == [w for w in want for _ in range(2)]
    assert [ch["text"] for ch in whole["choices"]] == [engine.tokenizer.decode(w) for w in want for _ in range(2)]
    completion = sum(len(w) for w in want) * 2
    assert whole["usage"]["prompt_tokens"] == sum(map(len, ids))    # each prompt once, however many choices
    assert whole["usage"]["completion_tokens"] == completion
    assert [ch["token_ids"] for ch in by_ids["choices"]] == [ch["token_ids"] for ch in whole["choices"]]
    streamed: dict[int, list] = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            streamed.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
    assert streamed == {ch["index"]: ch["token_ids"] for ch in whole["choices"]}
    assert events[-2]["usage"]["completion_tokens"] == completion
    # lm-eval's batched loglikelihood: each choice echoes its own prompt with that prompt's logprobs
    assert [ch["text"] for ch in echo.json()["choices"]] == BATCH[:2]
    assert [ch["logprobs"] for ch in echo.json()["choices"]] == [a["choices"][0]["logprobs"] for a in alone]
