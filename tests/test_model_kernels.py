"""The row-invariant CPU kernels (models/rowgemm.py): right answers, the same bits for every row count, a tuning
cache that survives corruption, and the stock fallback when the kernel cannot be built."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specscope.errors import SpecscopeError
from specscope.models import load_model, rowgemm, tuning
from specscope.models.kernels import RowAttention
from specscope.models.linear import PackedLinear, pack_linears
from specscope.speculative.tree import DraftTree
from tiny import make_hf_model

needs_kernels = pytest.mark.skipif(not rowgemm.available(),
                                   reason="no AVX-512, AVX2+FMA or NEON CPU, or no C++ compiler here")


def _variants():
    return [(nb, rb) for nb, rbs in rowgemm.VARIANTS.items() for rb in rbs]


@needs_kernels
@pytest.mark.parametrize("out,k", [(1, 1), (17, 3), (33, 16), (100, 17), (64, 64), (200, 333), (1000, 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fmt", ["f32", "bf16a"])
def test_gemm_matches_torch_and_every_row_count_gives_the_same_bits(out, k, bias, fmt):
    """fp32, and bf16 precision (weights and inputs rounded to bf16 as torch rounds them, fp32 sums): float64 over
    the same values, and every row count, panel and tile gives the same bits."""
    g = torch.Generator().manual_seed(out * 1000 + k)
    w = torch.randn(out, k, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    x = torch.randn(40, k, generator=g)
    wv, xv = (w, x) if fmt == "f32" else (w.bfloat16().float(), x.bfloat16().float())
    ref = (xv.double() @ wv.double().T + (b.double() if bias else 0)).float()
    full = None
    for nb, rb in _variants():
        p = rowgemm.pack(w, nb, fmt=fmt)
        torch.testing.assert_close(rowgemm.unpack(p, nb, out, k, fmt), wv, rtol=0, atol=0)
        y = rowgemm.gemm(x, p, nb, out, b, rb, fmt=fmt)
        scale = (xv.abs() @ wv.abs().T + (b.abs() if bias else 0)).max().item()
        torch.testing.assert_close(y, ref, rtol=0, atol=1e-6 * scale * max(k, 1) ** 0.5)
        full = y if full is None else full
        assert torch.equal(y, full), "panel width / register tile changed the result"
        for n in list(range(1, 33)) + [40]:
            assert torch.equal(rowgemm.gemm(x[:n].contiguous(), p, nb, out, b, rb, fmt=fmt), full[:n]), (nb, rb, n)


@needs_kernels
def test_rmsnorm_and_fused_residual_add():
    g = torch.Generator().manual_seed(1)
    for d in (1, 15, 16, 64, 576, 1000):
        x, delta, w = torch.randn(7, d, generator=g), torch.randn(7, d, generator=g), torch.randn(d, generator=g)
        ref = F.rms_norm(x, (d,), w, 1e-5)
        y = rowgemm.rmsnorm(x, w, 1e-5)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        h, y2 = rowgemm.rmsnorm(x, w, 1e-5, delta=delta)
        assert torch.equal(h, x + delta)
        torch.testing.assert_close(y2, F.rms_norm(x + delta, (d,), w, 1e-5), rtol=1e-5, atol=1e-6)
        for r in range(7):   # row-invariant
            assert torch.equal(rowgemm.rmsnorm(x[r:r + 1].contiguous(), w, 1e-5), y[r:r + 1])


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (2, 2, 80), (8, 1, 128)])
def test_attention_matches_sdpa_with_tree_masks(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * d)
    S, T, maxlen = 37, 6, 48
    k = torch.randn(hkv, maxlen, d, generator=g)
    v = torch.randn(hkv, maxlen, d, generator=g)
    q = torch.randn(T, hq, d, generator=g)
    tree = DraftTree(torch.arange(T - 1), torch.tensor([-1, 0, 0, 1, 2]), torch.tensor([1, 2, 2, 3, 3]))
    mask = tree.verify_inputs(0, S - T, S - T)[3][0]             # [T, S]: prefix + ancestors
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, :S], v[None, :, :S],
                                         attn_mask=mask[None, None], enable_gqa=hq != hkv)[0]
    y = rowgemm.attention(q, k, v, S, mask)
    torch.testing.assert_close(y.view(T, hq, d), ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
    # a row sees only its keys, in slot order: the same bits alone, and with the invisible slots simply absent
    for t in range(T):
        assert torch.equal(rowgemm.attention(q[t:t + 1], k, v, S, mask[t:t + 1]), y[t:t + 1])
        vis = mask[t].nonzero().flatten()
        kk, vv = k.clone(), v.clone()
        kk[:, :vis.numel()], vv[:, :vis.numel()] = k[:, vis], v[:, vis]
        assert torch.equal(rowgemm.attention(q[t:t + 1], kk, vv, vis.numel(), None), y[t:t + 1])


@needs_kernels
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_and_verify_give_identical_logits(tmp_path, dtype):
    """The losslessness the kernels buy: a verify forward (chain or tree rows) equals step-by-step decoding bit
    for bit, so greedy speculation cannot flip a near-tie argmax -- in fp32 and in bf16 precision."""
    make_hf_model(tmp_path, "llama", tie=True)
    m = load_model(tmp_path, dtype=dtype)
    fmts = {pl.fmt for pl in m.modules() if isinstance(pl, PackedLinear)}
    assert all(pl.kernel == "rowgemm" for pl in m.modules() if isinstance(pl, PackedLinear))
    assert fmts == ({"bf16a"} if dtype == "bf16" else {"f32"}) and m.precision == (None if dtype == "fp32" else dtype)
    ids = torch.randint(3, 101, (1, 30), generator=torch.Generator().manual_seed(0))
    L = 20
    with torch.inference_mode():
        c_dec = m.new_cache(40)
        m(ids[:, :L], torch.arange(L)[None], c_dec)
        steps = [m(ids[:, t:t + 1], torch.tensor([[t]]), c_dec).logits[0, 0] for t in range(L, 30)]
        # a tree whose node 4 path (rows 0 -> 2 -> 4 -> 6) is the true continuation, siblings interleaved
        toks = ids[0, L:].tolist()
        tree = DraftTree(torch.tensor([7, toks[1], 9, toks[2], 11, toks[3]]), torch.tensor([-1, -1, 0, 1, 2, 3]),
                         torch.tensor([1, 1, 2, 2, 3, 3]))
        c_ver = m.new_cache(40)
        m(ids[:, :L], torch.arange(L)[None], c_ver)
        c_ver.length = L
        v_ids, v_pos, v_slots, v_mask = tree.verify_inputs(toks[0], L, L)
        out = m(v_ids, v_pos, c_ver, v_slots, v_mask).logits[0]
    for row, t in ((0, 0), (2, 1), (4, 2), (6, 3)):
        assert torch.equal(out[row], steps[t]), f"tree row {row} differs from decode step {t}"


# ---- tuning cache ----------------------------------------------------------------------------------------------
@needs_kernels
def test_tuning_cache_is_written_reused_and_survives_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECSCOPE_LINEAR_TUNE", "1")
    calls = []
    real = tuning.measure

    def counting(out, k, **kw):
        calls.append((out, k))
        return real(out, k, rounds=1, cold_bytes=1 << 16)

    monkeypatch.setattr(tuning, "measure", counting)
    plan = tuning.tuned_plan(40, 24)
    path = tuning.tune_file()
    assert path.parent == tmp_path / "kernels" and tuning.fingerprint() in path.name
    assert json.loads(path.read_text())["plans"]["40x24"] == plan and calls == [(40, 24)]
    assert tuning.tuned_plan(40, 24) == plan and calls == [(40, 24)]      # cached: not measured again
    tuning.tuned_plan(8, 24)
    assert set(json.loads(path.read_text())["plans"]) == {"40x24", "8x24"}
    path.write_text("{not json")                                              # corrupt file -> re-measure
    assert tuning.tuned_plan(40, 24)["nb"] in rowgemm.VARIANTS and len(calls) == 3
    assert "40x24" in json.loads(path.read_text())["plans"]
    bad = json.loads(path.read_text())
    bad["plans"]["40x24"]["rb"]["8"] = 99                                    # a tile the library lacks
    path.write_text(json.dumps(bad))
    tuning.tuned_plan(40, 24)
    assert len(calls) == 4 and tuning._valid_plan(json.loads(path.read_text())["plans"]["40x24"])


@needs_kernels
def test_every_plan_gives_the_same_result(tmp_path, monkeypatch):
    """Tuning only changes speed: a linear under any plan returns the bits of the default plan."""
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    lin = nn.Linear(50, 70)
    x = torch.randn(3, 9, 50)
    ref = PackedLinear(lin, tune=False)(x)
    for nb, rbs in rowgemm.VARIANTS.items():
        for rb in rbs:
            plan = {"nb": nb, "rb": {str(n): rb for n in rowgemm.TUNE_ROWS}}
            monkeypatch.setattr(tuning, "tuned_plan", lambda out, k, tune=None, fmt="f32", plan=plan: plan)
            assert torch.equal(PackedLinear(lin)(x), ref)


# ---- build and fallback ----------------------------------------------------------------------------------------
@pytest.fixture
def fresh_library(monkeypatch):
    """Forget the loaded library for one test (restored afterwards)."""
    monkeypatch.setattr(rowgemm, "_lib", None)
    monkeypatch.setattr(rowgemm, "_lib_state", "unloaded")
    monkeypatch.setattr(rowgemm, "_warned", False)
    monkeypatch.setattr(rowgemm, "_isa", rowgemm._isa)
    monkeypatch.setattr(rowgemm, "VARIANTS", rowgemm.VARIANTS)


@needs_kernels
def test_builds_into_the_cache_dir_on_first_use(tmp_path, monkeypatch, fresh_library):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    assert rowgemm.library() is not None
    built = list((tmp_path / "kernels").glob("rows_gemm-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(rowgemm, "_lib_state", "unloaded")
    assert rowgemm.library() is not None and built[0].stat().st_mtime_ns == mtime   # reused, not rebuilt


def test_without_a_compiler_it_warns_once_and_uses_the_stock_path(tmp_path, monkeypatch, capsys, fresh_library):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: set(rowgemm.ISAS["avx2"][0]))
    monkeypatch.setattr(rowgemm.platform, "machine", lambda: "x86_64")
    lin = nn.Linear(32, 48)
    m = nn.Sequential(lin, nn.ReLU(), nn.Linear(48, 16))
    x = torch.randn(5, 32)
    ref = m(x)
    pack_linears(m)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "compiler" in err[0], err
    assert all(p.kernel == "onednn" for p in m.modules() if isinstance(p, PackedLinear))
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.so"))


@pytest.mark.parametrize("off", ["0", "off"])
def test_kernels_can_be_switched_off(monkeypatch, capsys, fresh_library, off):
    monkeypatch.setenv("SPECSCOPE_KERNELS", off)
    pl = PackedLinear(nn.Linear(8, 8))
    assert pl.kernel == "onednn" and capsys.readouterr().err == ""


def test_the_best_isa_of_each_cpu(monkeypatch):
    monkeypatch.delenv("SPECSCOPE_KERNELS", raising=False)
    zen4 = {"avx512f", "avx512dq", "avx512vl", "avx512bw", "avx2", "fma", "avx512_bf16"}
    cases = [("x86_64", zen4, "avx512_bf16"),                                               # Zen 4/5, SPR
             ("x86_64", zen4 - {"avx512bw"}, "avx512"),   # the bf16 attention's 16-bit interleaves need AVX512BW
             ("x86_64", {"avx512f", "avx512dq", "avx512vl", "avx2", "fma"}, "avx512"),
             ("x86_64", {"avx2", "fma", "avx"}, "avx2"),       # Zen 1-3, Alder Lake, VMs hiding AVX-512
             ("x86_64", {"avx2"}, None),                       # AVX2 without FMA: the FMA chain needs it
             ("aarch64", {"asimd", "fp"}, "neon"), ("arm64", set(), "neon"), ("riscv64", set(), None)]
    for machine, flags, want in cases:
        monkeypatch.setattr(rowgemm.platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(rowgemm, "cpu_flags", lambda f=flags: f)
        assert rowgemm.best_isa()[0] == want, (machine, flags)


def test_an_isa_can_be_forced_and_an_impossible_one_is_refused(monkeypatch):
    monkeypatch.setattr(rowgemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: {"avx512f", "avx512dq", "avx512vl", "avx2", "fma"})
    monkeypatch.setenv("SPECSCOPE_KERNELS", "avx2")
    assert rowgemm.requested_isa() == ("avx2", "")
    monkeypatch.setenv("SPECSCOPE_KERNELS", "neon")
    with pytest.raises(SpecscopeError, match="SPECSCOPE_KERNELS=neon but this x86_64 CPU cannot run neon"):
        rowgemm.requested_isa()
    monkeypatch.setenv("SPECSCOPE_KERNELS", "sse9")
    with pytest.raises(SpecscopeError, match="SPECSCOPE_KERNELS='sse9' is not one of auto, avx512_bf16, avx512, avx2, neon, off"):
        rowgemm.requested_isa()
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("SPECSCOPE_KERNELS", "avx512")
    with pytest.raises(SpecscopeError, match="cannot run avx512"):
        rowgemm.requested_isa()
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: {"avx512f", "avx512dq", "avx512vl", "avx2", "fma"})
    monkeypatch.setenv("SPECSCOPE_KERNELS", "avx512_bf16")
    with pytest.raises(SpecscopeError, match="cannot run avx512_bf16"):
        rowgemm.requested_isa()


def test_the_compiler_is_whichever_exists(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    seen = []
    monkeypatch.setattr(rowgemm.shutil, "which", lambda n: seen.append(n) or ("/usr/bin/clang++" if n == "clang++" else None))
    assert rowgemm._compiler() == "/usr/bin/clang++" and seen == ["c++", "g++", "clang++"]


def test_a_failing_build_falls_back(tmp_path, monkeypatch, capsys, fresh_library):
    """A compiler that exits non-zero (e.g. no AVX-512 support in an old assembler) is a warning, not a crash."""
    fake = tmp_path / "bad-cxx"
    fake.write_text("#!/bin/sh\necho 'cc1plus: error: unrecognized option' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: set(rowgemm.ISAS["avx2"][0]))
    monkeypatch.setattr(rowgemm.platform, "machine", lambda: "x86_64")
    assert rowgemm.library() is None
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "unrecognized option" in err


def test_a_compiler_without_avx512_bf16_builds_plain_avx512(tmp_path, monkeypatch, capsys, fresh_library):
    """GCC < 10 has no -mavx512bf16: on an AVX512_BF16 CPU the fp32 kernels must still be ours (plain AVX-512), with
    one warning line, rather than every linear falling back to oneDNN."""
    cxx = rowgemm._compiler()
    if cxx is None or not rowgemm.ISAS["avx512"][0] <= rowgemm.cpu_flags() or rowgemm._machine() != "x86_64":
        pytest.skip("needs an AVX-512 x86 host with a C++ compiler")
    fake = tmp_path / "old-cxx"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *-mavx512bf16*) echo "cc1plus: error: unrecognized command-line option '
                    f"'-mavx512bf16'\" >&2; exit 1;; esac\nexec {cxx} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.delenv("SPECSCOPE_KERNELS", raising=False)
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: set(rowgemm.ISAS["avx512_bf16"][0]))
    assert rowgemm.library() is not None and rowgemm.isa() == "avx512" and not rowgemm.pairs()
    (w,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert w.startswith("warning: could not build the row-invariant kernels for avx512_bf16") and "using avx512" in w


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_kernel_model_matches_the_stock_path(tmp_path, arch):
    """Rotary embedding, cache writes, GQA attention (tree masks, sliding windows), norms: same logits as the
    oneDNN + SDPA path within fp32 rounding, for prefill, decode and a tree verify."""
    kw = {"sliding_window": 6} if arch == "mistral" else {}
    make_hf_model(tmp_path, arch, **kw)
    ours = load_model(tmp_path, dtype="fp32")
    stock = load_model(tmp_path, dtype="fp32", pack=False)
    pack_linears(stock, kernel="onednn")
    assert isinstance(ours.layers[0].self_attn, RowAttention) and not isinstance(stock.layers[0].self_attn, RowAttention)
    ids = torch.randint(3, 101, (1, 12), generator=torch.Generator().manual_seed(1))
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]))
    with torch.inference_mode():
        outs = []
        for m in (ours, stock):
            c = m.new_cache(32)
            a = m(ids, torch.arange(12)[None], c).logits
            c.length = 12
            b = m(torch.tensor([[9]]), torch.tensor([[12]]), c).logits
            c.length = 13
            v = m(*tree.verify_inputs(4, 13, 13)[:2], c, *tree.verify_inputs(4, 13, 13)[2:]).logits
            outs.append((a, b, v))
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_a_slot_past_the_cache_is_refused_before_writing():
    kc, vc = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    cs = torch.ones(2, 16)
    with pytest.raises(IndexError, match="index 8 is out of bounds for dimension 1 with size 8"):
        rowgemm.rope_attention(qkv, 4, 2, cs, cs, torch.tensor([7, 8]), kc, vc, 8, None)
    assert not kc.any() and not vc.any()
    y = rowgemm.rope_attention(qkv, 4, 2, cs, 0 * cs, torch.tensor([6, 7]), kc, vc, 8, None)
    assert y.shape == (2, 64) and torch.equal(kc[:, 6:8], qkv[:, 64:96].view(2, 2, 16).transpose(0, 1))


def test_a_cpu_without_avx2_falls_back_with_one_warning(monkeypatch, capsys, fresh_library):
    monkeypatch.setattr(rowgemm, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setattr(rowgemm.platform, "machine", lambda: "x86_64")
    assert PackedLinear(nn.Linear(8, 8)).kernel == "onednn" and PackedLinear(nn.Linear(8, 4)).kernel == "onednn"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither AVX-512 nor AVX2" in err[0]


@needs_kernels
def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(3)
    for inter in (1, 17, 96, 1536):
        gu = torch.randn(5, 2 * inter, generator=g) * 30       # covers exp overflow (g < -88) and large g
        gate, up = gu.split(inter, -1)
        torch.testing.assert_close(rowgemm.silu_mul(gu, inter), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("arch,ckpt,dtype", [("llama", torch.float32, "fp32"), ("qwen2", torch.float32, "fp32"),
                                             ("mistral", torch.float32, "fp32"), ("llama", torch.bfloat16, "fp32"),
                                             ("llama", torch.float32, "bf16"), ("qwen2", torch.float32, "bf16")])
def test_the_one_call_layer_stack_gives_the_per_layer_bits(tmp_path, arch, ckpt, dtype):
    """rows_layers runs every decoder layer in one C++ call: prefill, decode and a tree verify, the aux hidden
    states EAGLE-3 reads included, must be the bits of the per-layer kernel path (a bf16 checkpoint loaded as
    fp32 streams bf16 panels through the same call; bf16 precision rounds each linear's input there too)."""
    kw = {"sliding_window": 6} if arch == "mistral" else {}
    make_hf_model(tmp_path, arch, dtype=ckpt, **kw)
    m = load_model(tmp_path, dtype=dtype)
    stack = m.row_stack
    assert stack is not None
    assert (m.layers[0].mlp.down_proj.rg.dtype == torch.int16) == (ckpt == torch.bfloat16 or dtype == "bf16")
    assert m.layers[0].mlp.down_proj.fmt == ("bf16a" if dtype == "bf16" else "bf16" if ckpt == torch.bfloat16 else "f32")
    ids = torch.randint(3, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]))
    aux = (0, 1, m.config.num_hidden_layers)
    outs = []
    with torch.inference_mode():
        for st in (stack, None):
            m.row_stack = st
            c = m.new_cache(32)
            a = m(ids, torch.arange(12)[None], c, aux_layers=aux)
            c.length = 12
            b = m(torch.tensor([[9]]), torch.tensor([[12]]), c, aux_layers=aux)
            c.length = 13
            v = m(*tree.verify_inputs(4, 13, 13)[:2], c, *tree.verify_inputs(4, 13, 13)[2:], aux_layers=aux)
            outs.append([a.logits, b.logits, v.logits, *a.aux_hidden, *b.aux_hidden, *v.aux_hidden, c.k, c.v])
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def test_no_layer_stack_for_a_model_with_qk_norm(tmp_path):
    make_hf_model(tmp_path, "qwen3")
    assert getattr(load_model(tmp_path, dtype="fp32"), "row_stack", None) is None


