"""bf16 on CPU through our kernels (`--dtype bf16`; models/loader.py round_to_bf16): weights and each linear's input
rounded to bf16, fp32 accumulation, row-invariant. So greedy speculative output equals greedy plain bf16 output for
every drafter, sampling keeps the bf16 target's distribution, and the logits are the checkpoint's within bf16
rounding (transformers in fp32 is the oracle)."""

import pytest
import torch

from specscope.generate import generate
from specscope.models import load_model, rowgemm
from specscope.models.linear import PackedLinear, pack_linears
from specscope.models.loader import compute_dtype, round_to_bf16
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import DraftModelDrafter, Eagle3TreeDrafter
from specscope.speculative.hybrid import CopyFirstHybrid, NgramDrafter
from spec_helpers import random_eagle3
from test_spec_lossless import SHAPES, prompts
from test_spec_sampling import CASES, N, V, chi2_p, drafter_for, exact_pair_dist, sample_pairs
from tiny import make_hf_model

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="bf16 precision needs our CPU kernels")


def bf16_drafter(target, **kw):
    """A random EAGLE-3 drafter in the target's bf16 precision, as build_drafter places a real one."""
    d = random_eagle3(target, **kw)
    round_to_bf16(d)
    pack_linears(d, keep_dense=(), precision="bf16")
    return d


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("t")
    make_hf_model(path, "llama", layers=4)
    return load_model(path, dtype="bf16")


def test_a_bf16_model_is_fp32_tensors_of_bf16_values_behind_bf16_linears(target):
    assert target.precision == "bf16" and compute_dtype(target) == torch.bfloat16 and target.dtype == torch.float32
    lins = [m for m in target.modules() if isinstance(m, PackedLinear)]
    assert lins and all(pl.fmt == "bf16a" for pl in lins)
    for p in target.parameters():
        assert torch.equal(p, p.bfloat16().float())
    cache = target.new_cache(8)   # keys and values in bf16, as a bf16 engine keeps them; the residual stream fp32
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16


def test_bf16_logits_are_the_checkpoints_within_bf16_rounding(tmp_path):
    """Our bf16 forward against transformers in fp32 (the oracle) and in bf16: as close as torch's own bf16."""
    transformers = pytest.importorskip("transformers")
    make_hf_model(tmp_path, "llama", layers=3)
    ours = load_model(tmp_path, dtype="bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 101, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0].double()
        ref_bf16 = hf.to(torch.bfloat16)(ids).logits[0].double()
        got = ours(ids, torch.arange(24)[None]).logits[0].double()
    err, torch_err = (got - ref).abs().max().item(), (ref_bf16 - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item() and err <= 2 * torch_err, (err, torch_err)
    assert (got - ref).abs().max().item() > 0     # really rounded: not the fp32 path


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: f"s{c.steps}k{c.topk}n{c.draft_tokens}")
def test_eagle3_greedy_equals_plain_bf16(target, cfg):
    d = bf16_drafter(target, draft_vocab=60)
    for p in prompts():
        ref = generate(target, p, 24, stop_ids=[])
        res = speculative_generate(target, Eagle3TreeDrafter(d, target), p, 24, cfg=cfg)
        assert res.token_ids == ref.token_ids


def test_ngram_hybrid_and_draft_model_greedy_equal_plain_bf16(tmp_path, target):
    other_dir = tmp_path / "other"
    make_hf_model(other_dir, "llama", seed=7, layers=2)
    other = load_model(other_dir, dtype="bf16")
    d = bf16_drafter(target, draft_vocab=60)
    drafters = {"ngram": (lambda: NgramDrafter(target.device), SpecConfig(4, 1, 5)),
                "draft model": (lambda: DraftModelDrafter(other, target), SpecConfig(3, 2, 6)),
                "hybrid": (lambda: CopyFirstHybrid(Eagle3TreeDrafter(d, target), target.config.max_position_embeddings),
                           SpecConfig(3, 2, 6, 3))}
    for name, (make, cfg) in drafters.items():
        for p in prompts():
            ref = generate(target, p, 24, stop_ids=[])
            res = speculative_generate(target, make(), p, 24, cfg=cfg)
            assert res.token_ids == ref.token_ids, name


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("v6")
    make_hf_model(path, "llama", vocab=V, hidden=16, layers=2, seed=3)
    return load_model(path, dtype="bf16")


@pytest.mark.parametrize("name", ["chain_q", "tree", "hybrid_priced_tree"])
def test_bf16_speculative_sampling_matches_the_bf16_target(small_target, name):
    d = bf16_drafter(small_target, draft_vocab=5, seed=1, scale=4.0)
    probs = exact_pair_dist(small_target)
    counts = sample_pairs(small_target, drafter_for(small_target, d, name), CASES[name])
    assert counts.sum() == N and chi2_p(counts, probs) > 1e-3


def test_bf16_has_its_own_prices_and_says_what_it_is(tmp_path, target):
    """A bf16 model's tensors are fp32: its verify prices must not be cached as fp32's, and the demo's dtype line
    must say which bf16 it is."""
    from specscope.economics.prices import _key
    from specscope.models.loader import describe_dtype

    path = tmp_path / "same"
    make_hf_model(path, "llama", layers=4)
    fp32 = load_model(path, dtype="fp32")
    bf16 = load_model(path, dtype="bf16")
    assert _key(fp32) != _key(bf16) and _key(bf16) == _key(load_model(path, dtype="bf16"))
    assert describe_dtype(bf16).startswith("bf16 through specscope's kernels") and "plain bf16 output" in describe_dtype(bf16)
    assert describe_dtype(fp32).startswith("fp32")
