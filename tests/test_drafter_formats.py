"""EAGLE-3 drafter checkpoints: the published configs (shrunk) load and compute what the spec says; both layouts
round-trip with the exact names; bad drafters are refused with errors naming both values."""

import json

import pytest
import torch
from drafter_util import (published, random_drafter, raw_tensors, ref_cfg, reference_step, shrink, tiny_target,
                          write_raw)
from safetensors.torch import load_file

from specscope.errors import SpecscopeError
from specscope.speculative.formats import load_drafter, save_drafter, validate_drafter

SGLANG_CONFIGS = ["eagle3_llama31_8b_config.json", "specforge_llama3_8b_eagle3.json", "specforge_qwen3_eagle3.json"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("tgt"), layers=8)


def _inputs(drafter, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    H = drafter.config.hidden_size
    return torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g), torch.arange(T)[None]


def _check_against_reference(drafter, tensors, prefix):
    e, h, pos = _inputs(drafter)
    logits, nh = drafter(e, h, pos)
    ref_logits, ref_h, _ = reference_step(tensors, prefix, ref_cfg(drafter), e[0], h[0], pos[0])
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nh[0], ref_h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", SGLANG_CONFIGS)
def test_published_sglang_configs_load_and_match_spec(tmp_path, target, name):
    raw = shrink(published(name))
    t = raw_tensors(raw, "midlayer.")
    d = load_drafter(write_raw(tmp_path / "d", raw, t), target)
    c = d.config
    assert c.format == "sglang" and c.draft_vocab_size == 40 and c.vocab_size == 101
    # no layer ids in these configs: the default (2, L//2, L-3) of the 8-layer target, recorded as such
    assert list(d.aux_layers) == [2, 4, 5] and c.aux_convention_in_file == "default"
    assert c.norm_before_residual is False and c.norm_output is False
    assert c.rms_norm_eps == raw["rms_norm_eps"] and c.rope_theta == float(raw.get("rope_theta", 10000.0))
    assert torch.equal(d.draft_to_target(torch.arange(40)), torch.nonzero(t["t2d"]).flatten())
    _check_against_reference(d, t, "midlayer.")


def test_sglang_layer_ids_are_output_of_layer(tmp_path, target):
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    d = load_drafter(write_raw(tmp_path / "d", raw, raw_tensors(raw, "midlayer.")), target)
    assert list(d.aux_layers) == [2, 4, 5] and d.config.aux_convention_in_file == "output"


def test_published_speculators_config_loads_as_published(tmp_path, target):
    # four aux ids (the 4th feeds only the verifier's logits), norm_before_fc, sliding window: all honoured
    raw = shrink(published("speculators_eagle3_config.json"))
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 4, 6, 7]
    t = raw_tensors(raw, "layers.0.")
    d = load_drafter(write_raw(tmp_path / "d", raw, t), target)
    c = d.config
    assert c.format == "speculators" and c.aux_convention_in_file == "input"
    assert list(d.aux_layers) == [1, 4, 6] and c.meta.verifier_logits_layer == 7   # entering-layer ids as given
    assert c.norm_before_residual and c.norm_output and c.norm_before_fc and c.target_hidden_size == 64
    assert c.sliding_window == 2048
    _check_against_reference(d, t, "layers.0.")
    # the config a training checkpoint stores round-trips, and one stored with the old `extra` dict still loads
    from specscope.speculative.eagle3 import DrafterConfig

    assert DrafterConfig.from_dict(c.to_dict()) == c
    old = c.to_dict()
    old["extra"] = old.pop("meta")
    assert DrafterConfig.from_dict(old) == c


