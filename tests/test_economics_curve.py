"""Verify-cost curve: the piecewise fit on known curves, a real measurement on a tiny model, the CLI run + plot."""

import json

import pytest

from specscope.cli import main
from specscope.economics.verify_curve import PiecewiseFit, VerifyCurve, fit_piecewise, knee_words, parse_int_list
from specscope.errors import SpecscopeError
from tiny import make_hf_model


def test_fit_recovers_flat_then_linear():
    ns = [1, 2, 4, 8, 16, 32, 64]
    truth = PiecewiseFit(10.0, 0.5, 8.0, 0.0)          # 10 ms up to 8 tokens, then +0.5 ms per token
    fit = fit_piecewise(ns, [truth(n) for n in ns])
    assert fit.flat_ms == pytest.approx(10.0, rel=1e-6)
    assert fit.slope_ms == pytest.approx(0.5, rel=1e-3)
    assert fit.knee == pytest.approx(8.0, abs=0.2)
    assert "knee at n ≈ 8" in knee_words(fit.to_dict(), 64)


def test_fit_flat_and_rising_from_start():
    ns = [1, 2, 4, 8]
    flat = fit_piecewise(ns, [5.0, 5.0, 5.0, 5.0])
    assert flat.slope_ms == 0.0 and flat.knee == 8.0
    assert "no knee in range" in knee_words(flat.to_dict(), 8)
    lin = fit_piecewise(ns, [2.0 + 3.0 * (n - 1) for n in ns])
    assert lin.knee == pytest.approx(1.0) and lin.slope_ms == pytest.approx(3.0)
    assert "no flat region" in knee_words(lin.to_dict(), 8)


def test_curve_interpolates_between_contexts():
    vc = VerifyCurve({100: PiecewiseFit(10, 1, 4, 0), 300: PiecewiseFit(20, 1, 4, 0)})
    assert vc(1, 100) == 10 and vc(8, 100) == 14
    assert vc(1, 200) == pytest.approx(15)             # halfway in L
    assert vc(1, 50) == 10                             # clamped below the first context
    assert vc(1, 500) == pytest.approx(30)             # extrapolated linearly above the last
    assert vc.ratio(8, 1, 100) == pytest.approx(1.4)


def test_curve_prefers_measured_points_inside_their_range():
    fit = PiecewiseFit(10, 1, 4, 0)
    # width 2 measured slower than its neighbours (a kernel quirk): the measurement wins over the fit
    vc = VerifyCurve({100: fit}, points={100: {1: 10.0, 2: 14.0, 4: 10.0, 8: 14.0}})
    assert vc(2, 100) == 14.0 and vc(3, 100) == pytest.approx(12.0) and vc(6, 100) == pytest.approx(12.0)
    assert vc(16, 100) == fit(16)                      # beyond the measured widths: the fit
    run = {"kind": "verify_curve", "id": "v1", "results": {"fits": {"100": fit.to_dict()},
           "points": [{"context": 100, "tokens": n, "median_ms": t} for n, t in ((1, 10.0), (2, 14.0))]}}
    assert VerifyCurve.from_run(run)(2, 100) == 14.0


def test_parse_int_list_errors():
    assert parse_int_list("4, 1,2,2", "--tokens") == [1, 2, 4]
    with pytest.raises(SpecscopeError, match="comma-separated"):
        parse_int_list("1,x", "--tokens")
    with pytest.raises(SpecscopeError, match=">= 1"):
        parse_int_list("0,2", "--context")


