"""vLLM log lines: `SpecDecoding metrics:` (V1, either field order), V0's cumulative `Speculative metrics:`, the
periodic throughput line, and the engine-config line (version, model, speculative tokens, enforce_eager).

τ is recomputed from counts: drafts = Drafted / K (K speculative tokens per draft, from the config line or the
length of the per-position list), τ = 1 + Σ Accepted / Σ drafts. The printed `Mean acceptance length` is used only
when K is unknown, and a disagreement between it and the counts is reported. Per-position rates are
unconditional (accepted at i / drafts), so they are pooled weighted by drafts.
"""

from __future__ import annotations

import re

from specscope.ingest.base import OK, FormatParser, Malformed
from specscope.ingest.lines import Clock, histogram, key_values, number, stats, vllm_time

SPEC_V1 = re.compile(r"SpecDecoding metrics:")
SPEC_V0 = re.compile(r"Speculative metrics:")
THROUGHPUT = re.compile(r"Avg prompt throughput:")
CONFIG = re.compile(r"(?:Initializing a V\d LLM engine|Initializing an LLM engine).*with config:")
CUDA_GRAPH = re.compile(r"Capturing CUDA graph|Graph capturing finished|CUDA graphs? captur", re.I)
NUM_SPEC = re.compile(r"num_spec(?:ulative)?_tokens['\"]?\s*[=:]\s*(\d+)")


