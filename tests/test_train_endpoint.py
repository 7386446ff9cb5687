"""`specscope train --answers-from URL`: training answers from a real OpenAI-compatible server on loopback
(`specscope serve` of the same tiny chat target) equal specscope's own greedy answers; the cache resumes with only
the missing requests (counted by the server's /metrics); a server that is down or refuses is one clear error and
leaves the cache as it was."""

import json
import os
import socket

import httpx
import pytest
from serve_util import Background
from train_util import make_chat_target, write_dataset

from specscope.cli import main
from specscope.errors import SpecscopeError
from specscope.train.data import read_conversations, read_jsonl
from specscope.train.endpoint import Endpoint, answer_via_endpoint, base_url

TOKENS = 16


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("SPECSCOPE_API_KEY", "OPENAI_API_KEY")}
    env.update(extra)
    return env


class Server(Background):
    """`specscope serve` of a model on 127.0.0.1, any free port."""

    def __init__(self, model, *args):
        super().__init__(["serve", "--model", str(model), "--port", "0", "--device", "cpu", "--dtype", "fp32",
                          "--threads", "1", "--no-phase-profile", *args], _env(), start_timeout=120)

    def requests(self) -> float:
        """Chat requests the server has answered so far."""
        from specscope.ingest.prometheus import parse_text

        return parse_text(httpx.get(self.url + "/metrics").text).total("specscope:request_success_total") or 0.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("endpoint")
    tgt = make_chat_target(root / "target")
    srv = Server(tgt)
    yield tgt, srv, root
    srv.stop()


@pytest.fixture(scope="module")
def local(setup):
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models import load_model

    tgt = setup[0]
    return load_model(tgt, "fp32", "cpu"), Tokenizer(tgt)


def _items(root, n=6, seed=3):
    convs, _ = read_conversations(write_dataset(root / f"p{n}-{seed}.jsonl", n=n, seed=seed))
    return [{"id": f"p:{i}", "prompt": c[0]["content"], "source": "p"} for i, c in enumerate(convs)]


class Stop(Exception):
    """An interruption (Ctrl-C, a kill) between two answers."""


def stop_at(k):
    def progress(n):
        if n == k:
            raise Stop()
    return progress


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_base_url_takes_specforge_and_openai_spellings():
    assert base_url("localhost:30000") == "http://localhost:30000"
    assert base_url("http://10.0.0.1:8000/v1/") == "http://10.0.0.1:8000"
    assert base_url("https://h.example") == "https://h.example"
    for bad in ("", "ftp://h:1", "http://"):
        with pytest.raises(SpecscopeError, match="--answers-from"):
            base_url(bad)


def test_endpoint_answers_equal_local_greedy_answers(setup, local, tmp_path):
    """The key property: the server's answers are the ones specscope's own greedy regenerate writes."""
    from specscope.runtime.sampling import SamplingParams
    from specscope.train.data import answer_prompts, regenerate

    tgt, srv, root = setup
    model, tok = local
    items = _items(tmp_path)
    greedy = SamplingParams(temperature=0.0)
    answer_prompts(model, tok, items, tmp_path / "answers.jsonl", TOKENS, greedy, batch=4)
    want = {r["id"]: r for r in read_jsonl(tmp_path / "answers.jsonl")}
    recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, tmp_path / "ep.jsonl",
                                     log=lambda m: None)
    assert [r["id"] for r in recs] == [it["id"] for it in items]
    for r in recs:
        assert r["messages"] == want[r["id"]]["messages"], r["id"]
        assert r["truncated"] == want[r["id"]]["truncated"]
    assert info["served_model"] == "target" and info["endpoint"] == srv.url and info["temperature"] == 0.0
    assert info["answered_now"] == len(items) and info["reused"] == 0

    # conversations (a system turn, a second user turn): the first answer is the local --regenerate's
    convs = [[{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w10 w11 w12"},
              {"role": "assistant", "content": "w1"}, {"role": "user", "content": "w20 w21"},
              {"role": "assistant", "content": "w2"}],
             [{"role": "user", "content": "w40 w41 w42 w43"}, {"role": "assistant", "content": "w9"}]]
    local_regen = regenerate(model, tok, convs, TOKENS, greedy, batch=2)
    citems = [{"id": f"c:{i}", "messages": c} for i, c in enumerate(convs)]
    first, _ = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), citems, tmp_path / "c1.jsonl",
                                   all_turns=False, log=lambda m: None)
    assert [r["messages"] for r in first] == local_regen
    # every user turn (SpecForge): the first answer is the same, the second user turn is answered too
    every, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), citems, tmp_path / "c2.jsonl",
                                      log=lambda m: None)
    m0 = every[0]["messages"]
    assert [m["role"] for m in m0] == ["system", "user", "assistant", "user", "assistant"]
    assert m0[:3] == local_regen[0] and m0[3] == convs[0][3] and m0[2]["content"] != "w1"
    assert every[1]["messages"] == local_regen[1]
    assert "every user turn" in info["turns"]


