"""Sampling: temperature, top-k, top-p, seeds; stop on EOS / stop ids / max tokens."""

import pytest
import torch

from specscope.engine.request import StopCriteria
from specscope.generate import generate
from specscope.runtime.sampling import SamplingParams, make_generator, next_token, probs_from_logits, sample
from specscope.errors import SpecscopeError
from specscope.models import load_model
from tiny import make_hf_model

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_temperature_scales_logits():
    for t in (0.5, 1.0, 2.0):
        p = probs_from_logits(LOGITS, SamplingParams(temperature=t))
        torch.testing.assert_close(p, torch.softmax(LOGITS / t, -1))
    assert probs_from_logits(LOGITS, SamplingParams(temperature=1.0)).dtype == torch.float32


def test_top_k_keeps_k_largest():
    p = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    assert (p[0, :3] > 0).all() and (p[0, 3:] == 0).all()
    torch.testing.assert_close(p[0, :3], torch.softmax(LOGITS[0, :3], -1))


def test_top_p_keeps_smallest_set_reaching_p():
    base = torch.softmax(LOGITS, -1)[0]
    cum = base.cumsum(0)
    for p_ in (0.3, 0.6, 0.9, 0.99):
        p = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=p_))[0]
        n = int((cum < p_).sum()) + 1  # first k whose mass reaches top_p
        assert (p[:n] > 0).all() and (p[n:] == 0).all(), (p_, p)
        torch.testing.assert_close(p[:n], base[:n] / base[:n].sum())


def test_top_k_and_top_p_combine():
    p = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=4, top_p=0.8))[0]
    k4 = torch.softmax(LOGITS[0, :4], -1)
    n = int((k4.cumsum(0) < 0.8).sum()) + 1
    assert (p[:n] > 0).all() and (p[n:] == 0).all()


def test_sample_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, 4), g)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert (freq - probs).abs().max() < 0.015


def test_greedy_is_argmax_and_needs_no_generator():
    sp = SamplingParams()
    assert sp.greedy and make_generator(sp, "cpu") is None
    assert int(next_token(LOGITS, sp, None)) == 0


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_invalid_sampling_params(kw):
    with pytest.raises(SpecscopeError):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    make_hf_model(d, "llama")
    return load_model(d, dtype="fp32")


def test_seed_reproducible_and_different_seeds_differ(model):
    sp = lambda s: SamplingParams(temperature=1.5, seed=s)  # noqa: E731
    a = generate(model, [5, 6, 7], 24, sp(1)).token_ids
    b = generate(model, [5, 6, 7], 24, sp(1)).token_ids
    c = generate(model, [5, 6, 7], 24, sp(2)).token_ids
    assert a == b
    assert a != c


def test_top_k_1_is_greedy(model):
    greedy = generate(model, [9, 10, 11], 16).token_ids
    assert generate(model, [9, 10, 11], 16, SamplingParams(temperature=0.8, top_k=1, seed=3)).token_ids == greedy
    assert generate(model, [9, 10, 11], 16, SamplingParams(temperature=2.0, top_p=1e-6, seed=4)).token_ids == greedy


def test_stop_on_max_tokens(model):
    r = generate(model, [5, 6], 7)
    assert r.num_tokens == 7 and r.stop_reason == "length"
    assert len(r.step_ms) == 6  # the first token comes from prefill
    r1 = generate(model, [5, 6], 1)
    assert r1.num_tokens == 1 and r1.stop_reason == "length"


def test_stop_on_stop_ids_inclusive(model):
    free = generate(model, [5, 6], 20).token_ids
    stop = free[6]
    first = free.index(stop)
    r = generate(model, [5, 6], 20, stop_ids=[stop, 100_000])
    assert r.token_ids == free[:first + 1]
    assert r.stop_reason == "eos"
    # streamed callbacks see exactly the returned tokens
    seen = []
    generate(model, [5, 6], 20, stop_ids=[stop], on_tokens=seen.extend)
    assert seen == r.token_ids


def test_stop_criteria_clip():
    s = StopCriteria(5, stop_ids=[9])
    assert s.clip([1, 2], [3, 9, 4]) == ([3, 9], "eos")
    assert s.clip([1, 2], [3, 4, 5, 6]) == ([3, 4, 5], "length")
    assert s.clip([], [3]) == ([3], None)


def test_on_tokens_exception_aborts(model):
    class Stop(Exception):
        pass

    def cb(ids):
        raise Stop

    with pytest.raises(Stop):
        generate(model, [5, 6], 20, on_tokens=cb)


def test_stop_criteria_emit_appends_and_streams_what_clip_keeps():
    s, produced, streamed = StopCriteria(5, stop_ids=[9]), [1, 2], []
    assert s.emit(produced, [3, 4, 5, 6], streamed.append) == "length"
    assert produced == [1, 2, 3, 4, 5] and streamed == [[3, 4, 5]]
    assert s.emit([], [3]) is None           # no callback: nothing streamed, nothing fails
