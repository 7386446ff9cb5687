"""`specscope serve` driven by the official OpenAI SDK (and httpx for vLLM's own routes), over real HTTP on
loopback, against a tiny random Llama: models.list / retrieve, chat and completions (plain and streamed), echo
with prompt logprobs (max_tokens 0 too, as lm-eval sends it), n > 1, stop, seed, logprobs, x-request-id, vLLM's
/tokenize and /detokenize, and that a stream's first chunk leaves with the first token.

Logprobs are the target's own: speculation (--draft ngram) gives the same tokens and logprobs as plain decoding,
and both equal one direct forward of the target over prompt + output (and transformers' forward, within its
tolerance). The plain server prefills in 32-token chunks, the speculative one in one piece: prompt logprobs
computed chunk by chunk must agree too.
"""

import os
import time

import httpx
import pytest
import torch

from serve_util import Background
from tiny import make_served_model

openai = pytest.importorskip("openai")

KEY = "protocol-test-key"
HUB_NAME = "test-org/tiny-llama"   # a served name with a slash: /v1/models/{id} must take it whole
# a repetitive prompt: n-gram drafts get accepted, so the speculative path really commits drafted tokens
LOOP = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("tiny_protocol"))


def _serve(model_dir, tmp, *extra):
    env = dict(os.environ, SPECSCOPE_DB=str(tmp / "serve.db"), HF_HUB_OFFLINE="1")
    env.pop("SPECSCOPE_API_KEY", None)
    # it prints its URL once the socket accepts
    return Background(["serve", "--model", str(model_dir), "--port", "0", "--device", "cpu", "--dtype", "fp32",
                       "--threads", "1", *extra], env, start_timeout=120)


@pytest.fixture(scope="module")
def plain(model_dir, tmp_path_factory):
    s = _serve(model_dir, tmp_path_factory.mktemp("plain"), "--max-num-batched-tokens", "32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec(model_dir, tmp_path_factory):
    # --spec-policy always: the priced default drafts only where this machine's measured step times say it pays,
    # and under a loaded suite they once said it did not (no draft in 24 tokens); the protocol tests need drafts
    s = _serve(model_dir, tmp_path_factory.mktemp("spec"), "--draft", "ngram", "--steps", "4", "--spec-policy",
               "always", "--api-key", KEY, "--served-model-name", HUB_NAME)
    yield s
    s.stop()


def sdk(server, key="unused"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _name(server):
    return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def _tokenize(server, text):
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


# ---- models, request ids --------------------------------------------------------------------------------------

def test_models_list_and_retrieve(plain, spec):
    for server, key in ((plain, "unused"), (spec, KEY)):
        c = sdk(server, key)
        ids = [m.id for m in c.models.list()]
        assert len(ids) == 1
        m = c.models.retrieve(ids[0])
        assert m.id == ids[0] and m.object == "model" and m.owned_by == "specscope"
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve("no-such-model")
        assert e.value.status_code == 404 and e.value.body["param"] == "model"
        assert "no-such-model" in e.value.body["message"]
    assert _name(spec) == HUB_NAME


def test_request_id_header_on_every_endpoint(plain, spec):
    c = sdk(plain)
    name = _name(plain)
    r = c.completions.create(model=name, prompt="the quick", max_tokens=2)
    assert r._request_id and r.id == "cmpl-" + r._request_id
    raw = c.chat.completions.with_raw_response.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"x-request-id": "client-id-42"})
    assert raw.headers["x-request-id"] == "client-id-42" and raw.parse().id == "chatcmpl-client-id-42"
    with c.chat.completions.with_streaming_response.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=2, stream=True) as s:
        assert s.headers["x-request-id"]
    for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/nothing", None),
                               ("POST", "/v1/completions", {"prompt": ""}), ("POST", "/tokenize", {"prompt": "hi"})):
        got = httpx.request(method, plain.url + path, json=body, headers={"x-request-id": "probe-" + path})
        assert got.headers["x-request-id"] == "probe-" + path, (path, got.status_code)
        assert httpx.request(method, plain.url + path, json=body).headers["x-request-id"]
    denied = httpx.get(spec.url + "/v1/models", headers={"x-request-id": "no-key"})
    assert denied.status_code == 401 and denied.headers["x-request-id"] == "no-key"


# ---- chat and completions, streamed and not -------------------------------------------------------------------

