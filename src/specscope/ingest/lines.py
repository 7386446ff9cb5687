"""Helpers shared by the line parsers: log-record prefixes, timestamps, "key: value" lists, number parsing."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta

# Start of a log record; a second one inside a physical line means two writers interleaved.
SGLANG_PREFIX = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?(?:\s+([^\]]*))?\]")
# SGLang before late 2024 stamped the time of day only: "[04:40:55 TP0] Decode batch. ..."
SGLANG_UNDATED = re.compile(r"\[(\d\d:\d\d:\d\d)(?:[.,]\d+)?(?:\s+([^\]]*))?\]")
# Python logging's default asctime, e.g. "2025-10-22 10:27:57,123 - sglang.srt.managers.scheduler - INFO - ..."
PYLOG_PREFIX = re.compile(r"\s*\[?(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)")
# vLLM: "INFO 10-22 10:27:57 [...]", optionally behind a process tag "(APIServer pid=7)" / "(EngineCore_DP0 pid=9)"
VLLM_PREFIX = re.compile(r"(?:\([\w.-]+ pid=\d+\)\s+)?(?:INFO|WARNING|DEBUG|ERROR|CRITICAL)\s+"
                         r"(\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?")
_VLLM_LEVEL = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d")
_PID = re.compile(r"\([\w.-]+ pid=\d+\)\s+$")
_LEVELS = ("INFO", "WARNING", "DEBUG", "ERROR", "CRITICAL")
# a superset of both record starts, to rule most lines out with one search
_ANY_START = re.compile(r"\[20\d\d-\d\d-\d\d |(?:INFO|WARNING|DEBUG|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:")
_PID_LEAD = re.compile(r"\([\w.-]+ pid=\d+\)\s+")


def split_records(line: str) -> list[str]:
    """Split a physical line wherever another log record starts (interleaved writers).

    Hot path (every line of a multi-GB log): one regex search for any record start past the line's own; the exact
    checks run only on lines that have one.
    """
    lead = _PID_LEAD.match(line)
    if not _ANY_START.search(line, lead.end() + 1 if lead else 1):
        return [line]
    cuts = []
    i = line.find("[20", 1)
    while i != -1:
        if SGLANG_PREFIX.match(line, i):
            cuts.append(i)
        i = line.find("[20", i + 1)
    for lvl in _LEVELS:
        j = line.find(lvl, 1)
        while j != -1:
            if _VLLM_LEVEL.match(line, j):
                m = _PID.search(line, max(0, j - 40), j)  # "(APIServer pid=7) INFO ..." starts at the "("
                start = m.start() if m else j
                if start > 0:
                    cuts.append(start)
            j = line.find(lvl, j + 1)
    if not cuts:
        return [line]
    cuts = sorted(set(cuts))
    bounds = [0] + cuts + [len(line)]
    return [line[a:b] for a, b in zip(bounds, bounds[1:]) if line[a:b].strip()]


def _fast_datetime(s: str) -> datetime:
    """'YYYY-MM-DD HH:MM:SS' (strptime is ~10x slower, and this runs once per log line)."""
    return datetime(int(s[0:4]), int(s[5:7]), int(s[8:10]), int(s[11:13]), int(s[14:16]), int(s[17:19]))


SPAN_WARN_S = 86400.0  # a log spanning more than a day is usually several runs appended into one file


class Clock:
    """Seconds since the first timestamp of a file.

    vLLM stamps have no year and old SGLang stamps no date: a jump back of more than half the stamp's range (a
    year, a day) is taken as the next year / day. Spans above SPAN_WARN_S are reported by `span_warning`.
    """

    def __init__(self):
        self.t0: datetime | None = None
        self.last: datetime | None = None
        self.shift = timedelta(0)
        self.t_min: float | None = None
        self.t_max: float | None = None
        self.last_in: datetime | None = None
        self.last_out: float | None = None

    def seconds(self, dt: datetime | None, wrap: timedelta | None = timedelta(days=365)) -> float | None:
        """wrap: the period of a stamp without year (vLLM) or date (old SGLang); None for full dates."""
        if dt is None:
            return None
        if dt == self.last_in:          # consecutive lines often share a stamp
            return self.last_out
        self.last_in = dt
        dt = dt + self.shift
        if wrap is not None and self.last is not None and (self.last - dt) > wrap / 2:
            self.shift += wrap
            dt += wrap
        self.last = dt
        if self.t0 is None:
            self.t0 = dt
        t = (dt - self.t0).total_seconds()
        self.t_min = t if self.t_min is None else min(self.t_min, t)
        self.t_max = t if self.t_max is None else max(self.t_max, t)
        self.last_out = t
        return t

    def span(self) -> float | None:
        return None if self.t_min is None else self.t_max - self.t_min

    def span_warning(self) -> str | None:
        sp = self.span()
        if sp is None or sp <= SPAN_WARN_S:
            return None
        return (f"the timestamps span {sp / 86400:.1f} days ({sp:,.0f} s): several runs appended into one file? "
                "duration_s covers all of them; split the log per run for per-run figures")


DAY = timedelta(days=1)


def sglang_time(piece: str) -> tuple[datetime | None, str | None, timedelta | None]:
    """(time, rank label such as "TP0" / "DP1 TP0", wrap period) of an SGLang (or Python-logging) line.

    Forms: "[2025-10-22 10:27:57 TP0]", "[2025-10-22 10:27:57]", "[04:40:55 TP0]" (time of day only: the wrap is
    a day), "2025-10-22 10:27:57,123 - ... - INFO - " (Python logging's default).
    """
    s = piece.lstrip()
    m = SGLANG_PREFIX.match(s)
    try:
        if m:
            return _fast_datetime(m.group(1)), (m.group(2) or None), None
        m = SGLANG_UNDATED.match(s)
        if m:
            t = m.group(1)
            return datetime(2000, 1, 1, int(t[0:2]), int(t[3:5]), int(t[6:8])), (m.group(2) or None), DAY
        m = PYLOG_PREFIX.match(s)
        if m:
            return _fast_datetime(m.group(1) + " " + m.group(2)), None, None
    except ValueError:
        pass
    return None, None, None


def vllm_time(piece: str) -> datetime | None:
    m = VLLM_PREFIX.search(piece)
    if not m:
        return None
    try:
        return _fast_datetime("2000-" + m.group(1))
    except ValueError:
        return None


def key_values(text: str) -> dict[str, str]:
    """'Key: value, Other key: v1, v2, Third: x' -> {"Key": "value", "Other key": "v1, v2", "Third": "x"}.

    A comma-separated piece without a 'key:' continues the previous value (vLLM's per-position list). Plain
    str methods: measured ~2x faster than one regex scan per line.
    """
    out: dict[str, str] = {}
    last = None
    for part in text.strip().rstrip(",.").split(","):
        k, sep, v = part.partition(":")
        k = k.strip()
        if sep and k and (k[0].isalpha() or k[0] == "#"):
            last = k
            out[k] = v.strip()
        elif last is not None and part.strip():
            out[last] += "," + part
    return out


def number(v: str | None, unit: str = "") -> float:
    """'178.86' / '8.90 tokens/s' / '9.1%' -> float; ValueError otherwise (a truncated value is an error)."""
    if v is None:
        raise ValueError("missing")
    try:
        x = float(v)            # the common case first: this runs several times per log line
    except ValueError:
        s = v.strip()
        for u in (unit, "tokens/s", "tokens", "reqs", "%"):
            if u and s.endswith(u):
                s = s[: -len(u)].strip()
                break
        try:
            x = float(s)
        except ValueError:
            raise ValueError(f"not a number: {v!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"not a finite number: {v!r}")
    return x


def boolean(v: str | None) -> bool:
    if v in ("True", "true"):
        return True
    if v in ("False", "false"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def stats(values: list[float]) -> dict | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None

    def q(p):
        k = (len(vals) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(vals) - 1)
        return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

    return {"mean": sum(vals) / len(vals), "median": q(0.5), "p90": q(0.9), "min": vals[0], "max": vals[-1],
            "n": len(vals)}


def histogram(values) -> dict[str, int]:
    h: dict[int, int] = {}
    for v in values:
        h[int(v)] = h.get(int(v), 0) + 1
    return {str(k): h[k] for k in sorted(h)}


class Series:
    """A bounded time series for the record's samples: at most `cap` points; when full, neighbouring points are
    averaged pairwise (so a multi-GB log yields a few thousand points, evenly spread over the run)."""

    def __init__(self, fields: tuple[str, ...], cap: int = 2048):
        self.fields = fields
        self.cap = cap
        self.stride = 1
        self.done: list[list] = []   # buckets: per field [sum, count]
        self.cur = self._empty()
        self.cur_n = 0

    def _empty(self):
        return [[0.0, 0] for _ in self.fields]

    def add(self, *values) -> None:
        for slot, v in zip(self.cur, values):
            if v is not None:
                slot[0] += v
                slot[1] += 1
        self.cur_n += 1
        if self.cur_n >= self.stride:
            self.done.append(self.cur)
            self.cur, self.cur_n = self._empty(), 0
            if len(self.done) >= self.cap:
                merged = []
                for a, b in zip(self.done[0::2], self.done[1::2]):
                    merged.append([[x[0] + y[0], x[1] + y[1]] for x, y in zip(a, b)])
                if len(self.done) % 2:
                    merged.append(self.done[-1])
                self.done = merged
                self.stride *= 2

    def to_dict(self) -> dict:
        buckets = self.done + ([self.cur] if self.cur_n else [])
        out = {f: [(b[i][0] / b[i][1]) if b[i][1] else None for b in buckets] for i, f in enumerate(self.fields)}
        out["points_per_sample"] = self.stride
        return out
