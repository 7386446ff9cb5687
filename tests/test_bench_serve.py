"""End to end: `specscope serve` subprocesses on loopback, `specscope bench-serve` against them, and the
bench-serve pieces (datasets, Prometheus deltas)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serve_util import Background
from tiny import make_hf_model, make_tiny_tokenizer

PROMPTS = ["the quick brown fox", "what is the capital of france", "write a short poem about the sea",
           "explain how a cache works", "a small model proposes"]


class Server(Background):
    """`specscope serve` on 127.0.0.1 with a free port (read back from its stdout)."""

    def __init__(self, args, env):
        super().__init__(["serve", "--port", "0", "--device", "cpu", "--dtype", "fp32", "--threads", "1", *args], env,
                         start_timeout=120)
        assert self.url.startswith("http://127.0.0.1:")

    def metric(self, name, **labels):
        from specscope.ingest.prometheus import parse_text

        s = parse_text(httpx.get(self.url + "/metrics").text)
        return s.total(name, **labels) or 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_e2e")
    make_hf_model(d, "llama", vocab=101, layers=2, max_position_embeddings=4096)  # room for a long decode
    make_tiny_tokenizer(d, 101)
    return d


def _env(**extra):
    env = dict(os.environ, **extra)
    env.pop("SPECSCOPE_API_KEY", None)
    env.update(extra)
    return env


def _offline_chat(model_dir, prompt, n):
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams
    from specscope.session import load_target, stop_ids_for

    model, tok, _ = load_target(str(model_dir), "fp32", "cpu")
    ids = tok.encode_messages([{"role": "user", "content": prompt}])
    return tok.decode(generate(model, ids, n, SamplingParams(), stop_ids_for(model, tok)).token_ids)


def _offline_text(model_dir, prompt, n):
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams
    from specscope.session import load_target, stop_ids_for

    model, tok, _ = load_target(str(model_dir), "fp32", "cpu")
    return tok.decode(generate(model, tok.encode(prompt), n, SamplingParams(), stop_ids_for(model, tok)).token_ids)


@pytest.fixture(scope="module")
def spec_server(model_dir):
    """`specscope serve` with n-gram drafting (SGLang's spelling of --steps), shared by the tests below; drafting at
    every step (--spec-policy always): on the tiny random model the default priced policy soon stops drafting, and
    these tests count drafts."""
    server = Server(["--model", str(model_dir), "--draft", "ngram", "--speculative-num-steps", "3", "--spec-policy",
                     "always"], _env())
    yield server
    server.stop()


def test_bench_serve_random_dataset_at_a_request_rate_writes_vllm_result(spec_server, tmp_path):
    """The acceptance command: Poisson arrivals at 4 req/s, 32 random prompts of 64 words, 32 output tokens
    (exact with --ignore-eos), result JSON in `vllm bench serve`'s layout and units, with a speculative section."""
    from specscope.registry import open_registry

    res_dir = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--base-url", spec_server.url,
                        "--backend", "openai-chat", "--request-rate", "4", "--num-prompts", "32", "--dataset-name",
                        "random", "--random-input-len", "64", "--random-output-len", "32", "--save-result",
                        "--result-dir", str(res_dir), "--metric-percentiles", "50,90,99", "--goodput", "ttft:60000",
                        "tpot:60000"],
                       capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "\r" not in r.stdout               # no in-place progress without a terminal
    # progress that tells time, as vLLM's client shows it: the level's requests, their rate, how long it took
    m = re.search(r"^max concurrency unbounded: 32/32 req \(([\d.]+) req/s, done in 0:\d\d\)$", r.stderr, re.M)
    assert m and 1.0 < float(m.group(1)) < 8.0, r.stderr               # arrivals at 4 req/s pace the level
    assert max(len(line) for line in r.stdout.splitlines()) > 80      # the table is not cut at 80 columns
    files = list(res_dir.glob("openai-chat-4.0qps-*.json"))
    assert len(files) == 1, list(res_dir.iterdir())
    res = json.loads(files[0].read_text())
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput"):
        assert key in res, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{m}_ms" in res, (stat, m)
    assert res["request_rate"] == 4.0 and res["burstiness"] == 1.0 and res["max_concurrency"] is None
    assert res["num_prompts"] == res["completed"] == 32 and res["failed"] == 0
    assert res["total_output_tokens"] == 32 * 32                     # --ignore-eos: exactly --random-output-len
    assert res["total_input_tokens"] >= 32 * 64                      # 64 words + the chat template
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])   # generous SLOs: all good
    # 32 arrivals at 4/s take about 8 s; all-at-once would take a fraction of that on this tiny model
    assert res["duration"] > 3.0
    assert res["mean_ttft_ms"] > 0 and res["p99_e2el_ms"] >= res["median_e2el_ms"] > res["median_ttft_ms"]
    assert res["spec_decode"]["accept_length"] >= 1.0 and res["spec_decode"]["num_drafts"] > 0
    # vLLM's top-level speculative fields from specscope's own counters: acceptance rate in percent
    sd = res["spec_decode"]
    assert res["spec_decode_num_drafts"] == sd["num_drafts"] and res["spec_decode_draft_tokens"] == sd["num_draft_tokens"]
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100 * sd["draft_acceptance_rate"])
    assert res["spec_decode_acceptance_length"] == pytest.approx(sd["accept_length"])
    assert len(res["spec_decode_per_position_acceptance_rates"]) == 3            # --speculative-num-steps 3
    assert res["backend"] == res["endpoint_type"] == "openai-chat" and res["ignore_eos"] is True  # random: as vLLM
    run = open_registry().get_run(res["specscope_run_id"])
    assert run["kind"] == "bench_serve" and run["config"]["prompt_set"] == "random"


