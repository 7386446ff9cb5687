"""Published drafters to the engines: every upstream layout (shrunk, with its real quirks) loads and converts with
`export --model`, round trips are byte-stable, incompatibilities come all at once, loading stays within 1.5x the
file size, and `check-drafter` names each fault of a broken pair or engine launch."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_util import cli, one_error_line
from drafter_util import (SMALL, published, random_drafter, raw_tensors, ref_cfg, reference_step, shrink,
                          shrink_text, write_raw)
from safetensors.torch import load_file, save_file

from specscope.errors import SpecscopeError
from specscope.check_drafter import check_drafter
from specscope.engines import parse_engine_args
from specscope.speculative.formats import load_drafter, resolve_target, save_drafter

LAYERS = 8


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    """A tiny 8-layer Llama target directory with a real tokenizer and chat template."""
    from tiny import make_hf_model, make_tiny_tokenizer

    d = tmp_path_factory.mktemp("tgt") / "tiny-llama"
    make_hf_model(d, "llama", layers=LAYERS, hidden=64, vocab=101)
    make_tiny_tokenizer(d, 101)
    return d


@pytest.fixture(scope="module")
def target(tdir):
    from specscope.models import load_model

    return load_model(tdir, "fp32", "cpu")


def _published_dir(tmp, name, prefix, **values):
    """A published config, shrunk by editing its text (CRLF, spacing kept), with random tensors of its names."""
    text = shrink_text(name, **values)
    raw = json.loads(text)
    return write_raw(tmp, text, raw_tensors(raw, prefix)), raw


UPSTREAM = [("eagle3_llama31_8b_config.json", "midlayer.", {}),           # no aux ids: the target's default
            ("specforge_llama3_8b_eagle3.json", "midlayer.", {}),
            ("specforge_qwen3_eagle3.json", "midlayer.", {"rope_theta": 10000}),
            ("speculators_eagle3_config.json", "layers.0.", {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 7]})]


@pytest.mark.parametrize("name,prefix,values", UPSTREAM)
def test_upstream_layouts_load_with_their_quirks(tmp_path, target, name, prefix, values):
    path, raw = _published_dir(tmp_path / "d", name, prefix, **values)
    text = (path / "config.json").read_bytes()
    if name == "eagle3_llama31_8b_config.json":
        assert b"\r\n" in text and not text.endswith(b"\n")          # CRLF, no final newline, as published
    if name == "specforge_qwen3_eagle3.json":
        assert b'"num_key_value_heads":2 ,' in text                  # the odd spacing survives the shrink
    d = load_drafter(path, target)
    assert list(d.aux_layers) == [2, 4, 5] and d.config.vocab_size == SMALL["vocab_size"]
    t = raw_tensors(raw, prefix)
    g = torch.Generator().manual_seed(3)
    e, h, pos = torch.randn(1, 5, 64, generator=g), torch.randn(1, 5, 64, generator=g), torch.arange(5)[None]
    logits, nh = d(e, h, pos)
    ref_logits, ref_h, _ = reference_step(t, prefix, ref_cfg(d), e[0], h[0], pos[0])
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nh[0], ref_h, rtol=1e-4, atol=1e-4)
    if raw.get("norm_before_fc"):     # one RMSNorm over the 3·Ht concatenation, then fc
        aux = [torch.randn(1, 5, 64, generator=g) for _ in range(3)]
        x = torch.cat(aux, -1)
        want = (t["input_norm.weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.config.rms_norm_eps)) \
            @ t["fc.weight"].T
        torch.testing.assert_close(d.fuse(aux), want, rtol=1e-5, atol=1e-5)
        assert d.config.meta.verifier_logits_layer == 7


def test_sliding_window_masks_old_keys(tmp_path, target):
    path, raw = _published_dir(tmp_path / "d", "speculators_eagle3_config.json", "layers.0.",
                               eagle_aux_hidden_state_layer_ids=[2, 4, 5], sliding_window=3)
    d = load_drafter(path, target)
    assert d.config.sliding_window == 3
    g = torch.Generator().manual_seed(4)
    e, h, pos = torch.randn(1, 7, 64, generator=g), torch.randn(1, 7, 64, generator=g), torch.arange(7)[None]
    t = raw_tensors(raw, "layers.0.")
    ref, _, _ = reference_step(t, "layers.0.", ref_cfg(d), e[0], h[0], pos[0])
    torch.testing.assert_close(d(e, h, pos)[0][0], ref, rtol=1e-4, atol=1e-4)
    full, _, _ = reference_step(t, "layers.0.", {**ref_cfg(d), "window": None}, e[0], h[0], pos[0])
    assert not torch.allclose(ref[-1], full[-1], atol=1e-3)           # the window really changed something
    cache = d.new_cache(16)                                            # and the cached path agrees
    lg, _ = d(e, h, pos, cache, pos)
    torch.testing.assert_close(lg[0], ref, rtol=1e-4, atol=1e-4)
    lg1, _ = d(e[:, -1:], h[:, -1:], pos[:, -1:], cache, pos[:, -1:])  # one-token decode step past the window
    torch.testing.assert_close(lg1[0, 0], ref[-1], rtol=1e-4, atol=1e-4)


def test_every_problem_in_one_error(tmp_path, target):
    raw = shrink(published("speculators_eagle3_config.json"))
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3, 4, 5]
    raw["fc_norm"] = True
    raw["transformer_layer_config"].update(num_hidden_layers=2, hidden_act="gelu", mlp_bias=True,
                                           rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(SpecscopeError) as e:
        load_drafter(write_raw(tmp_path / "d", raw, raw_tensors(raw, "layers.0.")), target)
    msg = str(e.value)
    for part in ("6 problems", "names 5 layers", "num_hidden_layers=2", "gelu", "norm_before_fc and fc_norm",
                 "mlp_bias", "yarn"):
        assert part in msg, msg
    assert "\n" not in msg


def test_sharded_checkpoint_loads(tmp_path, target):
    path, raw = _published_dir(tmp_path / "one", "specforge_llama3_8b_eagle3.json", "midlayer.")
    t = load_file(str(path / "model.safetensors"))
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_bytes((path / "config.json").read_bytes())
    names = sorted(t)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    wm = {}
    for i, part in enumerate(parts, 1):
        f = f"model-0000{i}-of-00002.safetensors"
        save_file({k: t[k] for k in part}, str(shard / f))
        wm.update({k: f for k in part})
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    a, b = load_drafter(path, target), load_drafter(shard, target)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    os.remove(shard / "model-00002-of-00002.safetensors")
    with pytest.raises(SpecscopeError, match="model-00002-of-00002.safetensors"):
        load_drafter(shard, target)


def test_loads_in_stored_dtype(tmp_path, target):
    d = random_drafter(target)
    save_drafter(d, tmp_path / "d", dtype=torch.bfloat16)
    back = load_drafter(tmp_path / "d")
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert back.rope.dtype == torch.float32 and back.rope.shape[1] <= 4096    # RoPE table: float32, built small
    ref = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert torch.equal(back.fc.weight, ref["fc.weight"]) and torch.equal(back.d2t, ref["d2t"])


def test_rope_table_grows_on_demand(tmp_path, target):
    path, _ = _published_dir(tmp_path / "d", "speculators_eagle3_config.json", "layers.0.",
                             eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    d = load_drafter(path, target)
    assert d.config.max_position_embeddings == 262144 and d.rope.shape[1] == 4096
    far = torch.tensor([[5000, 5001]])
    d(torch.randn(1, 2, 64), torch.randn(1, 2, 64), far)
    assert 5002 <= d.rope.shape[1] <= 8192
    from specscope.models.rope import rope_table
    full = rope_table(d.config.head_dim, 5002, d.config.rope_theta, d.config.rope_scaling)
    torch.testing.assert_close(d.rope[:, 5001], full[:, 5001])


PEAK_SCRIPT = r"""
import sys, torch
torch.set_num_threads(1)
from specscope.speculative.formats import load_drafter
def status(key):   # VmHWM, not ru_maxrss: that one carries the parent's high-water mark across fork/exec
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) * 1024
load_drafter(sys.argv[2])      # one-time costs (lazy imports, meta-device registrations) paid on a tiny drafter
base = status("VmRSS")
d = load_drafter(sys.argv[1])
print(base, status("VmHWM"), str(d.dtype))
"""


def peak_load_bytes(path: Path, warm: Path) -> tuple[int, str]:
    """Peak RSS that loading `path` adds in a fresh process (over the RSS after imports and a warm-up load of the
    tiny drafter `warm`), and the loaded dtype."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(warm)], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    return int(out[1]) - int(out[0]), out[2]