def test_resume_asks_only_for_missing_answers(setup, tmp_path):
    tgt, srv, root = setup
    items = _items(tmp_path, n=6, seed=5)
    cache = tmp_path / "ep.jsonl"

    before = srv.requests()
    with pytest.raises(Stop):                              # a run interrupted after two answers
        answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS, concurrency=1), items, cache, log=lambda m: None,
                            progress=stop_at(2))
    assert len(read_jsonl(cache)) == 2
    mid = srv.requests()
    assert mid - before == 2
    seen = []
    recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, cache, log=lambda m: None,
                                     progress=seen.append)
    assert srv.requests() - mid == 4                      # only the missing ones
    assert seen[0] == 2 and seen[-1] == 6 and (info["reused"], info["answered_now"]) == (2, 4)
    assert [r["id"] for r in recs] == [it["id"] for it in items]
    # all cached: nothing asked; another max_tokens or a changed prompt: asked again, never reused
    mid = srv.requests()
    again, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, cache, log=lambda m: None)
    assert again == recs and srv.requests() == mid and info["reused"] == 6
    changed = [dict(it, prompt=it["prompt"] + " w1") if i == 0 else it for i, it in enumerate(items)]
    answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), changed, cache, log=lambda m: None)
    assert srv.requests() - mid == 1
    answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS - 4), items, cache, log=lambda m: None)
    assert srv.requests() - mid == 7


def test_server_down_or_refusing_is_one_clear_error_and_the_cache_survives(setup, tmp_path, capsys):
    tgt, _, root = setup
    items = _items(tmp_path, n=5, seed=7)
    cache = tmp_path / "ep.jsonl"
    keyed = Server(tgt, "--api-key", "sesame")
    try:
        with pytest.raises(SpecscopeError, match="refused the request .*HTTP 401.*--api-key"):
            answer_via_endpoint(Endpoint(keyed.url), items, cache, log=lambda m: None)
        with pytest.raises(SpecscopeError, match="HTTP 404.*--served-model-name"):
            answer_via_endpoint(Endpoint(keyed.url, model="nope", api_key="sesame"), items, cache, log=lambda m: None)
        ep = Endpoint(keyed.url, api_key="sesame", max_tokens=TOKENS, concurrency=1, retries=1, retry_wait_s=0.05)
        with pytest.raises(Stop):
            answer_via_endpoint(ep, items, cache, log=lambda m: None, progress=stop_at(2))
    finally:
        keyed.stop()                                     # the server dies mid-run
    good = cache.read_bytes()
    assert len(read_jsonl(cache)) == 2
    with pytest.raises(SpecscopeError, match=r"/v1/chat/completions: cannot connect .*restart it and rerun") as e:
        answer_via_endpoint(ep, items, cache, log=lambda m: None)
    assert keyed.url in str(e.value) and "\n" not in str(e.value)
    assert cache.read_bytes() == good                   # nothing torn, nothing lost
    assert all(json.loads(line) for line in good.decode().splitlines())

    # the CLI: the server is checked before the target loads; one line, non-zero exit, no files written
    url = f"http://127.0.0.1:{_closed_port()}"
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt": it["prompt"]}) + "\n" for it in items))
    work = tmp_path / "w"
    with pytest.raises(SystemExit) as ex:
        main(["train", "--workdir", str(work), "--model", str(tgt), "--prompt-file", str(pf), "--answers-from", url,
              "--stages", "data", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ex.value.code != 0
    assert err.startswith("error: ") and url + "/v1/models" in err and "is the server running?" in err, err
    assert not (work / "endpoint_answers.jsonl").exists() and not (work / "data").exists()
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(work), "--model", str(tgt), "--synth", "4", "--answers-from", url,
              "--stages", "data", "--device", "cpu"])
    assert "--synth conversations are written by the local target" in capsys.readouterr().err


