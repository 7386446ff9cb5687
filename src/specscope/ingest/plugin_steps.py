"""The JSONL of specscope's in-engine step recorder (`plugins/steps.py`, e.g. the vLLM plugin's SPECSCOPE_PHASES
file): one line per decode/verify step with its phase times and per-request draft/accepted counts.

The run it makes has per-cycle samples like specscope's own runs (so `compare` tests changes, `breakeven --run`
and `tune --run` read its costs) and acceptance counted the way vLLM counts it (drafts = request-steps that verified
draft tokens; per-position = accepted at position i / drafts), exactly, batched steps included.
"""

from __future__ import annotations

import json
import math

from specscope.economics.engine_steps import surface_from_steps
from specscope.ingest.base import OK, FormatParser, Malformed

KIND = "step records"


class StepsParser(FormatParser):
    name = "specscope-steps"
    description = "specscope in-engine step records (JSONL from the vLLM plugin, SPECSCOPE_PHASES)"

    def __init__(self):
        super().__init__()
        self.headers: list[dict] = []
        self.rows: list[list[dict]] = []      # steps per header
        self.env: dict | None = None
        self.end: dict | None = None
        self.windows: list[list[dict]] = []   # profiled steps (components) per header
        self.unknown: dict[str, float] = {}   # ms of ops the op table did not classify (the latest window's totals)

    def feed(self, piece: str, lineno: int) -> str | None:
        s = piece.strip()
        if not s.startswith("{") or not ('"specscope_steps"' in s or '"kind":' in s or '"env":' in s
                                         or '"end":' in s or '"window":' in s):
            return None
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            if '"specscope_steps"' in s or '"total_ms"' in s or '"drafted"' in s:
                self.malformed(KIND)
                raise Malformed(f"step record is not JSON ({e.msg}; truncated?)") from None
            return None
        if not isinstance(obj, dict):
            return None
        if "specscope_steps" in obj:
            self.headers.append(obj)
            self.rows.append([])
            self.windows.append([])
            self.info_lines += 1
            self.saw("header")
            return OK
        if not self.headers:
            return None        # step-like JSON before any header: not ours
        if "env" in obj and len(obj) == 1:
            self.env = obj["env"] if isinstance(obj["env"], dict) else None
            self.info_lines += 1
            self.saw("header")
            return OK
        if "window" in obj:
            try:
                self.windows[-1] += window_steps(obj)
                if isinstance(obj.get("unknown"), dict):
                    self.unknown = {str(k): float(v) / 1e3 for k, v in obj["unknown"].items() if _time(v)}
            except (KeyError, TypeError, ValueError) as e:
                self.malformed(KIND)
                raise Malformed(f"profiler window: {e}") from None
            self.info_lines += 1
            self.saw(KIND)
            return OK
        if isinstance(obj.get("end"), bool):
            self.end = obj         # the totals: after each interval (false) and at exit (true); the latest wins
            self.info_lines += 1
            self.saw("header")
            return OK
        try:
            row = _step(obj)
        except (KeyError, TypeError, ValueError) as e:
            self.malformed(KIND)
            raise Malformed(f"step record: {e}") from None
        self.rows[-1].append(row)
        self.data_lines += 1
        self.saw(KIND)
        return OK

    def has_data(self) -> bool:
        return self.data_lines > 0

    def result(self) -> dict:
        from specscope.profile.cycle import CycleProfiler
        from specscope.registry.records import results_from_summary

        warnings = []
        segs = [(h, r, w) for h, r, w in zip(self.headers, self.rows, self.windows) if r]
        head, rows, _ = segs[-1]
        same = [r for h, r, _ in segs if h.get("config") == head.get("config")]
        profiled = [x for h, _, w in segs if h.get("config") == head.get("config") for x in w]
        if len(same) < len(segs):
            warnings.append(f"{len(segs) - len(same)} earlier engine run(s) in this file had another configuration; "
                            f"this run holds the steps of the last configuration only")
        rows = [x for r in same for x in r]
        phases = []
        for r in rows:
            phases += [k for k in r["ms"] if k not in phases]
        samples = {"cycle_ms": {k: [r["ms"].get(k, 0.0) for r in rows] for k in phases},
                   "cycle_total_ms": [r["total_ms"] for r in rows],
                   "accept_lengths": [_tokens(r) for r in rows],
                   "num_draft": [max(r["drafted"], default=0) for r in rows]}
        single = all(r["reqs"] == 1 for r in rows)
        flags = [[i < (r["accepted"] or [0])[0] for i in range(r["drafted"][0] if r["drafted"] else 0)]
                 for r in rows] if single else None
        prof = CycleProfiler.from_samples(samples, accepted=flags, device=head.get("device", "cpu"),
                                          timer=head.get("timer"))
        res = results_from_summary(prof.summary())
        res.pop("profiler", None)
        res["profiler"] = {"timer": head.get("timer"), "where": f"inside {head.get('engine')} (specscope plugin)"}
        res.update(_vllm_counters(rows, warnings))
        if profiled:
            res["components"] = components_of(profiled)
            if self.unknown:
                res["components_unclassified"] = self.unknown
        end = self.end or {}
        untimed, oh = end.get("untimed_steps"), end.get("overhead")
        res["steps_untimed"] = untimed if isinstance(untimed, dict) else None
        if isinstance(oh, dict) and isinstance(oh.get("us_per_step"), (int, float)):
            res["plugin_overhead"] = oh                        # the plugin's own host time per step, and its share
        elif oh is not None:
            warnings.append(f"the plugin's totals line holds an unreadable overhead ({str(oh)[:60]!r}); ignored")
        res["batch"] = {"mean_requests_per_step": round(sum(r["reqs"] for r in rows) / len(rows), 3),
                        "max_requests_per_step": max(r["reqs"] for r in rows)}
        surface, why = surface_from_steps(rows)      # the engine's own T(B, n), for tune and breakeven
        warnings += why
        if surface is not None:
            res["surface"] = surface
            timer, device = head.get("timer"), str(head.get("device") or "")
            if timer == "perf_counter" and device.startswith("cuda"):
                warnings.append("the steps were timed with perf_counter on a GPU: host time of asynchronously "
                                "launched work, so the verify surface is not the device's forward time")
        if not single:
            warnings.append("batched steps: τ and per-position acceptance are vLLM's per-request counts; the "
                            "per-cycle accept lengths are per-step means")
        config = dict(head.get("config") or {})
        config.update(engine=head.get("engine"), engine_version=head.get("engine_version"),
                      timer=head.get("timer"), source="plugin")
        env = dict(self.env or {})
        env["engine"] = head.get("engine")
        return {"config": config, "results": res, "samples": samples, "warnings": warnings, "env": env}