def _tiny_drafter_dir(tmp_path) -> Path:
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    return write_raw(tmp_path / "warm", raw, raw_tensors(raw, "midlayer."))


def test_peak_memory_small(tmp_path, target):
    # a mid-size bf16 drafter: loading adds at most 1.5x its file size (measured in a subprocess)
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw.update(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
               vocab_size=32000, draft_vocab_size=8000, head_dim=64,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    t = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in raw_tensors(raw, "midlayer.").items()}
    path = write_raw(tmp_path / "d", raw, t)
    size = (path / "model.safetensors").stat().st_size
    added, dtype = peak_load_bytes(path, _tiny_drafter_dir(tmp_path))
    assert dtype == "torch.bfloat16"
    assert added <= 1.5 * size, (added / 1e6, size / 1e6)


# ------------------------------------------------------------------ export

def _target_config(tmp_path, arch="Qwen3ForCausalLM", **over):
    cfg = {"architectures": [arch], "model_type": "qwen3", "hidden_size": 64, "vocab_size": 101,
           "num_hidden_layers": LAYERS, "intermediate_size": 96, "num_attention_heads": 4, "rope_theta": 10000,
           "torch_dtype": "bfloat16", **over}
    f = tmp_path / "qwen-tiny" / "config.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(cfg))
    return f