def test_chat_stream_first_chunk_carries_the_first_token_and_the_role(plain):
    c = sdk(plain)
    name = _name(plain)
    msgs = [{"role": "user", "content": "what is the capital of france"}]
    full = c.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(c.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content, chunks[0]
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:] if ch.choices)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_first_chunk_leaves_after_the_first_token(plain):
    """A ~250-token prompt prefilled in 32-token chunks: the first chunk cannot come before the server's own
    time to first token (the role-only chunk used to leave as soon as the request was accepted)."""
    c = sdk(plain)
    name = _name(plain)

    def ttft_sum():
        for line in httpx.get(plain.url + "/metrics").text.splitlines():
            if line.startswith("specscope:time_to_first_token_seconds_sum"):
                return float(line.split()[-1])

    msgs = [{"role": "user", "content": LOOP * 6}]
    for _ in range(2):
        before = ttft_sum()
        t0 = time.perf_counter()
        stream = c.chat.completions.create(model=name, messages=msgs, max_tokens=2, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        waited = time.perf_counter() - t0
        list(stream)
        assert first.choices[0].delta.content
        assert waited >= ttft_sum() - before


def test_completions_plain_stream_stop_and_seed(plain):
    c = sdk(plain)
    name = _name(plain)
    kw = dict(model=name, prompt="the quick brown fox", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw)
    streamed = list(c.completions.create(stream=True, **kw))
    assert streamed[0].choices[0].text
    assert "".join(ch.choices[0].text for ch in streamed) == full.choices[0].text
    words = full.choices[0].text.split()
    stop = " " + words[2]
    cut = c.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full.choices[0].text[:full.choices[0].text.index(stop)] and cut.finish_reason == "stop"
    sampled = dict(kw, temperature=1.0, seed=1234)
    a, b = c.completions.create(**sampled), c.completions.create(**sampled)
    assert a.choices[0].text == b.choices[0].text
    chat = [c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                      temperature=1.0, seed=5).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]


def test_n_choices_are_independent_and_reproducible_with_a_seed(plain):
    c = sdk(plain)
    name = _name(plain)
    kw = dict(model=name, prompt="a small model proposes", max_tokens=8, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    r = c.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.text for ch in r.choices]
    assert len(set(texts)) > 1, texts            # three draws, not one answer three times
    assert [ch.text for ch in c.completions.create(n=3, **kw).choices] == texts
    assert c.completions.create(n=1, **kw).choices[0].text == texts[0]   # choice 0 is the n = 1 answer
    assert r.usage.completion_tokens == 24
    got = {}
    for ch in c.completions.create(n=3, stream=True, **kw):
        for x in ch.choices:
            got[x.index] = got.get(x.index, "") + x.text
    assert [got[i] for i in range(3)] == texts
    chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
                                     temperature=1.0, seed=3)
    assert [ch.index for ch in chat.choices] == [0, 1]
    first = {}
    for ch in c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
                                        temperature=1.0, seed=3, stream=True):
        for x in ch.choices:
            first.setdefault(x.index, x.delta)
    assert all(first[i].role == "assistant" and first[i].content for i in (0, 1))


def test_a_batch_of_prompts_as_the_sdk_sends_it(plain):
    """completions.create(prompt=[three strings] or [three id lists], n=2): six choices, prompt k's choice j at
    index k * n + j, each the answer its prompt gets alone (a seed too: choice j draws from seed + j, as alone);
    streamed, the same texts by index."""
    c = sdk(plain)
    name = _name(plain)
    prompts = ["the quick brown fox", "what is the capital of france", "a small model proposes"]
    kw = dict(model=name, max_tokens=6, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    alone = [ch.text for t in prompts for ch in c.completions.create(prompt=t, **kw).choices]
    r = c.completions.create(prompt=prompts, **kw)
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == alone
    assert r.usage.completion_tokens == 36
    by_ids = c.completions.create(prompt=[_tokenize(plain, t) for t in prompts], **kw)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in r.choices]
    got = {}
    for ev in c.completions.create(prompt=prompts, stream=True, **kw):
        for x in ev.choices:
            got[x.index] = got.get(x.index, "") + x.text
    assert [got[i] for i in range(6)] == alone


# ---- logprobs, echo ------------------------------------------------------------------------------------------------

