"""The clients users already run, against `specscope serve` (issue 40): vLLM's own `vllm bench serve` times it as it
times vLLM (its TTFT agrees with the server's own time_to_first_token metric over the same requests), and lm-eval's
`local-completions` runs a loglikelihood (multiple-choice) task and a generation task from local files, with the same
scores and the same answers through a lossless drafter as without, and in batches of 4 prompts as one by one. Both
clients live in .venv-vllm (engines.lock).

One server at a time, each started and stopped by its test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine_util import VLLM_BENCH_SERVE

from specscope.ingest.prometheus import parse_text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_util import Background  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
NAME = "smollm2"


@pytest.fixture
def serve(tmp_path):
    """serve(*extra) -> a running `specscope serve` on the embedded model (stopped when the test ends)."""
    started = []

    def start(*extra):
        env = {**os.environ, "SPECSCOPE_DB": str(tmp_path / "runs.db")}
        srv = Background(["serve", "--model", "smollm2-135m", "--served-model-name", NAME, "--port", "0", *extra],
                         env)
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.stop()


def _ttft(url: str) -> tuple[float, int]:
    s = parse_text(httpx.get(url + "/metrics", timeout=30).text)
    return (s.total("specscope:time_to_first_token_seconds_sum") or 0.0,
            int(s.total("specscope:time_to_first_token_seconds_count") or 0))


@pytest.mark.parametrize("backend,endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")])
def test_vllm_bench_serve_times_ttft_as_the_server_does(serve, vllm_python, model_dir, tmp_path, backend, endpoint):
    """The first chunk leaves with the first token, so vLLM's client (TTFT = the first chunk) measures prefill as
    TTFT, not as an inter-token gap: its mean TTFT is the server's own mean plus the HTTP round trip (< 10 %)."""
    srv = serve("--draft", "ngram")
    before = _ttft(srv.url)
    out = tmp_path / "bench"
    r = subprocess.run([vllm_python, "-c", VLLM_BENCH_SERVE, "--backend", backend, "--endpoint", endpoint,
                        "--base-url", srv.url, "--model", NAME, "--tokenizer", str(model_dir),
                        "--dataset-name", "random", "--random-input-len", "768", "--random-output-len", "16",
                        "--num-prompts", "8", "--max-concurrency", "1", "--seed", "0", "--ignore-eos",
                        "--save-result", "--result-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "/tokenize" not in r.stderr or "404" not in r.stderr          # its tokenizer probe finds the route
    res = json.loads(next(out.glob("*.json")).read_text())
    after = _ttft(srv.url)
    n = after[1] - before[1]
    assert res["completed"] == 8 and n == 8
    server_ms = (after[0] - before[0]) / n * 1e3
    assert server_ms > 50, server_ms                                      # a real prefill, not framing
    assert res["mean_ttft_ms"] == pytest.approx(server_ms, rel=0.10), (res["mean_ttft_ms"], server_ms)
    # the prefill is not counted as a gap between tokens: the slowest gap is well under the TTFT
    assert res["p99_itl_ms"] < 0.5 * res["mean_ttft_ms"], (res["p99_itl_ms"], res["mean_ttft_ms"])


TASKS = {
    "specscope_mc": {"output_type": "multiple_choice", "data": "mc.jsonl",
                     "doc_to_text": "Complete the sentence: {{question}}", "doc_to_choice": "choices",
                     "doc_to_target": "answer", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
    "specscope_gen": {"output_type": "generate_until", "data": "gen.jsonl",
                      "doc_to_text": "Question: What is the capital of France?\nAnswer: Paris\n\nQuestion: What is 2 "
                                     "plus 2?\nAnswer: 4\n\nQuestion: {{question}}\nAnswer:",
                      "doc_to_target": " {{answer}}",      # the answer as generated: after the space
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 24, "do_sample": False,
                                            "temperature": 0},
                      "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                       "ignore_case": True, "ignore_punctuation": True}]},
}


def _task_dir(root: Path) -> Path:
    """The tasks as lm-eval YAML over the JSONL files shipped with the tests (no hub)."""
    d = root / "tasks"
    d.mkdir()
    for name, t in TASKS.items():
        cfg = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA / t["data"])}},
               "test_split": "test", **{k: v for k, v in t.items() if k != "data"}}
        (d / f"{name}.yaml").write_text(json.dumps(cfg))        # JSON is YAML
    return d


def _lm_eval(vllm_python, url, model_dir, tasks: Path, out: Path, batch_size: int = 1) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false"}
    args = (f"model={NAME},base_url={url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
            f"num_concurrent=1,max_retries=1")
    r = subprocess.run([vllm_python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                        "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--output_path", str(out),
                        "--log_samples", "--seed", "0", "--batch_size", str(batch_size)], capture_output=True,
                       text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {t: [json.loads(ln) for ln in next(out.rglob(f"samples_{t}_*.jsonl")).read_text().splitlines()]
               for t in TASKS}
    return {"results": results, "resps": {t: [s["resps"] for s in rows] for t, rows in samples.items()}}


def test_lm_eval_scores_are_the_same_through_a_drafter(serve, vllm_python, model_dir, tmp_path):
    """A lossless speculative server is where users check that no score moved: loglikelihoods (echoed prompt
    logprobs) and greedy generations through the hybrid drafter equal plain decoding's."""
    tasks = _task_dir(tmp_path)
    runs = {}
    for label, extra in (("plain", ()), ("draft", ("--draft", "smollm2-135m-eagle3+ngram"))):
        srv = serve(*extra)
        runs[label] = _lm_eval(vllm_python, srv.url, model_dir, tasks, tmp_path / label)
        srv.stop()
    plain, draft = runs["plain"], runs["draft"]
    mc = plain["results"]["specscope_mc"]
    assert mc["acc,none"] >= 0.5, mc       # the loglikelihood task really ran on the model (chance is 0.25)
    assert plain["results"]["specscope_gen"]["exact_match,none"] >= 0.25, plain["results"]   # answers, not blanks
    _assert_same_scores(plain, draft)


def test_lm_eval_batches_score_as_single_requests(serve, vllm_python, model_dir, tmp_path):
    """lm-eval's --batch_size 4 sends a list of prompts per request (issue 52: refused with a 400 before); the
    server answers each with the choices in order, so the scores and answers are those of --batch_size 1."""
    tasks = _task_dir(tmp_path)
    srv = serve()
    one, four = (_lm_eval(vllm_python, srv.url, model_dir, tasks, tmp_path / f"batch{b}", batch_size=b)
                 for b in (1, 4))
    assert one["results"]["specscope_mc"]["acc,none"] >= 0.5, one["results"]
    _assert_same_scores(one, four)


def _assert_same_scores(a: dict, b: dict) -> None:
    """Two lm-eval runs' metrics, greedy generations and per-choice loglikelihoods agree."""
    for task in TASKS:
        for key, v in a["results"][task].items():
            if isinstance(v, float) and not key.endswith("_stderr,none"):
                assert b["results"][task][key] == pytest.approx(v, abs=1e-9), (task, key)
    assert b["resps"]["specscope_gen"] == a["resps"]["specscope_gen"]      # the same text, token for token
    for doc_a, doc_b in zip(a["resps"]["specscope_mc"], b["resps"]["specscope_mc"]):
        for [(lp_a, greedy_a)], [(lp_b, greedy_b)] in zip(doc_a, doc_b):     # per choice: (loglikelihood, greedy)
            assert float(lp_b) == pytest.approx(float(lp_a), abs=1e-4) and greedy_a == greedy_b