def test_serve_and_bench_serve_end_to_end(model_dir, spec_server, tmp_path):
    pytest.importorskip("specscope.speculative.decode")
    from specscope.registry import open_registry

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "category": "c"}) + "\n" for p in PROMPTS))
    spec = spec_server
    keyed = Server(["--model", str(model_dir), "--api-key", "k3y"], _env())
    try:
        # --- bench-serve at concurrency 1 and 4 against the speculative server -----------------------------
        # the old spellings (--url, --dataset, --concurrency, --max-tokens) still work; --endpoint chat as before
        r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--url", spec.url, "--dataset",
                            str(data), "--endpoint", "chat", "--concurrency", "1,4", "--max-tokens", "24", "--json",
                            "--tag", "e2e"],
                           capture_output=True, text=True, timeout=300, env=_env())
        assert r.returncode == 0, r.stderr
        assert "max concurrency" not in r.stderr                       # --json in a log: no progress chatter
        out = json.loads(r.stdout)
        run = open_registry().get_run(out["run_id"])
        assert run["kind"] == "bench_serve" and "e2e" in run["tags"]
        per_req = run["samples"]["per_request"]
        assert len(per_req) == 2 * len(PROMPTS) and all(x["ok"] for x in per_req)
        want = {i: _offline_chat(model_dir, p, 24) for i, p in enumerate(PROMPTS)}
        for x in per_req:  # greedy speculative output == offline greedy baseline, at every concurrency
            assert x["text"] == want[x["index"]], (x["concurrency"], x["index"])
        for lv in run["results"]["levels"]:
            mine = [x for x in per_req if x["concurrency"] == lv["max_concurrency"]]
            m = lv["server_metrics"]
            assert lv["failed"] == 0 and lv["median_ttft_ms"] > 0 and lv["p99_e2el_ms"] >= lv["median_e2el_ms"]
            assert m["engine"] == "specscope" and m["window"] == "delta"
            # the /metrics deltas agree with what the server told each client
            assert m["generation_tokens"] == sum(x["completion_tokens"] for x in mine)
            assert m["num_drafts"] == sum(x["spec"]["verify_ct"] for x in mine) > 0
            assert m["num_accepted_tokens"] == sum(x["spec"]["accepted_tokens"] for x in mine)
            assert m["num_draft_tokens"] == sum(x["spec"]["draft_tokens"] for x in mine)
            assert sum(m["accepted_per_pos"]) == m["num_accepted_tokens"]
            assert m["accept_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
        assert run["results"]["accept_length"] > 1.0
        # the served run carries the engine's step phases, in the profiler's shape, as a generate run does
        phases = run["results"]["phases"]
        assert set(phases) == {"draft", "verify", "accept", "commit", "other"}
        assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0, abs=1e-3)
        assert phases["verify"]["mean_ms"] > 0 and run["results"]["drafted_step_share"] == 1.0   # --spec-policy always
        shown = subprocess.run([sys.executable, "-m", "specscope", "runs", "show", out["run_id"]], capture_output=True,
                               text=True, timeout=120, env=_env())
        assert shown.returncode == 0 and "phases (per cycle)" in shown.stdout and "verify" in shown.stdout, shown

        # --- the completions endpoint too (plain prompts, no chat template) ----------------------------------
        r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--base-url", spec.url + "/v1",
                            "--dataset-path", str(data), "--disable-shuffle", "--no-oversample", "--backend", "vllm",
                            "--max-concurrency", "2", "--output-len", "16", "--json"],
                           capture_output=True, text=True, timeout=300, env=_env())
        assert r.returncode == 0, r.stderr
        per_req = open_registry().get_run(json.loads(r.stdout)["run_id"])["samples"]["per_request"]
        for x in per_req:
            assert x["ok"] and x["text"] == _offline_text(model_dir, PROMPTS[x["index"]], 16)

        # --- malformed requests get 4xx, and the server is fine afterwards -----------------------------------
        for body in ({"messages": "hi"}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                     {"messages": [{"role": "user", "content": "x"}], "top_p": 7}):
            resp = httpx.post(spec.url + "/v1/chat/completions", json=body)
            assert 400 <= resp.status_code < 500 and "error" in resp.json()
        assert httpx.post(spec.url + "/v1/completions", content=b"{oops").status_code == 400

        # --- API key: 401 without it, 200 with it ------------------------------------------------------------
        body = {"prompt": "the quick", "max_tokens": 4, "temperature": 0}  # OpenAI defaults to T=1: be deterministic
        assert httpx.post(keyed.url + "/v1/completions", json=body).status_code == 401
        ok = httpx.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200
        auth = {"Authorization": "Bearer k3y"}

        # --- a client that disconnects mid-stream cancels its decode; the server keeps serving ---------------
        long = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 220,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=long, headers=auth) as s:
            for line in s.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # first real token: hang up
        deadline = time.time() + 30
        while keyed.metric("specscope:request_failed_total", reason="cancelled") < 1 and time.time() < deadline:
            time.sleep(0.1)
        assert keyed.metric("specscope:request_failed_total", reason="cancelled") == 1
        # the same for a non-streaming client that gives up (the server polls for the disconnect)
        host, port = keyed.url[len("http://"):].split(":")
        # long enough to still be decoding when the server next polls for the hang-up (~0.1 s) on fast kernels
        payload = json.dumps({"prompt": "the quick", "max_tokens": 2000, "temperature": 0,
                              "ignore_eos": True}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            deadline = time.time() + 30  # hang up only once it is being decoded
            while keyed.metric("specscope:num_requests_running") < 1 and time.time() < deadline:
                time.sleep(0.005)
        deadline = time.time() + 30
        while keyed.metric("specscope:request_failed_total", reason="cancelled") < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert keyed.metric("specscope:request_failed_total", reason="cancelled") == 2
        assert keyed.metric("specscope:request_success_total") == 1  # only the keyed 4-token request finished
        after = httpx.post(keyed.url + "/v1/completions", json=body, headers=auth)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4

        # --- SIGTERM: the in-flight stream finishes, then the process exits cleanly --------------------------
        lines = []
        with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=dict(long, max_tokens=120),
                          headers=auth, timeout=60) as s:
            for line in s.iter_lines():
                if not lines:
                    keyed.proc.send_signal(signal.SIGTERM)
                lines.append(line)
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert keyed.proc.wait(30) == 0
    finally:
        keyed.stop()


