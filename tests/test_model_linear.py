"""Pre-packed CPU linears (models/linear.py): same results as nn.Linear for every row count, dtype and kernel
(our row-invariant one where it builds, oneDNN otherwise; tests/test_model_kernels.py has the kernel's own tests)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specscope.models import load_model
from specscope.models.linear import PackedLinear, can_pack, pack_linears
from tiny import make_hf_model

needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(1, 1)), reason="oneDNN linear packing unavailable")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "onednn"])
def test_packed_linear_matches_f_linear(dtype, bias, transposed, kernel):
    if dtype == torch.bfloat16 and not can_pack(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip("no bf16 oneDNN on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(dtype)
    pl = PackedLinear(lin, one_row_transposed=transposed, kernel=kernel)
    assert pl.kernel == "onednn" or (kernel == "auto" and dtype == torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 1, 96), (1, 2, 96), (1, 5, 96), (2, 3, 96), (1, 64, 96), (96,)]:
        x = torch.randn(shape).to(dtype)
        ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        got = pl(x)
        assert got.shape == ref.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(pl.weight, lin.weight)


@needs_onednn
def test_pack_linears_on_a_loaded_model(tmp_path):
    make_hf_model(tmp_path, "qwen2", tie=True)  # qkv bias + tied lm_head
    dense = load_model(tmp_path, dtype="fp32", pack=False)
    packed = load_model(tmp_path, dtype="fp32")
    assert not any(isinstance(m, PackedLinear) for m in dense.modules())
    n_linear = 1 + 4 * dense.config.num_hidden_layers
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n_linear
    assert packed.lm_head.weight is packed.embed_tokens.weight  # tied weight kept, not copied
    ids = torch.randint(3, 101, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        torch.testing.assert_close(packed(ids, pos).logits, dense(ids, pos).logits, atol=1e-4, rtol=1e-4)
        c1, c2 = packed.new_cache(32), dense.new_cache(32)
        packed(ids[:, :8], pos[:, :8], c1)
        dense(ids[:, :8], pos[:, :8], c2)
        for t in range(8, 16):  # one-row steps take the other kernel
            a = packed(ids[:, t:t + 1], pos[:, t:t + 1], c1).logits
            b = dense(ids[:, t:t + 1], pos[:, t:t + 1], c2).logits
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_pack_linears_skips_what_it_cannot_pack():
    m = nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 4))
    n = pack_linears(m)
    if not can_pack(torch.zeros(1, 1, dtype=torch.float16)):
        assert type(m[0]) is nn.Linear  # e.g. fp16 on CPUs without avx512_fp16: stays on F.linear
    assert n == sum(isinstance(x, PackedLinear) for x in m)
