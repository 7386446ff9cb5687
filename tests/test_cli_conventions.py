"""One meaning per flag across commands, the engines' spellings accepted, old spellings still parsing but hidden,
help on every --json, and the packaged prompt sets the tools default to."""

import hashlib
import re

import click
import pytest

from specscope.cli import cli as root
from cli_util import cli


def commands():
    ctx = click.Context(root)

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for n in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, n), path + [n])
        else:
            yield " ".join(path), cmd

    return dict(walk(root, []))


def parse(name, *args):
    """The parameters `specscope NAME ARGS` would run with (nothing is run)."""
    cmd = commands()[name]
    return cmd.make_context(name, [str(a) for a in args]).params


def visible_opts(cmd):
    from specscope.cli.common import AliasOption

    out = {}
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            hidden = p.hidden_aliases if isinstance(p, AliasOption) else set()
            for o in p.opts + p.secondary_opts:
                if o not in hidden:
                    out[o] = p
    return out


def test_every_json_option_has_help_and_means_print_json():
    for name, cmd in commands().items():
        for p in cmd.params:
            if isinstance(p, click.Option) and "--json" in p.opts and not p.hidden:
                assert p.help and p.name == "as_json" and p.is_flag, name


def test_one_meaning_per_visible_flag():
    meaning = {"--steps": "steps", "--topk": "topk", "--draft-tokens": "draft_tokens", "--prompts": None,
               "--num-prompts": "num_prompts", "--max-new-tokens": None, "-o": "output", "--output": "output",
               "--model": None, "--dataset": None, "--max-steps": None}
    for name, cmd in commands().items():
        opts = visible_opts(cmd)
        assert "--out" not in opts and "--plot" not in opts and "--plot-dir" not in opts, name
        assert "--prompts" not in opts and "--target" not in opts, name
        assert "--max-tokens" not in opts and "--engine" not in opts and "--url" not in opts, name
        for flag, dest in meaning.items():
            if flag in opts and dest:
                assert opts[flag].name == dest, (name, flag, opts[flag].name)
    # where a command writes, it is -o/--output
    for name in ("report", "demo", "export", "train", "verify-curve", "tune", "runs export"):
        assert "-o" in visible_opts(commands()[name]) and "--output" in visible_opts(commands()[name]), name


@pytest.mark.parametrize("name", ["generate", "serve", "demo", "tune"])
def test_sglang_and_vllm_spellings_are_aliases(name):
    extra = ["--prompt", "x"] if name == "generate" else []
    p = parse(name, *extra, "--speculative-num-steps", 3, "--speculative-eagle-topk", 2,
              "--speculative-num-draft-tokens", 6, "--speculative-draft-model-path", "ngram")
    assert (p["steps"], p["topk"], p["draft_tokens"], p["draft"]) == (3, 2, 6, "ngram")
    assert parse(name, *extra, "--num-speculative-tokens", 4)["steps"] == 4


@pytest.mark.parametrize("spelling,short", [("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"),
                                            ("half", "fp16"), ("bf16", "bf16"), ("BFloat16", "bf16")])
def test_dtype_takes_hf_vllm_spellings(spelling, short):
    assert parse("generate", "--prompt", "x", "--dtype", spelling)["dtype"] == short
    assert parse("serve", "--dtype", spelling)["dtype"] == short
    assert parse("export", ".", "--format", "sglang", "-o", "o", "--dtype", spelling)["dtype"] == short


