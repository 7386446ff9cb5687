"""`specscope report`: runs made by the real engine and profiler on a tiny model, stored, then reported. Which
charts appear depends on what the runs hold; links pull in baselines and verify curves; bad input is one line."""

import copy
import json
import re

import pytest

from specscope.registry import make_record, open_registry
from tiny import make_hf_model
from cli_util import cli


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from specscope.models import load_model

    d = tmp_path_factory.mktemp("report-target")
    make_hf_model(d, "llama", layers=2)
    return load_model(d, dtype="fp32")


def _profiled(target, draft: bool, steps: int = 3):
    from specscope.generate import generate
    from specscope.profile import CycleProfiler
    from specscope.speculative.decode import SpecConfig, build_drafter, speculative_generate

    prof = CycleProfiler()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]       # repetitive: n-gram drafting gets some acceptance
    if draft:
        cfg = SpecConfig(steps, 1, steps + 1)
        speculative_generate(target, build_drafter("ngram", target), prompt, 24, None, (), cfg, profiler=prof)
        config = {"model": "tiny", "draft": "ngram", "steps": steps, "topk": 1, "draft_tokens": steps + 1}
        return make_record("speculative", f"ngram s{steps}", config=config, profiler=prof)
    generate(target, prompt, 24, None, (), profiler=prof)
    return make_record("baseline", "plain", config={"model": "tiny", "draft": None}, profiler=prof)


def _curve(target):
    from specscope.economics.verify_curve import measure_curve

    res = measure_curve(target, [32], [1, 2, 4, 8], warmup=0, repeats=2)
    return make_record("verify_curve", "curve", config={"model": "tiny"},
                       results={"points": res["points"], "fits": res["fits"]})


@pytest.fixture(scope="module")
def records(target):
    """Made once per module; each test stores copies in its own registry."""
    b, c = _profiled(target, False), _curve(target)
    s, s2 = _profiled(target, True, 3), _profiled(target, True, 2)
    s2["name"] = "<script>alert(1)</script>"
    ing = make_record("ingest", "sglang log", config={"engine": "sglang"},
                      results={"tok_per_s": 120.0, "accept_length": 2.4}, env={"host": "gpu-box"})
    return b, c, s, s2, ing


@pytest.fixture
def stored(records):
    """baseline B, speculative S (linked to B and the curve C), a second speculative S2, an ingested-style run I."""
    b, c, s, s2, ing = copy.deepcopy(records)
    with open_registry() as reg:
        ids = {"B": reg.add_run(b), "C": reg.add_run(c)}
        s["config"].update(baseline_run=ids["B"], verify_curve_run=ids["C"])
        ids["S"] = reg.add_run(s)
        ids["S2"] = reg.add_run(s2)
        ids["I"] = reg.add_run(ing)
    return ids


def alts(html):
    return re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,[A-Za-z0-9+/=]{200,}"', html)


def sections(html):
    return re.findall(r"<h2>([^<]+)</h2>", html)