def test_export_published_to_speculators_with_target_config(tmp_path, capsys):
    src, _ = _published_dir(tmp_path / "src", "specforge_qwen3_eagle3.json", "midlayer.")
    cfgf = _target_config(tmp_path)
    code, out, err = cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "v", "--model", cfgf,
                         "--verifier-name", "Qwen/Qwen3-8B", "--json")
    assert code == 0, err
    info = json.loads(out)
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-8B",
                                                     "architectures": ["Qwen3ForCausalLM"]}   # from the target
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]            # the target's default, as indices
    assert info["aux_layer_ids"]["hidden_state_index"] == [2, 4, 5]
    assert info["aux_layer_ids"]["sglang_output_of_layer"] == [1, 3, 4]
    assert raw["transformer_layer_config"]["rms_norm_eps"] == 1e-06
    assert raw["torch_dtype"] == "float32"
    # no --model: the verifier recorded in the directory is kept on re-export, version and tokens too
    code, _, err = cli(capsys, "export", tmp_path / "v", "--format", "speculators", "-o", tmp_path / "v2")
    assert code == 0, err
    raw2 = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert raw2["speculators_config"] == raw["speculators_config"]


def test_export_safeailab_dir_needs_only_a_target_config(tmp_path, capsys):
    # the most common conversion: a SafeAILab drafter (no aux ids, plain LlamaForCausalLM) -> vLLM
    src, _ = _published_dir(tmp_path / "src", "eagle3_llama31_8b_config.json", "midlayer.")
    cfgf = _target_config(tmp_path, arch="LlamaForCausalLM", model_type="llama")
    code, out, err = cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "v", "--model", cfgf,
                         "--verifier-name", "meta-llama/Llama-3.1-8B-Instruct")
    assert code == 0, err
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert "hidden-state indices [2, 4, 5] = SGLang output-of-layer ids [1, 3, 4]" in out
    # a hub id is looked up in the Hugging Face cache (offline in tests, and not cached): one line naming it
    line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "w",
                               "--model", "meta-llama/Llama-3.1-8B-Instruct")[::2])
    assert "'meta-llama/Llama-3.1-8B-Instruct' is not in" in line and "HF_HUB_OFFLINE" in line


