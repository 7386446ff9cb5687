"""bench/shared_machine.py's bookkeeping: shares of the quiet speed, outputs under load checked against the quiet
ones, and the issue's bars (issue 51)."""

from types import SimpleNamespace

from bench_util import load_bench

sm = load_bench("shared_machine")


def _per(tokens, seconds):
    return [{"tokens": tokens, "seconds": seconds}]


def test_shares_and_identity_under_load():
    runs = {("specscope-plain", "fp32"): {"quiet": [_per([1, 2, 3, 4], 0.1)], "busy": [_per([1, 2, 3, 4], 0.2)],
                                          "nice19": [_per([1, 2, 3, 5], 0.1)]},
            ("specscope-plain-1t", "fp32"): {"quiet": [_per([1, 2, 3, 4], 0.2)], "busy": [_per([1, 2, 3, 4], 0.5)],
                                             "nice19": [_per([1, 2, 3, 4], 0.2)]},
            ("transformers", "fp32"): {"quiet": [_per([1, 2, 3, 4], 1.0)], "busy": [_per([1, 2, 3, 4], 4.0)],
                                       "nice19": [_per([1, 2, 3, 4], 1.0)]}}
    args = SimpleNamespace(dtypes=["fp32"], loads=["quiet", "busy", "nice19"])
    summary, same = sm.summarise(args, runs)
    two = summary["specscope-plain/fp32"]
    assert abs(two["quiet"]["tok_per_s"] - 40) < 1e-9 and abs(two["busy"]["share_of_quiet"] - 0.5) < 1e-9
    assert same["specscope-plain/fp32 busy output identical to its quiet output"] is True
    assert same["specscope-plain/fp32 nice19 output identical to its quiet output"] is False
    assert "same_as_quiet" not in summary["transformers/fp32"]["busy"]        # only our outputs are checked
    b = sm.bars(args, summary)
    assert b["fp32: 2-thread >= 0.40x quiet beside same-priority load"]
    assert b["fp32: 2-thread not slower than 1-thread beside same-priority load"]
    assert b["fp32: 2-thread ahead of transformers/fp32 (busy)"]
    assert sm.two_vs_one(args, summary) == {"fp32": "2.50x (rounds 2.50)"}     # 20 against 8 tok/s, one round