def test_one_speculative_run_pulls_in_its_baseline_and_curve(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, stdout, err = cli(capsys, "report", stored["S"], "-o", out, "--json")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["runs"] == [stored["S"]] and sorted(res["linked"]) == sorted([stored["B"], stored["C"]])
    html = out.read_text()
    a = alts(html)
    assert len(a) == 5, a
    assert sections(html) == ["Runs", "Where the time goes", "Acceptance", "Break-even", "Verify cost",
                              "Environment"]       # one run: no compare table
    # the break-even is computed against the linked baseline's decode time
    assert "plain decoding:" in html
    assert "break-even needs τ" in html or "break-even is impossible" in html


def test_several_runs_get_a_compare_table_and_escaped_names(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, stdout, err = cli(capsys, "report", stored["B"], stored["S"], stored["S2"], "-o", out)
    assert code == 0, err
    assert stdout.startswith("wrote ")
    html = out.read_text()
    assert "Compare" in sections(html)
    assert "(reference)" in html and "ms/cycle" in html
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    a = alts(html)
    assert any("cycle time breakdown" in x for x in a) and any("histogram of τ" in x for x in a)
    # breakdown, τ, per position, break-even (S and S2 against B) and S's linked verify curve
    assert len(a) == 5, a
    # S links B; S2 links nothing and pairs with B, the plain run of the same model among those given
    assert html.count(f"vs baseline {stored['B']}") == 2 and "lacks" not in html


def test_unlinked_speculative_run_pairs_with_a_plain_run_of_the_same_model(target, tmp_path, capsys):
    b, s = _profiled(target, False), _profiled(target, True, 3)     # neither links the other
    with open_registry() as reg:
        bid, sid = reg.add_run(b), reg.add_run(s)
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", bid, sid, "-o", out)
    assert code == 0, err
    html = out.read_text()
    assert "speedup vs τ with the break-even point" in alts(html) and "lacks" not in html
    assert f"vs baseline {bid}" in html


def test_speculative_run_without_any_baseline_says_what_is_missing(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["S2"], "-o", out)
    assert code == 0, err
    html = out.read_text()
    assert "lacks" in html and "plain decode time per token" in html
    assert "speedup vs τ with the break-even point" not in alts(html)


def test_runs_without_phases_still_report(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["I"], "-o", out)
    assert code == 0, err
    html = out.read_text()
    assert alts(html) == []
    assert "No per-phase timings" in html and "gpu-box" in html


def test_environments_that_differ_are_shown_side_by_side(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["B"], stored["I"], "-o", out)
    assert code == 0, err
    html = out.read_text()
    assert "2 environments" in html and "<b>gpu-box</b>" in html


def test_verify_curve_run_alone(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["C"], "-o", out)
    assert code == 0, err
    html = out.read_text()
    assert [a for a in alts(html)] == ["verify cost curve with piecewise fit"]
    assert "context 32:" in html


@pytest.mark.parametrize("args,needle", [
    ((), "at least one run"),
    (("zzzz",), "no run 'zzzz'"),
    (("ab",), "too short"),
])
def test_bad_input_is_one_line(stored, tmp_path, capsys, args, needle):
    code, _, err = cli(capsys, "report", *args, "-o", tmp_path / "r.html")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not (tmp_path / "r.html").exists()


def test_unwritable_output_is_one_line(stored, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = cli(capsys, "report", stored["B"], "-o", blocker / "r.html")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "r.html" in lines[0] and "not a directory" in lines[0].lower(), err


def test_dollar_signs_in_run_labels_are_plain_text(records):
    from specscope.report import build_report

    s = copy.deepcopy(records[2])
    s["id"], s["config"]["draft"] = "abcd1234", "/drafters/x$^$y"     # as mathtext this fails to parse
    html = build_report([s])
    assert len(alts(html)) == 3 and "x$^$y" in html


# ------------------------------------------------------------------------------------------ trustworthy pictures

def _busy(rec, load=9, cores=2):
    rec = copy.deepcopy(rec)
    rec["env"].setdefault("cpu", {}).update(load_1m=load, cores_usable=cores)
    return rec


def test_runs_recorded_under_load_are_flagged_in_report_and_compare(records, tmp_path, capsys):
    b, _, s, _, _ = records
    with open_registry() as reg:
        quiet = reg.add_run(_busy(b, load=1))
        busy = reg.add_run(_busy(s, load=9))
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", quiet, busy, "-o", out)
    assert code == 0, err
    page = out.read_text()
    assert "Were these runs comparable?" in page and busy[:8] in page.split("Were these runs comparable?")[1][:400]
    assert "load average of 9 on 2 usable cores" in page
    code, stdout, err = cli(capsys, "compare", quiet, busy)
    assert code == 0, err
    assert f"run {busy} was recorded with a 1-minute load average of 9 on 2 usable cores" in stdout
    code, stdout, _ = cli(capsys, "compare", quiet, busy, "--json")
    assert list(json.loads(stdout)["load_warnings"]) == [busy]


def test_ingested_runs_show_drafter_acceptance_and_ingest_notes(tmp_path, capsys):
    """A vLLM log with per-position acceptance but no phase timings: acceptance chart, drafter not 'none',
    the malformed-line count and the warnings on the page."""
    ingest = {"format": "vllm", "lines": 120, "recognised": {"spec_decode": 10, "throughput": 4}, "malformed": 2,
              "other": 104, "malformed_examples": [{"line": 17, "reason": "truncated metrics line"}],
              "warnings": ["2 malformed line(s) skipped (corrupt, truncated or interleaved)"]}
    rec = make_record("ingest", "vllm log", config={"engine": "vllm", "steps": 3},
                      results={"tok_per_s": 90.0, "accept_length": 2.1, "drafted_tokens": 300,
                               "per_position_acceptance": [0.6, 0.35, 0.15], "ingest": ingest},
                      env={"ingested": True})
    with open_registry() as reg:
        rid = reg.add_run(rec)
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", rid, "-o", out)
    assert code == 0, err
    page = out.read_text()
    assert "per-position acceptance rate" in alts(page)
    assert "Ingested logs" in sections(page) and "truncated metrics line" in page and "malformed line(s)" in page
    runs_table = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    assert ">none<" not in runs_table and "not named in the log" in runs_table


def test_one_step_run_gets_a_bar_not_a_single_dot(target):
    from specscope.report import charts

    one = _profiled(target, True, steps=1)
    assert len(one["results"]["per_position_acceptance"]) == 1
    img = charts.per_position([one])
    assert img and img.startswith(b"\x89PNG")
    # the single-position chart is the bar chart: short (one bar), not the tall line chart
    import struct

    width, height = struct.unpack(">II", img[16:24])
    assert width == 480 and height < 300


def test_verify_curve_too_noisy_to_fit_says_so():
    from specscope.economics.verify_curve import knee_words

    fit = {"flat_ms": 300.0, "slope_ms_per_token": 40.0, "knee_tokens": 1.0, "rel_rmse": 0.4}
    noisy = [{"context": 64, "tokens": n, "median_ms": m, "p10_ms": 200.0, "p90_ms": 1300.0}
             for n, m in ((1, 320.0), (2, 600.0), (4, 450.0), (8, 900.0))]
    words = knee_words(fit, 8, noisy)
    assert words.startswith("too noisy to fit") and "200–1300 ms" in words and "compute-bound" not in words
    quiet = [dict(p, p10_ms=p["median_ms"] * 0.97, p90_ms=p["median_ms"] * 1.03) for p in noisy]
    assert "compute-bound already at n = 1" in knee_words(dict(fit, rel_rmse=0.05), 8, quiet)


def test_page_does_not_break_words(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["S"], stored["B"], "-o", out)
    assert code == 0, err
    page = out.read_text()
    assert "overflow-wrap:anywhere" not in page and "word-break:break-word" not in page
    assert "white-space:nowrap" in page.split("th{")[1].split("}")[0]    # headers never break mid-word


def test_breakeven_hint_names_no_flag_report_lacks(stored, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", stored["S2"], "-o", out)
    assert code == 0, err
    page = out.read_text()
    assert "--decode-ms" not in page.split("Break-even")[1].split("<h2>")[0].replace(
        "specscope breakeven --run ID --help", "") and "--baseline-run" not in page


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 700])
def test_report_renders_in_headless_chromium_without_overflow(stored, tmp_path, capsys, width):
    """The page as a browser draws it: a non-blank screenshot, no sideways scrolling at a laptop and a narrow
    window width, every inline image decodes. Skipped where Chromium is not installed."""
    import shutil

    from bench_util import load_bench

    if not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    rr = load_bench("render_report")
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", *stored.values(), "-o", out)
    assert code == 0, err
    lay = rr.layout(out, width)
    assert lay["scrollWidth"] <= lay["clientWidth"], lay          # no layout overflow
    assert lay["images"] == len(alts(out.read_text())) > 0 and lay["broken"] == 0, lay
    png = rr.screenshot(out, tmp_path / f"r{width}.png", width=width, height=1600)
    import matplotlib.image as mpimg
    import numpy as np

    px = mpimg.imread(str(png))[..., :3]
    assert px.shape[1] == width
    ink = (px.mean(axis=2) < 0.9).mean()                          # share of pixels that are not near-white
    assert 0.01 < ink < 0.9 and float(np.std(px)) > 0.05, (ink, float(np.std(px)))


def test_per_token_bars_add_up_to_the_run_tables_ms_per_token(records):
    from specscope.report import charts

    s = records[2]
    phases = charts.top_phases(s)
    total = sum(v * charts._per_token_scale(s, phases) for v in phases.values())
    assert total == pytest.approx(s["results"]["decode_ms_per_token"], rel=1e-9)