def test_export_keeps_published_speculators_metadata(tmp_path, capsys, tdir):
    src, _ = _published_dir(tmp_path / "src", "speculators_eagle3_config.json", "layers.0.",
                            eagle_aux_hidden_state_layer_ids=[2, 4, 5, 7])
    code, out, err = cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "v",
                         "--model", tdir, "--steps", "5", "--json")
    assert code == 0, err
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["speculators_version"] == "0.8.0.dev0"                       # the source's, not a constant
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 7]          # the 4th (verifier logits) survives
    assert raw["norm_before_fc"] and raw["transformer_layer_config"]["sliding_window"] == 2048
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(tdir.resolve())
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    info = json.loads(out)
    assert info["aux_layer_ids"]["verifier_logits_layer"] == 7
    assert info["notes"] == [f"verifier '/model/from_s3' recorded in the source is replaced by '{tdir.resolve()}'"]
    # SGLang cannot run it as published: every ignored feature named in one error, nothing written
    code, _, err = cli(capsys, "export", src, "--format", "sglang", "-o", tmp_path / "s", "--model", tdir)
    line = one_error_line(code, err)
    for flag in ("norm_before_residual", "norm_output", "norm_before_fc", "sliding_window=2048"):
        assert flag in line
    assert not (tmp_path / "s").exists()


def test_export_plain_speculators_to_sglang_drops_the_4th_aux_id(tmp_path, capsys, tdir):
    raw = shrink(published("speculators_eagle3_config.json"))
    raw.update(eagle_aux_hidden_state_layer_ids=[2, 4, 5, 7], norm_before_fc=False, norm_before_residual=False,
               norm_output=False)
    raw["transformer_layer_config"].update(use_sliding_window=False, layer_types=["full_attention"])
    src = write_raw(tmp_path / "src", raw, raw_tensors(raw, "layers.0."))
    code, out, err = cli(capsys, "export", src, "--format", "sglang", "-o", tmp_path / "s", "--model", tdir)
    assert code == 0, err
    assert "note: the 4th aux id (7" in out
    back = json.loads((tmp_path / "s" / "config.json").read_text())
    assert back["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_round_trip_sglang_speculators_sglang_byte_stable(tmp_path, capsys):
    src, _ = _published_dir(tmp_path / "src", "specforge_llama3_8b_eagle3.json", "midlayer.",
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    t = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(
        str(src / "model.safetensors")).items()}
    save_file(t, str(src / "model.safetensors"))
    cfgf = _target_config(tmp_path, arch="LlamaForCausalLM", model_type="llama")
    assert cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "v", "--model", cfgf)[0] == 0
    assert cli(capsys, "export", tmp_path / "v", "--format", "sglang", "-o", tmp_path / "s")[0] == 0
    back = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert set(back) == set(t)
    for k in t:
        assert back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]), k
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert raw["rms_norm_eps"] == 1e-05 and raw["torch_dtype"] == "bfloat16"


def test_export_eps_written_as_decimal(tmp_path, target):
    d = random_drafter(target)
    d.config.rms_norm_eps = 9.999999747378752e-06                           # what a GGUF-converted target carries
    save_drafter(d, tmp_path / "d")
    text = (tmp_path / "d" / "config.json").read_text()
    assert '"rms_norm_eps": 1e-05' in text and "9.99999974" not in text


def test_export_errors(tmp_path, capsys, tdir):
    src, _ = _published_dir(tmp_path / "src", "specforge_llama3_8b_eagle3.json", "midlayer.",
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    # a speculators drafter must name its verifier: vLLM serves it as the target
    line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "a")[::2])
    assert "--model" in line
    # a target that does not fit: every mismatch named
    bad = _target_config(tmp_path, hidden_size=48, vocab_size=120, num_hidden_layers=3)
    line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "b",
                               "--model", bad)[::2])
    assert "hidden size is 48" in line and "has 120" in line and "3 layers" in line
    line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "c",
                               "--model", tmp_path / "nowhere")[::2])
    assert "nowhere" in line


