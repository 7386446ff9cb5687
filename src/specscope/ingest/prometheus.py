"""Prometheus text exposition: parse scrapes and read the speculative-decoding metrics of specscope, vLLM, SGLang.

Counters (vLLM, specscope) only mean something as deltas over a run — lifetime totals mix every run since the
server started; SGLang exports gauges (already averaged over its last interval), which are read as they are.
"""

from __future__ import annotations

import math
import re

# name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')

ENGINES = ("specscope", "vllm", "sglang")
# counters named like vLLM's (specscope mirrors them under its own prefix)
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SGLANG_GAUGES = ("spec_accept_length", "spec_accept_rate", "gen_throughput", "num_running_reqs", "num_queue_reqs")


def _unescape(v: str) -> str:
    return v.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def parse_sample(line: str):
    """One sample line -> (name, labels dict, value); None for comments/blank; ValueError if malformed."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = _SAMPLE.match(line)
    if not m:
        raise ValueError("not a sample line")
    name, labels_s, value_s = m.group(1), m.group(3), m.group(4)
    labels = {}
    if labels_s:
        pos = 0
        while pos < len(labels_s):
            lm = _LABEL.match(labels_s, pos)
            if not lm:
                raise ValueError("bad labels")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
    try:
        value = float(value_s)  # accepts NaN, +Inf, -Inf
    except ValueError:
        raise ValueError("bad value") from None
    return name, labels, value


class Scrape:
    """One scrape: {(name, sorted label items): value}."""

    def __init__(self):
        self.values: dict[tuple, float] = {}
        self.timestamp_ms: float | None = None

    def add(self, name: str, labels: dict, value: float):
        self.values[(name, tuple(sorted(labels.items())))] = value

    def __contains__(self, key):
        return key in self.values

    def names(self) -> set[str]:
        return {k[0] for k in self.values}

    def total(self, name: str, **match) -> float | None:
        """Sum over label sets (e.g. several model_name / engine labels), optionally filtered."""
        vals = [v for (n, ls), v in self.values.items()
                if n == name and all(dict(ls).get(k) == want for k, want in match.items()) and not math.isnan(v)]
        return sum(vals) if vals else None

    def mean(self, name: str) -> float | None:
        """Gauges from several ranks / label sets are averaged, not summed."""
        vals = [v for (n, _), v in self.values.items() if n == name and not math.isnan(v)]
        return sum(vals) / len(vals) if vals else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, ls), v in self.values.items():
            d = dict(ls)
            if n == name and label in d:
                out[d[label]] = out.get(d[label], 0.0) + v
        return out


def parse_text(text: str) -> Scrape:
    s = Scrape()
    for line in text.splitlines():
        try:
            got = parse_sample(line)
        except ValueError:
            continue
        if got:
            s.add(*got)
    return s


def engine_of(s: Scrape) -> str | None:
    names = s.names()
    for e in ENGINES:
        if any(n.startswith(e + ":") for n in names):
            return e
    return None


def _counter(s: Scrape, engine: str, base: str) -> float | None:
    # prometheus_client appends _total to counters; some exporters do not
    v = s.total(f"{engine}:{base}_total")
    return v if v is not None else s.total(f"{engine}:{base}")


def _delta(a: float | None, b: float | None) -> float | None:
    if b is None:
        return None
    if a is None or b < a:  # counter appeared or reset (server restart): the after value is the delta
        return b
    return b - a


def spec_delta(before: Scrape | None, after: Scrape) -> dict:
    """Acceptance over the window between two scrapes (before=None: lifetime totals, flagged as such)."""
    engine = engine_of(after)
    out: dict = {"engine": engine, "window": "delta" if before is not None else "lifetime"}
    if engine is None:
        return out
    b = before or Scrape()
    for base in SPEC_COUNTERS + ("generation_tokens", "prompt_tokens"):
        d = _delta(_counter(b, engine, base), _counter(after, engine, base))
        if d is not None:
            out[base.replace("spec_decode_", "")] = d
    pa = after.by_label(f"{engine}:{PER_POS}_total", "position") or after.by_label(f"{engine}:{PER_POS}", "position")
    pb = b.by_label(f"{engine}:{PER_POS}_total", "position") or b.by_label(f"{engine}:{PER_POS}", "position")
    if pa:
        out["accepted_per_pos"] = [_delta(pb.get(k), pa[k]) for k in sorted(pa, key=int)]
    drafts, acc = out.get("num_drafts"), out.get("num_accepted_tokens")
    if drafts:
        # τ recomputed from counts: each verify yields its accepted tokens + 1 (vLLM's mean acceptance length)
        out["accept_length"] = 1.0 + (acc or 0.0) / drafts
        if pa:
            out["per_position_acceptance"] = [a / drafts for a in out["accepted_per_pos"]]
    if out.get("num_draft_tokens"):
        out["draft_acceptance_rate"] = (acc or 0.0) / out["num_draft_tokens"]
    if engine == "sglang":
        for g in SGLANG_GAUGES:
            v = after.mean(f"sglang:{g}")
            if v is not None:
                out[g] = v  # a gauge: SGLang's own average over its last log interval
        if "accept_length" not in out and "spec_accept_length" in out:
            out["accept_length"] = out["spec_accept_length"]
    return out


# ---- a file of scrapes (ingest) ------------------------------------------------------------------------------------

def _is_counter(name: str) -> bool:
    return name.endswith("_total")


class PrometheusParser:
    """Scrapes appended to one file (e.g. `while sleep 10; do curl -s host/metrics; done >> scrapes.txt`).

    A sample whose series was already seen starts the next scrape. Counters become reset-aware increases over
    the file; with a single scrape they are lifetime totals and flagged so. SGLang gauges are averaged over scrapes.
    """

    name = "prometheus"
    description = "Prometheus text scrapes (vllm:/sglang:/specscope: metrics)"

    def __init__(self):
        self.data_lines = self.info_lines = 0
        self.scrapes: list[Scrape] = []
        self.cur: Scrape | None = None

    def feed(self, piece: str, lineno: int):
        from specscope.ingest.base import OK, Malformed

        line = piece.strip()
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and _engine_name(parts[2]):
                self.info_lines += 1
                return OK
            return None
        if not _engine_name(line.split("{", 1)[0].split(" ", 1)[0]):
            return None
        try:
            name, labels, value = parse_sample(line)
        except ValueError as e:
            raise Malformed(f"metric sample: {e}") from None
        key = (name, tuple(sorted(labels.items())))
        if self.cur is None or key in self.cur:
            self.cur = Scrape()
            self.scrapes.append(self.cur)
        self.cur.add(name, labels, value)
        ts = _SAMPLE.match(line).group(5)
        if ts and self.cur.timestamp_ms is None:
            self.cur.timestamp_ms = float(ts)
        self.data_lines += 1
        return OK

    def has_data(self) -> bool:
        return bool(self.scrapes)

    def result(self) -> dict:
        scrapes = self.scrapes
        last = scrapes[-1]
        warnings = []
        if len(scrapes) == 1:
            d = spec_delta(None, last)
            if d.get("engine") in ("vllm", "specscope"):
                warnings.append("one scrape only: counters are lifetime totals since the server started, not a run; "
                                "scrape before and after a run for deltas")
        else:
            inc = Scrape()
            keys = {k for s in scrapes for k in s.values}
            for key in keys:
                series = [s.values[key] for s in scrapes if key in s.values]
                if _is_counter(key[0]):
                    total, prev = 0.0, series[0]
                    for v in series[1:]:
                        total += v - prev if v >= prev else v
                        prev = v
                    inc.values[key] = total
                else:
                    inc.values[key] = series[-1]
            d = spec_delta(Scrape(), inc)
        engine = d.get("engine")
        res = {k: v for k, v in d.items() if k not in ("engine", "window")}
        res["window"] = d.get("window")
        res["scrapes"] = len(scrapes)
        samples: dict = {}
        if engine == "sglang":
            series = {g: [s.mean(f"sglang:{g}") for s in scrapes] for g in SGLANG_GAUGES}
            samples["series"] = {k: v for k, v in series.items() if any(x is not None for x in v)}
            for g, v in samples["series"].items():
                vals = [x for x in v if x is not None]
                res[g] = sum(vals) / len(vals)
            if "spec_accept_length" in res:
                res["accept_length"] = res["spec_accept_length"]
            if "gen_throughput" in res:
                res["tok_per_s"] = res["gen_throughput"]
            warnings.append("SGLang gauges are averages over its last log interval; values are means over scrapes")
        ts = [s.timestamp_ms for s in scrapes]
        if engine in ("vllm", "specscope") and len(scrapes) > 1:
            gen = [s.total(f"{engine}:generation_tokens_total") for s in scrapes]
            samples["series"] = {"generation_tokens": gen, "t_ms": ts}
            if all(t is not None for t in ts) and all(g is not None for g in gen) and ts[-1] > ts[0]:
                res["tok_per_s"] = res.get("generation_tokens", 0.0) / ((ts[-1] - ts[0]) / 1e3)
        return {"config": {"engine": engine}, "results": res, "samples": samples, "warnings": warnings,
                "env": {"engine": engine}}


def _engine_name(metric: str) -> str | None:
    for e in ENGINES:
        if metric.startswith(e + ":"):
            return e
    return None