def test_completions_echo_logprobs_and_max_tokens_zero(plain):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0): the prompt back with a logprob per token
    but the first (null); with max_tokens > 0 the prompt's entries are the same and the completion's follow."""
    c = sdk(plain)
    name = _name(plain)
    prompt = "the quick brown fox jumps over the lazy dog"
    n_prompt = len(_tokenize(plain, prompt))
    zero = c.completions.create(model=name, prompt=prompt, echo=True, logprobs=3, max_tokens=0).choices[0]
    lp = zero.logprobs
    assert zero.text == prompt and len(lp.tokens) == n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == x and 3 <= len(top) <= 4   # the 3 likeliest and the token itself
        assert max(top.values()) >= x
    assert lp.text_offset[0] == 0
    assert c.completions.create(model=name, prompt=prompt, echo=True, logprobs=3, max_tokens=0).usage \
        .completion_tokens == 0
    more = c.completions.create(model=name, prompt=prompt, echo=True, logprobs=3, max_tokens=4, temperature=0,
                                extra_body={"ignore_eos": True})
    m = more.choices[0]
    assert m.text.startswith(prompt) and len(m.logprobs.tokens) == n_prompt + 4
    assert m.logprobs.token_logprobs[:n_prompt] == lp.token_logprobs
    streamed = list(c.completions.create(model=name, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].text.startswith(prompt)
    assert "".join(ch.choices[0].text for ch in streamed) == m.text
    got = [x for ch in streamed if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert got == m.logprobs.token_logprobs
    plain_text = c.completions.create(model=name, prompt=prompt, echo=True, max_tokens=2, temperature=0).choices[0]
    assert plain_text.text.startswith(prompt) and plain_text.logprobs is None


def test_chat_logprobs_and_top_logprobs(plain):
    c = sdk(plain)
    name = _name(plain)
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "the lazy dog"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    text = r.choices[0].message.content
    assert all(e.token in text for e in content if not e.token.startswith("<"))   # specials: shown, not in text
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob   # greedy: the argmax
    assert c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                     logprobs=True).choices[0].logprobs.content[0].top_logprobs == []
    streamed = list(c.chat.completions.create(model=name, messages=[{"role": "user", "content": "the lazy dog"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    got = [e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
           for e in ch.choices[0].logprobs.content]
    assert got == [e.logprob for e in content]


def _echo_logprobs(server, key, ids, k=5, n=24):
    c = sdk(server, key)
    return c.completions.create(model=_name(server), prompt=ids, echo=True, logprobs=k, max_tokens=n, temperature=0,
                                extra_body={"ignore_eos": True, "return_token_ids": True}).to_dict()


def test_speculation_does_not_change_tokens_or_logprobs(plain, spec):
    """The same greedy requests with --draft ngram and without: identical tokens, logprobs within 1e-5 (prompt
    ones included, chunked there and whole here), and drafts really accepted on the speculative server."""
    ids = _tokenize(plain, LOOP)
    a, b = _echo_logprobs(plain, "unused", ids), _echo_logprobs(spec, KEY, ids)
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["token_ids"] == cb["token_ids"] and ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
    assert b["spec"]["accepted_tokens"] > 0, b["spec"]
    la, lb = ca["logprobs"], cb["logprobs"]
    assert la["token_logprobs"][0] is None and lb["token_logprobs"][0] is None
    for x, y in zip(la["token_logprobs"][1:], lb["token_logprobs"][1:]):
        assert abs(x - y) <= 1e-5
    for ta, tb in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
        assert ta.keys() == tb.keys() and all(abs(ta[k] - tb[k]) <= 1e-5 for k in ta)
    msgs = [{"role": "user", "content": LOOP}]
    chats = [sdk(s, key).chat.completions.create(model=_name(s), messages=msgs, max_tokens=24, temperature=0,
                                                 logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
             for s, key in ((plain, "unused"), (spec, KEY))]
    ea, eb = (ch.choices[0].logprobs.content for ch in chats)
    assert [e.token for e in ea] == [e.token for e in eb]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(ea, eb)) <= 1e-5


def test_logprobs_equal_a_direct_forward_of_the_target(plain, spec, model_dir):
    """Every logprob the server reports (prompt and completion) is the log-softmax of the target's logits at that
    position: one forward of our model over prompt + output (tight), and of transformers' (its tolerance)."""
    import transformers

    from specscope.models.loader import load_model

    ids = _tokenize(plain, LOOP)
    r = _echo_logprobs(spec, KEY, ids, k=4, n=16)["choices"][0]
    full = ids + r["token_ids"]
    ours = load_model(model_dir, dtype="fp32", device="cpu")
    x = torch.tensor([full])
    with torch.inference_mode():
        mine = torch.log_softmax(ours(x, torch.arange(len(full))[None]).logits[0].float(), -1)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        theirs = torch.log_softmax(hf(x).logits[0].float(), -1)
    lp = r["logprobs"]
    assert len(lp["token_logprobs"]) == len(full)
    for i in range(1, len(full)):
        got = lp["token_logprobs"][i]
        assert abs(got - float(mine[i - 1, full[i]])) <= 1e-5, i
        assert abs(got - float(theirs[i - 1, full[i]])) <= 1e-4, i
        want_top = sorted(mine[i - 1].topk(4).values.tolist(), reverse=True)
        top = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert all(any(abs(t - w) <= 1e-5 for t in top) for w in want_top), i