@needs_kernels
def test_bf16_exact_weights_stream_as_bf16_with_the_fp32_bits(monkeypatch):
    """A bf16 checkpoint upcast to fp32 (the shipped drafter; most hub checkpoints) is packed as bf16: half the
    bytes to stream, and the same results, bit for bit, as the fp32 panels, for every row count."""
    lin = nn.Linear(70, 300)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    x = torch.randn(13, 70)
    pl = PackedLinear(lin, tune=False)
    assert pl.rg.dtype == torch.int16 and pl.rg.numel() * 2 <= 1.1 * lin.weight.numel() * 2
    assert torch.equal(pl.weight, lin.weight)
    monkeypatch.setattr(rowgemm, "is_bf16_exact", lambda w: False)
    ref = PackedLinear(lin, tune=False)
    assert ref.rg.dtype == torch.float32
    for n in range(1, 14):
        assert torch.equal(pl(x[:n]), ref(x[:n])), n
    assert not rowgemm.is_bf16_exact(torch.randn(4, 4))       # an ordinary fp32 weight stays fp32


# ---- threads (csrc/pool.h) -------------------------------------------------------------------------------------
@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_thread_count_gives_the_same_bits(tmp_path, dtype, torch_threads):
    """Chunks of a layer go to whichever thread claims them, more threads than this host has cores included (so
    some are always late): prefill, decode, a tree verify and the caches are the bits of one thread."""
    make_hf_model(tmp_path, "llama", tie=True)
    m = load_model(tmp_path, dtype=dtype)
    ids = torch.randint(3, 101, (1, 16), generator=torch.Generator().manual_seed(3))
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]))
    runs = []
    for n in (1, 2, 3, 4):
        torch_threads(n)
        with torch.inference_mode():
            c = m.new_cache(40)
            a = m(ids, torch.arange(16)[None], c).logits
            c.length = 16
            steps = [m(torch.tensor([[9 + t]]), torch.tensor([[16 + t]]), c).logits for t in range(4)]
            c.length = 20
            v = m(*tree.verify_inputs(4, 20, 20)[:2], c, *tree.verify_inputs(4, 20, 20)[2:]).logits
        runs.append([a, *steps, v, c.k, c.v])
    for n, run in zip((2, 3, 4), runs[1:]):
        for x, y in zip(runs[0], run):
            assert torch.equal(x, y), f"{n} threads differ from 1"


