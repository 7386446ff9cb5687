"""Timings that feed a decision (serve's verify prices, a verify curve, tune's tables) are checked against what
else ran while they were measured (issue 52, item 1): `serve` once cached prices measured at load 5-6 and then
drafted in 0 of 503 steps, silently. The load here is real: one busy process per usable core, at our priority."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cli_util import cli, one_error_line
from spec_helpers import tiny_target


@pytest.fixture
def busy(monkeypatch):
    """One busy process per usable core for the test's duration, and the real load rule (conftest lifts it)."""
    monkeypatch.delenv("SPECSCOPE_LOADED_CORES", raising=False)
    n = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5)                       # running, not still starting
    yield n
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU accounting is read from Linux's /proc")
def test_the_meter_counts_other_processes_not_ours(busy):
    from specscope.cpuload import ContentionMeter

    with ContentionMeter() as m:
        end = time.process_time() + 0.5
        while time.process_time() < end:     # our own work (a busy thread of ours) is not a neighbour
            pass
        time.sleep(0.5)
    assert m.result is not None and m.result.loaded
    assert 0.5 * busy <= m.result.others_cores <= m.result.cores
    assert "other processes kept" in m.result.words()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU accounting is read from Linux's /proc")
def test_prices_measured_under_load_are_used_once_never_cached_and_never_seed_the_policy(busy, tmp_path,
                                                                                          monkeypatch, capsys):
    from specscope import cachedir
    from specscope.economics import prices as prices_mod
    from specscope.economics.policy import PricedPolicy
    from specscope.speculative.decode import SpecConfig

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    monkeypatch.setattr(prices_mod, "QUIET_WAIT_S", 1.5)    # how long to wait for the load to drop (10 s in use)
    target = tiny_target(tmp_path / "m", layers=1, max_position_embeddings=40)
    capsys.readouterr()
    p = prices_mod.host_prices(target)
    assert p.loaded and "other processes kept" in p.loaded
    assert p.verify(1) == 1.0                                  # still a usable curve for this run
    assert not prices_mod.prices_path(target).exists()        # but not this host's prices for later runs
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "not cached" in warned[0] and "other processes kept" in warned[0]
    # the live policy learns T(rows) from the server's own steps instead of from the loaded curve
    policy = PricedPolicy(SpecConfig(steps=3, topk=1, draft_tokens=4), p)
    assert policy.costs.bins == {} and policy.predict(1) is None
    quiet = PricedPolicy(SpecConfig(steps=3, topk=1, draft_tokens=4), prices_mod.Prices(p.verify_ratio, p.decode_ms))
    assert quiet.predict(1) is not None


def _store_curve(contention: dict | None) -> str:
    from specscope.economics.verify_curve import fit_piecewise
    from specscope.registry import make_record, store_record

    fit = fit_piecewise([1, 2, 4, 8], [10.0, 10.2, 10.5, 14.0]).to_dict()
    results = {"points": [{"context": 64, "tokens": n, "median_ms": ms, "p10_ms": ms, "p90_ms": ms}
                          for n, ms in ((1, 10.0), (2, 10.2), (4, 10.5), (8, 14.0))],
               "fits": {"64": fit}, "decode_ms": {"64": 10.0}}
    if contention:
        results["contention"] = contention
    rec = make_record("verify_curve", "curve", config={"contexts": [64], "tokens": [1, 2, 4, 8]}, results=results,
                      samples={})
    return store_record(rec)


def test_a_curve_measured_under_load_is_no_basis_for_pricing(capsys):
    loaded = _store_curve({"others_cores": 1.8, "cores": 2, "seconds": 4.0, "loaded": True})
    quiet = _store_curve({"others_cores": 0.02, "cores": 2, "seconds": 4.0, "loaded": False})
    old = _store_curve(None)                                   # stored before the meter existed: read as before
    args = ["breakeven", "--draft-ms", "1.0", "--steps", "3", "--verify-tokens", "4"]
    line = one_error_line(*cli(capsys, *args, "--verify-curve", loaded)[::2])
    assert f"verify curve {loaded}" in line and "other processes kept 1.8 of 2 cores busy" in line
    assert "measure it again on a quieter machine" in line
    for ok in (quiet, old):
        code, out, err = cli(capsys, *args, "--verify-curve", ok)
        assert code == 0 and "error" not in err, err


def test_the_policy_says_why_it_runs_plain(monkeypatch):
    """/metrics counts each priced step's decision by reason, and the plain steps' reason is in words."""
    from specscope.economics.policy import PricedPolicy
    from specscope.engine.batch import StepRecord
    from specscope.server.metrics import ServerMetrics
    from specscope.speculative.budget import Prices
    from specscope.speculative.decode import SpecConfig

    steep = Prices({1: 1.0, 2: 1.9, 4: 3.8, 8: 7.6, 16: 15.0}, 10.0)    # every verified row costs a whole step
    policy = PricedPolicy(SpecConfig(steps=3, topk=1, draft_tokens=4), steep)
    assert policy(1) is None and policy.last == ("plain", "predicted_slower")
    words = policy.why_plain(1)
    assert words.startswith("drafting predicted at ") and "tok/s against" in words and "plain at batch 1" in words

    m = ServerMetrics()
    m.observe_step(StepRecord(batch=1, drafted=0, rows=1, tokens=1, phases_ms={"verify": 10.0}), policy.last)
    text = m.render().decode()
    assert 'specscope:spec_policy_decisions_total{decision="plain",reason="predicted_slower"} 1.0' in text


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU accounting is read from Linux's /proc")
def test_kernel_tiles_chosen_under_load_are_not_cached(busy, tmp_path, monkeypatch, capsys):
    """The row kernels' tile choice is a timing that decides every later run's speed: one made beside a busy
    process per core (a plan tuned during a loaded test run made verify 30 % slower here) is this run's only."""
    import json

    from specscope import cachedir
    from specscope.models import tuning

    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    monkeypatch.setattr(tuning, "_this_run", {})
    plan = tuning.tuned_plan(64, 32)
    assert tuning._valid_plan(plan)
    path = tuning.tune_file()
    assert not path.exists() or "64x32" not in json.loads(path.read_text())["plans"]
    assert tuning.tuned_plan(64, 32) == plan                   # kept for this process: not measured again
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "not cached" in warned[0] and "other processes kept" in warned[0]
