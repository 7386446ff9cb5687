"""Prometheus text exposition: parse scrapes and read the speculative-decoding metrics of specscope, vLLM, SGLang.

Counters (vLLM, specscope) only mean something as deltas over a run — lifetime totals mix every run since the
server started; they are summed over label sets (vLLM's `engine` label: data-parallel engines add up).
SGLang exports gauges (already averaged over its last log interval), one series per data-parallel rank (`dp_rank`)
and, depending on the version, a copy per TP / PP / EP rank and one for the draft engine (`engine_type="draft"`):
only the leader ranks (tp/pp/ep rank 0) of the serving engine are read; throughput, running and queued requests
are summed over DP ranks, accept length / rate averaged over them weighted by their running requests.

Also read: the Prometheus web UI's table view copied as text, one `series | value` (or tab-separated) row per line.
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
SGLANG_SUMMED = ("gen_throughput", "num_running_reqs", "num_queue_reqs")
SGLANG_AVERAGED = ("spec_accept_length", "spec_accept_rate")
SGLANG_GAUGES = SGLANG_AVERAGED + SGLANG_SUMMED
LEADER_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank")
COUNTERS_READ = {f"{b}{sfx}" for b in SPEC_COUNTERS + (PER_POS, "generation_tokens", "prompt_tokens")
                 for sfx in ("", "_total")}
# specscope serve's engine steps: a histogram per phase (they add up to phase "step") and the steps that drafted
PHASE_HIST = "cycle_phase_seconds"
STEP_PHASES = ("draft", "verify", "accept", "commit", "other")
# specscope serve's info metric, what it drafts with: its labels, named as a `generate` run's config names them
# (vLLM 0.32 and SGLang export no such metric: their runs name no drafter)
SPEC_INFO = "spec_decode_info"
SPEC_INFO_LABELS = ("draft", "spec_policy", "draft_budget", "steps", "topk", "draft_tokens", "ngram_tokens")
SPEC_INFO_INTS = ("steps", "topk", "draft_tokens", "ngram_tokens")


def _unescape(v: str) -> str:
    return v.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _table_row(line: str) -> str:
    """'series | value' (the web UI's table, copied) or 'series<TAB>value' -> 'series value'."""
    for sep in ("|", "\t"):
        head, found, tail = line.rpartition(sep)
        if found and head.strip() and '"' not in tail and "}" not in tail:
            return head.strip() + " " + tail.strip()
    return line


def parse_sample(line: str):
    """One sample line -> (name, labels dict, value); None for comments/blank; ValueError if malformed."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if "|" in line or "\t" in line:
        line = _table_row(line)
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
        """Sum over label sets (several model_name / engine labels), optionally filtered."""
        vals = [v for (n, ls), v in self.values.items()
                if n == name and all(dict(ls).get(k) == want for k, want in match.items()) and not math.isnan(v)]
        return sum(vals) if vals else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, ls), v in self.values.items():
            d = dict(ls)
            if n == name and label in d:
                out[d[label]] = out.get(d[label], 0.0) + v
        return out

    def label_value(self, engine: str, *labels: str) -> str | None:
        for (n, ls), _ in self.values.items():
            if n.startswith(engine + ":"):
                d = dict(ls)
                for lab in labels:
                    if d.get(lab):
                        return d[lab]
        return None


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


def engines_in(s: Scrape) -> dict[str, int]:
    """{engine: number of its series}, engines with speculative-decoding metrics first."""
    count: dict[str, int] = {}
    spec: set[str] = set()
    for n in s.names():
        e = _engine_name(n)
        if e:
            count[e] = count.get(e, 0) + 1
            if "spec" in n:
                spec.add(e)
    return dict(sorted(count.items(), key=lambda kv: (kv[0] not in spec, -kv[1], ENGINES.index(kv[0]))))


def engine_of(s: Scrape) -> str | None:
    return next(iter(engines_in(s)), None)


def sglang_leader(labels: dict) -> str | None:
    """None if this SGLang series is read; else why not (a copy from a non-leader rank, the draft engine)."""
    if labels.get("engine_type") == "draft":
        return "the draft engine's own series"
    if any(labels.get(lab, "0") != "0" for lab in LEADER_LABELS):
        return "a copy from a non-leader rank (tp/pp/ep rank ≠ 0)"
    return None


def sglang_gauges(s: Scrape) -> dict:
    """SGLang's gauges of one scrape: summed (throughput, requests) or running-weighted (accept length / rate)
    over data-parallel ranks."""
    rows: dict[str, list[tuple[str, float]]] = {}
    for (n, ls), v in s.values.items():
        if not n.startswith("sglang:") or math.isnan(v) or n[7:] not in SGLANG_GAUGES:
            continue
        d = dict(ls)
        if sglang_leader(d) is None:
            rows.setdefault(n[7:], []).append((d.get("dp_rank", "0"), v))
    out: dict = {}
    for g in SGLANG_SUMMED:
        if g in rows:
            out[g] = sum(v for _, v in rows[g])
    running = dict(rows.get("num_running_reqs", []))
    for g in SGLANG_AVERAGED:
        if g in rows:
            w = [running.get(dp) for dp, _ in rows[g]]
            if len(rows[g]) > 1 and all(x is not None for x in w) and sum(w) > 0:
                out[g] = sum(v * wi for (_, v), wi in zip(rows[g], w)) / sum(w)
            else:
                out[g] = sum(v for _, v in rows[g]) / len(rows[g])
    ranks = {dp for vals in rows.values() for dp, _ in vals}
    if len(ranks) > 1:
        out["dp_ranks"] = len(ranks)
    return out


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


def spec_delta(before: Scrape | None, after: Scrape, engine: str | None = None) -> dict:
    """Acceptance over the window between two scrapes (before=None: lifetime totals, flagged as such).

    engine: whose metrics to read (default: the engine with speculative-decoding metrics, then the most series).
    """
    engine = engine or engine_of(after)
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
        # indexed by position: a series missing for a position stays None instead of shifting the others
        out["accepted_per_pos"] = [_delta(pb.get(str(i)), pa[str(i)]) if str(i) in pa else None
                                   for i in range(max(int(k) for k in pa) + 1)]
    drafts, acc = out.get("num_drafts"), out.get("num_accepted_tokens")
    if drafts and acc is not None:
        # τ recomputed from counts: each verify yields its accepted tokens + 1 (vLLM's mean acceptance length)
        out["accept_length"] = 1.0 + acc / drafts
    if drafts and pa:
        out["per_position_acceptance"] = [None if a is None else a / drafts for a in out["accepted_per_pos"]]
    if out.get("num_draft_tokens") and acc is not None:
        out["draft_acceptance_rate"] = acc / out["num_draft_tokens"]
    out.update(step_phases(b, after, engine))
    if info := server_spec(after, engine):
        out["server_spec"] = info
    if engine == "sglang":
        out.update(sglang_gauges(after))   # gauges: SGLang's own averages over its last log interval
        if "accept_length" not in out and "spec_accept_length" in out:
            out["accept_length"] = out["spec_accept_length"]
    return out


def server_spec(s: Scrape, engine: str) -> dict:
    """What the server drafts with, from its spec_decode_info labels (only SPEC_INFO_LABELS, the knobs as ints):
    {"draft": "ngram", "spec_policy": "always", "steps": 3, ...}; {} where it exports none (no drafter)."""
    for (n, ls), v in s.values.items():
        if n == f"{engine}:{SPEC_INFO}" and v == 1:
            return {k: int(x) if k in SPEC_INFO_INTS and x.isdigit() else x for k, x in ls if k in SPEC_INFO_LABELS}
    return {}


def step_phases(before: Scrape, after: Scrape, engine: str) -> dict:
    """specscope serve's engine steps over the window: {"phases": {phase: {"mean_ms" per step, "share" of the
    step}}, "engine_steps", and with a drafter "drafted_step_share"}, the phases in the profiler's shape (registry
    results["phases"]), so a served run is shown and compared like a `generate` run; {} for other engines."""
    name = f"{engine}:{PHASE_HIST}"
    steps = _delta(before.total(name + "_count", phase="verify"), after.total(name + "_count", phase="verify"))
    sums = {p: _delta(before.total(name + "_sum", phase=p), after.total(name + "_sum", phase=p)) for p in STEP_PHASES}
    if not steps or any(v is None for v in sums.values()):
        return {}
    total = sum(sums.values())
    out = {"engine_steps": int(steps),
           "phases": {p: {"mean_ms": round(v * 1e3 / steps, 4), "share": round(v / total, 4) if total > 0 else 0.0}
                      for p, v in sums.items()}}
    modes = f"{engine}:spec_decode_steps_total"   # a label appears once counted: a missing one is 0 steps
    by_mode = {m: _delta(before.total(modes, mode=m), after.total(modes, mode=m)) or 0.0 for m in ("draft", "plain")}
    if sum(by_mode.values()):
        out["drafted_step_share"] = round(by_mode["draft"] / sum(by_mode.values()), 4)
    return out


# ---- a file of scrapes (ingest) ------------------------------------------------------------------------------------

def _is_counter(name: str) -> bool:
    return name.endswith("_total")


def _read_by_specscope(engine: str, name: str) -> bool:
    base = name.split(":", 1)[1]
    return base in COUNTERS_READ or base == SPEC_INFO or (engine == "sglang" and base in SGLANG_GAUGES)


class PrometheusParser:
    """Scrapes appended to one file (e.g. `while sleep 10; do curl -s host/metrics; done >> scrapes.txt`), or
    the web UI's table copied as text.

    A sample whose series was already seen starts the next scrape. Counters become reset-aware increases over
    the file; with a single scrape they are lifetime totals and flagged so. SGLang gauges are averaged over the
    scrapes with a running request.
    """

    name = "prometheus"
    description = "Prometheus text scrapes (vllm:/sglang:/specscope: metrics)"

    def __init__(self):
        from specscope.ingest.base import FormatParser

        self._fp = FormatParser()   # line bookkeeping only
        self.data_lines = self.info_lines = 0
        self.scrapes: list[Scrape] = []
        self.cur: Scrape | None = None
        self.samples_by_engine: dict[str, int] = {}

    @property
    def kinds(self):
        return self._fp.kinds

    def line_report(self) -> dict:
        return self._fp.line_report()

    def feed(self, piece: str, lineno: int):
        from specscope.ingest.base import OK, Malformed

        line = piece.strip()
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and _engine_name(parts[2]):
                self.info_lines += 1
                self._fp.saw("HELP/TYPE comments")
                self._fp.skip("HELP/TYPE comments", "metadata, no value")
                return OK
            return None
        engine = _engine_name(line.split("{", 1)[0].split(" ", 1)[0].split("|", 1)[0].strip())
        if not engine:
            return None
        kind = f"{engine} samples"
        try:
            name, labels, value = parse_sample(line)
        except ValueError as e:
            self._fp.malformed(kind)
            raise Malformed(f"metric sample: {e}") from None
        self._fp.saw(kind)
        self.samples_by_engine[engine] = self.samples_by_engine.get(engine, 0) + 1
        if not _read_by_specscope(engine, name):
            self._fp.skip(kind, "a metric specscope does not read")
        elif engine == "sglang" and sglang_leader(labels):
            self._fp.skip(kind, "SGLang: " + sglang_leader(labels))
        key = (name, tuple(sorted(labels.items())))
        if self.cur is None or key in self.cur:
            self.cur = Scrape()
            self.scrapes.append(self.cur)
        self.cur.add(name, labels, value)
        ts = _SAMPLE.match(line).group(5) if "|" not in line and "\t" not in line else None
        if ts and self.cur.timestamp_ms is None:
            self.cur.timestamp_ms = float(ts)
        self.data_lines += 1
        return OK

    def has_data(self) -> bool:
        return bool(self.scrapes)

    def _figures(self, engine: str, warnings: list) -> tuple[dict, dict]:
        scrapes = self.scrapes
        if len(scrapes) == 1:
            d = spec_delta(None, scrapes[-1], engine)
            if engine in ("vllm", "specscope") and any(k in d for k in ("num_drafts", "generation_tokens")):
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
            d = spec_delta(Scrape(), inc, engine)
        res = {k: v for k, v in d.items() if k not in ("engine", "window", "server_spec")}
        res["window"] = d.get("window")
        res["scrapes"] = len(scrapes)
        samples: dict = {}
        if engine == "sglang":
            per = [sglang_gauges(s) for s in scrapes]
            series = {g: [p.get(g) for p in per] for g in SGLANG_GAUGES}
            samples["series"] = {k: v for k, v in series.items() if any(x is not None for x in v)}
            busy = [p for p in per if p.get("num_running_reqs", 1) > 0]
            for g in SGLANG_GAUGES:
                vals = [p[g] for p in busy if p.get(g) is not None]
                if vals:
                    res[g] = sum(vals) / len(vals)
                else:
                    res.pop(g, None)
            if "spec_accept_length" in res:
                res["accept_length"] = res["spec_accept_length"]
            if "gen_throughput" in res:
                res["tok_per_s"] = res["gen_throughput"]
            if len(busy) < len(per):
                res["idle_scrapes"] = len(per) - len(busy)
            if any(p.get("dp_ranks") for p in per):
                res["dp_ranks"] = max(p.get("dp_ranks", 1) for p in per)
            warnings.append("SGLang gauges are averages over its last log interval; values are means over the "
                            "scrapes with a running request, summed over data-parallel ranks")
        ts = [s.timestamp_ms for s in scrapes]
        if engine in ("vllm", "specscope") and len(scrapes) > 1:
            gen = [s.total(f"{engine}:generation_tokens_total") for s in scrapes]
            samples["series"] = {"generation_tokens": gen, "t_ms": ts}
            if all(t is not None for t in ts) and all(g is not None for g in gen) and ts[-1] > ts[0]:
                res["tok_per_s"] = res.get("generation_tokens", 0.0) / ((ts[-1] - ts[0]) / 1e3)
        return res, samples

    def result(self) -> dict:
        engines = list(engines_in(self.scrapes[-1]) if len(self.scrapes) == 1 else
                       engines_in(_union(self.scrapes)))
        warnings: list[str] = []
        engine = engines[0] if engines else None
        res, samples = self._figures(engine, warnings) if engine else ({}, {})
        if len(engines) > 1:
            others = {}
            for e in engines[1:]:
                others[e], _ = self._figures(e, [])
                self._fp.partial(f"{e} samples", f"another engine's: figures in results.other_engines.{e}, "
                                                 "not in the headline", self.samples_by_engine.get(e, 0))
            res["other_engines"] = others
            counts = ", ".join(f"{e} ({self.samples_by_engine.get(e, 0)} samples)" for e in engines)
            warnings.append(f"these scrapes hold metrics of several engines: {counts}; the headline figures are "
                            f"{engine}'s, the others are in results.other_engines")
        model, spec = None, {}
        if engine:
            model = _union(self.scrapes).label_value(engine, "model_name", "model", "name")
            spec = server_spec(_union(self.scrapes), engine)   # a specscope server's drafter, in the config
        return {"config": {"engine": engine, "model": model, **spec}, "results": res, "samples": samples,
                "warnings": warnings, "env": {"engine": engine}}


def _union(scrapes: list[Scrape]) -> Scrape:
    u = Scrape()
    for s in scrapes:
        u.values.update(s.values)
    return u


def _engine_name(metric: str) -> str | None:
    for e in ENGINES:
        if metric.startswith(e + ":"):
            return e
    return None