# ---- vLLM's /tokenize and /detokenize -----------------------------------------------------------------------------

def test_tokenize_detokenize_in_vllm_shape(plain):
    c = sdk(plain)
    name = _name(plain)
    text = "explain how a cache works"
    t = httpx.post(plain.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert set(t) == {"count", "max_model_len", "tokens", "token_strs"} and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == c.models.retrieve(name).model_extra["max_model_len"]
    assert t["token_strs"] == text.split()
    assert c.completions.create(model=name, prompt=text, max_tokens=1).usage.prompt_tokens == t["count"]
    msgs = [{"role": "user", "content": text}]
    m = httpx.post(plain.url + "/tokenize", json={"model": name, "messages": msgs}).json()
    assert m["token_strs"] is None
    assert c.chat.completions.create(model=name, messages=msgs, max_tokens=1).usage.prompt_tokens == m["count"]
    bare = httpx.post(plain.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["count"] < m["count"] and m["tokens"][:bare["count"]] == bare["tokens"]
    d = httpx.post(plain.url + "/detokenize", json={"tokens": t["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": text}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                              ("/tokenize", {}, "messages"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens")):
        bad = httpx.post(plain.url + path, json=body)
        err = bad.json()["error"]
        assert bad.status_code in (400, 404) and err["param"] == param and err["message"], (path, body)


# ---- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "'logprobs': true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "true or false"),
    ("/v1/chat/completions", {"echo": True}, "echo", "not supported"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", "at least 1"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", "not supported"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "'echo': true"),
    ("/v1/completions", {"echo": "yes"}, "echo", "true or false"),
    ("/v1/completions", {"n": 0}, "n", "'n'"),
    ("/v1/completions", {"n": 65}, "n", "--max-queue"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of", "'best_of'"),
])
def test_bad_protocol_fields_are_one_line_400s(plain, path, body, param, says):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(plain.url + path, json=dict(base, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and "\n" not in err["message"], err


# ---- the engine underneath ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_logprobs_are_the_targets_under_a_drafting_tree(model_dir, temperature):
    """The engine with a tree drafter that gets most drafts accepted (the model drafts for itself), sampled or
    greedy, beside a second request: every generated and prompt logprob, and each top-k, is the target's at that
    position in one direct forward over prompt + output; prompt logprobs are computed, never reused."""
    from specscope.engine import Request
    from specscope.runtime.sampling import SamplingParams
    from specscope.server.worker import ServeConfig, ServedModel
    from specscope.speculative.decode import DraftOptions

    served = ServedModel(ServeConfig(model=str(model_dir), device="cpu", dtype="fp32", spec_policy="always",
                                     drafting=DraftOptions(str(model_dir), 3, 2, 6, budget="fixed")))
    engine = served.new_engine()
    prompt = served.tokenizer.encode(LOOP)
    got = {}
    # c and d repeat a's prompt once a region holds it: reused by d, not by c (it asks for prompt logprobs)
    for rid in ("a", "b", "c", "d"):
        engine.add(Request(rid, prompt[:30] if rid == "b" else prompt, 20, SamplingParams(temperature, seed=7), (),
                           logprobs=3, prompt_logprobs=None if rid in "bd" else 3))
        while engine.busy:
            for f in engine.step():
                got[f.id] = f
    with torch.inference_mode():
        for rid, f in got.items():
            assert f.stats is not None and sum(f.stats.accepted_per_pos) > 0
            ids = (prompt[:30] if rid == "b" else prompt) + f.token_ids
            lp = torch.log_softmax(served.model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0], -1)
            n = len(ids) - len(f.token_ids)
            recs = ([] if f.prompt_logprobs is None else f.prompt_logprobs[1:]) + f.logprobs
            start = 1 if f.prompt_logprobs is not None else n
            assert len(recs) == len(ids) - start
            for pos, rec in zip(range(start, len(ids)), recs):
                assert abs(rec.logprob - float(lp[pos - 1, ids[pos]])) <= 1e-5, (rid, pos)
                want = lp[pos - 1].topk(3)
                assert [i for i, _ in rec.top] == want.indices.tolist()
                assert max(abs(v - w) for (_, v), w in zip(rec.top, want.values.tolist())) <= 1e-5
    assert got["c"].cached_tokens == 0 and got["c"].prompt_logprobs == got["a"].prompt_logprobs
    assert got["d"].cached_tokens > 0 and got["d"].logprobs == got["a"].logprobs
