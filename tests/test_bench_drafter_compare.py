"""bench/drafter_compare.py: τ pooled over cycles (not averaged over prompts), per task and MT-bench category."""

from bench_util import load_bench


def load():
    return load_bench("drafter_compare")


def test_summarise_pools_cycles_per_group():
    dc = load()
    per = [
        {"task": "mt_bench", "category": "writing", "accept_lengths": [1, 1, 1, 1], "identical": True},
        {"task": "mt_bench", "category": "math", "accept_lengths": [4, 4], "identical": True},
        {"task": "qa", "category": "qa", "accept_lengths": [2], "identical": False},
    ]
    s = dc.summarise(per)
    assert s["mt_bench"]["accept_length"] == 12 / 6          # pooled: 12 tokens over 6 cycles, not (1 + 4) / 2
    assert s["mt_bench/writing"]["accept_length"] == 1.0
    assert s["mt_bench/math"]["accept_length"] == 4.0
    assert s["qa"]["accept_length"] == 2.0 and s["qa"]["identical"] == 0
    assert s["overall"] == {"accept_length": 14 / 7, "cycles": 7, "identical": 2, "prompts": 3}
    assert "mt_bench/qa" not in s


def test_shape_parses_steps_topk_draft_tokens():
    c = load().shape("3,2,6")
    assert (c.steps, c.topk, c.draft_tokens) == (3, 2, 6)


def test_a_malformed_shape_is_one_clear_line():
    import pytest

    with pytest.raises(SystemExit, match="expected steps,topk,draft_tokens"):
        load().shape("3,2")
