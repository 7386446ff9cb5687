"""The report as a browser draws it: headless Chromium (Debian's `chromium`, installed by `make report-tools`) loads
a report of every kind of run and the page has no console error, no image that does not decode and no element
whose content overflows its box (at a laptop width nothing even scrolls sideways; at a narrow one only the tables'
scrolling wrappers may). The probe itself is shown to catch each of those on a page made broken on purpose."""

from __future__ import annotations

import pytest

from chromium_util import chromium_path, render
from cli_util import cli
from specscope.registry import make_record, open_registry
from tiny import make_hf_model

pytestmark = pytest.mark.skipif(chromium_path() is None,
                                reason="chromium is not installed (make report-tools, or apt-get install -y chromium)")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A plain run, an n-gram speculative run linked to it and to a verify curve, a second speculative run with a
    long name, and an ingested engine log with acceptance but no phases: made by the real engine on a tiny model."""
    from specscope.economics.verify_curve import measure_curve
    from specscope.generate import generate
    from specscope.models import load_model
    from specscope.profile import CycleProfiler
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig, build_drafter

    d = tmp_path_factory.mktemp("render-target")
    make_hf_model(d, "llama", layers=2)
    target = load_model(d, dtype="fp32")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def spec(steps, name):
        prof = CycleProfiler()
        speculative_generate(target, build_drafter("ngram", target), prompt, 24, None, (),
                             SpecConfig(steps, 1, steps + 1), profiler=prof)
        return make_record("speculative", name, profiler=prof, config={"model": "tiny", "draft": "ngram",
                                                                        "steps": steps, "topk": 1,
                                                                        "draft_tokens": steps + 1})

    prof = CycleProfiler()
    generate(target, prompt, 24, None, (), profiler=prof)
    base = make_record("baseline", "plain", config={"model": "tiny", "draft": None}, profiler=prof)
    res = measure_curve(target, [32], [1, 2, 4, 8], warmup=0, repeats=2)
    curve = make_record("verify_curve", "curve", config={"model": "tiny"},
                        results={"points": res["points"], "fits": res["fits"]})
    ing = make_record("ingest", "vllm log", config={"engine": "vllm", "steps": 3},
                      results={"tok_per_s": 90.0, "accept_length": 2.1, "drafted_tokens": 300,
                               "per_position_acceptance": [0.6, 0.35, 0.15]}, env={"ingested": True})
    return base, curve, spec(3, "ngram s3"), spec(2, "a rather long run name " * 4), ing


@pytest.fixture
def report(records, tmp_path, capsys):
    b, c, s, s2, ing = [dict(r) for r in records]
    with open_registry() as reg:
        bid, cid = reg.add_run(b), reg.add_run(c)
        s["config"] = dict(s["config"], baseline_run=bid, verify_curve_run=cid)
        ids = [bid, reg.add_run(s), reg.add_run(s2), reg.add_run(ing), cid]
    out = tmp_path / "report.html"
    code, _, err = cli(capsys, "report", *ids, "-o", out)
    assert code == 0, err
    return out


def _overflowing(layout: dict, allow_scrolling: bool) -> list[dict]:
    return [o for o in layout["over"] if not (allow_scrolling and o["scrolls"])]


@pytest.mark.parametrize("width,allow_scrolling", [(1280, False), (700, True)])
def test_report_renders_clean_in_chromium(report, width, allow_scrolling):
    got = render(report, width)
    lay = got["layout"]
    assert got["console"] == [], got["console"]
    assert lay["images"] >= 5 and lay["broken"] == [], lay
    assert lay["scrollWidth"] <= lay["clientWidth"], lay          # the page itself never scrolls sideways
    assert _overflowing(lay, allow_scrolling) == [], lay["over"]


def test_the_probe_catches_what_it_checks(tmp_path):
    """A page with each fault planted: the checks above can fail."""
    page = tmp_path / "bad.html"
    page.write_text('<!doctype html><html><body><div style="width:100px"><pre>' + "x" * 80 + "</pre></div>"
                    '<img alt="not a png" src="data:image/png;base64,AAAA">'
                    '<script>console.error("boom"); no_such_function();</script></body></html>')
    got = render(page, 800)
    assert got["layout"]["broken"] == ["not a png"]
    assert any(o["tag"] == "pre" and not o["scrolls"] for o in got["layout"]["over"])
    assert any("boom" in c for c in got["console"]) and any("no_such_function" in c for c in got["console"])


FLAG_LISTS = ["avx512f,avx512_bf16,avx512_vnni,avx512bw,avx512cd,avx512dq,avx512vl,amx_bf16,amx_int8,avx2,fma",
              "avx512f,avx512_bf16,avx512_vnni,avx512bw,avx512vl,avx2,fma", "avx2,fma,f16c,bmi2,sha_ni,vaes",
              "asimd,asimdhp,asimddp,sve,sve2,bf16,i8mm,sha3,sm4"]


def _distinct_env(rec: dict, i: int) -> dict:
    """Four machines: long values without spaces (CPU flag lists, a path list), as real fingerprints have."""
    env = dict(rec.get("env") or {})
    env["cpu"] = dict(env.get("cpu") or {}, simd=FLAG_LISTS[i], model=f"Example CPU model {i} @ 2.{i}0GHz")
    env["vars"] = dict(env.get("vars") or {}, LD_LIBRARY_PATH=":".join(f"/opt/lib{i}/toolkit-{j}/lib64"
                                                                       for j in range(6)))
    env["host"] = f"bench-host-{i}"
    return env


def _write(tmp_path, capsys, runs: list[dict], name: str):
    with open_registry() as reg:
        ids = [reg.add_run(r) for r in runs]
    out = tmp_path / name
    code, _, err = cli(capsys, "report", *ids, "-o", out)
    assert code == 0, err
    return out


@pytest.mark.parametrize("kind", ["served", "four runs"])
def test_no_element_is_wider_than_its_box(records, tmp_path, capsys, kind):
    """A served-run report and a four-run report with four environments, at a laptop width (the page's 1000 px
    box): no element's content is wider than its box, not even a table inside its scrolling wrapper (the
    Environment table was 1143 px in a 1000 px box, its third column cut)."""
    from served_runs import priced_and_always

    if kind == "served":
        runs = [dict(r, env=_distinct_env(r, i)) for i, r in enumerate(priced_and_always())]
    else:
        b, _, s, s2, _ = [dict(r) for r in records]
        s3 = dict(s, name="ngram s3, again")
        runs = [dict(r, env=_distinct_env(r, i)) for i, r in enumerate((b, s, s2, s3))]
    page = _write(tmp_path, capsys, runs, "r.html")
    got = render(page, 1280)
    lay = got["layout"]
    assert got["console"] == [] and lay["broken"] == [], got
    assert lay["scrollWidth"] <= lay["clientWidth"], lay
    assert _overflowing(lay, allow_scrolling=False) == [], lay["over"]
    assert "avx512f,<wbr>avx512_bf16" in page.read_text()          # the flag list wraps after its commas
