"""`specscope demo` end to end on a tiny random target with a random EAGLE-3 drafter (and n-gram): the runs land
in the registry, linked, with per-prompt stats; the report holds its charts; bad input ends in one clear line.
The real SmolLM2 demo is in test_demo_smollm2.py (slow)."""

import json
import re

import pytest

from specscope.errors import SpecscopeError
from specscope.registry import open_registry
from spec_helpers import random_eagle3
from tiny import make_hf_model, make_tiny_tokenizer
from cli_util import cli, one_error_line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter

    d = tmp_path_factory.mktemp("demo-target")
    make_hf_model(d, "llama", layers=4)
    make_tiny_tokenizer(d)
    target = load_model(d, dtype="fp32")
    drafter_dir = tmp_path_factory.mktemp("demo-drafter")
    save_drafter(random_eagle3(target, draft_vocab=60), drafter_dir)
    return d, drafter_dir


def images(html: str) -> list[str]:
    return re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]{200,})"', html)


def test_demo_eagle3_end_to_end(tiny, tmp_path, capsys):
    target, drafter = tiny
    out = tmp_path / "demo"
    code, stdout, err = cli(capsys, "demo", "--model", target, "--draft", drafter, "--prompts", 2,
                            "--max-new-tokens", 10, "--steps", 3, "--topk", 2, "--out", out, "--threads", 1)
    assert code == 0, err
    # the summary: speedup, τ, the profile lines, the break-even, where things went and what to try next
    for needle in ("Speedup:", "τ =", "Target verify:", "Draft:", "Break-even for these measured costs",
                   "baseline run",
                   "speculative run", "Report:", "specscope compare", "specscope breakeven --run",
                   "specscope tune --run", "specscope report"):
        assert needle in stdout, needle
    # the verdict depends on the timings: needs τ = x / is impossible / any acceptance pays
    assert re.search(r"break-even (needs τ = [0-9.]+|is impossible)", stdout), stdout
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    with open_registry() as reg:
        base, spec, curve = (reg.get_run(runs[k]) for k in ("baseline", "speculative", "verify_curve"))
    assert (base["kind"], spec["kind"], curve["kind"]) == ("baseline", "speculative", "verify_curve")
    assert spec["config"]["baseline_run"] == base["id"] and spec["config"]["verify_curve_run"] == curve["id"]
    assert (spec["config"]["steps"], spec["config"]["topk"]) == (3, 2) and "demo" in spec["tags"]
    assert spec["config"]["draft_hash"]          # the drafter's weights are hashed into the record
    for rec in (base, spec):
        pp = rec["samples"]["per_prompt"]
        assert len(pp) == 2 and all(p["tokens"] >= 1 for p in pp)
        assert rec["results"]["phases"] and rec["results"]["tok_per_s"] > 0
        assert rec["samples"]["cycle_ms"]
    assert "draft" in spec["results"]["phases"] and "verify" in spec["results"]["phases"]
    assert "decode" in base["results"]["phases"]
    assert spec["results"]["accept_length"] >= 1.0
    # greedy speculative decoding is lossless: the same tokens as plain decoding
    assert summary["identical_outputs"] == 2
    assert summary["speedup"] == pytest.approx(spec["results"]["tok_per_s"] / base["results"]["tok_per_s"], rel=1e-3)
    assert summary["breakeven"]["break_even_accept_length"] > 0
    html = (out / "report.html").read_text()
    alts = [a for a, _ in images(html)]
    assert len(alts) == 5, alts
    for want in ("cycle time breakdown", "histogram of τ", "per-position acceptance", "break-even",
                 "verify cost curve"):
        assert any(want in a for a in alts), want
    for h2 in ("Runs", "Where the time goes", "Acceptance", "Break-even", "Verify cost", "Compare", "Per prompt",
               "Environment"):
        assert f"<h2>{h2}</h2>" in html, h2
    assert base["id"] in html and spec["id"] in html
    assert "http://" not in html and "https://" not in html    # self-contained: nothing to fetch
    # the speedup carries the verdict the report's headline gives it (registry.compare's rule), in the same words
    from specscope.registry.compare import speed_words

    judged = summary["speedup_judged"]
    assert judged["verdict"] in ("better", "worse", "no significant change"), judged
    words = speed_words(judged, ratio=False)
    assert re.search(rf"^Speedup: {judged['ratio']:.2f}× " + re.escape(words) + "$", stdout, re.M), stdout
    assert words in html.replace("&#x27;", "'")
    # progress as every command shows it (stderr not a terminal: a closing line with rate and time), not stdout
    assert re.search(r"^remaining prompts \(.+\): 1/1 prompt \([\d.]+ (prompt/s|s/prompt), done in \d+:\d\d\)",
                     err, re.M), err
    assert re.search(r"^verify-cost curve: (\d+)/\1 forward \(", err, re.M), err
    assert "remaining prompts" not in stdout and "forward" not in stdout


