"""vLLM log lines, by the engine's own definitions (docs/engine-metrics.md has the table):

* V1 `SpecDecoding metrics:` (vllm/v1/spec_decode/metrics.py), three forms over time — "Draft acceptance rate:
  61.2%, Accepted: N tokens, Drafted: M tokens" (v0.8.3); the same plus "Mean acceptance length" and
  "Per-position acceptance rate" (v0.8.4+); and "Mean acceptance length: ..., Accepted throughput: ..., ..., Avg
  Draft acceptance rate: ..%" (v0.9+). Counts are per logging interval; Accepted counts the accepted *prefix*.
* early V1 `Speculative metrics: Draft acceptance rate: 1.000, Number of accepted tokens: 66, Number of draft
  tokens: 66,` (v0.8.0–0.8.2, renamed by vLLM PR #15902): per interval, no k.
* V0 `Speculative metrics: ... System efficiency: ..., Number of speculative tokens: k, Number of accepted tokens:
  A, Number of draft tokens: D, Number of emitted tokens: E.` (vllm/engine/metrics.py): counters cumulative since
  the engine started. A counts accepted tokens *per position*, not the accepted prefix (vLLM's rejection sampler
  notes `accepted` may hold True values after a rejection), so τ comes from E: τ = E / (D / k) = system
  efficiency × (k + 1), and the accepted prefix is E − D / k.
* the throughput line ("Engine 000: Avg prompt throughput: ..., Avg generation throughput: ..., Running: N reqs")
  and the engine-config lines (version, model, speculative config, enforce_eager).

Drafts = Drafted / k, k being the draft length of that line: the length of its per-position list, else the k of
the last config line before it, else (one k in the whole log) that k. A change of k (a restart) starts a new
segment; each segment has its own τ, the headline τ pools the drafts of all. Per-position rates are unconditional
(accepted at i / drafts) and pooled over the drafts that had position i. With data parallelism (`Engine 001:`)
each engine's lines follow its throughput line: counts are summed over engines, and tok/s is summed per logging
tick (one line per engine) before averaging over ticks.
"""

from __future__ import annotations

import re

from specscope.ingest.base import OK, FormatParser, Malformed
from specscope.ingest.lines import Clock, histogram, key_values, number, stats, vllm_time

SPEC_V1 = re.compile(r"SpecDecoding metrics:")
SPEC_V0 = re.compile(r"Speculative metrics:")
THROUGHPUT = re.compile(r"Avg prompt throughput:")
ENGINE = re.compile(r"\bEngine (\d+):")
CONFIG = re.compile(r"(?:Initializing a V\d LLM engine|Initializing an LLM engine).*with config:|non-default args:")
CUDA_GRAPH = re.compile(r"Capturing CUDA graph|Graph capturing finished|CUDA graphs? captur", re.I)
NUM_SPEC = re.compile(r"num_spec(?:ulative)?_tokens['\"]?\s*[=:]\s*(\d+)")
VERSION = re.compile(r"\(v(\d[^\s)]*)\)|vLLM API server version (\d[^\s,]*)")
V1, V1_EARLY, V0, TPUT, CFG, GRAPH = ("SpecDecoding metrics (V1)", "Speculative metrics (early V1, no k)",
                                      "Speculative metrics (V0, cumulative)", "throughput", "config", "cuda graph")
NO_K = "no k: no per-position list, no config line and more than one k in the log; left out of every figure"


