"""Hugging Face ids wherever a model or drafter is named, resolved through huggingface_hub from a real cache laid
out as it writes one (offline: HF_HUB_OFFLINE=1, HF_HUB_CACHE in tmp, set for every test by conftest), and shipped
drafter names in every command that takes a drafter."""

import json
import os
import subprocess
import sys

import pytest
from cli_util import cli, one_error_line
from drafter_util import random_drafter
from hub_util import dir_files, write_hub_repo

from specscope.errors import SpecscopeError
from specscope.models.hub import parse_hub_id, resolve_drafter, resolve_model

# SmolLM2-135M-Instruct's config.json (the fields a drafter is checked against)
SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
                  "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint with tokenizer, and a random EAGLE-3 drafter for it (both local directories)."""
    from tiny import make_hf_model, make_tiny_tokenizer

    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter

    root = tmp_path_factory.mktemp("hub-src")
    make_hf_model(root / "model", "llama", layers=8, hidden=64, vocab=101)
    make_tiny_tokenizer(root / "model", 101)
    save_drafter(random_drafter(load_model(root / "model", "fp32", "cpu")), root / "drafter")
    return root


@pytest.fixture
def hub(tiny):
    cache = os.environ["HF_HUB_CACHE"]
    write_hub_repo(cache, "tiny-org/tiny-llama", dir_files(tiny / "model"))
    write_hub_repo(cache, "tiny-org/tiny-llama-config", {"config.json": (tiny / "model" / "config.json")})
    write_hub_repo(cache, "tiny-org/tiny-eagle3", dir_files(tiny / "drafter"))
    write_hub_repo(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", {"config.json": json.dumps(SMOLLM2_CONFIG).encode()})
    return cache


def test_layout_is_the_one_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub)
    assert not info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {"tiny-org/tiny-llama", "tiny-org/tiny-llama-config", "tiny-org/tiny-eagle3",
                          "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert {"main"} == set(next(iter(repos["tiny-org/tiny-llama"].revisions)).refs)


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_id in ("smollm2-135m", "/abs/path", "./rel/x", "a/b/c", "org/config.json", "org/../x"):
        assert parse_hub_id(not_id) is None, not_id


def test_model_drafter_and_config_only_target_by_id(hub, tiny, capsys, tmp_path):
    snap = resolve_model("tiny-org/tiny-llama")
    assert snap.parent.name == "snapshots" and (snap / "model.safetensors").is_symlink()
    assert resolve_drafter("tiny-org/tiny-eagle3").parent == \
        resolve_model("tiny-org/tiny-eagle3", files="drafter").parent
    # a model and its drafter by id, decoded for real
    code, out, err = cli(capsys, "generate", "--model", "tiny-org/tiny-llama", "--draft", "tiny-org/tiny-eagle3",
                         "--prompt", "the quick brown fox", "--max-new-tokens", "6", "--json", "--no-record",
                         "--threads", "1")
    assert code == 0, err
    assert json.loads(out)["num_tokens"] >= 1
    # the drafter exported by id, checked against a target whose cache holds config.json alone
    code, out, err = cli(capsys, "export", "tiny-org/tiny-eagle3", "--format", "speculators", "-o", tmp_path / "v",
                         "--model", "tiny-org/tiny-llama-config", "--json")
    assert code == 0, err
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == {"name_or_path": "tiny-org/tiny-llama-config",
                                                     "architectures": ["LlamaForCausalLM"]}
    code, out, err = cli(capsys, "check-drafter", "tiny-org/tiny-eagle3", "--model", "tiny-org/tiny-llama-config",
                         "--no-run")
    assert code == 0, out + err
    assert "tiny-org/tiny-llama-config" in out


def test_revision_after_at(hub, tiny):
    cfg = json.loads((tiny / "model" / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    snap = write_hub_repo(hub, "tiny-org/tiny-llama-config", {"config.json": json.dumps(cfg).encode()}, revision="v2")
    assert resolve_model("tiny-org/tiny-llama-config@v2", files="config") == snap
    assert resolve_model("tiny-org/tiny-llama-config", files="config") != snap
    from specscope.speculative.formats import resolve_target

    assert resolve_target("tiny-org/tiny-llama-config@v2").num_hidden_layers == 4
    with pytest.raises(SpecscopeError, match="is not in .* and HF_HUB_OFFLINE is set"):
        resolve_model("tiny-org/tiny-llama-config@v3", files="config")


def test_shipped_drafter_name_in_export_and_check(hub, capsys, tmp_path):
    # the command, with the target by its hub id (config.json only in the cache)
    code, out, err = cli(capsys, "export", "smollm2-135m-eagle3", "--format", "speculators", "-o", tmp_path / "v",
                         "--model", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert code == 0, err
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    code, out, err = cli(capsys, "check-drafter", "smollm2-135m-eagle3", "--model",
                         "HuggingFaceTB/SmolLM2-135M-Instruct", "--no-run", "--json")
    assert code == 0, out + err
    assert json.loads(out)["checks"]


def test_id_not_cached_offline_is_one_error_line(hub, capsys, tmp_path):
    for args in (["generate", "--model", "nobody/missing", "--prompt", "hi"],
                 ["generate", "--model", "tiny-org/tiny-llama", "--draft", "nobody/missing", "--prompt", "hi"],
                 ["export", "nobody/missing", "--format", "sglang", "-o", tmp_path / "a"],
                 ["export", "smollm2-135m-eagle3", "--format", "speculators", "-o", tmp_path / "b", "--model",
                  "nobody/missing"],
                 ["check-drafter", "smollm2-135m-eagle3", "--model", "nobody/missing", "--no-run"]):
        line = one_error_line(*cli(capsys, *args)[::2])
        assert "'nobody/missing' is not in" in line and "HF_HUB_OFFLINE is set" in line, line
    # a model id whose cache holds config.json only cannot be run: the missing weights are named
    line = one_error_line(*cli(capsys, "generate", "--model", "tiny-org/tiny-llama-config", "--prompt", "hi")[::2])
    assert "model.safetensors" in line


def test_id_neither_cached_nor_reachable_is_one_error_line(tmp_path):
    # online, but the Hub endpoint refuses connections (a closed local port): one line, no traceback
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2")
    p = subprocess.run([sys.executable, "-m", "specscope", "export", "smollm2-135m-eagle3", "--format",
                        "speculators", "-o", str(tmp_path / "o"), "--model", "nobody/missing"],
                       capture_output=True, text=True, env=env, timeout=300)
    line = one_error_line(p.returncode, p.stderr)
    assert "'nobody/missing' is not in" in line and "cannot be reached" in line, line


def test_serve_engine_by_ids(hub):
    # `serve --model ID --draft ID`: the engine loads both from the cache and serves the model under its id
    from specscope.server.worker import ServedModel, ServeConfig
    from specscope.speculative.decode import DraftOptions

    eng = ServedModel(ServeConfig(model="tiny-org/tiny-llama", device="cpu", dtype="fp32",
                                  drafting=DraftOptions("tiny-org/tiny-eagle3", budget="fixed")))
    assert eng.name == "tiny-org/tiny-llama" and eng.drafter is not None