def test_demo_try_next_commands_work(tiny, tmp_path, capsys, monkeypatch):
    """The commands the demo suggests, run verbatim against the runs it stored."""
    target, drafter = tiny
    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli(capsys, "demo", "--model", target, "--draft", drafter, "--prompts", 1,
                            "--max-new-tokens", 8, "--no-verify-curve", "--threads", 1)
    assert code == 0, err
    assert (tmp_path / "specscope-demo" / "report.html").is_file()
    suggested = [ln.split("#")[0].split() for ln in stdout.splitlines() if ln.strip().startswith("specscope ")]
    assert [c[1] for c in suggested] == ["compare", "breakeven", "tune", "report"]
    for cmd in suggested:
        code, out, err = cli(capsys, *cmd[1:])
        assert code == 0, (cmd, err)
        assert out.strip(), cmd
    assert (tmp_path / "report.html").is_file()


@pytest.mark.parametrize("draft", ["ngram", "ngram-lookup"])
def test_demo_ngram_json(tiny, tmp_path, capsys, draft):
    target, _ = tiny
    code, stdout, err = cli(capsys, "demo", "--model", target, "--draft", draft, "--prompts", 1,
                            "--max-new-tokens", 6, "--out", tmp_path / "d", "--no-verify-curve", "--json",
                            "--threads", 1)
    assert code == 0, err
    res = json.loads(stdout)
    assert res["runs"]["verify_curve"] is None and res["draft"] == draft
    assert res["prompts"] == 1 and res["identical_outputs"] == 1
    with open_registry() as reg:
        assert reg.count() == 2
        spec = reg.get_run(res["runs"]["speculative"])
    assert spec["config"]["draft"] == draft and spec["config"]["draft_hash"] is None
    html = (tmp_path / "d" / "report.html").read_text()
    assert "<h2>Verify cost</h2>" not in html and len(images(html)) == 4


def test_demo_missing_shipped_drafter_is_one_clear_line(tiny, tmp_path, capsys, monkeypatch):
    import specscope.speculative.decode as decode

    monkeypatch.setattr(decode, "ASSETS", tmp_path / "no-drafters")
    code, _, err = cli(capsys, "demo", "--model", tiny[0], "--prompts", 1, "--max-new-tokens", 4,
                       "--out", tmp_path / "d")
    line = one_error_line(code, err)
    assert "smollm2-135m-eagle3" in line and "--draft ngram" in line
    with open_registry() as reg:
        assert reg.count() == 0


@pytest.mark.parametrize("args,needle", [
    (("--draft", "ngram", "--topk", "2"), "--topk 1"),
    (("--draft", "no-such-drafter"), "not found"),
    (("--prompts", "0"), "--prompts"),
    (("--max-new-tokens", "1"), "--max-new-tokens"),
])
def test_demo_bad_input(tiny, tmp_path, capsys, args, needle):
    code, _, err = cli(capsys, "demo", "--model", tiny[0], "--out", tmp_path / "d", *args)
    assert needle in one_error_line(code, err)


def test_demo_out_that_is_a_file_fails_before_decoding(tiny, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = cli(capsys, "demo", "--model", tiny[0], "--draft", "ngram", "--out", tmp_path / "f" / "sub")
    line = one_error_line(code, err)
    assert "--output" in line and "is not a directory" in line
    with open_registry() as reg:
        assert reg.count() == 0


def test_pick_prompts_spreads_over_mt_bench_categories(tmp_path, monkeypatch):
    from specscope.demo import pick_prompts

    rows = [(1, "writing"), (2, "writing"), (3, "translation"), (4, "roleplay"), (5, "roleplay"), (6, "math"),
            (7, "coding"), (8, "qa")]
    f = tmp_path / "spec_bench_question.jsonl"
    f.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [f"q{q} first", f"q{q} second"]})
                         + "\n" for q, c in rows))
    monkeypatch.setenv("SPECSCOPE_SPEC_BENCH", str(f))
    prompts, name = pick_prompts(6)
    # one MT-bench category after another (in MT-bench order), first turns only, other Spec-Bench tasks left out
    assert [p["question_id"] for p in prompts] == [1, 4, 6, 7, 2, 5]
    assert [p["prompt"] for p in prompts][:2] == ["q1 first", "q4 first"]
    assert name == "spec-bench mt_bench first turns (6)"
    f.write_text(json.dumps({"question_id": 3, "category": "translation", "turns": ["x"]}) + "\n")
    with pytest.raises(SpecscopeError, match="no MT-bench questions"):
        pick_prompts(2)
    f.write_text("{broken\n")
    with pytest.raises(SpecscopeError, match=":1 is not valid JSON"):
        pick_prompts(2)


def test_pick_prompts_falls_back_without_the_spec_bench_file(tmp_path, monkeypatch):
    from specscope.demo import FALLBACK_PROMPTS, pick_prompts

    monkeypatch.setenv("SPECSCOPE_SPEC_BENCH", str(tmp_path / "missing.jsonl"))
    prompts, name = pick_prompts(3)
    assert "built-in" in name and [p["prompt"] for p in prompts] == list(FALLBACK_PROMPTS[:3])


def test_demo_help_names_the_drafter_it_uses(capsys):
    """--draft's help states the default demo_drafter() really is (the hybrid, not EAGLE-3 alone)."""
    from specscope.demo import demo_drafter

    code, out, _ = cli(capsys, "demo", "--help")
    assert code == 0 and f"by default {demo_drafter()} " in " ".join(out.split())