def test_old_spellings_still_parse_but_are_hidden(tmp_path, capsys):
    assert parse("demo", "--prompts", 2, "--out", "x")["num_prompts"] == 2
    assert parse("demo", "--prompts", 2, "--out", "x")["output"] == "x"
    assert parse("train", "--workdir", "w", "--steps", 7, "--target", "m", "--out", "o")["total_steps"] == 7
    assert parse("train", "--workdir", "w", "--max-train-steps", 9, "--model", "m")["target_name"] == "m"
    assert parse("tune", "--prompts", "p.jsonl", "--plot-dir", "d")["prompts_file"] == "p.jsonl"
    assert parse("verify-curve", "--plot", "c.png")["output"] == "c.png"
    assert parse("ingest", "--engine", "vllm", "f.log")["engine"] == "vllm"
    p = parse("export", ".", "--format", "speculators", "--out", "o", "--target", "t", "--speculative-tokens", 4)
    assert (p["output"], p["target_name"], p["steps"]) == ("o", "t", 4)
    assert parse("export", ".", "--format", "speculators", "-o", "o", "--num-speculative-tokens", 5)["steps"] == 5
    p = parse("check-drafter", "d", "--target", "t", "--prompts", 2)
    assert (p["target_name"], p["num_prompts"]) == ("t", 2)
    p = parse("train", "--workdir", "w", "--select-prompts", 5, "--out", "o")
    assert (p["select_prompts"], p["output"]) == (5, "o")
    assert parse("ingest", "--format", "vllm", "f.log")["engine"] == "vllm"
    p = parse("bench-serve", "--url", "http://h:1", "--concurrency", "1,4", "--max-tokens", 9)
    assert (p["url"], p["concurrency"], p["max_tokens"]) == ("http://h:1", "1,4", 9)
    for name, old in (("demo", "--prompts"), ("demo", "--out "), ("train", "--target"), ("tune", "--plot-dir"),
                      ("export", "--target"), ("export", "--out "), ("export", "--speculative-tokens"),
                      ("check-drafter", "--target"), ("check-drafter", "--prompts"), ("train", "--select-prompts"),
                      ("ingest", "--engine"), ("bench-serve", "--url "), ("bench-serve", "--max-tokens")):
        code, out, _ = cli(capsys, *name.split(), "--help")
        # the whole flag: train's --target-model-path (SpecForge's spelling) is shown, the old --target is not
        assert code == 0 and not re.search(re.escape(old.rstrip()) + r"(?![\w-])", out), (name, old)


def test_runs_export_format_option_and_old_flags(tmp_path, capsys):
    from specscope.registry import make_record, store_record

    rid = store_record(make_record("bench", "r", config={"model": None}, results={"tok_per_s": 1.0}, env={}))
    code, out, err = cli(capsys, "runs", "export", rid, "--format", "csv")
    assert code == 0 and out.startswith("id,"), err
    code, out, _ = cli(capsys, "runs", "export", rid, "--csv")
    assert out.startswith("id,")
    code, out, _ = cli(capsys, "runs", "export", rid)
    assert out.lstrip().startswith("[")
    code, _, err = cli(capsys, "runs", "export", rid, "-o", tmp_path / "x.csv")
    assert code == 0 and (tmp_path / "x.csv").read_text().startswith("id,")


def test_spec_bench_ships_in_the_package_unchanged(monkeypatch):
    from specscope.prompts import (PACKAGED, SPEC_BENCH_FILE, SPEC_BENCH_SHA256, load_prompts, mt_bench_prompts,
                                   spec_bench_path)

    monkeypatch.delenv("SPECSCOPE_SPEC_BENCH", raising=False)
    assert spec_bench_path() == PACKAGED / SPEC_BENCH_FILE
    assert hashlib.sha256(spec_bench_path().read_bytes()).hexdigest() == SPEC_BENCH_SHA256
    readme = (PACKAGED / "README.md").read_text()
    assert "fd2c1cd7d2201ef71db4c5f4e455008f017967bf" in readme and "Apache-2.0" in readme
    assert SPEC_BENCH_SHA256 in readme
    assert len(load_prompts("spec_bench")["prompts"]) == 480
    rows, name = mt_bench_prompts(8)
    assert [r["category"] for r in rows] == ["writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                             "stem", "humanities"]
    assert load_prompts("mt_bench", num_prompts=3)["name"] == "mt_bench"


def test_missing_packaged_file_falls_back_loudly(tmp_path, monkeypatch, capsys):
    import specscope.prompts as P
    from specscope.demo import FALLBACK_PROMPTS, pick_prompts

    monkeypatch.delenv("SPECSCOPE_SPEC_BENCH", raising=False)
    monkeypatch.setattr(P, "PACKAGED", tmp_path / "gone")
    monkeypatch.chdir(tmp_path)          # no checkout around: nothing to fall back to but the built-in prompts
    monkeypatch.setattr(P, "__file__", str(tmp_path / "x" / "prompts.py"))
    prompts, name = pick_prompts(2)
    err = capsys.readouterr().err
    assert "built-in" in name and [p["prompt"] for p in prompts] == list(FALLBACK_PROMPTS[:2])
    assert err.startswith("warning: ") and "packaged Spec-Bench file" in err and "not MT-bench" in err
    # bench-serve's default dataset: one clear error naming the fix
    code, _, err = cli(capsys, "bench-serve", "--base-url", "http://127.0.0.1:9", "--max-concurrency", 1)
    assert code == 2 and "reinstall specscope" in err and "--dataset FILE" in err