def test_verify_curve_cli_tiny_model(tmp_path, capsys):
    model = tmp_path / "tiny"
    make_hf_model(model)
    png = tmp_path / "curve.png"
    main(["verify-curve", "--model", str(model), "--context", "16,64", "--tokens", "1,4,8", "--repeats", "2",
          "--warmup", "1", "--device", "cpu", "--plot", str(png), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert png.exists() and png.stat().st_size > 5000 and out["plot"] == str(png)
    assert {(p["context"], p["tokens"]) for p in out["points"]} == {(L, n) for L in (16, 64) for n in (1, 4, 8)}
    assert all(p["p10_ms"] <= p["median_ms"] <= p["p90_ms"] for p in out["points"])
    from specscope.registry import open_registry

    with open_registry() as reg:
        run = reg.get_run(out["run_id"])
    assert run["kind"] == "verify_curve" and len(run["samples"]["verify_ms"]["16:8"]) == 2
    vc = VerifyCurve.from_run(run)
    assert vc(1, 16) > 0 and set(vc.fits) == {16, 64}
    # the human table names the knee per context
    main(["verify-curve", "--model", str(model), "--context", "16", "--tokens", "1,2", "--repeats", "3",
          "--device", "cpu", "--no-plot", "--no-record"])
    text = capsys.readouterr().out
    # a hiccup on a shared machine can make two points unreadable; then it says so instead of reading them
    assert "context 16:" in text and ("one decode step" in text or "too noisy to fit" in text)


def test_verify_curve_cli_bad_input(tmp_path, capsys):
    model = tmp_path / "tiny"
    make_hf_model(model)
    with pytest.raises(SystemExit):
        main(["verify-curve", "--model", str(model), "--context", "250", "--tokens", "1,16", "--no-plot"])
    assert "exceeds the model's context of 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify-curve", "--model", str(model), "--repeats", "0", "--no-plot"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def _pts(meds, spread=0.03):
    return [{"context": 64, "tokens": n, "median_ms": m, "p10_ms": m * (1 - spread), "p90_ms": m * (1 + spread)}
            for n, m in meds]


def test_cheap_words_agree_with_the_noise_verdict_and_read_as_english():
    from specscope.economics.verify_curve import cheap_words, fit_piecewise, knee_words

    flat = _pts([(1, 10.0), (2, 10.2), (4, 10.4), (8, 10.6), (16, 14.0), (32, 20.0), (64, 30.0)])
    assert cheap_words(flat) == "up to 8 tokens verify within 10% of one decode step (10.00 ms)"
    # a width within 10 % after one that is not (noise, a kernel quirk) does not extend the range
    quirk = _pts([(1, 10.0), (2, 10.5), (4, 12.0), (8, 10.8)])
    assert cheap_words(quirk).startswith("up to 2 tokens")
    # only the one-token step itself: said so, never "up to 1 tokens"
    steep = _pts([(1, 10.0), (2, 13.0), (4, 16.0)])
    words = cheap_words(steep)
    assert words == "no wider verify stays within 10% of one decode step (10.00 ms): 2 tokens already cost 1.30× as much"
    # too noisy to fit: knee_words says so and no number read off the noise follows it
    noisy = _pts([(1, 300.0), (2, 320.0), (4, 290.0), (64, 310.0)], spread=2.0)
    fit = fit_piecewise([p["tokens"] for p in noisy], [p["median_ms"] for p in noisy]).to_dict()
    assert knee_words(fit, 64, noisy).startswith("too noisy to fit") and cheap_words(noisy, fit) is None
    assert cheap_words(_pts([(1, 10.0)])) is None                       # one width: nothing to compare
    assert cheap_words(_pts([(2, 10.0), (4, 10.5)])) == "up to 4 tokens verify within 10% of the 2-token forward " \
                                                         "(10.00 ms)"


def test_verify_curve_cli_conclusions_follow_the_noise_verdict(tmp_path, capsys):
    model = tmp_path / "tiny"
    make_hf_model(model)
    main(["verify-curve", "--model", str(model), "--context", "16,64", "--tokens", "1,2,4,8", "--repeats", "3",
          "--device", "cpu", "--no-plot", "--no-record"])
    out = capsys.readouterr().out
    for L in (16, 64):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"context {L}: ")]
        noisy = any("too noisy to fit" in ln for ln in lines)
        cheap = [ln for ln in lines if "within 10%" in ln]
        assert len(cheap) == (0 if noisy else 1), out       # no "up to N tokens" after "too noisy to fit"
    assert "up to 1 tokens" not in out and "up to 1 token " not in out