def test_train_cli_answers_from_a_server(setup, tmp_path, capsys):
    """`specscope train --answers-from`: the same conversations as the local target writes, the source recorded,
    and a rerun asks for nothing."""
    tgt, srv, root = setup
    items = _items(tmp_path, n=5, seed=11)
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt": it["prompt"]}) + "\n" for it in items))
    common = ["--model", str(tgt), "--prompt-file", str(pf), "--stages", "data", "--response-tokens", str(TOKENS),
              "--device", "cpu", "--threads", "1"]
    main(["train", "--workdir", str(tmp_path / "local"), *common])
    before = srv.requests()
    host_port = srv.url.split("://")[1]
    main(["train", "--workdir", str(tmp_path / "ep"), *common, "--server-address", host_port, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert srv.requests() - before == len(items)
    want = [json.loads(x)["messages"] for x in (tmp_path / "local" / "conversations.jsonl").read_text().splitlines()]
    got = [json.loads(x)["messages"] for x in (tmp_path / "ep" / "conversations.jsonl").read_text().splitlines()]
    assert got == want
    man = json.loads((tmp_path / "ep" / "data" / "manifest.json").read_text())
    for rec in (man["answers"], summary["data"]["answers"],
                json.loads((tmp_path / "ep" / "data_report.json").read_text())["answers"]):
        assert (rec["endpoint"], rec["served_model"], rec["temperature"], rec["max_tokens"]) == \
               (srv.url, "target", 0.0, TOKENS)
    assert json.loads((tmp_path / "local" / "data" / "manifest.json").read_text())["answers"]["source"] == "target"
    # rerun: every answer is cached, nothing is asked; a --dataset is regenerated through the server too
    main(["train", "--workdir", str(tmp_path / "ep"), *common, "--answers-from", srv.url + "/v1"])
    assert srv.requests() - before == len(items)
    ds = write_dataset(tmp_path / "ds.jsonl", n=4, seed=2)
    main(["train", "--workdir", str(tmp_path / "ds"), "--model", str(tgt), "--dataset", str(ds), "--stages", "data",
          "--max-tokens", str(TOKENS), "--device", "cpu", "--answers-from", srv.url])
    regen, _ = read_conversations(tmp_path / "ds" / "regenerated.jsonl")
    orig, _ = read_conversations(ds)
    assert [c[0] for c in regen] == [c[0] for c in orig] and all(c[1]["role"] == "assistant" for c in regen)
    assert json.loads((tmp_path / "ds" / "data" / "manifest.json").read_text())["sequences"] == len(orig)
    assert srv.requests() - before == len(items) + len(orig)


def test_checkpoints_record_where_answers_came_from():
    from types import SimpleNamespace

    from specscope.train.stages import train_meta

    ans = {"source": "endpoint", "endpoint": "http://h:1", "served_model": "m"}
    assert train_meta({"name_or_path": "t"}, SimpleNamespace(manifest={"answers": ans})) == \
        {"target": {"name_or_path": "t"}, "answers": ans}
    assert train_meta({}, SimpleNamespace(manifest={})) == {"target": {}}


def test_refused_requests_are_left_out_and_counted(setup, tmp_path):
    """A 4xx for one request (here: longer than the tiny target's 256-token context) drops that item, or the turns
    from the refused one on; every request refused is an error, not an empty dataset."""
    tgt, srv, root = setup
    long = " ".join(f"w{i % 90}" for i in range(300))
    mid = " ".join(f"w{i % 90}" for i in range(200))
    items = [{"id": "ok", "prompt": "w1 w2 w3"}, {"id": "long", "prompt": long},
             {"id": "two", "messages": [{"role": "user", "content": mid}, {"role": "assistant", "content": "x"},
                                        {"role": "user", "content": mid}]}]
    logs = []
    recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, tmp_path / "ep.jsonl",
                                     log=logs.append)
    assert [r["id"] for r in recs] == ["ok", "two"] and info["failed"] == 1
    assert info["first_failures"][0].startswith("long: HTTP 400") and "1 of 3 requests" in logs[-1]
    two = recs[1]
    assert [m["role"] for m in two["messages"]] == ["user", "assistant"] and two["turns_dropped"] == 1
    assert "HTTP 400" in two["why_dropped"]
    with pytest.raises(SpecscopeError, match="refused the first 2 requests .*HTTP 400"):
        answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), [{"id": "a", "prompt": long},
                                                                   {"id": "b", "prompt": long + " w1"}],
                            tmp_path / "bad.jsonl", log=lambda m: None)


def test_a_torn_cache_line_is_asked_again(setup, tmp_path):
    tgt, srv, root = setup
    items = _items(tmp_path, n=4, seed=13)
    cache = tmp_path / "ep.jsonl"
    answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, cache, log=lambda m: None)
    lines = cache.read_bytes().split(b"\n")
    cache.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:25])      # killed while writing the third
    before = srv.requests()
    recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, cache, log=lambda m: None)
    assert srv.requests() - before == 2 and len(recs) == 4 and info["reused"] == 2
    assert len(read_jsonl(cache)) == 4 and all(json.loads(x) for x in cache.read_text().splitlines())


def test_sampled_answers_are_seeded_per_request(setup, tmp_path):
    tgt, srv, root = setup
    items = _items(tmp_path, n=3, seed=17)
    runs = [answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS, temperature=0.8, top_p=0.95, seed=s), items,
                                tmp_path / f"ep{k}.jsonl", log=lambda m: None)
            for k, s in enumerate((1, 1, 2))]
    msgs = [[r["messages"] for r in recs] for recs, _ in runs]
    assert msgs[0] == msgs[1] and msgs[0] != msgs[2]
    assert runs[0][1]["temperature"] == 0.8 and runs[0][1]["seed"] == 1


def test_duplicates_are_asked_once_and_keep_their_ids(setup, tmp_path):
    tgt, srv, root = setup
    items = [{"id": "a", "prompt": "w5 w6 w7"}, {"id": "b", "prompt": "w8 w9"}, {"id": "c", "prompt": "w5 w6 w7"}]
    seen = []
    before = srv.requests()
    recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=TOKENS), items, tmp_path / "ep.jsonl",
                                     log=lambda m: None, progress=seen.append)
    assert srv.requests() - before == 2 and seen[-1] == 3
    assert [r["id"] for r in recs] == ["a", "b", "c"] and recs[0]["messages"] == recs[2]["messages"]
