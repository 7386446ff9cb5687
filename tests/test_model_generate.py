"""Greedy generation against transformers `generate`, dtypes and sharded checkpoints."""

import json

import pytest
import torch

from specscope.generate import generate
from specscope.models import load_model, rowgemm
from specscope.models.loader import compute_dtype
from tiny import ARCHS, make_hf_model

EOS = 2


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                          pad_token_id=0)[0, len(prompt):].tolist()
    # transformers pads after EOS; we stop at it (inclusive)
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [False, True])
def test_greedy_matches_transformers_generate(tmp_path, arch, tie):
    hf = make_hf_model(tmp_path, arch, tie=tie)
    ours = load_model(tmp_path, dtype="fp32")
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        prompt = torch.randint(3, 101, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        ref = hf_greedy(hf, prompt, 24)
        res = generate(ours, prompt, 24, stop_ids=[EOS])
        assert res.token_ids == ref
        assert res.stop_reason == ("eos" if ref[-1] == EOS else "length")
        assert res.prompt_len == len(prompt)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tmp_path, stored):
    hf = make_hf_model(tmp_path, "qwen2", dtype=stored)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] in ("bfloat16", "float16")
    ids = torch.randint(3, 101, (1, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None]
    # upcast to fp32: exactly the stored weights, so transformers in fp32 is the oracle
    ours32 = load_model(tmp_path, dtype="fp32")
    assert ours32.dtype == torch.float32
    with torch.no_grad():
        ref32 = hf.float()(ids).logits
        assert (ours32(ids, pos).logits - ref32).abs().max() < 1e-4
    # kept in the stored dtype: same dtype end to end (bf16 on CPU with our kernels: bf16 weights and linear
    # inputs in fp32 tensors, models/loader.py round_to_bf16), close to the fp32 reference
    native = load_model(tmp_path, dtype="bf16" if stored == torch.bfloat16 else "fp16")
    ours_bf16 = stored == torch.bfloat16 and rowgemm.available()
    assert compute_dtype(native) == stored and native.dtype == (torch.float32 if ours_bf16 else stored)
    assert all(torch.equal(p, p.to(stored).to(p.dtype)) if ours_bf16 else p.dtype == stored
               for p in native.parameters())
    with torch.no_grad():
        lo = native(ids, pos).logits
        cache = native.new_cache(32)
        lo_cached = torch.cat([native(ids[:, :6], pos[:, :6], cache).logits,
                               native(ids[:, 6:], pos[:, 6:], cache).logits], 1)
    assert lo.dtype == native.dtype
    scale = ref32.abs().max()
    assert (lo.float() - ref32).abs().max() < 0.05 * scale
    assert (lo_cached.float() - ref32).abs().max() < 0.05 * scale


def test_bf16_greedy_runs_and_stays_close(tmp_path):
    make_hf_model(tmp_path, "llama")
    m32 = load_model(tmp_path, dtype="fp32")
    m16 = load_model(tmp_path, dtype="bf16")
    prompt = [5, 6, 7, 8]
    a = generate(m32, prompt, 8).token_ids
    b = generate(m16, prompt, 8).token_ids
    assert len(b) == 8
    assert a[0] == b[0]  # first token from the same prompt; later ones may drift in bf16


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf = make_hf_model(single, "llama", tie=False)
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids = torch.randint(3, 101, (1, 10), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10)[None]
    a, b = load_model(single, dtype="fp32"), load_model(sharded, dtype="fp32")
    with torch.no_grad():
        assert torch.equal(a(ids, pos).logits, b(ids, pos).logits)


def test_llama3_rope_scaling_generate_matches(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    hf = make_hf_model(tmp_path, "llama", rope_scaling=rope)
    ours = load_model(tmp_path, dtype="fp32")
    prompt = list(range(3, 43))  # runs past original_max_position_embeddings
    assert generate(ours, prompt, 16, stop_ids=[EOS]).token_ids == hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_matches_transformers(tmp_path, arch):
    kw = {"sliding_window": 6}
    if arch == "qwen2":
        kw.update(use_sliding_window=True, max_window_layers=0)
    hf = make_hf_model(tmp_path, arch, **kw)
    ours = load_model(tmp_path, dtype="fp32")
    assert ours.config.sliding_window == 6
    ids = torch.randint(3, 101, (1, 20), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(20)[None]
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids, pos).logits
        cache = ours.new_cache(32)
        cached = torch.cat([ours(ids[:, :9], pos[:, :9], cache).logits]
                           + [ours(ids[:, t:t + 1], pos[:, t:t + 1], cache).logits for t in range(9, 20)], 1)
    assert (ref - full).abs().max() < 1e-4
    assert (ref - cached).abs().max() < 1e-4
