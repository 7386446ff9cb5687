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
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter

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


def _page_of(rec, tmp_path, capsys) -> str:
    """`specscope report` of one stored record: the page."""
    with open_registry() as reg:
        rid = reg.add_run(rec)
    out = tmp_path / "r.html"
    code, _, err = cli(capsys, "report", rid, "-o", out)
    assert code == 0, err
    return out.read_text()


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
    page = _page_of(rec, tmp_path, capsys)
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


# ------------------------------------------------------------------------------------------ one rule, no clipping

def _cycles_run(kind, rid, seed, n, per_cycle_ms, tau_p, sigma):
    """A run with per-cycle samples: plain (tau_p None: one token a cycle, phase decode) or speculative."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total = (per_cycle_ms * rng.lognormal(0, sigma, n)).tolist()
    acc = [1] * n if tau_p is None else (1 + rng.binomial(3, tau_p, n)).tolist()
    T, A = sum(total), sum(acc)
    split = {"decode": 1.0} if tau_p is None else {"draft": 0.2, "verify": 0.8}
    cycle_ms = {p: [x * f for x in total] for p, f in split.items()}
    res = {"tok_per_s": A / T * 1e3, "decode_ms_per_token": T / A, "accept_length": A / n,
           "phases": {p: {"mean_ms": T * f / n, "share": f} for p, f in split.items()}}
    cfg = {"model": "tiny", "draft": None if tau_p is None else "ngram", "steps": None if tau_p is None else 3}
    if tau_p is not None:
        res["drafted_tokens"] = 3 * n
    return {"id": rid, "kind": kind, "name": kind, "config": cfg, "env": {}, "results": res,
            "samples": {"cycle_ms": cycle_ms, "cycle_total_ms": total, "accept_lengths": acc}}


@pytest.mark.parametrize("sigma,n,word", [(1.2, 12, "no significant change"), (0.05, 400, "faster")])
def test_headline_and_compare_table_judge_the_speed_by_one_rule(sigma, n, word):
    from specscope.registry.compare import compare_runs
    from specscope.report import build_report

    base = _cycles_run("baseline", "base000001", 1, n, 10.0, None, sigma)
    spec = _cycles_run("speculative", "spec000002", 2, n, 11.0, 0.6, sigma)    # τ ≈ 2.8: about 2.5× the speed
    spec["config"]["baseline_run"] = base["id"]
    spec["results"]["speedup"] = spec["results"]["tok_per_s"] / base["results"]["tok_per_s"]
    page = build_report([base, spec])
    head = re.search(r"<p class=headline>(.*?)</p>", page).group(1)
    row = {r["metric"]: r for r in compare_runs([base, spec])["rows"]}["tok_per_s"]
    expect = {"no significant change": "no significant change", "faster": "better"}[word]
    assert row["verdicts"][1] == expect                      # the table's verdict ...
    assert f": {word}" in head, head                         # ... is the headline's
    assert ("faster" in head) == (word == "faster") and f"{1 + row['changes'][1]['change']:.2f}×" in head
    compare = page.split("<h2>Compare</h2>")[1]
    assert f"{expect}</span>" in compare.split("</tr>")[1]   # the tok/s row, first after the header
    # the break-even's "achieved speedup" line follows the same rule
    achieved = re.search(r"<li>(achieved speedup: [^<]*)</li>", page).group(1)
    assert achieved.endswith("faster than plain decoding") == (word == "faster"), achieved


def test_every_chart_keeps_its_text_on_the_canvas(records):
    """Axis labels, tick labels and legends inside the PNG (the per-phase chart's x label was cut off), and no
    axis label under a legend; with long run names too."""
    from specscope.report import charts
    from specscope.report.build import breakeven_analysis

    b, c, s, s2, _ = copy.deepcopy(records)
    s2["config"]["draft"] = "/very/long/path/to/a/drafter/directory/with-a-rather-long-name-eagle3"
    runs = [b, s, s2]
    for i, r in enumerate(runs):
        r["id"] = f"run{i:07d}"
    by_id = {r["id"]: r for r in runs}
    items = [{"run": r, "analysis": breakeven_analysis(r, by_id, [b])} for r in (s, s2)]
    for name, args in (("cycle_breakdown", (runs,)), ("cycle_breakdown", ([b, s],)), ("tau_histogram", (runs,)),
                       ("per_position", (runs,)), ("breakeven", (items,)), ("verify_curve", (c,))):
        assert getattr(charts, name).layout_problems(*args) == [], name


def _analysis(mx, need, tau, sp, decode=14.4, cycle=15.7):
    return {"max_accept_length": mx, "break_even_accept_length": need, "cycle_ms": cycle, "decode_ms": decode,
            "measured_accept_length": tau, "speedup": sp}


def test_breakeven_axes_frame_the_measured_point(records):
    """A deep tree (steps 13) measured at τ 1.34: the axis ends a little past the point, not at τ 14 with the
    y-axis at 20×, and the caption says the lines run on."""
    from specscope.report import charts

    s = records[2]
    fig = charts.breakeven.figure([{"run": s, "analysis": _analysis(14.0, 1.09, 1.34, 1.23)}])
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert 1.34 < hi <= 2.5 and ax.get_ylim()[1] < 2.5
    assert "axis cut at" in ax.get_xlabel() and "steps + 1 = 14" in ax.get_xlabel()
    assert "the line ends" not in ax.get_xlabel() and "a line ends" not in ax.get_xlabel()
    assert max(max(line.get_xdata()) for line in ax.get_lines()) <= hi      # nothing drawn past the axis
    # a shallow chain: the axis reaches steps + 1, and the caption says the line ends there
    fig2 = charts.breakeven.figure([{"run": s, "analysis": _analysis(4.0, 1.5, 2.8, 2.1)}])
    assert fig2.axes[0].get_xlim()[1] == pytest.approx(4.0) and "a line ends at its steps + 1" in \
        fig2.axes[0].get_xlabel()
    import matplotlib.pyplot as plt

    plt.close(fig)
    plt.close(fig2)


def test_verify_cost_chart_draws_no_knee_its_legend_disowns():
    """A noisy context gets its points and no fit line, no dotted knee, and the title mentions no knee."""
    import matplotlib.pyplot as plt

    from specscope.report import charts

    noisy = [{"context": 64, "tokens": n, "median_ms": m, "p10_ms": 200.0, "p90_ms": 1300.0}
             for n, m in ((1, 320.0), (2, 600.0), (4, 450.0), (8, 900.0))]
    fit = {"flat_ms": 300.0, "slope_ms_per_token": 40.0, "knee_tokens": 2.0, "rel_rmse": 0.4}
    curve = {"id": "curve0001", "kind": "verify_curve", "results": {"points": noisy, "fits": {"64": fit}}}
    fig = charts.verify_curve.figure(curve)
    ax = fig.axes[0]
    assert [ln for ln in ax.get_lines() if ln.get_linestyle() in (":", "-") and len(ln.get_xdata()) > 2] == []
    assert "knee" not in ax.get_title() and "too noisy to fit: no fit drawn" in \
        " ".join(t.get_text() for t in ax.get_legend().get_texts())
    plt.close(fig)
    quiet = [dict(p, median_ms=300.0 + 40 * max(0, p["tokens"] - 2), p10_ms=None, p90_ms=None) for p in noisy]
    for p in quiet:
        p["p10_ms"], p["p90_ms"] = p["median_ms"] * 0.98, p["median_ms"] * 1.02
    fig = charts.verify_curve.figure({"id": "c2", "results": {"points": quiet, "fits": {"64": dict(fit, rel_rmse=0.01)}}})
    ax = fig.axes[0]
    assert "(dotted: knee)" in ax.get_title() and any(ln.get_linestyle() == ":" for ln in ax.get_lines())
    plt.close(fig)


# ------------------------------------------------------------------ labels derived from the numbers they label

def _served_report(tmp_path, capsys) -> tuple[str, list[dict]]:
    from served_runs import priced_and_always

    runs = list(priced_and_always())
    with open_registry() as reg:
        ids = [reg.add_run(r) for r in runs]
    for r, rid in zip(runs, ids):
        r["id"] = rid
    out = tmp_path / "served.html"
    code, _, err = cli(capsys, "report", *ids, "-o", out)
    assert code == 0, err
    return out.read_text(), runs


def _runs_table(page: str) -> list[list[str]]:
    body = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    return [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", body) if "<td" in tr]


def test_served_run_report_labels_match_their_numbers(tmp_path, capsys):
    """Two served runs (a priced server that drafted in 4 of 501 steps, the same server drafting at every step):
    the drafter is not 'none' beside τ 2.196, the ms/token shown is the chart's and decode tok/s is 1000 / it,
    the draft phase's change is 'from ~0', and no interval level is promised over a table without intervals."""
    from specscope.report import charts

    page, (priced, _) = _served_report(tmp_path, capsys)
    first = _runs_table(page)[0]
    drafter, decode_tok_s, ms_tok, tau, e2e = first[4], first[5], first[6], first[7], first[8]
    assert "none" not in drafter and "drafter not named by the server" in drafter
    assert tau.startswith("2.196") and "46 cycles" in tau                    # and how many cycles τ rests on
    from specscope.registry.rows import decode_ms_per_token

    phases = charts.top_phases(priced)
    per_token = sum(v * charts._per_token_scale(priced, phases) for v in phases.values())
    assert float(ms_tok) == pytest.approx(per_token, abs=0.01) == pytest.approx(decode_ms_per_token(priced))
    assert float(decode_tok_s) == pytest.approx(1e3 / per_token, abs=0.01) and e2e == "37.35"
    cmp = page.split("<h2>Compare</h2>")[1].split("<h2>")[0]
    draft_row = next(tr for tr in re.findall(r"<tr>(.*?)</tr>", cmp) if "Draft ms/cyc" in tr)
    assert "from ~0" in draft_row and "%" not in draft_row, draft_row
    assert "Intervals at" not in cmp and "No intervals" in cmp
    assert "neither" not in cmp and "not measured" not in cmp
    assert "drafter not named" in charts.label(priced)        # the legends beside τ and acceptance name it too


def test_runs_table_tok_s_columns_each_have_one_definition(records, tmp_path, capsys):
    """A generate run stores tok/s end to end (prefill in) beside decode-only ms/token: the table's decode tok/s
    is 1000 / its ms/token, and the end-to-end figure has its own column under its own note."""
    s = copy.deepcopy(records[2])
    res = s["results"]
    res["tok_per_s"] = round(res["decode_tok_per_s"] * 0.6, 3)     # as session.py stores it: prefill included
    page = _page_of(s, tmp_path, capsys)
    row = _runs_table(page)[0]
    from specscope.report.build import _f      # the table's number format

    assert row[5] == _f(1e3 / res["decode_ms_per_token"]) and row[6] == _f(res["decode_ms_per_token"])
    assert row[8] == _f(res["tok_per_s"])
    head = page.split("<h2>Runs</h2>")[1].split("</thead>")[0]
    assert "decode tok/s" in head and "tok/s end to end" in head
    note = page.split("<h2>Runs</h2>")[1].split("<p class=note>")[1].split("</p>")[0]
    assert "decode tok/s = 1000 / ms/token" in note and "tok/s end to end: with prefill" in note


def test_breakeven_max_is_bounded_by_the_positions_measured():
    """13 configured steps, acceptance measured at 7 positions: the line says the measured bound and names 14 as
    the extrapolation it is."""
    from specscope.economics.breakeven import BreakevenInputs, breakeven, describe, inputs_from_runs

    run = {"id": "deep", "kind": "speculative",
           "config": {"steps": 13},
           "results": {"accept_length": 2.2, "drafted_tokens": 300,
                       "per_position_acceptance": [0.6, 0.3, 0.15, 0.08, 0.04, 0.02, 0.01],
                       "phases": {"draft": {"mean_ms": 3.0}, "verify": {"mean_ms": 30.0}, "other": {"mean_ms": 1.0}}}}
    base = {"id": "plain", "results": {"decode_ms_per_token": 25.0}}
    inp = inputs_from_runs(run, base, BreakevenInputs())
    line = next(x for x in describe(breakeven(inp), inp) if x.startswith("break-even needs"))
    assert "max 8 as measured" in line and "7 draft position(s)" in line and "extrapolation" in line, line
    assert "max 14 with 13 step(s))" not in line


def test_environment_values_wrap_inside_their_column(records, tmp_path, capsys):
    """A CPU flag list has no spaces: it may wrap after its commas, and the table is laid out to its box."""
    b = copy.deepcopy(records[0])
    b["env"] = dict(b["env"] or {}, cpu=dict((b["env"] or {}).get("cpu") or {},
                                             simd="avx512f,avx512_bf16,avx512_vnni,amx_bf16,avx2,fma"))
    env = _page_of(b, tmp_path, capsys).split("<h2>Environment</h2>")[1]
    assert "<table class=fit>" in env and "avx512f,<wbr>avx512_bf16,<wbr>" in env