def test_shipped_drafter_exports_for_its_own_target_without_model(tmp_path, capsys, monkeypatch):
    # the shipped drafter declares the embedded model it was trained for: no --model, no download, no pull
    from specscope.models.hub import KNOWN_MODELS

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "empty-cache"))
    code, out, err = cli(capsys, "export", "smollm2-135m-eagle3", "--format", "speculators", "-o", tmp_path / "v",
                         "--json")
    assert code == 0, err
    info = json.loads(out)
    want = {"name_or_path": KNOWN_MODELS["smollm2-135m"].hf_repo, "architectures": ["LlamaForCausalLM"]}
    assert info["verifier"] == want and any("no --model" in n for n in info["notes"])
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == want
    assert not (tmp_path / "empty-cache" / "models").exists()
    # a local copy's name, as with --model; an SGLang export is checked against the same target
    code, out, err = cli(capsys, "export", "smollm2-135m-eagle3", "--format", "speculators", "-o", tmp_path / "w",
                         "--verifier-name", "my-org/smollm2-copy", "--json")
    assert code == 0 and json.loads(out)["verifier"]["name_or_path"] == "my-org/smollm2-copy", err
    code, out, err = cli(capsys, "export", "smollm2-135m-eagle3", "--format", "sglang", "-o", tmp_path / "s")
    assert code == 0 and "checked against HuggingFaceTB/SmolLM2-135M-Instruct" in out, err


def test_declared_target_is_checked_and_must_be_well_formed(tmp_path, capsys):
    from specscope.speculative.formats import TARGET_FILE

    src = _tiny_drafter_dir(tmp_path)
    shipped = Path(__file__).resolve().parents[1] / "src/specscope/assets/drafters/smollm2-135m-eagle3"
    # a drafter that declares a target it does not fit is refused, every mismatch named (it is checked, not trusted)
    (src / TARGET_FILE).write_bytes((shipped / TARGET_FILE).read_bytes())
    line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "a")[::2])
    assert "does not fit the target HuggingFaceTB/SmolLM2-135M-Instruct" in line and "hidden size is 576" in line
    for bad in ('{"config": {}}', '{"name_or_path": "org/x"}', "[1]", "{not json"):
        (src / TARGET_FILE).write_text(bad)
        line = one_error_line(*cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "b")[::2])
        assert TARGET_FILE in line, line
    # --model still names the target whatever the directory declares
    cfgf = _target_config(tmp_path, arch="LlamaForCausalLM", model_type="llama")
    code, out, err = cli(capsys, "export", src, "--format", "speculators", "-o", tmp_path / "c", "--model", cfgf,
                         "--json")
    assert code == 0 and not any("no --model" in n for n in json.loads(out)["notes"]), err


def test_target_by_known_name(tmp_path, monkeypatch):
    # a pulled known model resolves by name and records the id engines know it by (config only, no weights)
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    d = tmp_path / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
                                               "vocab_size": 49152, "num_hidden_layers": 30}))
    (d / "specscope_manifest.json").write_text(json.dumps({"files": {"config.json": {
        "size": (d / "config.json").stat().st_size, "sha256": ""}}}))
    f = resolve_target("smollm2-135m")
    assert f.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct" and f.num_hidden_layers == 30


# ------------------------------------------------------------------ check-drafter

def _facts(tdir):
    return resolve_target(str(tdir))


def _good_drafter(tmp_path, target):
    return save_drafter(random_drafter(target), tmp_path / "good")


def test_check_good_pair_measures_acceptance(tmp_path, target, tdir):
    rep = check_drafter(_good_drafter(tmp_path, target), _facts(tdir), prompts=["the quick brown fox",
                                                                              "what is the capital of france"],
                        max_new_tokens=12, steps=3).to_dict()
    assert rep["ok"], rep["faults"]
    acc = rep["acceptance"]
    assert len(acc["per_position_acceptance"]) == 3 and acc["teacher_forced_rows"] > 0
    pp = acc["per_position_acceptance"]
    assert all(0 <= b <= a <= 1 for a, b in zip(pp, pp[1:]))       # chain: a later position never beats an earlier
    assert 1 <= acc["teacher_forced_tau"] <= 4 and 1 <= acc["measured_tau"] <= 4
    assert 0 <= acc["coverage"] <= 1 and acc["output_tokens"] > 0
    names = {c["check"]: c["status"] for c in rep["checks"]}
    assert names["tokenizer"] == "ok" and names["aux layers"] == "ok" and names["token map"] == "ok"