def test_speculators_omitted_norm_before_residual_defaults_true(tmp_path, target):
    raw = shrink(published("speculators_eagle3_config.json"))
    raw.update(eagle_aux_hidden_state_layer_ids=[2, 4, 5], norm_before_fc=False, norm_output=False)
    raw["transformer_layer_config"].update(use_sliding_window=False, layer_types=["full_attention"])
    del raw["norm_before_residual"]
    t = raw_tensors(raw, "layers.0.")
    d = load_drafter(write_raw(tmp_path / "d", raw, t), target)
    assert d.config.norm_before_residual is True
    _check_against_reference(d, t, "layers.0.")


EXPECTED_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "{p}self_attn.q_proj.weight",
                 "{p}self_attn.k_proj.weight", "{p}self_attn.v_proj.weight", "{p}self_attn.o_proj.weight",
                 "{p}mlp.gate_proj.weight", "{p}mlp.up_proj.weight", "{p}mlp.down_proj.weight",
                 "{p}hidden_norm.weight", "{p}input_layernorm.weight", "{p}post_attention_layernorm.weight"}


@pytest.mark.parametrize("fmt,prefix,flags", [
    ("sglang", "midlayer.", {}), ("speculators", "layers.0.", {}),
    ("speculators", "layers.0.", {"norm_before_residual": True, "norm_output": True, "fc_norm": True})])
def test_round_trip_exact_names(tmp_path, target, fmt, prefix, flags):
    d = random_drafter(target, **flags)
    save_drafter(d, tmp_path / "d", format=fmt, target_info={"name_or_path": "tiny", "architectures": ["X"]})
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    want = {k.format(p=prefix) for k in EXPECTED_KEYS} | ({f"fc_norm.{i}.weight" for i in range(3)} if flags else set())
    assert keys == want                                    # never the embedding, never our fused names
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    if fmt == "sglang":
        assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 40
        assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # output-of-layer = id - 1
    else:
        assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
        assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert raw["transformer_layer_config"]["vocab_size"] == 101
        assert raw["speculators_config"]["verifier"] == {"name_or_path": "tiny", "architectures": ["X"]}
    back = load_drafter(tmp_path / "d", target)
    assert back.config.format == fmt and list(back.aux_layers) == list(d.aux_layers)
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    e, h, pos = _inputs(d)
    assert torch.equal(d(e, h, pos)[0], back(e, h, pos)[0])


def test_sglang_export_refuses_what_sglang_ignores(tmp_path, target):
    d = random_drafter(target, norm_before_residual=True, norm_output=True, fc_norm=True)
    with pytest.raises(SpecscopeError, match=r"norm_before_residual.*norm_output.*fc_norm.*--format speculators"):
        save_drafter(d, tmp_path / "s", format="sglang")
    assert not (tmp_path / "s").exists()                  # refused before writing anything


