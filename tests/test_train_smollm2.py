"""Slow: Magpie synthesis on the real SmolLM2 target (dedup, resume) and the shipped drafter against it."""

import json
from pathlib import Path

import pytest
import torch

SHIPPED = Path(__file__).resolve().parent.parent / "src" / "specscope" / "assets" / "drafters" / "smollm2-135m-eagle3"


@pytest.fixture(scope="module")
def smollm2():
    from specscope.train.pipeline import load_target

    return load_target("smollm2-135m", "cpu", "fp32")


@pytest.mark.slow
def test_synthesis_dedup_and_resume(smollm2, tmp_path):
    from specscope.train.data import read_conversations, synthesise

    model, tok, _ = smollm2
    out = tmp_path / "c.jsonl"
    n1 = synthesise(model, tok, out, 2, batch=4, user_tokens=48, response_tokens=16, seed=0, max_batches=6)
    assert n1 >= 2
    lines = out.read_text().splitlines()
    n2 = synthesise(model, tok, out, n1 + 1, batch=4, user_tokens=48, response_tokens=16, seed=0, max_batches=6)
    assert n2 > n1 and out.read_text().splitlines()[:len(lines)] == lines      # appended, never rewritten
    convs, rep = read_conversations(out)
    users = [c[0]["content"].lower() for c in convs]
    assert len(set(users)) == len(users) and all(c[1]["role"] == "assistant" for c in convs)
    assert all(json.loads(l)["source"] == "magpie" for l in out.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.skipif(not SHIPPED.exists(), reason="shipped drafter not trained yet")
def test_shipped_drafter_fits_smollm2(smollm2):
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter
    from specscope.speculative.formats import load_drafter

    model, tok, _ = smollm2
    d = load_drafter(SHIPPED, model)               # validates against the target
    assert d.config.draft_vocab_size * 576 * 2 < 30e6 and list(d.aux_layers) == [2, 15, 27]
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size < 30e6
    ids = tok.encode("Give me three tips for staying productive while working from home.", chat=True)
    base = generate(model, ids, 48, SamplingParams(), tok.eos_ids)
    spec = speculative_generate(model, build_drafter("smollm2-135m-eagle3", model), ids, 48, SamplingParams(),
                                tok.eos_ids, SpecConfig.from_knobs(steps=4, topk=1, draft_tokens=5))
    assert spec.token_ids == base.token_ids
    assert spec.stats.accept_length > 1.2