class VLLMParser(FormatParser):
    name = "vllm"
    description = "vLLM log (SpecDecoding metrics / throughput lines)"

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.spec: list[dict] = []
        self.v0: list[dict] = []
        self.tput: list[dict] = []
        self.cfg: dict = {}
        self.graph_lines = 0

    def feed(self, piece: str, lineno: int) -> str | None:
        # substring tests before any regex: this runs on every line of the file
        if "metrics:" not in piece and "throughput:" not in piece:
            if ("config" in piece or "num_spec" in piece) and (CONFIG.search(piece) or NUM_SPEC.search(piece)):
                self._config(piece)
                self.info_lines += 1
                return OK
            if "raph" in piece and CUDA_GRAPH.search(piece) and VLLM_LIKE.search(piece):
                self.graph_lines += 1
                self.info_lines += 1
                return OK
            return None
        for rx, fn in ((SPEC_V1, self._spec_v1), (SPEC_V0, self._spec_v0), (THROUGHPUT, self._throughput)):
            m = rx.search(piece)
            if m:
                kv = key_values(piece[m.end():] if rx is not THROUGHPUT else piece[m.start():])
                try:
                    fn(kv, self.clock.seconds(vllm_time(piece)))
                except (ValueError, KeyError) as e:
                    raise Malformed(f"{rx.pattern.rstrip(':')} line: {e}") from None
                self.data_lines += 1
                return OK
        return None

    def _spec_v1(self, kv: dict, t):
        if "Accepted" not in kv or "Drafted" not in kv:
            raise ValueError("missing Accepted/Drafted counts (truncated?)")
        d = {"t": t, "accepted": number(kv["Accepted"], "tokens"), "drafted": number(kv["Drafted"], "tokens")}
        if "Mean acceptance length" in kv:
            d["mean_al"] = number(kv["Mean acceptance length"])
        if "Per-position acceptance rate" in kv:
            d["per_pos"] = [number(x) for x in kv["Per-position acceptance rate"].split(",")]
            if any(not 0 <= x <= 1 for x in d["per_pos"]):
                raise ValueError("per-position rate outside [0, 1]")
        for k in ("Avg Draft acceptance rate", "Draft acceptance rate"):
            if k in kv:
                d["reported_rate"] = number(kv[k]) / 100.0
        if d["accepted"] > d["drafted"]:
            raise ValueError("more accepted than drafted tokens")
        self.spec.append(d)

    def _spec_v0(self, kv: dict, t):
        need = ("Number of accepted tokens", "Number of draft tokens", "Number of speculative tokens")
        if any(k not in kv for k in need):
            raise ValueError("missing token counts (truncated?)")
        self.v0.append({"t": t, "accepted": number(kv[need[0]]), "drafted": number(kv[need[1]]),
                        "k": int(number(kv[need[2]])),
                        "emitted": number(kv["Number of emitted tokens"]) if "Number of emitted tokens" in kv
                        else None})

    def _throughput(self, kv: dict, t):
        if "Avg generation throughput" not in kv or "Running" not in kv:
            raise ValueError("missing generation throughput / Running (truncated?)")
        d = {"t": t, "gen_tok_s": number(kv["Avg generation throughput"], "tokens/s"),
             "prompt_tok_s": number(kv.get("Avg prompt throughput", "0"), "tokens/s"),
             "running": int(number(kv["Running"], "reqs"))}
        for k, name in (("Waiting", "waiting"), ("Pending", "waiting"), ("GPU KV cache usage", "kv_usage"),
                        ("Prefix cache hit rate", "prefix_hit")):
            if k in kv:
                d[name] = number(kv[k], "reqs")
        self.tput.append(d)

    def _config(self, piece: str):
        m = re.search(r"\(v(\d[^\s)]*)\)", piece)
        if m:
            self.cfg["version"] = m.group(1)
        m = re.search(r"\bmodel=['\"]([^'\"]+)['\"]", piece)
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
            self.cfg["k"] = int(m.group(1))
        m = re.search(r"enforce_eager['\"]?\s*[=:]\s*(True|False)", piece)
        if m:
            self.cfg["enforce_eager"] = m.group(1) == "True"
        m = re.search(r"\bdtype=([\w.]+)", piece)
        if m:
            self.cfg["dtype"] = m.group(1)

    def result(self) -> dict:
        c = self.cfg
        warnings = []
        res: dict = {"spec_lines": len(self.spec) + len(self.v0), "throughput_lines": len(self.tput)}
        acc_known = drafts_known = 0.0
        acc_all = drafted_all = 0.0
        pos_acc: list[float] = []
        pos_drafts = 0.0
        inconsistent = 0
        series_tau = []
        for d in self.spec:
            acc_all += d["accepted"]
            drafted_all += d["drafted"]
            k = c.get("k") or (len(d["per_pos"]) if d.get("per_pos") else None)
            if c.get("k") and d.get("per_pos") and len(d["per_pos"]) != c["k"]:
                inconsistent += 1
            if k:
                drafts = d["drafted"] / k
            elif d.get("mean_al", 1.0) > 1.0:
                drafts = d["accepted"] / (d["mean_al"] - 1.0)
            else:
                drafts = None
            tau = 1.0 + d["accepted"] / drafts if drafts else None
            if tau is not None and "mean_al" in d and abs(tau - d["mean_al"]) > 0.011:
                inconsistent += 1
            series_tau.append(tau)
            if drafts:
                acc_known += d["accepted"]
                drafts_known += drafts
                if d.get("per_pos"):
                    if len(pos_acc) < len(d["per_pos"]):
                        pos_acc += [0.0] * (len(d["per_pos"]) - len(pos_acc))
                    for i, r in enumerate(d["per_pos"]):
                        pos_acc[i] += r * drafts
                    pos_drafts += drafts
        if self.v0:
            a, dr = _increase([x["accepted"] for x in self.v0]), _increase([x["drafted"] for x in self.v0])
            k = self.v0[-1]["k"]
            acc_all += a
            drafted_all += dr
            if k:
                acc_known += a
                drafts_known += dr / k
            res["v0_cumulative_lines"] = len(self.v0)
        if drafts_known:
            res["accept_length"] = 1.0 + acc_known / drafts_known
            res["num_drafts"] = drafts_known
        if drafted_all:
            res["accepted_tokens"] = acc_all
            res["drafted_tokens"] = drafted_all
            res["draft_acceptance_rate"] = acc_all / drafted_all
        if pos_drafts:
            res["per_position_acceptance"] = [x / pos_drafts for x in pos_acc]
        reported = [d["mean_al"] for d in self.spec if "mean_al" in d]
        if reported:
            res["reported_mean_acceptance_length"] = sum(reported) / len(reported)
        if inconsistent:
            warnings.append(f"{inconsistent} SpecDecoding lines disagree with themselves (printed mean acceptance "
                            "length or per-position count vs the token counts); τ uses the counts")
        active = [d for d in self.tput if d["running"] > 0]
        if active:
            tput = [d["gen_tok_s"] for d in active]
            res["tok_per_s"] = sum(tput) / len(tput)
            res["tok_per_s_stats"] = stats(tput)
            res["batch_size"] = stats([d["running"] for d in active])
            res["batch_size_hist"] = histogram(d["running"] for d in active)
            single = [d["gen_tok_s"] for d in active if d["running"] == 1 and d["gen_tok_s"] > 0]
            if single:
                res["decode_ms_per_token"] = 1e3 / stats(single)["median"]
        res["idle_lines"] = len(self.tput) - len(active)
        if "enforce_eager" in c:
            res["cuda_graph"] = not c["enforce_eager"]
        elif self.graph_lines:
            res["cuda_graph"] = True
        times = [d["t"] for d in self.spec + self.tput if d["t"] is not None]
        if times:
            res["duration_s"] = max(times) - min(times)
        config = {"engine": "vllm", "engine_version": c.get("version"), "model": c.get("model"),
                  "draft": c.get("draft"), "speculative_method": c.get("method"), "steps": c.get("k"),
                  "draft_tokens": (c["k"] + 1) if c.get("k") else None, "dtype": c.get("dtype")}
        samples = {"series": {"t_s": [d["t"] for d in self.tput], "gen_tok_per_s": [d["gen_tok_s"] for d in self.tput],
                              "running": [d["running"] for d in self.tput]},
                   "spec_series": {"t_s": [d["t"] for d in self.spec], "accept_length": series_tau,
                                   "accepted": [d["accepted"] for d in self.spec],
                                   "drafted": [d["drafted"] for d in self.spec]}}
        return {"config": config, "results": res, "samples": samples, "warnings": warnings,
                "env": {"engine": "vllm", "engine_version": c.get("version"), "cuda_graph": res.get("cuda_graph")}}


VLLM_LIKE = re.compile(r"(INFO|WARNING|DEBUG)\s+\d\d-\d\d ")


def _increase(values: list[float]) -> float:
    """Total growth of a cumulative counter, counting from 0 and across resets (a restart starts again at 0)."""
    total, prev = 0.0, 0.0
    for v in values:
        total += v - prev if v >= prev else v
        prev = v
    return total