def window_steps(obj: dict) -> list[dict]:
    """A profiler window line's steps, checked: kind, tokens, phase -> component -> ms (finite, >= 0)."""
    steps = obj["window"]
    if not isinstance(steps, list):
        raise ValueError("window must be a list of steps")
    out = []
    for st in steps:
        phases = st["phases"]
        if not isinstance(phases, dict) or not all(isinstance(p, dict) and all(_time(v) for v in p.values())
                                                   for p in phases.values()):
            raise ValueError("phases must map phase -> component -> non-negative ms")
        measured = st.get("measured") or {}
        if not isinstance(measured, dict) or not all(_time(v) for v in measured.values()):
            raise ValueError("measured must map phases to non-negative ms")
        ex = st.get("experts")
        if ex is not None and not (isinstance(ex, dict) and _time(ex.get("distinct")) and _time(ex.get("bytes"))):
            raise ValueError("experts must hold distinct and bytes")
        scopes = st.get("scopes") or {}
        if not isinstance(scopes, dict) or not all(isinstance(v, int) and v >= 0 for v in scopes.values()):
            raise ValueError("scopes must map phases to counts")
        out.append({"kind": str(st["kind"]), "tokens": _count(st["tokens"]), "phases": phases, "measured": measured,
                    "experts": ex, "scopes": scopes})
    return out