def test_num_warmups_warms_up_until_two_requests_agree_and_measures_after(spec_server, tmp_path):
    """--num-warmups 2: the first request twice, then until two in a row take the same time per token (at most 8
    more); the warm-up is not among the measured requests, its times are in the run's results and on stderr."""
    from specscope.benchserve.warmup import MORE_WARMUP

    r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--base-url", spec_server.url,
                        "--backend", "openai-chat", "--num-prompts", "3", "--dataset-name", "random",
                        "--random-input-len", "16", "--random-output-len", "16", "--max-concurrency", "1",
                        "--num-warmups", "2", "--json", "--no-record"],
                       capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["results"]
    warm = res["warmup"]
    assert 2 <= warm["requests"] <= 2 + MORE_WARMUP and len(warm["tpot_ms"]) == warm["requests"]
    assert warm["steady"] or warm["requests"] == 2 + MORE_WARMUP      # unsettled only once the extra ones ran out
    assert res["levels"][0]["completed"] == 3                   # the measured requests alone
    r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--base-url", spec_server.url,
                        "--backend", "openai-chat", "--num-prompts", "1", "--dataset-name", "random",
                        "--random-input-len", "16", "--random-output-len", "16", "--num-warmups", "1", "--no-record"],
                       capture_output=True, text=True, timeout=600, env=_env())
    assert re.search(r"^warm-up: \d+ request\(s\), (steady|not steady) \(ms per output token: [\d.]+, ", r.stderr,
                     re.M), r.stderr


