"""Headless Chromium driven over the DevTools protocol, with the standard library only: `--remote-debugging-pipe`
makes Chromium read commands on fd 3 and write replies and events on fd 4, each a JSON message ending in NUL (no
websocket client needed). `render(page, width)` loads a page and returns what a reader would see broken: console
errors and uncaught exceptions, images that did not decode, elements whose content overflows their box."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# as bench/render_report.py: no network, no first-run UI, no background fetches; a fresh profile per browser
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium_path() -> str | None:
    return next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)


class Browser:
    """One Chromium process; call(method, params, session) -> result; events collect in `events`."""

    def __init__(self, exe: str, timeout: float = 60.0):
        self.timeout, self.events, self._buf, self._next = timeout, [], b"", 0
        self.profile = tempfile.mkdtemp(prefix="specscope-chromium-")
        to_r, to_w = os.pipe()          # we write commands -> Chromium's fd 3
        from_r, from_w = os.pipe()      # Chromium's fd 4 -> we read

        def wire():                     # in the child: the two pipe ends onto fds 3 and 4 (via free high fds, so
            os.dup2(to_r, 250)          # that one dup2 cannot clobber the other end)
            os.dup2(from_w, 251)
            os.dup2(250, 3)
            os.dup2(251, 4)

        self.log = tempfile.TemporaryFile()
        # close_fds=False keeps the dup2'ed fds 3 and 4 (inheritable); every other pipe end is close-on-exec
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
                                      "about:blank"], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     close_fds=False, preexec_fn=wire)
        os.close(to_r)
        os.close(from_w)
        self.w, self.r = to_w, from_r

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        reply = self._until(lambda m: m.get("id") == msg["id"], method)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, name: str, session: str | None = None) -> dict:
        for i, e in enumerate(self.events):
            if e.get("method") == name and e.get("sessionId") == session:
                return self.events.pop(i)
        ev = self._until(lambda m: m.get("method") == name and m.get("sessionId") == session, name)
        self.events.remove(ev)
        return ev

    def _until(self, match, what: str) -> dict:
        end = time.monotonic() + self.timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                m = json.loads(raw)
                if "id" not in m:
                    self.events.append(m)
                if match(m):
                    return m
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {what} within {self.timeout:.0f} s{self._tail()}")
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited while waiting for {what}{self._tail()}")
            self._buf += chunk

    def _tail(self) -> str:
        self.log.seek(0)
        return "; its log ends: " + self.log.read()[-1500:].decode(errors="replace")

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.w, self.r):
            os.close(fd)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


# Runs in the page once it has loaded: every image decoded, and no element's content wider (or taller) than its
# box. A box that scrolls (overflow auto/scroll: the tables' wrappers) is reported with scrolls=true, since on a
# wide window even that means a table the reader has to scroll sideways.
PROBE = """(async () => {
  await Promise.all([...document.images].map(i => i.complete ? 0 : new Promise(r => { i.onload = i.onerror = r; })));
  const over = [];
  for (const el of document.body.querySelectorAll('*')) {
    const cs = getComputedStyle(el);
    if (cs.display === 'inline' || cs.display === 'none' || !el.clientWidth) continue;
    const dx = el.scrollWidth - el.clientWidth, dy = el.scrollHeight - el.clientHeight;
    if (dx > 1 || dy > 1) {
      over.push({tag: el.tagName.toLowerCase(), cls: String(el.className || ''), by: [dx, dy],
                 scrolls: ['auto', 'scroll'].includes(cs.overflowX) || ['auto', 'scroll'].includes(cs.overflowY),
                 text: (el.textContent || '').trim().slice(0, 80)});
    }
  }
  const d = document.documentElement;
  return {scrollWidth: d.scrollWidth, clientWidth: d.clientWidth, images: document.images.length,
          broken: [...document.images].filter(i => !i.naturalWidth).map(i => i.alt), over};
})()"""


def render(page: Path, width: int, exe: str | None = None) -> dict:
    """Load `page` at this window width: {"layout": PROBE's findings, "console": [error lines]}."""
    b = Browser(exe or chromium_path())
    try:
        pages = [t for t in b.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        target = pages[0]["targetId"] if pages else b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Runtime.enable", "Log.enable", "Page.enable"):
            b.call(m, session=sid)
        b.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                      "mobile": False}, session=sid)
        b.call("Page.navigate", {"url": Path(page).resolve().as_uri()}, session=sid)
        b.wait_event("Page.loadEventFired", sid)
        got = b.call("Runtime.evaluate", {"expression": PROBE, "returnByValue": True, "awaitPromise": True},
                     session=sid)
        if "exceptionDetails" in got:
            raise RuntimeError(f"the layout probe failed: {got['exceptionDetails']}")
        return {"layout": got["result"]["value"], "console": _console_errors(b.events)}
    finally:
        b.close()


def _console_errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params") or {}
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description", "")))
                                                           for a in p.get("args") or []))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails") or {}
            out.append(f"uncaught: {(d.get('exception') or {}).get('description') or d.get('text')}")
        elif m == "Log.entryAdded" and (p.get("entry") or {}).get("level") in ("error", "warning"):
            out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} ({p['entry'].get('url', '')})")
    return out