def components_of(steps: list[dict]) -> dict:
    """The run's components: per step bucket (kind@tokens), each phase's mean ms per component over the profiled
    steps, the phase as the plugin timed those steps, and the experts touched (profile/components.py)."""
    from specscope.profile.components import Bucket, bucket_key

    buckets: dict[str, Bucket] = {}
    for st in steps:
        buckets.setdefault(bucket_key(st["kind"], st["tokens"]), Bucket()).add(st["phases"], st["measured"],
                                                                              st["experts"], st["scopes"])
    return {k: b.mean() for k, b in buckets.items()}


def _time(v) -> bool:
    # JSON readers take NaN and Infinity, and True is an int: none of them is a time, and none may reach the registry
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _count(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"counts must be integers, got {v!r}")
    return v


def _step(obj: dict) -> dict:
    ms = obj["ms"]
    if not isinstance(ms, dict) or not all(_time(v) for v in ms.values()):
        raise ValueError("ms must map phases to non-negative finite numbers")
    if not _time(obj["total_ms"]):
        raise ValueError("total_ms must be a non-negative finite number")
    total = float(obj["total_ms"])
    drafted = [_count(x) for x in obj["drafted"]]
    acc = obj.get("accepted")
    acc = None if acc is None else [_count(x) for x in acc]
    if any(d < 0 for d in drafted) or (acc is not None and any(a < 0 for a in acc)):
        raise ValueError("negative count")
    if acc is not None and (len(acc) != len(drafted) or any(a > d for a, d in zip(acc, drafted))):
        raise ValueError("accepted does not fit drafted")
    reqs = obj.get("reqs")
    reqs = max(len(drafted), 1) if reqs is None else _count(reqs)
    # the recorder writes one draft count per request: a step whose counts disagree is not one it wrote
    if reqs < 1 or (drafted and reqs != len(drafted)):
        raise ValueError(f"reqs {reqs} does not match the {len(drafted)} per-request draft count(s)")
    return {"ms": {str(k): float(v) for k, v in ms.items()}, "total_ms": total, "drafted": drafted,
            "accepted": acc, "reqs": reqs, "kind": obj.get("kind")}


def _tokens(r: dict) -> int:
    """Tokens the step produced per request (the profiler's per-cycle accept length; a mean when batched)."""
    acc = r["accepted"]
    if acc is None or not acc:
        return 1
    return round(sum(a + 1 for a in acc) / len(acc))


def _vllm_counters(rows: list[dict], warnings: list) -> dict:
    """vLLM's spec-decode counters from the steps: num_drafts, draft and accepted tokens, per position."""
    known = [r for r in rows if r["accepted"] is not None]
    if len(known) < len(rows):
        warnings.append(f"{len(rows) - len(known)} step(s) without acceptance (async scheduling keeps sampled "
                        f"tokens on the device); τ counts the others")
    drafts = [(d, a) for r in known for d, a in zip(r["drafted"], r["accepted"]) if d > 0]
    if not drafts:
        return {}
    depth = max(d for d, _ in drafts)
    per_pos = [sum(1 for _, a in drafts if a > i) for i in range(depth)]
    # conditional per request as the profiler counts it (position i drafted, i - 1 accepted): the profiler's own
    # sees a batched step as one cycle of its mean tokens, which the tuner's acceptance must not read
    reach = [sum(1 for d, a in drafts if d > i and a >= i) for i in range(depth)]
    accepted = sum(a for _, a in drafts)
    return {"accept_length": round(1 + accepted / len(drafts), 4),
            "drafted_tokens": sum(d for d, _ in drafts), "accepted_tokens": accepted,
            "per_position_acceptance": [round(x / len(drafts), 4) for x in per_pos],
            "per_position_acceptance_conditional": [round(x / r, 4) if r else None for x, r in zip(per_pos, reach)],
            "spec_decode": {"num_drafts": len(drafts), "num_draft_tokens": sum(d for d, _ in drafts),
                            "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos}}
