"""check-drafter --served, its logic without an engine: the counters' deltas from real /metrics texts, the noise
band, which reading names the cause, and the one line for a server without the counters (a real HTTP server on
loopback). Against real engines: tests/engines/test_served.py and test_vllm.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from serve_util import LoopbackThread, QuietHandler

from specscope.served_check import Counters, Reading, band, counters_between, diagnose, missing_metric

LABELS = 'engine="0",model_name="m"'


def vllm_metrics(drafts, draft_tokens, accepted, per_pos, extra="") -> str:
    lines = ["# TYPE vllm:spec_decode_num_drafts counter",
             f"vllm:spec_decode_num_drafts_total{{{LABELS}}} {drafts}",
             f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}} {draft_tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}} {accepted}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABELS},position="{i}"}} {a}'
              for i, a in enumerate(per_pos)]
    return "\n".join(lines) + "\n" + extra


def test_counters_are_deltas_so_a_warm_servers_history_does_not_count():
    before = vllm_metrics(500, 1500, 300, [200, 80, 20])
    after = vllm_metrics(600, 1800, 360, [240, 95, 25])
    c = counters_between(before, after, "vllm")
    assert c == Counters(100, 300, 60, (40, 15, 5))
    assert c.tau == pytest.approx(1.6) and c.per_position == [0.4, 0.15, 0.05]


def test_tau_standard_error_counts_the_accepted_prefix():
    # P(A >= 1) = .5, P(A >= 2) = .25: E[A] = .75, E[A^2] = .5 + 3 * .25 = 1.25, Var = .6875 per draft
    c = Counters(100, 200, 75, (50, 25))
    assert c.se == pytest.approx(math.sqrt(0.6875 / 100))
    assert band(c, c) == pytest.approx(2 * math.sqrt(2) * c.se)
    assert Counters(10, 30, 0, (0, 0, 0)).se == 0.0


def reading(cause, c, what="x"):
    return Reading(cause, what, c, f"engine fix for {cause}", f"file fix for {cause}")


GOOD = Counters(167, 501, 86, (60, 20, 6))
SHIFTED = Counters(167, 501, 88, (64, 19, 5))


def test_equal_counters_agree_and_no_reading_is_blamed():
    d = diagnose(GOOD, GOOD, [reading("aux layer ids", SHIFTED)])
    assert (d.verdict, d.exact, d.causes) == ("agrees", True, [])


def test_a_reading_equal_to_the_served_counters_names_the_cause_within_noise():
    # τ 1.527 vs 1.515 is well within noise, but the engine's counters are the shifted reading's, to the token
    other = reading("norm placement", Counters(179, 537, 74, (67, 6, 1)))
    d = diagnose(SHIFTED, GOOD, [other, reading("aux layer ids", SHIFTED)])
    assert d.verdict == "explained" and d.exact and [(r.cause, how) for r, how in d.causes] == [
        ("aux layer ids", "engine")]


def test_a_gap_beyond_noise_is_named_by_the_closest_reading_else_left_unexplained():
    served = Counters(234, 702, 18, (13, 5, 0))
    near = reading("norm placement", Counters(230, 690, 19, (14, 5, 0)))
    far = reading("aux layer ids", SHIFTED)
    d = diagnose(served, GOOD, [far, near])
    assert d.verdict == "explained" and not d.exact and d.causes[0][0] is near and d.causes[0][1] == "engine"
    assert diagnose(served, GOOD, [far]).verdict == "unexplained"


def test_files_that_fit_another_reading_are_named_when_the_engine_agrees_with_them():
    collapsed = Counters(252, 756, 0, (0, 0, 0))
    d = diagnose(collapsed, collapsed, [reading("vocabulary map", GOOD), reading("aux layer ids", collapsed)])
    assert d.verdict == "explained" and d.causes[0][0].cause == "vocabulary map" and d.causes[0][1] == "files"
    # a reading better only within noise blames nothing
    assert diagnose(GOOD, GOOD, [reading("aux layer ids", SHIFTED)]).verdict == "agrees"


def test_missing_metric_names_the_first_counter_missing():
    text = vllm_metrics(1, 3, 1, [1, 0, 0])
    assert missing_metric(text, "http://h") == ("vllm", None)
    plain = "\n".join(ln for ln in text.splitlines() if "num_drafts" not in ln) + \
        f"\nvllm:num_requests_running{{{LABELS}}} 0\n"
    engine, why = missing_metric(plain, "http://h")
    assert engine == "vllm" and "no vllm:spec_decode_num_drafts counter" in why
    engine, why = missing_metric('sglang:spec_accept_length{dp_rank="0"} 2.1\n', "http://h")
    assert engine == "sglang" and "no vllm: or specscope: metrics" in why


class PlainVLLM(QuietHandler):
    """A vLLM serving without a drafter: its /metrics has no spec-decode counters."""

    def do_GET(self):
        body = f'vllm:num_requests_running{{{LABELS}}} 0\nvllm:generation_tokens_total{{{LABELS}}} 12\n'
        self._send(200, body.encode(), "text/plain")


def test_a_server_without_the_counters_is_one_line_naming_the_metric():
    srv = LoopbackThread(PlainVLLM)
    try:
        r = subprocess.run([sys.executable, "-m", "specscope", "check-drafter", "smollm2-135m-eagle3", "--model",
                            "smollm2-135m", "--served", srv.url], capture_output=True, text=True, timeout=120)
    finally:
        srv.close()
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stdout == ""
    assert r.stderr.startswith("error: ") and "vllm:spec_decode_num_drafts" in r.stderr