@needs_kernels
def test_many_small_dispatches_from_two_callers_keep_the_bits(torch_threads):
    """Thousands of back-to-back dispatches (each a new job for the pool's workers: a late worker must never run a
    chunk of the next job with the last one's bounds), from two Python threads at once (the second caller runs
    inline while the pool is busy): every result is the one-thread result."""
    import threading

    g = torch.Generator().manual_seed(5)
    shapes = [(517, 96), (40, 64), (1000, 33)]
    nb, rb = _variants()[0]
    cases = []
    torch_threads(1)
    for out, k in shapes:
        w, x = torch.randn(out, k, generator=g), torch.randn(3, k, generator=g)
        p = rowgemm.pack(w, nb)
        cases.append((x, p, out, rowgemm.gemm(x, p, nb, out, None, rb)))
    torch_threads(3)
    bad = []

    def loop():
        for i in range(600):
            x, p, out, want = cases[i % len(cases)]
            if not torch.equal(rowgemm.gemm(x, p, nb, out, None, rb), want):
                bad.append(i)

    ts = [threading.Thread(target=loop) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad, f"dispatches {bad[:5]} gave other bits"


@needs_kernels
def test_a_forked_child_gets_a_pool_of_its_own(torch_threads):
    """A child forked after the pool ran (a DataLoader worker, multiprocessing) has none of the parent's worker
    threads: its dispatches must not wait for them, and give the same bits."""
    import os

    g = torch.Generator().manual_seed(7)
    nb, rb = _variants()[0]
    w, x = torch.randn(700, 64, generator=g), torch.randn(2, 64, generator=g)
    p = rowgemm.pack(w, nb)
    torch_threads(2)
    want = rowgemm.gemm(x, p, nb, 700, None, rb)
    pid = os.fork()
    if pid == 0:   # the child: exit status 0 only with the parent's bits, 1 otherwise; killed if it hangs
        ok = all(torch.equal(rowgemm.gemm(x, p, nb, 700, None, rb), want) for _ in range(50))
        os._exit(0 if ok else 1)
    import time

    for _ in range(300):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in a dispatch")
    assert os.waitstatus_to_exitcode(status) == 0


@needs_kernels
def test_a_decode_step_runs_torch_inline_and_the_kernels_on_torch_threads(tmp_path, torch_threads):
    """During a BatchEngine step on the CPU, torch's own ops run on the calling thread (its libgomp threads would
    otherwise spin beside the kernels' pool) while the kernels keep torch's thread count; the count is restored
    after the step, an exception included, and a nested step changes nothing."""
    from specscope.engine.batch import BatchEngine
    from specscope.engine.request import Request

    torch_threads(2)
    with rowgemm.step_threads():
        assert torch.get_num_threads() == 1 and rowgemm.threads() == 2
        with rowgemm.step_threads():
            assert torch.get_num_threads() == 1 and rowgemm.threads() == 2
    assert torch.get_num_threads() == 2 and rowgemm.threads() == 2
    with pytest.raises(RuntimeError):
        with rowgemm.step_threads():
            raise RuntimeError("a failed step")
    assert torch.get_num_threads() == 2 and rowgemm.threads() == 2

    make_hf_model(tmp_path, "llama", tie=True)
    m = load_model(tmp_path, dtype="fp32")
    seen = []
    inner = m.forward

    def forward(*a, **k):          # the target's forward inside the step, as the engine calls it
        seen.append((torch.get_num_threads(), rowgemm.threads()))
        return inner(*a, **k)

    m.forward = forward
    eng = BatchEngine(m, None, None, max_num_seqs=2, max_seq_len=64)
    eng.add(Request("a", [1, 2, 3, 4], max_new_tokens=4))
    while eng.busy:
        eng.step()
    assert seen and set(seen) == {(1, 2)} and torch.get_num_threads() == 2