def test_check_measures_a_perfect_drafter_exactly(tmp_path, tdir):
    # a target whose final norm is zero always answers token 0 (all logits tie, argmax takes the first); a drafter
    # whose state is a constant (fc, o_proj and down_proj zero, o_proj bias ones) always drafts draft id 0 = target
    # id 0 by a strict margin: every draft is accepted, so teacher forcing must predict τ = 1 + K and the real
    # chain run must measure exactly that, as must the replay of decoding (--predict)
    import shutil

    from specscope.models import load_model
    t = tmp_path / "always0"
    shutil.copytree(tdir, t)
    st = load_file(str(t / "model.safetensors"))
    st["model.norm.weight"] = torch.zeros_like(st["model.norm.weight"])
    save_file(st, str(t / "model.safetensors"), metadata={"format": "pt"})
    d = random_drafter(load_model(t, "fp32", "cpu"), attention_bias=True)
    ids = torch.cat([torch.tensor([0]), torch.nonzero(d.t2d).flatten()[1:]]).sort().values
    with torch.no_grad():
        for w in (d.fc.weight, d.midlayer.self_attn.o_proj.weight, d.midlayer.mlp.down_proj.weight, d.lm_head.weight):
            w.zero_()
        d.midlayer.self_attn.o_proj.bias.fill_(1.0)
        d.norm.weight.fill_(1.0)
        d.lm_head.weight[0] = 1.0
        d.d2t.copy_(ids - torch.arange(len(ids)))
        d.t2d.zero_()
        d.t2d[ids] = True
    K = 3
    rep = check_drafter(save_drafter(d, tmp_path / "perfect"), _facts(t), prompts=["the quick brown fox"],
                        max_new_tokens=13, steps=K, predict=True).to_dict()
    acc = rep["acceptance"]
    assert acc["per_position_acceptance"] == [1.0] * K and acc["coverage"] == 1.0
    assert acc["teacher_forced_tau"] == acc["measured_tau"] == 1 + K
    pred = {p["shape"]: p for p in rep["prediction"]["shapes"]}
    assert [pred[f"chain {k}"]["tau"] for k in range(1, K + 1)] == [1 + k for k in range(1, K + 1)]
    assert pred[f"chain {K}"]["per_position_acceptance"] == [1.0] * K


def _statuses(rep):
    return {c["check"]: (c["status"], c["detail"]) for c in rep.to_dict()["checks"]}


@pytest.mark.parametrize("ids,word", [([1, 3, 20], "out of range"), ([1, 3, 4], "off by one")])
def test_check_names_wrong_aux_ids(tmp_path, target, tdir, ids, word):
    raw = shrink(published("speculators_eagle3_config.json"))
    raw.update(eagle_aux_hidden_state_layer_ids=ids)
    path = write_raw(tmp_path / "d", raw, raw_tensors(raw, "layers.0."))
    st, detail = _statuses(check_drafter(path, _facts(tdir), run=False))["aux layers"]
    assert st == "fail" and word in detail and "[2, 4, 5]" in detail and "[1, 3, 4]" in detail


def test_check_names_wrong_vocab_and_rope(tmp_path, tdir):
    raw = shrink(published("specforge_qwen3_eagle3.json"))
    raw.update(vocab_size=120, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})    # theta 1e6 vs 1e4
    path = write_raw(tmp_path / "d", raw, raw_tensors(raw, "midlayer."))
    rep = check_drafter(path, _facts(tdir))
    s = _statuses(rep)
    assert s["vocab"][0] == "fail" and "120" in s["vocab"][1] and "101" in s["vocab"][1]
    assert s["rope"][0] == "warn" and "rope_theta 1e+06" in s["rope"][1] and "10000" in s["rope"][1]
    assert s["acceptance"][0] == "skip"                             # nothing measured on a broken pair
    assert any(f.startswith("vocab:") for f in rep.faults)


