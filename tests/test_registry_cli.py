"""Registry end to end: `generate` stores runs (profile included), `runs ...` and `compare` read them back."""

import csv
import io
import json

import pytest

from specscope.registry import open_registry
from tiny import make_hf_model, make_tiny_tokenizer
from cli_util import cli


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_hf_model(d, "llama")
    make_tiny_tokenizer(d)
    return d


def gen(capsys, model, *extra):
    code, out, err = cli(capsys, "generate", "--model", model, "--prompt", "the quick brown fox",
                         "--max-new-tokens", 16, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_generate_stores_a_full_record(tiny_model, capsys, tmp_path):
    res = gen(capsys, tiny_model)
    assert res["run_id"] and res["profile"]["cycles"] == res["num_tokens"] - 1
    assert any(l.startswith("Target decode: ") for l in res["summary_lines"])
    with open_registry() as reg:
        rec = reg.get_run(res["run_id"])
    c = rec["config"]
    assert c["model"] == str(tiny_model) and c["model_hash"].startswith("fast1:") and c["dtype"] == "float32"
    assert c["engine"] == "baseline" and c["threads"] >= 1 and c["prompt_set_hash"].startswith("sha256:")
    assert c["sampling"]["temperature"] == 0.0
    r = rec["results"]
    assert r["tok_per_s"] == res["tok_per_s"] and r["phases"]["decode"]["share"] > 0.3
    assert len(rec["samples"]["cycle_ms"]["decode"]) == res["num_tokens"] - 1
    assert rec["env"]["cpu"]["model"] and rec["env"]["torch"]["threads"] >= 1
    # --no-record stores nothing; --db points elsewhere
    n = gen(capsys, tiny_model, "--no-record")
    assert "run_id" not in n
    other = tmp_path / "other.db"
    o = gen(capsys, tiny_model, "--db", other)
    with open_registry() as reg:
        assert reg.count() == 1
    with open_registry(other) as reg:
        assert reg.get_run(o["run_id"])["kind"] == "generate"


def test_runs_commands(tiny_model, capsys, tmp_path):
    a = gen(capsys, tiny_model)["run_id"]
    b = gen(capsys, tiny_model, "--temperature", 0.8, "--seed", 1)["run_id"]
    code, out, _ = cli(capsys, "runs", "list", "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)] == [b, a]
    code, out, _ = cli(capsys, "runs", "list")
    assert a in out and b in out and "generate" in out
    code, out, _ = cli(capsys, "runs", "show", a[:6])
    assert a in out and "decode" in out and "environment" in out
    code, out, _ = cli(capsys, "runs", "show", a, "--json")
    assert json.loads(out)["id"] == a and "samples" not in json.loads(out)
    code, out, _ = cli(capsys, "runs", "export", a, b, "--json")
    exported = json.loads(out)
    assert [r["id"] for r in exported] == [a, b] and exported[0]["samples"]["cycle_ms"]["decode"]
    code, out, _ = cli(capsys, "runs", "export", a, b, "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["id"] for r in rows] == [a, b] and float(rows[0]["results.tok_per_s"]) > 0
    assert rows[1]["config.sampling.temperature"] == "0.8"
    code, out, _ = cli(capsys, "runs", "tag", a, "keep", "--json")
    assert json.loads(out)["tags"] == ["keep"]
    code, out, _ = cli(capsys, "runs", "list", "--tag", "keep", "--json")
    assert [r["id"] for r in json.loads(out)] == [a]
    code, out, _ = cli(capsys, "runs", "delete", b)
    assert code == 0
    code, _, err = cli(capsys, "runs", "show", b)
    assert code == 2 and err.startswith("error: no run") and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "runs", "delete", a, "zzzzzz")     # all or nothing
    assert code == 2
    with open_registry() as reg:
        assert reg.count() == 1


def test_compare_two_real_runs_and_matrix(tiny_model, capsys):
    a = gen(capsys, tiny_model, "--max-new-tokens", 24)["run_id"]
    b = gen(capsys, tiny_model, "--max-new-tokens", 24, "--temperature", 0.7, "--seed", 3)["run_id"]
    code, out, err = cli(capsys, "compare", a, b, "--json")
    assert code == 0, err
    res = json.loads(out)
    metrics = [r["metric"] for r in res["rows"]]
    assert metrics[:2] == ["tok_per_s", "ms_per_token"] and "phase.decode" in metrics
    assert res["config_diff"]["config.sampling.temperature"] == [0.0, 0.7]
    assert res["attribution"][0]["likely_causes"]
    code, out, _ = cli(capsys, "compare", "last~1", "last")
    assert "Target decode ms/cyc" in out and "configuration differences" in out
    code, out, err = cli(capsys, "compare", "--by", "temperature", a, b, "--json")
    m = json.loads(out)
    assert m["rows"] == ["0.0", "0.7"] and m["cells"][0][0]["runs"] == [a]
    code, _, err = cli(capsys, "compare", a)
    assert code == 2 and "at least two runs" in err


def test_speculative_generate_records_phases_and_acceptance(tiny_model, capsys):
    prompt = "the quick brown fox the quick brown fox the quick brown fox"
    code, out, err = cli(capsys, "generate", "--model", tiny_model, "--prompt", prompt, "--max-new-tokens", 24,
                         "--draft", "ngram", "--steps", 3, "--json")
    assert code == 0, err
    res = json.loads(out)
    with open_registry() as reg:
        rec = reg.get_run(res["run_id"])
    c, r, s = rec["config"], rec["results"], rec["samples"]
    assert c["engine"] == "speculative" and c["draft"] == "ngram" and c["steps"] == 3 and c["draft_hash"] is None
    assert {"draft", "verify", "accept", "commit"} <= set(r["phases"])
    assert r["accept_length"] == pytest.approx(res["accept_length"], abs=1e-3)
    assert 1 <= len(r["per_position_acceptance"]) <= 3 and r["drafted_tokens"] > 0
    assert sum(s["accept_lengths"]) == r["tokens"] and len(s["num_draft"]) == r["cycles"]
    assert any(l.startswith("Per-position acceptance (unconditional)") for l in res["summary_lines"])