def test_cross_format_identical_outputs(tmp_path, target):
    d = random_drafter(target)
    a = load_drafter(save_drafter(d, tmp_path / "s", format="sglang"), target)
    b = load_drafter(save_drafter(a, tmp_path / "v", format="speculators",
                                  target_info={"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}), target)
    c = load_drafter(save_drafter(b, tmp_path / "s2", format="sglang"), target)
    e, h, pos = _inputs(d)
    outs = [m(e, h, pos) for m in (d, a, b, c)]
    for lo, hid in outs[1:]:
        assert torch.equal(lo, outs[0][0]) and torch.equal(hid, outs[0][1])
    assert (a.config.format, b.config.format) == ("sglang", "speculators")
    assert a.config.aux_convention_in_file == "output" and b.config.aux_convention_in_file == "input"


def test_pytorch_bin_and_ignored_embedding(tmp_path, target):
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    t = raw_tensors(raw, "midlayer.")
    t["embed_tokens.weight"] = torch.randn(101, 64)        # some checkpoints carry the target embedding: unused
    d = load_drafter(write_raw(tmp_path / "d", raw, t, bin_file=True), target)
    _check_against_reference(d, t, "midlayer.")


def test_bf16_save_keeps_maps_exact(tmp_path, target):
    d = random_drafter(target)
    save_drafter(d, tmp_path / "d", dtype=torch.bfloat16)
    st = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert st["fc.weight"].dtype == torch.bfloat16 and st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool
    back = load_drafter(tmp_path / "d")
    assert back.dtype == torch.bfloat16 and torch.equal(back.d2t, d.d2t)
    assert load_drafter(tmp_path / "d", target).dtype == torch.float32      # follows the target


# ------------------------------------------------------------------ bad drafters

def test_wrong_hidden_size(tmp_path, target):
    small = tiny_target(tmp_path, layers=8, hidden=48)
    path = save_drafter(random_drafter(target), tmp_path / "d")
    with pytest.raises(SpecscopeError, match=r"hidden size 64 .*48"):
        load_drafter(path, small)


def test_vocab_mismatch(tmp_path, target):
    other = tiny_target(tmp_path, layers=8, vocab=120)
    with pytest.raises(SpecscopeError, match=r"vocabulary of 101 .* has 120"):
        validate_drafter(random_drafter(target), other)


def test_layer_ids_out_of_range(tmp_path, target):
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 20]}
    with pytest.raises(SpecscopeError, match=r"\[2, 4, 21\].*8 layers"):
        load_drafter(write_raw(tmp_path / "d", raw, raw_tensors(raw, "midlayer.")), target)


def test_missing_d2t(tmp_path, target):
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    t = raw_tensors(raw, "midlayer.")
    del t["d2t"]
    with pytest.raises(SpecscopeError, match=r"no 'd2t'.*\(40\).*\(101\)"):
        load_drafter(write_raw(tmp_path / "d", raw, t), target)


@pytest.mark.parametrize("breakage,msg", [
    (lambda d: d.d2t.__setitem__(-1, 500), r"target ids .*outside the target vocabulary 0\.\.100"),
    (lambda d: d.t2d.__setitem__(torch.nonzero(~d.t2d)[0], True), r"t2d marks 41 target ids but d2t maps 40"),
    (lambda d: d.d2t.__setitem__(1, d.d2t[0] - 1), r"only 39 distinct"),
])
def test_inconsistent_maps(target, breakage, msg):
    d = random_drafter(target)
    breakage(d)
    with pytest.raises(SpecscopeError, match=msg):
        validate_drafter(d, target)


@pytest.mark.parametrize("edit,msg", [
    (lambda r, t: r.update(num_hidden_layers=2), "only single-layer"),
    (lambda r, t: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)}), "q/k RMSNorm"),
    (lambda r, t: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor 'midlayer.mlp.up_proj.weight'"),
    (lambda r, t: t.update({"lm_head.weight": torch.zeros(41, 64)}), r"shape \(41, 64\).*\(40, 64\)"),
    (lambda r, t: r.update(architectures=["MistralForCausalLM"]), "not an EAGLE-3 drafter"),
    (lambda r, t: r.update(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_bad_checkpoints(tmp_path, target, edit, msg):
    raw = shrink(published("specforge_qwen3_eagle3.json"))
    t = raw_tensors(raw, "midlayer.")
    edit(raw, t)
    with pytest.raises(SpecscopeError, match=msg):
        load_drafter(write_raw(tmp_path / "d", raw, t), target)


def test_missing_files(tmp_path):
    with pytest.raises(SpecscopeError, match="not a directory"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "e").mkdir()
    with pytest.raises(SpecscopeError, match="no config.json"):
        load_drafter(tmp_path / "e")
    raw = shrink(published("specforge_llama3_8b_eagle3.json"))
    (tmp_path / "e" / "config.json").write_text(json.dumps(
        {**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    with pytest.raises(SpecscopeError, match="no model.safetensors, model.safetensors.index.json or pytorch_model.bin"):
        load_drafter(tmp_path / "e")
    with pytest.raises(SpecscopeError, match="pass the target"):
        write_raw(tmp_path / "f", raw, raw_tensors(raw, "midlayer."))
        load_drafter(tmp_path / "f")
