"""Our forward against transformers' logits on tiny random configs (the oracle)."""

import pytest
import torch

from specscope.models import load_model
from tiny import ARCHS, make_hf_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tmp_path, arch, tie):
    kw = {"rope_scaling": LLAMA3_ROPE} if arch == "llama" else {}
    hf = make_hf_model(tmp_path, arch, tie=tie, **kw)
    ours = load_model(tmp_path, dtype="fp32")
    ids = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None]
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids, pos).logits
        cache = ours.new_cache(64)
        chunks = [ours(ids[:, :10], pos[:, :10], cache).logits]
        for t in range(10, 24):
            chunks.append(ours(ids[:, t:t + 1], pos[:, t:t + 1], cache).logits)
        cached = torch.cat(chunks, 1)
    assert (ref - full).abs().max() < 1e-4
    assert (ref - cached).abs().max() < 1e-4