def test_check_names_engine_misconfigurations(tmp_path, target, tdir):
    good = _good_drafter(tmp_path, target)
    cmd = ("python -m sglang.launch_server --model-path tiny --speculative-algorithm EAGLE "
           f"--speculative-draft-model-path {good} --speculative-num-steps 3 --speculative-eagle-topk 2 "
           "--speculative-num-draft-tokens 16")
    s = _statuses(check_drafter(good, _facts(tdir), cmd, run=False))
    assert s["engine: algorithm"][0] == "fail" and "EAGLE3" in s["engine: algorithm"][1] \
        and "1.00" in s["engine: algorithm"][1]
    assert s["engine: draft tokens"][0] == "fail" and "(11 with the root)" in s["engine: draft tokens"][1]
    log = ("[2025-10-22 10:20:01] server_args=ServerArgs(model_path='tiny', tokenizer_path='tiny', "
           "speculative_algorithm='EAGLE3', speculative_draft_model_path='/d', speculative_num_steps=5, "
           "speculative_eagle_topk=1, speculative_num_draft_tokens=6, dtype='auto')")
    s = _statuses(check_drafter(good, _facts(tdir), log, run=False))
    assert s["engine: algorithm"][0] == "ok" and s["engine: draft tokens"][0] == "ok"
    spec = json.dumps({"method": "eagle", "model": str(good), "num_speculative_tokens": 3})
    vllm = f"vllm serve tiny --speculative-config '{spec}'"
    s = _statuses(check_drafter(good, _facts(tdir), vllm, run=False))
    assert s["engine: method"][0] == "fail" and "eagle3" in s["engine: method"][1]


def test_check_warns_vllm_reads_sglang_layer_ids_one_early(tmp_path, tdir):
    """vLLM 0.32 takes eagle_config's output-of-layer ids as hidden-state indices (make test-engines measures the
    counters this gives); SGLang adds the +1 and a speculators export names the indices themselves."""
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    path = write_raw(tmp_path / "d", raw, raw_tensors(raw, "midlayer."))
    spec = json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": 3})
    s = _statuses(check_drafter(path, _facts(tdir), f"vllm serve tiny --speculative-config '{spec}'", run=False))
    st, detail = s["engine: aux layers"]
    assert st == "warn" and "[1, 3, 4] instead of [2, 4, 5]" in detail and "--format speculators" in detail
    sglang = f"python -m sglang.launch_server --model-path tiny --speculative-algorithm EAGLE3 " \
             f"--speculative-draft-model-path {path}"
    assert "engine: aux layers" not in _statuses(check_drafter(path, _facts(tdir), sglang, run=False))
    raw.pop("eagle_config")            # no ids in the file: vLLM and SGLang both use the target's default
    path = write_raw(tmp_path / "e", raw, raw_tensors(raw, "midlayer."))
    spec = json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": 3})
    assert "engine: aux layers" not in _statuses(check_drafter(path, _facts(tdir),
                                                               f"vllm serve tiny --speculative-config '{spec}'",
                                                               run=False))


def test_check_names_missing_token_map(tmp_path, tdir):
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    t = raw_tensors(raw, "midlayer.")
    del t["d2t"], t["t2d"]
    path = write_raw(tmp_path / "d", raw, t)
    cmd = "python -m sglang.launch_server --model-path tiny --speculative-algorithm EAGLE3"
    rep = check_drafter(path, _facts(tdir), cmd, run=False)
    s = _statuses(rep)
    assert s["token map"][0] == "fail" and "no d2t" in s["token map"][1]
    assert s["engine: token map"][0] == "fail" and "--speculative-token-map" in s["engine: token map"][1]