class VLLMParser(FormatParser):
    name = "vllm"
    description = "vLLM log (SpecDecoding metrics / throughput lines)"

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.spec: list[dict] = []     # V1 lines (both V1 forms and early V1), per interval
        self.v0: list[dict] = []       # V0 lines, cumulative
        self.tput: list[dict] = []
        self.cfg: dict = {}
        self.cur_k: int | None = None  # k of the last config line: a restart prints a new one
        self.cur_engine: str | None = None
        self.graph_lines = 0

    def feed(self, piece: str, lineno: int) -> str | None:
        # substring tests before any regex: this runs on every line of the file
        if "metrics:" not in piece and "throughput:" not in piece:
            if ("config" in piece or "num_spec" in piece or "args" in piece or "version" in piece) and (
                    CONFIG.search(piece) or NUM_SPEC.search(piece) or VERSION.search(piece)):
                self._config(piece)
                self.info_lines += 1
                self.saw(CFG)
                return OK
            if "raph" in piece and CUDA_GRAPH.search(piece) and VLLM_LIKE.search(piece):
                self.graph_lines += 1
                self.info_lines += 1
                self.saw(GRAPH)
                return OK
            return None
        for rx, fn in ((SPEC_V1, self._spec_v1), (SPEC_V0, self._spec_v0), (THROUGHPUT, self._throughput)):
            m = rx.search(piece)
            if m:
                kv = key_values(piece[m.end():] if rx is not THROUGHPUT else piece[m.start():])
                em = ENGINE.search(piece, 0, m.start() + 1)
                try:
                    kind = fn(kv, vllm_time(piece), lineno, str(int(em.group(1))) if em else None)
                except (ValueError, KeyError) as e:
                    self.malformed(V0 if rx is SPEC_V0 else V1 if rx is SPEC_V1 else TPUT)
                    raise Malformed(f"{rx.pattern.rstrip(':')} line: {e}") from None
                self.saw(kind)
                self.data_lines += 1
                return OK
        return None

    def _engine(self, named: str | None) -> str:
        """Engine index as a plain number string; a line without one belongs to the last engine named."""
        return named if named is not None else (self.cur_engine or "0")

    def _spec_v1(self, kv: dict, dt, lineno, engine) -> str:
        if "Accepted" not in kv or "Drafted" not in kv:
            raise ValueError("missing Accepted/Drafted counts (truncated?)")
        d = {"accepted": number(kv["Accepted"], "tokens"), "drafted": number(kv["Drafted"], "tokens"),
             "line": lineno, "form": V1}
        if "Mean acceptance length" in kv:
            d["mean_al"] = number(kv["Mean acceptance length"])
        if "Per-position acceptance rate" in kv:
            d["per_pos"] = [number(x) for x in kv["Per-position acceptance rate"].split(",")]
            if any(not 0 <= x <= 1 for x in d["per_pos"]):
                raise ValueError("per-position rate outside [0, 1]")
        for k in ("Avg Draft acceptance rate", "Draft acceptance rate"):
            if k in kv:
                d["reported_rate"] = number(kv[k]) / 100.0
        return self._add_interval(d, dt, engine)

    def _add_interval(self, d: dict, dt, engine) -> str:
        if d["accepted"] > d["drafted"]:
            raise ValueError("more accepted than drafted tokens")
        d["t"] = self.clock.seconds(dt)
        d["engine"] = self._engine(engine)
        d["k"] = len(d["per_pos"]) if d.get("per_pos") else self.cur_k
        d["cfg_k"] = self.cur_k
        self.spec.append(d)
        return d["form"]

    def _spec_v0(self, kv: dict, dt, lineno, engine) -> str:
        acc_key, draft_key = "Number of accepted tokens", "Number of draft tokens"
        if draft_key not in kv and "Number of draft tokens tokens" in kv:   # vLLM 0.4's doubled "tokens"
            draft_key = "Number of draft tokens tokens"
        if acc_key not in kv or draft_key not in kv:
            raise ValueError("missing token counts (truncated?)")
        if "Number of speculative tokens" not in kv:
            # the early V1 form: interval counts of the accepted prefix, no k
            d = {"accepted": number(kv[acc_key]), "drafted": number(kv[draft_key]), "line": lineno, "form": V1_EARLY}
            if "Draft acceptance rate" in kv:
                d["reported_rate"] = number(kv["Draft acceptance rate"])
            return self._add_interval(d, dt, engine)
        emitted = None
        for key in ("Number of emitted tokens", "Number of emitted tokens tokens"):
            if key in kv:
                emitted = number(kv[key])
        k = int(number(kv["Number of speculative tokens"]))
        if k < 1:
            raise ValueError(f"number of speculative tokens {k} < 1")
        self.v0.append({"t": self.clock.seconds(dt), "accepted": number(kv[acc_key]), "drafted": number(kv[draft_key]),
                        "k": k, "emitted": emitted, "line": lineno})
        return V0

    def _throughput(self, kv: dict, dt, lineno, engine) -> str:
        if "Avg generation throughput" not in kv or "Running" not in kv:
            raise ValueError("missing generation throughput / Running (truncated?)")
        d = {"t": self.clock.seconds(dt), "gen_tok_s": number(kv["Avg generation throughput"], "tokens/s"),
             "prompt_tok_s": number(kv.get("Avg prompt throughput", "0"), "tokens/s"),
             "running": int(number(kv["Running"], "reqs")), "engine": engine or "0"}
        if engine is not None:
            self.cur_engine = engine   # the SpecDecoding line that follows is this engine's
        self.tput.append(d)
        return TPUT

    def _config(self, piece: str):
        m = VERSION.search(piece)
        if m:
            self.cfg["version"] = m.group(1) or m.group(2)
        m = re.search(r"\bmodel=['\"]([^'\"]+)['\"]", piece) or re.search(r"['\"]model['\"]:\s*['\"]([^'\"]+)['\"]",
                                                                          piece)
        if m and "model" not in self.cfg:
            self.cfg["model"] = m.group(1)
        m = re.search(r"speculative_config=SpeculativeConfig\((.*?)\)", piece) or \
            re.search(r"['\"]?speculative_config['\"]?\s*[:=]\s*\{(.*?)\}", piece)
        if m:
            inner = m.group(1)
            mm = re.search(r"method['\"]?\s*[=:]\s*['\"](\w+)['\"]", inner)
            if mm:
                self.cfg["method"] = mm.group(1)
            mm = re.search(r"model['\"]?\s*[=:]\s*['\"]([^'\"]+)['\"]", inner)
            if mm:
                self.cfg["draft"] = mm.group(1)
        m = NUM_SPEC.search(piece)
        if m:
            self.cfg["k"] = self.cur_k = int(m.group(1))
        m = re.search(r"enforce_eager['\"]?\s*[=:]\s*(True|False)", piece)
        if m:
            self.cfg["enforce_eager"] = m.group(1) == "True"
        m = re.search(r"\bdtype=([\w.]+)", piece)
        if m:
            self.cfg["dtype"] = m.group(1)

    # ---- figures -------------------------------------------------------------------------------------------
    def _segments(self, warnings: list) -> list[dict]:
        """Per-interval V1 lines and cumulative V0 lines -> segments of one k, each with drafts and the accepted
        prefix, in file order."""
        segs: list[dict] = []
        self._v1_segments(segs, warnings)
        self._v0_segments(segs, warnings)
        if len({s["k"] for s in segs}) > 1:
            change = ", ".join(f"k={s['k']} from line {s['first_line']}" for s in segs)
            warnings.append(f"the number of speculative tokens changes in this log ({change}): a restart; τ per "
                            "segment is in results.segments, the headline τ pools their drafts")
        return segs

    def _v1_segments(self, segs: list, warnings: list) -> None:
        """V1 lines (per interval): drafts = Drafted / k, τ per line, per-position rates pooled over drafts."""
        ks = {d["k"] for d in self.spec if d["k"]} | {d["k"] for d in self.v0}
        only_k = next(iter(ks)) if len(ks) == 1 else None
        no_k = 0
        inconsistent = 0
        for d in self.spec:
            k = d["k"] or only_k
            if not k:
                no_k += 1
                self.skip(d["form"], NO_K)
                continue
            if not d["k"]:
                self.partial(d["form"], "k taken from the other lines (the log has one k)")
            if d.get("per_pos") and d["cfg_k"] and len(d["per_pos"]) != d["cfg_k"]:
                inconsistent += 1
            drafts = d["drafted"] / k
            d["drafts"] = drafts
            d["tau"] = 1.0 + d["accepted"] / drafts if drafts else None
            if d["tau"] is not None and "mean_al" in d and abs(d["tau"] - d["mean_al"]) > 0.011:
                inconsistent += 1
            s = _segment(segs, k, "v1", d["line"])
            s["lines"] += 1
            s["drafts"] += drafts
            s["accepted"] += d["accepted"]
            s["drafted"] += d["drafted"]
            for i, r in enumerate(d.get("per_pos") or []):
                if len(s["pos_acc"]) <= i:
                    s["pos_acc"].append(0.0)
                    s["pos_drafts"].append(0.0)
                s["pos_acc"][i] += r * drafts
                s["pos_drafts"][i] += drafts
        if no_k:
            warnings.append(f"{no_k} vLLM spec-decoding line(s) give no k (no per-position list, no config line, "
                            f"k differs across the log): left out of every figure")
        if inconsistent:
            warnings.append(f"{inconsistent} SpecDecoding lines disagree with themselves (printed mean acceptance "
                            "length or per-position count vs the token counts); τ uses the counts")

    def _v0_segments(self, segs: list, warnings: list) -> None:
        """V0 lines: cumulative counters; a change of k is a restart and starts a segment, a drop in a counter too.
        The accepted prefix comes from the emitted tokens (V0's accepted count is per position)."""
        prev = None
        missing_e = 0
        for d in self.v0:
            # a restart (counters start again from 0) with the same k continues the segment
            restart = prev is None or d["k"] != prev["k"] or d["drafted"] < prev["drafted"]
            base = {"accepted": 0.0, "drafted": 0.0, "emitted": 0.0} if restart else prev
            s = _segment(segs, d["k"], "v0", d["line"])
            s["lines"] += 1
            dd = d["drafted"] - base["drafted"]
            s["v0_accepted_per_pos"] = s.get("v0_accepted_per_pos", 0.0) + d["accepted"] - base["accepted"]
            s["drafted"] += dd
            s["drafts"] += dd / d["k"]
            if d["emitted"] is None or base["emitted"] is None:
                missing_e += 1
                s["no_emitted"] = True
            else:
                s["emitted"] = (s["emitted"] or 0.0) + d["emitted"] - base["emitted"]
            prev = d
        for s in segs:
            if s["form"] == "v0":
                if s.get("no_emitted"):
                    s["accepted"] = None      # per-position counts cannot give the accepted prefix
                    self.skip(V0, "no 'Number of emitted tokens': the accepted prefix is unknown", s["lines"])
                else:
                    s["accepted"] = s["emitted"] - s["drafts"]
        if missing_e:
            warnings.append(f"{missing_e} V0 line(s) lack 'Number of emitted tokens': V0's accepted count is per "
                            "position, so τ cannot be computed for their segment")

    def _throughput_figures(self, res: dict, warnings: list) -> None:
        engines = sorted({d["engine"] for d in self.tput})
        ticks: list[dict] = []
        for d in self.tput:   # one line per engine per logging tick
            if not ticks or d["engine"] in ticks[-1]["engines"]:
                ticks.append({"engines": set(), "gen": 0.0, "running": 0})
            t = ticks[-1]
            t["engines"].add(d["engine"])
            t["gen"] += d["gen_tok_s"]
            t["running"] += d["running"]
        active = [t for t in ticks if t["running"] > 0]
        idle_lines = sum(1 for d in self.tput if d["running"] == 0)
        res["idle_lines"] = idle_lines
        self.skip(TPUT, "idle: no running request", idle_lines)
        if not active:
            return
        tput = [t["gen"] for t in active]
        res["tok_per_s"] = sum(tput) / len(tput)
        res["tok_per_s_stats"] = stats(tput)
        res["batch_size"] = stats([t["running"] for t in active])
        res["batch_size_hist"] = histogram(t["running"] for t in active)
        single = [t["gen"] for t in active if t["running"] == 1 and t["gen"] > 0]
        if single:
            res["decode_ms_per_token"] = 1e3 / stats(single)["median"]
        if len(engines) > 1:
            res["data_parallel_engines"] = len(engines)
            warnings.append(f"{len(engines)} data-parallel engines: tok/s and batch sizes are summed over the "
                            "engines of each logging tick; acceptance counts are summed")

    def _acceptance(self, res: dict, segs: list, warnings: list) -> None:
        """τ and the acceptance rates, pooled over the segments whose accepted prefix is known; with no k anywhere
        only the acceptance rate (the counts define it, τ needs k)."""
        known = [s for s in segs if s["accepted"] is not None and s["drafts"]]
        drafts = sum(s["drafts"] for s in known)
        if drafts:
            acc = sum(s["accepted"] for s in known)
            drafted = sum(s["drafted"] for s in known)
            res["accept_length"] = 1.0 + acc / drafts
            res["num_drafts"] = drafts
            res["accepted_tokens"] = acc
            res["drafted_tokens"] = drafted
            res["draft_acceptance_rate"] = acc / drafted
            res["system_efficiency"] = (drafts + acc) / sum(s["drafts"] * (s["k"] + 1) for s in known)
        elif self.spec and not any(d["k"] or 0 for d in self.spec):
            # no k anywhere: the acceptance rate is still defined by the counts, τ is not
            acc, drafted = sum(d["accepted"] for d in self.spec), sum(d["drafted"] for d in self.spec)
            if drafted:
                res["accepted_tokens"], res["drafted_tokens"] = acc, drafted
                res["draft_acceptance_rate"] = acc / drafted
                for d in self.spec:
                    self._kind(d["form"])["skipped"].pop(NO_K, None)
                    self.partial(d["form"], "no k anywhere in the log: in draft_acceptance_rate, not in τ")
                warnings[:] = [w for w in warnings if "give no k" not in w]
                warnings.append(f"no line or config line gives k (the number of speculative tokens): τ is unknown; "
                                f"draft_acceptance_rate uses the {len(self.spec)} lines' counts. Include the "
                                "engine's startup lines (num_spec_tokens) to get τ")

    def _segment_figures(self, res: dict, segs: list) -> None:
        """Per-position acceptance, V0's own acceptance rate, and τ per segment when the log has several."""
        # per position: pooled over the drafts that had that position (a k=3 draft has no 4th position)
        depth = max((len(s["pos_acc"]) for s in segs), default=0)
        if depth:
            pp = []
            for i in range(depth):
                num = sum(s["pos_acc"][i] for s in segs if len(s["pos_acc"]) > i)
                den = sum(s["pos_drafts"][i] for s in segs if len(s["pos_drafts"]) > i)
                pp.append(num / den if den else None)
            res["per_position_acceptance"] = pp
        v0_pp = [s for s in segs if s["form"] == "v0"]
        if v0_pp:
            res["v0_cumulative_lines"] = len(self.v0)
            dd = sum(s["drafted"] for s in v0_pp)
            if dd:   # vLLM V0's own "Draft acceptance rate": per-position accepted / draft tokens
                res["v0_reported_acceptance_rate"] = sum(s["v0_accepted_per_pos"] for s in v0_pp) / dd
        if len(segs) > 1 or (segs and len({s["k"] for s in segs}) > 1):
            res["segments"] = [{"k": s["k"], "form": s["form"], "lines": s["lines"], "first_line": s["first_line"],
                                "num_drafts": s["drafts"], "accepted_tokens": s["accepted"],
                                "accept_length": (1.0 + s["accepted"] / s["drafts"])
                                if s["accepted"] is not None and s["drafts"] else None} for s in segs]

    def _per_engine(self) -> dict | None:
        """τ, drafts and tok/s per data-parallel engine, when the log has several."""
        engines = sorted({d["engine"] for d in self.spec} | {d["engine"] for d in self.tput})
        if len(engines) <= 1:
            return None
        per = {}
        for e in engines:
            sp = [d for d in self.spec if d["engine"] == e and d.get("drafts")]
            tp = [d["gen_tok_s"] for d in self.tput if d["engine"] == e and d["running"] > 0]
            dr = sum(d["drafts"] for d in sp)
            per[e] = {"accept_length": 1.0 + sum(d["accepted"] for d in sp) / dr if dr else None,
                      "num_drafts": dr, "tok_per_s": sum(tp) / len(tp) if tp else None}
        return per

    def _config_of(self, segs: list) -> dict:
        """The run's config: the engine's startup lines, k from the segments (the one with the most drafts)."""
        c = self.cfg
        ks = [s["k"] for s in segs]
        k = max(set(ks), key=lambda x: sum(s["drafts"] for s in segs if s["k"] == x)) if ks else c.get("k")
        return {"engine": "vllm", "engine_version": c.get("version"), "model": c.get("model"),
                "draft": c.get("draft"), "speculative_method": c.get("method"), "steps": k,
                "draft_tokens": (k + 1) if k else None, "dtype": c.get("dtype")}

    def _samples(self) -> dict:
        return {"series": {"t_s": [d["t"] for d in self.tput], "gen_tok_per_s": [d["gen_tok_s"] for d in self.tput],
                           "running": [d["running"] for d in self.tput]},
                "spec_series": {"t_s": [d["t"] for d in self.spec],
                                "accept_length": [d.get("tau") for d in self.spec],
                                "accepted": [d["accepted"] for d in self.spec],
                                "drafted": [d["drafted"] for d in self.spec]}}

    def result(self) -> dict:
        c = self.cfg
        warnings: list[str] = []
        res: dict = {"spec_lines": len(self.spec) + len(self.v0), "throughput_lines": len(self.tput)}
        segs = self._segments(warnings)
        self._acceptance(res, segs, warnings)
        self._segment_figures(res, segs)
        per_engine = self._per_engine()
        if per_engine:
            res["per_engine"] = per_engine
        reported = [d["mean_al"] for d in self.spec if "mean_al" in d]
        if reported:
            res["reported_mean_acceptance_length"] = sum(reported) / len(reported)
        self._throughput_figures(res, warnings)
        if "enforce_eager" in c:
            res["cuda_graph"] = not c["enforce_eager"]
        elif self.graph_lines:
            res["cuda_graph"] = True
        span = self.clock.span()
        if span is not None:
            res["duration_s"] = span
            if self.clock.span_warning():
                warnings.append(self.clock.span_warning())
        return {"config": self._config_of(segs), "results": res, "samples": self._samples(), "warnings": warnings,
                "env": {"engine": "vllm", "engine_version": c.get("version"), "cuda_graph": res.get("cuda_graph")}}


VLLM_LIKE = re.compile(r"(INFO|WARNING|DEBUG)\s+\d\d-\d\d ")


def _segment(segs: list, k: int, form: str, line: int) -> dict:
    """The segment a line of draft length k and form ("v1" / "v0") adds to: the last one, or a new one."""
    if not segs or segs[-1]["k"] != k or segs[-1]["form"] != form:
        segs.append({"k": k, "form": form, "lines": 0, "first_line": line, "drafts": 0.0, "accepted": 0.0,
                     "drafted": 0.0, "pos_acc": [], "pos_drafts": [], "emitted": None})
    return segs[-1]
