"""Progress for commands that run longer than a few seconds: done / total, the measured rate and the time left.

One rule for every command (bench-serve per level, verify-curve per point, tune --validate, train's stages, the
bench/ scripts), the one `vllm bench serve`'s users know from its tqdm bar:

* stderr only: stdout carries the results (tables, --json) that scripts read, so it never gets a progress byte;
* stderr a terminal: a live bar redrawn in place, "max concurrency 4 ━━━━━ 21/32 3.1 req/s 0:07 elapsed 0:04 left";
  also under --json (the JSON goes to stdout; a person at the terminal still wants to know how long);
* stderr not a terminal (a log, CI, nohup): a plain line every `every_s` seconds and one at the end, "max
  concurrency 4: 21/32 req (3.1 req/s, 0:04 left)": a log holds lines, not a bar's carriage returns. Under --json
  these lines are left out: a program that reads --json reads stderr for errors, not for chatter;
* disabled (--disable-tqdm, --no-progress): nothing.

`Progress.note(text)` prints a line on stderr above a live bar (per-point results, say) or plainly without one;
`Progress.echo(text)` a result line meant for stdout (a bench's per-item line), kept clear of the bar.
"""

from __future__ import annotations

import os
import sys
import time


def duration(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def rate_text(done: float, elapsed: float, unit: str) -> str | None:
    """'3.1 req/s', or '4.2 s/point' when items take longer than a second (0.24 point/s reads badly); None before
    anything is done."""
    if done <= 0 or elapsed <= 0:
        return None
    rate = done / elapsed
    if rate >= 1:
        return f"{rate:.1f} {unit}/s" if unit else f"{rate:.1f}/s"
    return f"{1 / rate:.1f} s/{unit}" if unit else f"{1 / rate:.1f} s each"


def left_text(done: float, total: float, elapsed: float, unknown: str = "time left unknown yet") -> str:
    """'0:04 left' from the rate so far (the whole elapsed time: items here are uneven, a window would jump)."""
    if done >= total:
        return "done"
    if done <= 0 or elapsed <= 0:
        return unknown
    return f"{duration((total - done) * elapsed / done)} left"


def _columns(unit: str):
    from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task):
            done = task.completed - task.fields.get("done_before", 0)
            return Text(rate_text(done, task.elapsed or 0.0, unit) or f"? {unit}/s", style="progress.data.speed")

    class Elapsed(ProgressColumn):
        def render(self, task):
            return Text(duration(task.elapsed or 0.0), style="progress.elapsed")

    class Left(ProgressColumn):
        def render(self, task):
            before = task.fields.get("done_before", 0)
            return Text(left_text(task.completed - before, (task.total or 0) - before, task.elapsed or 0.0,
                                  unknown="? left"), style="progress.remaining")

    # a short bar: the counts, rate and times must fit an 80-column terminal beside a long description
    return (TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), Rate(),
            Elapsed(), Left(), TextColumn("{task.fields[info]}"))


def _same_terminal(a, b) -> bool:
    """Are two streams the same terminal device (stdout and stderr both on the user's screen)?"""
    try:
        return a.isatty() and b.isatty() and os.fstat(a.fileno()).st_rdev == os.fstat(b.fileno()).st_rdev
    except (AttributeError, OSError, ValueError):        # a StringIO, a closed or fd-less stream
        return False


class Progress:
    """done/total of `unit`s with rate and time left, on stderr (see the module doc for where and when).

    what: the description ("max concurrency 4", "verify-curve context 256"); start: units already done before this
    run (a resumed one), left out of the rate; json_mode: the command prints --json (no log lines); enabled=False:
    nothing at all; stream / tty: where to write and whether it is a terminal (default stderr and its isatty())."""

    def __init__(self, what: str, total: int, unit: str = "step", *, start: int = 0, json_mode: bool = False,
                 enabled: bool = True, every_s: float = 10.0, stream=None, tty: bool | None = None):
        self.what, self.total, self.unit, self.every = what, max(0, int(total)), unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.mode = ("off" if not enabled or self.total == 0 else "bar" if self.tty
                     else "off" if json_mode else "lines")
        self.start = self.done = min(start, self.total)
        self.info = ""
        self.t0 = self.last = time.monotonic()
        self._bar = self._task = None
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            console = Console(file=self.stream, force_terminal=True, highlight=False)
            # stdout is not redirected: results printed meanwhile stay on stdout, not in the bar's stream
            self._bar = RichProgress(*_columns(unit), console=console, redirect_stdout=False)
            self._bar.start()
            self._task = self._bar.add_task(what, total=self.total, completed=self.done, done_before=self.start,
                                            info="")

    def advance(self, n: int = 1, info: str | None = None) -> None:
        self.update(self.done + n, info)

    def update(self, done: int, info: str | None = None) -> None:
        self.done = min(done, self.total)
        if info is not None:
            self.info = info
        if self.mode == "bar":
            self._bar.update(self._task, completed=self.done, info=self.info)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self.last >= self.every and self.done < self.total:
                self.last = now
                self._line()

    def set_total(self, total: int) -> None:
        """A total learnt on the way (train's --max-minutes fits the steps to the time)."""
        self.total = max(0, int(total))
        if self.mode == "bar":
            self._bar.update(self._task, total=self.total)

    def _line(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self.t0
        rate = rate_text(self.done - self.start, elapsed, self.unit)
        tail = (f"done in {duration(elapsed)}" if final and self.done >= self.total
                else left_text(self.done - self.start, self.total - self.start, elapsed))
        words = ", ".join(x for x in (rate, tail) if x)
        info = f" {self.info}" if self.info else ""
        self.stream.write(f"{self.what}: {self.done}/{self.total} {self.unit} ({words}){info}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line on stderr, above the bar when there is one."""
        if self.mode == "bar":
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def echo(self, text: str) -> None:
        """A result line for stdout. When stdout is the bar's own terminal it is drawn above the bar (through the
        bar's stream): written past the live bar it would start after a stale copy of it, and on one terminal the
        two streams read alike. Elsewhere (stdout a file or a pipe) it goes to stdout untouched."""
        if self.mode == "bar" and _same_terminal(sys.stdout, self.stream):
            self.note(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.mode == "bar" and self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.mode == "lines":
            self._line(final=True)
        self.mode = "off"

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.mode == "lines":
            # an error ends the work: its own line is what the log needs, not a last count that reads as a result
            self.mode = "off"
        self.close()
