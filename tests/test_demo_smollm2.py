"""The real demo on SmolLM2-135M (slow): what `make demo` runs, with fewer prompts and tokens. Uses the shipped
EAGLE-3 drafter when this checkout has it; without it the demo must say so in one line, and the n-gram variant
runs instead. The report is then rendered in headless Chromium when it is installed."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specscope.registry import open_registry
from cli_util import cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_demo_smollm2(tmp_path, capsys):
    from specscope.speculative.decode import ASSETS, DEFAULT_DRAFTER

    out = tmp_path / "demo"
    args = ["demo", "--prompts", 2, "--max-new-tokens", 32, "--out", out, "--threads", 2]
    code, stdout, err = cli(capsys, *args)
    if not (ASSETS / DEFAULT_DRAFTER / "config.json").exists():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "--draft ngram" in lines[0], err
        code, stdout, err = cli(capsys, *args, "--draft", "ngram")
    assert code == 0, err
    assert "Speedup:" in stdout and "Report:" in stdout and "specscope compare" in stdout
    res = json.loads((out / "summary.json").read_text())
    assert res["identical_outputs"] == 2           # greedy: the same text as plain decoding
    assert res["seconds"] < 600
    with open_registry() as reg:
        spec = reg.get_run(res["runs"]["speculative"])
        base = reg.get_run(spec["config"]["baseline_run"])
    assert "mt_bench" in spec["config"]["prompt_set"] and len(spec["samples"]["per_prompt"]) == 2
    assert base["kind"] == "baseline" and base["results"]["tok_per_s"] > 0
    html = (out / "report.html").read_text()
    assert len(re.findall(r'<img alt="[^"]+" src="data:image/png;base64,', html)) == 5
    if shutil.which("chromium") is None:
        return
    png = tmp_path / "report.png"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "render_report.py"), str(out / "report.html"),
                        "--out", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lay = json.loads(r.stdout)
    assert lay["no_sideways_scroll"] and lay["layout"]["images"] == 5 and lay["layout"]["broken"] == 0
    assert png.stat().st_size > 50_000