def test_parse_engine_args_forms():
    a = parse_engine_args("python3 -m sglang.launch_server --model-path m --speculative-algorithm=EAGLE3 "
                          "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8")
    assert (a.engine, a.algorithm, a.knobs["steps"], a.knobs["topk"], a.knobs["draft_tokens"]) == \
        ("sglang", "EAGLE3", 5, 4, 8)
    v = parse_engine_args("INFO 05-01 12:00:00 [utils.py:326] non-default args: {'model': 'm', "
                          "'speculative_config': {'method': 'eagle3', 'model': 'd', 'num_speculative_tokens': 3}}")
    assert (v.engine, v.algorithm, v.knobs["num_speculative_tokens"]) == ("vllm", "eagle3", 3)
    with pytest.raises(SpecscopeError, match="neither SGLang"):
        parse_engine_args("python serve.py --port 1")


def test_check_drafter_cli(tmp_path, capsys, target, tdir):
    good = _good_drafter(tmp_path, target)
    code, out, err = cli(capsys, "check-drafter", good, "--model", tdir, "--no-run", "--engine-args",
                         "python -m sglang.launch_server --model-path x --speculative-algorithm EAGLE")
    assert code == 1 and "[FAIL] engine: algorithm" in out and "1 fault(s)" in out
    code, out, err = cli(capsys, "check-drafter", good, "--model", tdir, "--json", "--num-prompts", "1",
                         "--max-new-tokens", "8", "--steps", "2")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["ok"] and rep["acceptance"]["teacher_forced_tau"] >= 1
    assert "check-drafter acceptance" not in err              # --json in a log: no progress chatter
    code, out, err = cli(capsys, "check-drafter", good, "--model", tdir, "--num-prompts", "2", "--max-new-tokens",
                         "8", "--steps", "2")
    # the measurement's progress, as every command shows it off a terminal: a closing line with rate and time
    assert code == 0 and re.search(r"^check-drafter acceptance: 2/2 prompt \([\d.]+ (prompt/s|s/prompt), done in "
                                   r"\d+:\d\d\)$", err, re.M), err
    assert "check-drafter acceptance" not in out
    line = one_error_line(*cli(capsys, "check-drafter", good, "--model", tdir, "--engine-args", "  ")[::2])
    assert "--engine-args" in line


# ------------------------------------------------------------------ slow: full size, real model

@pytest.mark.slow
def test_full_size_llama31_8b_drafter_peak_memory(tmp_path):
    """Llama-3.1-8B-shaped EAGLE-3 drafter (hidden 4096, draft vocab 32000, vocab 128256), fp16 as published:
    loading adds at most 1.5x the file size."""
    raw = json.loads((Path(__file__).parent / "data" / "drafter_configs" / "eagle3_llama31_8b_config.json").read_text())
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    H, I, V, Vd = 4096, 14336, 128256, 32000
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.float16)

    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t = {"fc.weight": r(H, 3 * H), "norm.weight": r(H), "lm_head.weight": r(Vd, H), "d2t": ids - torch.arange(Vd),
         "t2d": t2d, "midlayer.self_attn.q_proj.weight": r(4096, 2 * H),
         "midlayer.self_attn.k_proj.weight": r(1024, 2 * H), "midlayer.self_attn.v_proj.weight": r(1024, 2 * H),
         "midlayer.self_attn.o_proj.weight": r(H, 4096), "midlayer.mlp.gate_proj.weight": r(I, H),
         "midlayer.mlp.up_proj.weight": r(I, H), "midlayer.mlp.down_proj.weight": r(H, I),
         "midlayer.hidden_norm.weight": r(H), "midlayer.input_layernorm.weight": r(H),
         "midlayer.post_attention_layernorm.weight": r(H)}
    path = write_raw(tmp_path / "d", raw, t)
    del t
    size = (path / "model.safetensors").stat().st_size
    assert size > 800e6
    added, dtype = peak_load_bytes(path, _tiny_drafter_dir(tmp_path))
    assert dtype == "torch.float16"
    assert added <= 1.5 * size, (added / 1e6, size / 1e6)


@pytest.mark.slow
def test_check_shipped_drafter_with_smollm2(capsys):
    code, out, err = cli(capsys, "check-drafter", "smollm2-135m-eagle3", "--model", "smollm2-135m", "--num-prompts", "2",
                         "--max-new-tokens", "32")
    assert code == 0, out + err
    assert "teacher-forced τ" in out and "measured τ" in out and "no faults" in out
