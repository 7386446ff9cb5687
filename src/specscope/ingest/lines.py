"""Helpers shared by the line parsers: log-record prefixes, timestamps, "key: value" lists, number parsing."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

# Start of a log record; a second one inside a physical line means two writers interleaved.
SGLANG_PREFIX = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)?(?:\s+([^\]]*))?\]")
VLLM_PREFIX = re.compile(r"(?:\([A-Za-z]+ pid=\d+\)\s+)?(?:INFO|WARNING|DEBUG|ERROR|CRITICAL)\s+"
                         r"(\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?")
RECORD_START = re.compile(SGLANG_PREFIX.pattern + "|" + VLLM_PREFIX.pattern)


def split_records(line: str) -> list[str]:
    """Split a physical line wherever another log record starts (interleaved writers)."""
    starts = [m.start() for m in RECORD_START.finditer(line)]
    if not starts or starts == [0]:
        return [line]
    cuts = ([0] if starts[0] != 0 else []) + starts
    return [line[a:b] for a, b in zip(cuts, cuts[1:] + [len(line)]) if line[a:b].strip()]


class Clock:
    """Seconds since the first timestamp of a file. vLLM stamps have no year: a jump back of more than a day is
    taken as a new year."""

    def __init__(self):
        self.t0: datetime | None = None
        self.last: datetime | None = None
        self.shift = timedelta(0)

    def seconds(self, dt: datetime | None) -> float | None:
        if dt is None:
            return None
        dt = dt + self.shift
        if self.last is not None and (self.last - dt) > timedelta(days=1):
            self.shift += timedelta(days=365)
            dt += timedelta(days=365)
        self.last = dt
        if self.t0 is None:
            self.t0 = dt
        return (dt - self.t0).total_seconds()


def sglang_time(piece: str) -> tuple[datetime | None, str | None]:
    m = SGLANG_PREFIX.match(piece.lstrip())
    if not m:
        return None, None
    try:
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"), (m.group(2) or None)
    except ValueError:
        return None, None


def vllm_time(piece: str) -> datetime | None:
    m = VLLM_PREFIX.search(piece)
    if not m:
        return None
    try:
        return datetime.strptime("2000-" + m.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None


# "Key: value, Other key: v1, v2, Third: x" -> {"Key": "value", "Other key": "v1, v2", "Third": "x"}
_KV = re.compile(r"\s*([#A-Za-z][^:,]*?)\s*:\s*(.*?)\s*(?=,\s*[#A-Za-z][^:,]*:|,?\s*$)")


def key_values(text: str) -> dict[str, str]:
    out = {}
    pos = 0
    text = text.rstrip().rstrip(",").rstrip(".")
    while pos < len(text):
        m = _KV.match(text, pos)
        if not m or m.end() == pos:
            break
        out[m.group(1).strip()] = m.group(2).strip()
        pos = m.end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
    return out


_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def number(v: str | None, unit: str = "") -> float:
    """'178.86' / '8.90 tokens/s' / '9.1%' -> float; ValueError otherwise (a truncated value is an error)."""
    if v is None:
        raise ValueError("missing")
    s = v.strip()
    for u in (unit, "tokens/s", "tokens", "reqs", "%"):
        if u and s.endswith(u):
            s = s[: -len(u)].strip()
    m = _NUM.match(s)
    if not m or m.end() != len(s):
        raise ValueError(f"not a number: {v!r}")
    return float(s)


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
