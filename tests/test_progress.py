"""Progress that tells time (specscope.progress): done/total, the measured rate and the time left, on stderr only;
a bar on a terminal, timed lines in a log, nothing under --json off a terminal. And the load warning every timing
command prints when the machine was oversubscribed."""

from __future__ import annotations

import io
import json
import os
import re
import time

import pytest

from cli_util import cli
from specscope.progress import Progress, duration, left_text, rate_text
from specscope.registry.fingerprint import timing_warning
from tiny import make_hf_model


def test_log_lines_carry_rate_and_time_left_and_a_last_line():
    out = io.StringIO()
    with Progress("max concurrency 4", 4, "req", stream=out, tty=False, every_s=0) as p:
        time.sleep(0.05)
        p.advance()
        p.advance(2, info="1 failed")
        p.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines           # the last update is the closing line's, not one more of its own
    assert re.fullmatch(r"max concurrency 4: 1/4 req \([\d.]+ req/s, 0:0\d left\)", lines[0]), lines
    assert lines[1].endswith("left) 1 failed")
    assert re.fullmatch(r"max concurrency 4: 4/4 req \([\d.]+ req/s, done in 0:00\) 1 failed", lines[-1]), lines


def test_a_resumed_run_counts_only_its_own_work_in_the_rate():
    out = io.StringIO()
    p = Progress("prompts", 100, "prompt", start=50, stream=out, tty=False, every_s=0)
    time.sleep(0.25)
    p.update(60)
    rate = float(re.search(r"\(([\d.]+) prompt/s", out.getvalue()).group(1))
    assert rate <= 10 / 0.25 * 1.05         # 10 done in >= 0.25 s; counting the resumed 50 would give >= 240/s


def test_json_mode_off_a_terminal_and_disabled_print_nothing():
    for kw in ({"json_mode": True, "tty": False}, {"enabled": False, "tty": True}):
        out = io.StringIO()
        with Progress("x", 3, stream=out, every_s=0, **kw) as p:
            p.advance(3)
            p.close()
        assert out.getvalue() == "", kw


def test_a_terminal_gets_a_live_bar_with_rate_and_time_left():
    out = io.StringIO()
    with Progress("verify-curve", 10, "forward", stream=out, tty=True) as p:
        for _ in range(10):
            p.advance()
            time.sleep(0.01)
    text = out.getvalue()
    assert "verify-curve" in text and "10/10" in text and "forward/s" in text and "done" in text, text


def test_wording():
    assert duration(7) == "0:07" and duration(754) == "12:34" and duration(3723) == "1:02:03"
    assert rate_text(3, 1.0, "req") == "3.0 req/s" and rate_text(1, 4.2, "point") == "4.2 s/point"
    assert rate_text(0, 1.0, "req") is None and left_text(0, 5, 1.0) == "time left unknown yet"
    assert left_text(2, 4, 10.0) == "0:10 left" and left_text(4, 4, 10.0) == "done"


def test_timing_warning_reads_the_record_or_the_machine(monkeypatch):
    busy = {"cpu": {"load_1m": 6, "cores_usable": 2}}
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))      # a quiet machine now
    assert timing_warning(busy).startswith("warning: timed with a 1-minute load average of 6 on 2 usable cores")
    assert timing_warning({"cpu": {"load_1m": 1, "cores_usable": 2}}) is None and timing_warning() is None
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))   # the competing load, as the OS reports it
    assert "load average of 64" in timing_warning()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("progress-model")
    make_hf_model(d)
    return d


def test_verify_curve_shows_progress_on_stderr_and_results_on_stdout(model, capsys):
    args = ["verify-curve", "--model", model, "--context", "16,32", "--tokens", "1,2,4", "--repeats", "2",
            "--warmup", "1", "--device", "cpu", "--no-plot", "--no-record"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    # stderr is not a terminal here: per-point lines and the last progress line, with its rate and duration
    assert re.search(r"^verify-curve: 18/18 forward \([\d.]+ (forward/s|s/forward), done in \d+:\d\d\)$",
                     err, re.M), err
    assert "[6/6] context    32, n =   4" in err
    assert "verify-curve:" not in out and "[1/6]" not in out and "context 16:" in out
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["points"]
    assert "verify-curve:" not in err and "[1/6]" not in err    # --json off a terminal: no chatter


def test_verify_curve_warns_when_the_machine_was_loaded(model, capsys, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    args = ["verify-curve", "--model", model, "--context", "16", "--tokens", "1,2", "--repeats", "1", "--device",
            "cpu", "--no-plot", "--no-record"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert "warning: timed with a 1-minute load average of 9 on" in err and "warning" not in out
    code, out, err = cli(capsys, *args, "--json")
    assert "load average of 9" in json.loads(out)["load_warning"]
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    code, out, err = cli(capsys, *args, "--json")
    assert json.loads(out)["load_warning"] is None


def test_a_total_learnt_on_the_way_moves_the_bar():
    """train's --max-minutes fits the step count to the time after the bar started."""
    out = io.StringIO()
    with Progress("train", 1000, "step", stream=out, tty=True) as p:
        p.set_total(40)
        p.update(40)
    assert "40/40" in out.getvalue()
