"""Render an HTML report in headless Chromium and save a screenshot, so a person can see how it reads.

    .venv/bin/python bench/render_report.py specscope-demo/report.html            # -> bench/results/report.png
    .venv/bin/python bench/render_report.py --demo                                # run a small demo first

Needs Debian's `chromium` (`apt-get install -y chromium`). Also checks that the page does not scroll sideways at
the window width: it asks Chromium for the document's scroll width via --dump-dom of a probe page.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    sys.exit("chromium not found; install it with: apt-get install -y chromium")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="specscope-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 2400) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    r = _run([f"--screenshot={png}", f"--window-size={width},{height}", html.resolve().as_uri()])
    if not png.exists():
        sys.exit(f"chromium wrote no screenshot (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return png


def layout(html: Path, width: int = 1280) -> dict:
    """Document scroll width/height at this window width, read back through the DOM Chromium dumps."""
    probe = html.with_name(html.stem + ".probe.html")
    text = html.read_text(encoding="utf-8")
    script = ("<script>addEventListener('load',()=>{const d=document.documentElement;"
              "document.body.setAttribute('data-layout',JSON.stringify({scrollWidth:d.scrollWidth,"
              "clientWidth:d.clientWidth,scrollHeight:d.scrollHeight,images:document.images.length,"
              "broken:[...document.images].filter(i=>!i.naturalWidth).length}))});</script>")
    probe.write_text(text.replace("</body>", script + "</body>"), encoding="utf-8")
    try:
        r = _run([f"--window-size={width},900", "--virtual-time-budget=3000", "--dump-dom", probe.resolve().as_uri()])
    finally:
        probe.unlink(missing_ok=True)
    m = re.search(r"data-layout=\"([^\"]+)\"", r.stdout)
    if not m:
        sys.exit(f"could not read the layout back from chromium (exit {r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(m.group(1).replace("&quot;", '"'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("html", nargs="?", help="report to render (default with --demo: the demo's report)")
    ap.add_argument("--demo", action="store_true", help="first run `specscope demo --prompts 2 --max-new-tokens 48`")
    ap.add_argument("--draft", default=None, help="drafter for --demo (default: the demo's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "report.png"))
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=2400)
    args = ap.parse_args(argv)
    html = Path(args.html) if args.html else None
    if args.demo:
        work = Path(tempfile.mkdtemp(prefix="specscope-render-"))
        cmd = [str(ROOT / ".venv" / "bin" / "specscope"), "demo", "--prompts", "2", "--max-new-tokens", "48",
               "--out", str(work), "--db", str(work / "runs.db")]
        if args.draft:
            cmd += ["--draft", args.draft]
        subprocess.run(cmd, check=True)
        html = html or work / "report.html"
    if html is None or not html.is_file():
        sys.exit(f"no report to render: {html}")
    lay = layout(html, args.width)
    png = screenshot(html, Path(args.out), args.width, args.height)
    ok = lay["scrollWidth"] <= lay["clientWidth"] and lay["broken"] == 0
    print(json.dumps({"screenshot": str(png), "layout": lay, "no_sideways_scroll": lay["scrollWidth"] <=
                      lay["clientWidth"], "ok": ok}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