def test_served_run_names_the_drafter_the_server_drafts_with(spec_server, tmp_path):
    """Issue 52 item 4: `specscope serve` exports what it drafts with (spec_decode_info), bench-serve stores it in
    the run's config under a generate run's names, and the report and `compare` name the drafter beside τ instead
    of 'drafter not named by the server'."""
    from served_runs import priced_and_always

    from specscope.ingest.prometheus import parse_text
    from specscope.registry import open_registry
    from specscope.report import charts

    info = [k for k in parse_text(httpx.get(spec_server.url + "/metrics").text).values
            if k[0] == "specscope:spec_decode_info"]
    assert len(info) == 1 and dict(info[0][1])["draft"] == "ngram", info
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    r = subprocess.run([sys.executable, "-m", "specscope", "bench-serve", "--base-url", spec_server.url,
                        "--dataset-path", str(data), "--max-concurrency", "1", "--output-len", "8", "--json"],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr
    rid = json.loads(r.stdout)["run_id"]
    run = open_registry().get_run(rid)
    cfg = run["config"]
    assert (cfg["draft"], cfg["spec_policy"], cfg["steps"], cfg["topk"]) == ("ngram", "always", 3, 1), cfg
    assert run["results"]["accept_length"] > 1.0 and "drafter not named" not in charts.label(run)
    assert charts.label(run).startswith("ngram s3k1")
    # the report's runs table beside the old record (a server that exported no info metric), and compare
    old = priced_and_always()[0]
    with open_registry() as reg:
        old_id = reg.add_run(old)
    page = tmp_path / "r.html"
    rep = subprocess.run([sys.executable, "-m", "specscope", "report", old_id, rid, "-o", str(page)],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert rep.returncode == 0, rep.stderr
    body = page.read_text().split("<h2>Runs</h2>")[1].split("</table>")[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", body) if "<td" in tr]
    assert "drafter not named by the server" in rows[0][4]                 # the old record still says so
    assert "ngram" in rows[1][4] and "not named" not in rows[1][4], rows[1]
    cmp = subprocess.run([sys.executable, "-m", "specscope", "compare", old_id, rid], capture_output=True,
                         text=True, timeout=300, env=dict(_env(), COLUMNS="200"))
    assert cmp.returncode == 0, cmp.stderr
    line = next(ln for ln in cmp.stdout.splitlines() if ln.strip().startswith("config.draft "))
    assert line.split()[-1] == "ngram", cmp.stdout


def test_spec_decode_info_under_either_prefix_and_in_ingested_scrapes(tmp_path):
    """The info metric only with a drafter, under --metrics-prefix's name; read back by spec_delta (bench-serve)
    and by `ingest` of a scrape file into the run's config, under a generate run's names."""
    from specscope.ingest.core import ingest_file
    from specscope.ingest.prometheus import parse_text, spec_delta
    from specscope.server.metrics import DraftingInfo, ServerMetrics

    assert "spec_decode_info" not in ServerMetrics().render().decode()     # no drafter: no info metric
    info = DraftingInfo("org/eagle3+ngram", "priced", "fixed", 4, 1, 5, 8)
    want = {"draft": "org/eagle3+ngram", "spec_policy": "priced", "draft_budget": "fixed", "steps": 4, "topk": 1,
            "draft_tokens": 5, "ngram_tokens": 8}
    for prefix in ("specscope", "vllm"):
        met = ServerMetrics(prefix, info)
        met.num_drafts.inc(3)
        text = met.render().decode()
        assert f"{prefix}:spec_decode_info{{" in text
        d = spec_delta(parse_text(text), parse_text(text))
        assert d["engine"] == prefix and d["server_spec"] == want
    f = tmp_path / "scrapes.txt"
    f.write_text(text + text)
    s = ingest_file(f, record=False)
    assert {k: s["config"].get(k) for k in want} == want and "server_spec" not in s["results"]


def test_spec_delta_vllm_counters_and_reset():
    from specscope.ingest.prometheus import parse_text, spec_delta

    before = parse_text("""# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 100
vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 300
vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 150
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="0"} 80
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="1"} 50
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="2"} 20
vllm:generation_tokens_total{model_name="m"} 1000
""")
    after = parse_text("""vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 140
vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 420
vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 210
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="0"} 110
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="1"} 70
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="2"} 30
vllm:generation_tokens_total{model_name="m"} 1100
""")
    d = spec_delta(before, after)
    assert d["engine"] == "vllm" and d["num_drafts"] == 40 and d["num_accepted_tokens"] == 60
    assert d["accept_length"] == pytest.approx(2.5)
    assert d["accepted_per_pos"] == [30, 20, 10]
    assert d["per_position_acceptance"] == pytest.approx([0.75, 0.5, 0.25])
    assert sum(d["per_position_acceptance"]) == pytest.approx(d["accept_length"] - 1)
    assert d["draft_acceptance_rate"] == pytest.approx(0.5)
    assert d["generation_tokens"] == 100
    # a restarted server (counter went down) counts from zero, not negative
    assert spec_delta(after, before)["num_drafts"] == 100
    assert spec_delta(None, after)["window"] == "lifetime"


def test_spec_delta_sglang_gauges_leader_rank_and_dp_sum():
    from specscope.ingest.prometheus import parse_text, spec_delta

    # a tp_rank 1 copy is a duplicate of the leader's view; data-parallel ranks add up (accept length: weighted)
    s = parse_text('sglang:spec_accept_length{tp_rank="0"} 2.0\nsglang:spec_accept_length{tp_rank="1"} 3.0\n'
                   'sglang:gen_throughput{tp_rank="0"} 150.5\n')
    d = spec_delta(None, s)
    assert d["engine"] == "sglang" and d["accept_length"] == 2.0 and d["gen_throughput"] == 150.5
    dp = parse_text('sglang:gen_throughput{dp_rank="0",tp_rank="0"} 100\nsglang:gen_throughput{dp_rank="1",tp_rank="0"} 50\n'
                    'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 3\nsglang:num_running_reqs{dp_rank="1",tp_rank="0"} 1\n'
                    'sglang:spec_accept_length{dp_rank="0",tp_rank="0"} 3.0\nsglang:spec_accept_length{dp_rank="1",tp_rank="0"} 2.0\n')
    d = spec_delta(None, dp)
    assert d["gen_throughput"] == 150 and d["num_running_reqs"] == 4
    assert d["accept_length"] == pytest.approx((3.0 * 3 + 2.0 * 1) / 4)


def test_load_prompts_formats_and_categories(tmp_path):
    from specscope.prompts import load_prompts
    from specscope.errors import SpecscopeError

    f = tmp_path / "mixed.jsonl"
    rows = [{"question_id": 1, "category": "math", "turns": ["one", "two"]},
            {"category": "qa", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
            {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
            {"prompt": "p", "category": "math"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_prompts(str(f))
    assert [r["prompt"] for r in ds["prompts"]] == ["one", "q", "h", "p"]
    assert [r["prompt"] for r in load_prompts(str(f), ("math",))["prompts"]] == ["one", "p"]
    assert len(load_prompts(str(f), num_prompts=2)["prompts"]) == 2
    with pytest.raises(SpecscopeError, match="unknown --category"):
        load_prompts(str(f), ("poetry",))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(SpecscopeError, match="bad.jsonl:2"):
        load_prompts(str(bad))
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert [r["prompt"] for r in load_prompts(str(txt))["prompts"]] == ["first", "second"]
    with pytest.raises(SpecscopeError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_spec_bench_dataset_resolves():
    from specscope.prompts import load_prompts, spec_bench_path
    from specscope.errors import SpecscopeError

    try:
        spec_bench_path()
    except SpecscopeError:
        pytest.skip("the shared Spec-Bench file is not on this machine")
    ds = load_prompts("spec_bench", ("writing",), 3)
    assert ds["name"] == "spec_bench" and len(ds["prompts"]) == 3
    assert all(r["category"] == "writing" for r in ds["prompts"])


def test_bench_serve_cli_errors(tmp_path):
    from specscope.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench-serve", "--url", "http://127.0.0.1:9", "--concurrency", "0,x"])
    assert e.value.code == 2
    f = tmp_path / "p.txt"
    f.write_text("hello\n")
    with pytest.raises(SystemExit) as e:  # nothing listens on the discard port
        main(["bench-serve", "--url", "http://127.0.0.1:9", "--dataset", str(f), "--concurrency", "1"])
    assert e.value.code == 2


@pytest.mark.slow  # another server start (~30 s on a busy 2-core box); the e2e test above covers the same paths
def test_load_script_all_requests_ok_on_tiny_model(model_dir, tmp_path):
    """bench/serve_load.py end to end, small: its checks (no errors, counters agree, SIGTERM exit 0) must hold."""
    pytest.importorskip("specscope.speculative.decode")
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "serve_load.py"
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(script), "--model", str(model_dir), "--clients", "3", "--requests", "6",
                        "--max-tokens", "8", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert all(res["checks"].values()) and res["results"]["completed"] == 6
    assert res["results"]["p99_e2el_ms"] >= res["results"]["p50_e2el_ms"] > 0
    assert res["server_metrics"]["num_drafts"] > 0
    # the clients' progress as bench-serve shows a level (a closing line off a terminal), and the load it ran under
    assert re.search(r"^max concurrency 3: 6/6 req \([\d.]+ (req/s|s/req), done in \d+:\d\d\)", r.stderr, re.M), r.stderr
    assert "max concurrency" not in r.stdout and "load_warning" in res
    assert res["load_warning"] is None or res["load_warning"] in r.stderr


def test_arrivals_follow_vllms_gamma_process():
    import math

    import numpy as np

    from specscope.benchserve.run import intervals

    assert intervals(5, math.inf, 1.0, 0) == [0.0] * 5                    # all at once
    poisson = np.array(intervals(20000, 4.0, 1.0, 0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)                  # mean gap 1 / rate
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)   # exponential: CV 1
    bursty = np.array(intervals(20000, 4.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05) and bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    assert intervals(10, 4.0, 1.0, 7) == intervals(10, 4.0, 1.0, 7)         # --seed makes it repeatable


def test_level_summary_uses_vllm_names_units_and_goodput():
    from specscope.benchserve.client import RequestResult
    from specscope.benchserve.run import level_summary

    def req(i, ttft, e2e, toks):
        return RequestResult(i, ok=True, ttft_s=ttft, e2e_s=e2e, itl_s=[0.01] * (toks - 1), completion_tokens=toks,
                             prompt_tokens=10)

    rs = [req(0, 0.1, 1.1, 11), req(1, 0.3, 2.3, 11), RequestResult(2, error="HTTP 500: boom")]
    s = level_summary(4, rs, 2.0, None, ("ttft", "tpot", "e2el"), (50, 99.9), {"ttft": 200.0})
    assert s["completed"] == 2 and s["failed"] == 1 and s["max_concurrency"] == 4 and s["duration"] == 2.0
    assert s["total_output_tokens"] == 22 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 11.0 and s["total_token_throughput"] == 21.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(299.8) and "p50_e2el_ms" in s and "mean_itl_ms" not in s
    assert s["mean_tpot_ms"] == pytest.approx(((1.0 / 10) + (2.0 / 10)) / 2 * 1e3)
    assert s["request_goodput"] == 0.5                 # one of the two met TTFT <= 200 ms
    assert s["error_examples"] == ["HTTP 500: boom"]


@pytest.mark.parametrize("args,needle", [
    (["--goodput", "ttft:abc"], "--goodput takes KEY:MS"),
    (["--goodput", "latency:5"], "--goodput takes KEY:MS"),
    (["--metric-percentiles", "0,101"], "--metric-percentiles"),
    (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--dataset", "random", "--category", "math"], "--category does not apply"),
    (["--base-url", "localhost:8000"], "--base-url must start with http"),
    (["ttft:5"], "unexpected extra argument"),
])
def test_bench_serve_bad_options_are_one_line(args, needle, capsys):
    from cli_util import cli, one_error_line

    code, _, err = cli(capsys, "bench-serve", *args)
    assert needle in one_error_line(code, err)


def _bench_module(name):
    from bench_util import load_bench

    return load_bench(name)


def test_serve_concurrency_bench_parses_and_its_numbers_are_right():
    """bench/serve_concurrency.py is long and not run here: its --help parses, and the functions that turn runs
    into numbers (client lists, percentiles, Prometheus histogram quantiles, the answer check, the ratios) are
    right."""
    import argparse
    from pathlib import Path

    import numpy as np

    from specscope.ingest.prometheus import parse_text
    from specscope.server.metrics import ServerMetrics

    script = Path(__file__).resolve().parent.parent / "bench" / "serve_concurrency.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                       env=_env())
    assert r.returncode == 0, r.stderr
    assert "--max-num-seqs" in r.stdout and "--clients" in r.stdout
    m = _bench_module("serve_concurrency")

    assert m.parse_clients("16,32") == [16, 32] and m.parse_clients(" 8, 8 ,4") == [8, 4]
    for bad in ("0", "x", "16,", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            m.parse_clients(bad)

    vals = [0.3, 0.1, None, 0.4, 0.2, 1.7]
    d = m.dist(vals, "ttft")
    ms = np.array([0.3, 0.1, 0.4, 0.2, 1.7]) * 1e3
    assert d["mean_ttft_ms"] == pytest.approx(ms.mean()) and d["max_ttft_ms"] == pytest.approx(1700)
    for p in (50, 90, 99):
        assert d[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ms, p))
    assert m.dist([None], "ttft") is None

    # the server's own histogram, rendered and parsed as the bench reads it
    met = ServerMetrics()
    for _ in range(10):
        met.queue_time.observe(0.015)      # bucket (0.01, 0.02]
    for _ in range(10):
        met.queue_time.observe(0.03)       # bucket (0.02, 0.04]
    s = parse_text(met.render().decode())
    name = "specscope:request_queue_time_seconds"
    assert m.histogram_quantile(s, name, 0.5) == pytest.approx(0.02)          # the first bucket's top
    assert m.histogram_quantile(s, name, 0.25) == pytest.approx(0.015)        # halfway into (0.01, 0.02]
    assert m.histogram_quantile(s, name, 0.75) == pytest.approx(0.03)         # halfway into (0.02, 0.04]
    met.queue_time.observe(500.0)          # past the last finite bound: Prometheus answers that bound
    s = parse_text(met.render().decode())
    assert m.histogram_quantile(s, name, 0.999) == pytest.approx(81.92)
    assert m.histogram_quantile(parse_text(ServerMetrics().render().decode()), name, 0.5) is None
    h = m.server_histogram(s, name)
    assert h["count"] == 21 and h["mean_ms"] == pytest.approx((10 * 15 + 10 * 30 + 500_000) / 21)

    # a run: 3 completed (one differs from offline), 1 error; throughput over the duration
    ref = {"a": [1, 2, 3], "b": [4, 5]}
    run = {"started": 5, "hung_up": 1, "finished": [
        {"prompt": "a", "token_ids": [1, 2, 3], "ttft_s": 0.1, "e2e_s": 0.5, "error": None},
        {"prompt": "b", "token_ids": [4, 5], "ttft_s": 0.2, "e2e_s": 0.6, "error": None},
        {"prompt": "b", "token_ids": [4, 6], "ttft_s": 0.3, "e2e_s": 0.7, "error": None},
        {"prompt": "a", "error": "HTTP 500: boom", "status": 500}]}
    met.request_failed.labels(reason="cancelled").inc(1)
    sm = m.summarize(run, 2.0, ref, parse_text(met.render().decode()))
    assert (sm["completed"], sm["errors"], sm["mismatches"], sm["checked_against_offline"]) == (3, 1, 1, 3)
    assert sm["output_tokens"] == 7 and sm["output_tok_per_s"] == 3.5 and sm["completed_per_s"] == 1.5
    assert sm["server_cancelled"] == 1 and sm["rejected_429"] == 0
    assert sm["prefix_cache"] == {"queries": 0, "hits": 0, "hit_rate": None}
    met.prefix_cache_queries.inc(80)
    met.prefix_cache_hits.inc(20)
    pc = m.summarize(run, 2.0, ref, parse_text(met.render().decode()))["prefix_cache"]
    assert pc == {"queries": 80, "hits": 20, "hit_rate": 0.25}
    assert sm["time_to_first_token"]["p50_ttft_ms"] == pytest.approx(200)
    assert sm["request_queue_time"]["count"] == 21 and sm["mismatch_examples"][0]["server"] == [4, 6]
    c = m.checks_of(sm, 0.5, 200, 0)
    assert not c["no_errors"] and not c["every_completed_equals_offline_greedy"] and c["idle_within_10s_of_hangup"]
    assert all(m.checks_of(dict(sm, errors=0, mismatches=0), 0.5, 200, 0).values())

    serial = {"completed": 10, "output_tok_per_s": 20.0, "time_to_first_token": {"mean_ttft_ms": 900.0},
              "request_queue_time": {"mean_ms": 800.0}}
    batched = {"completed": 35, "output_tok_per_s": 70.0, "time_to_first_token": {"mean_ttft_ms": 300.0},
               "request_queue_time": None}
    x = m.ratios(serial, batched)
    assert x["completed"] == 3.5 and x["output_tok_per_s"] == 3.5 and x["mean_ttft_ms"] == pytest.approx(1 / 3)
    assert x["mean_request_queue_time_ms"] is None and x["p99_ttft_ms"] is None
    assert m.ratios(dict(serial, completed=0), batched)["completed"] is None

    args = argparse.Namespace(spec_policy="always", max_seq_len=None, prefix_caching="on", draft="ngram")
    assert m.serve_flags(args, 1) == ["--max-num-seqs", "1", "--spec-policy", "always"]
    args.draft = ""         # serve refuses --spec-policy without a drafter: the plain servers get none
    assert m.serve_flags(args, 1) == ["--max-num-seqs", "1"]
    args.max_seq_len = 512
    assert m.serve_flags(args, 16)[-2:] == ["--max-seq-len", "512"]
    args.prefix_caching = "off"
    assert "--no-enable-prefix-caching" in m.serve_flags(args, 16)
