"""SGLang scheduler lines (`Decode batch.` / `Decode batch,`, with or without `accept len`; `Prefill batch`) and
the `server_args=ServerArgs(...)` startup line.

τ over the log is the mean of `accept len` weighted by #running-req: each line averages (accepted + 1) over the
verifies of its interval, and an interval of N forward steps holds N × running verifies. `accept rate` changed
meaning between SGLang versions, so it is kept only as `reported_accept_rate` and the acceptance per draft token
is recomputed from τ and the draft-token count. `gen throughput` includes idle gaps: idle lines (no running
request) are left out of tok/s.
"""

from __future__ import annotations

import re

from specscope.ingest.base import OK, FormatParser, Malformed
from array import array

from specscope.ingest.lines import Clock, Series, boolean, key_values, number, sglang_time, stats

ANCHOR = re.compile(r"\b(Decode|Prefill) batch[.,]")
SERVER_ARGS = re.compile(r"server_args=ServerArgs\(")
_ARG = re.compile(r"\b(\w+)=('(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^,()\s]+)")
WANTED_ARGS = {"model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
               "speculative_eagle_topk", "speculative_num_draft_tokens", "tp_size", "dp_size", "dtype",
               "disable_cuda_graph", "decode_log_interval", "kv_cache_dtype", "attention_backend"}

DECODE_REQUIRED = ("#running-req", "#token", "gen throughput (token/s)", "#queue-req")
PREFILL_REQUIRED = ("#new-seq", "#new-token", "#queue-req")


class SGLangParser(FormatParser):
    name = "sglang"
    description = "SGLang scheduler log (Decode batch / Prefill batch lines)"

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        # running aggregates and compact arrays: memory stays small however long the log is
        self.n_decode = 0
        self.active_tput, self.active_running = array("d"), array("d")
        self.spec_al, self.spec_w = array("d"), array("d")
        self.single_tput = array("d")
        self.rates_reported = array("d")
        self.graph = [0, 0]                  # lines with cuda graph True / False
        self.max_queue = 0
        self.max_usage = None
        self.t_min = self.t_max = None
        self.series = Series(("t_s", "gen_tok_per_s", "running", "accept_length", "queue"))
        self.prefill = {"lines": 0, "new_seq": 0, "new_tokens": 0, "cached_tokens": 0}
        self.args: dict = {}
        self.ranks: set[str] = set()

    def feed(self, piece: str, lineno: int) -> str | None:
        m = ANCHOR.search(piece) if "batch" in piece else None  # substring test first: this runs on every line
        if m is None:
            if "server_args" in piece and SERVER_ARGS.search(piece):
                self.args.update({k: v.strip("'\"") for k, v in _ARG.findall(piece) if k in WANTED_ARGS})
                self.info_lines += 1
                return OK
            return None
        kv = key_values(piece[m.end():])
        dt, rank = sglang_time(piece)
        try:
            if m.group(1) == "Decode":
                self._decode(kv, self.clock.seconds(dt))
            else:
                self._prefill(kv)
        except (ValueError, KeyError) as e:
            raise Malformed(f"{m.group(1).lower()} line: {e}") from None
        if rank:
            self.ranks.add(rank)
        self.data_lines += 1
        return OK

    def has_data(self) -> bool:
        return self.n_decode > 0 or self.prefill["lines"] > 0

    def _decode(self, kv: dict, t: float | None):
        missing = [k for k in DECODE_REQUIRED if k not in kv]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (truncated?)")
        running = int(number(kv["#running-req"]))
        number(kv["#token"])
        tput = number(kv["gen throughput (token/s)"])
        queue = int(number(kv["#queue-req"]))
        usage = number(kv["token usage"]) if "token usage" in kv else None
        al = number(kv["accept len"]) if "accept len" in kv else None
        if al is not None and al < 1.0:
            raise ValueError(f"accept len {al} < 1")
        rate = number(kv["accept rate"]) if "accept rate" in kv else None
        graph = boolean(kv["cuda graph"]) if "cuda graph" in kv else None
        # all fields parsed: only now touch the aggregates, so a malformed line leaves no trace
        self.n_decode += 1
        if running > 0:
            self.active_tput.append(tput)
            self.active_running.append(running)
            if running == 1 and tput > 0:
                self.single_tput.append(tput)
            if al is not None:
                self.spec_al.append(al)
                self.spec_w.append(running)
                if rate is not None:
                    self.rates_reported.append(rate)
        if graph is not None:
            self.graph[0 if graph else 1] += 1
        self.max_queue = max(self.max_queue, queue)
        if usage is not None:
            self.max_usage = usage if self.max_usage is None else max(self.max_usage, usage)
        if t is not None:
            self.t_min = t if self.t_min is None else min(self.t_min, t)
            self.t_max = t if self.t_max is None else max(self.t_max, t)
        self.series.add(t, tput, running, al, queue)

    def _prefill(self, kv: dict):
        missing = [k for k in PREFILL_REQUIRED if k not in kv]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (truncated?)")
        seq, new, cached = (int(number(kv["#new-seq"])), int(number(kv["#new-token"])),
                            int(number(kv.get("#cached-token", "0"))))
        p = self.prefill
        p["lines"] += 1
        p["new_seq"] += seq
        p["new_tokens"] += new
        p["cached_tokens"] += cached

    def result(self) -> dict:
        a = self.args
        steps = _int(a.get("speculative_num_steps"))
        topk = _int(a.get("speculative_eagle_topk"))
        draft_tokens = _int(a.get("speculative_num_draft_tokens"))
        config = {"engine": "sglang", "model": a.get("model_path"), "draft": a.get("speculative_draft_model_path"),
                  "speculative_algorithm": a.get("speculative_algorithm"), "steps": steps, "topk": topk,
                  "draft_tokens": draft_tokens, "dtype": a.get("dtype"), "tp_size": _int(a.get("tp_size")),
                  "dp_size": _int(a.get("dp_size")), "decode_log_interval": _int(a.get("decode_log_interval"))}
        warnings = []
        n_active, n_spec = len(self.active_tput), len(self.spec_al)
        res: dict = {"decode_lines": self.n_decode, "prefill_lines": self.prefill["lines"]}
        if n_spec:
            w = sum(self.spec_w)
            tau = sum(a * wi for a, wi in zip(self.spec_al, self.spec_w)) / w
            res["accept_length"] = tau
            res["accept_length_unweighted"] = sum(self.spec_al) / n_spec
            res["accept_length_stats"] = stats(self.spec_al)
            if draft_tokens and draft_tokens > 1:
                # per draft token, from τ and the configured tree size — not SGLang's own `accept rate`
                res["draft_acceptance_rate"] = (tau - 1.0) / (draft_tokens - 1)
            if self.rates_reported:
                res["reported_accept_rate_mean"] = sum(self.rates_reported) / len(self.rates_reported)
                warnings.append("SGLang's 'accept rate' changed definition between versions; it is stored as "
                                "reported_accept_rate_mean and not used")
            if n_spec < n_active:
                warnings.append(f"{n_active - n_spec} active decode lines have no 'accept len' "
                                "(a non-speculative run mixed in?)")
        if n_active:
            res["tok_per_s"] = sum(self.active_tput) / n_active
            res["tok_per_s_stats"] = stats(self.active_tput)
            res["tok_per_s_per_request"] = sum(t / r for t, r in zip(self.active_tput, self.active_running)) / n_active
            res["batch_size"] = stats(self.active_running)
            hist: dict[int, int] = {}
            for r in self.active_running:
                hist[int(r)] = hist.get(int(r), 0) + 1
            res["batch_size_hist"] = {str(k): hist[k] for k in sorted(hist)}
            if self.single_tput:
                # at batch 1 the generation rate is one request's rate: ms per token (per cycle τ tokens)
                res["decode_ms_per_token"] = 1e3 / stats(self.single_tput)["median"]
        res["idle_lines"] = self.n_decode - n_active
        on, off = self.graph
        if on + off:
            res["cuda_graph"] = True if not off else False if not on else "mixed"
            res["cuda_graph_share"] = on / (on + off)
        elif "disable_cuda_graph" in a:
            res["cuda_graph"] = a["disable_cuda_graph"] != "True"
        if self.n_decode:
            res["max_queue"] = self.max_queue
            if self.max_usage is not None:
                res["max_token_usage"] = self.max_usage
        p = self.prefill
        if p["lines"]:
            res["prefill"] = dict(p)
            seen = p["new_tokens"] + p["cached_tokens"]
            res["prefill"]["cache_hit_rate"] = p["cached_tokens"] / seen if seen else None
        if self.t_min is not None:
            res["duration_s"] = self.t_max - self.t_min
        if self.ranks:
            res["ranks"] = sorted(self.ranks)
            if len({r.split()[0] for r in self.ranks}) > 1:
                warnings.append(f"lines from {len(self.ranks)} ranks: tok/s and batch sizes are per logging rank")
        samples = {"series": self.series.to_dict()}
        return {"config": config, "results": res, "samples": samples, "warnings": warnings,
                "env": {"engine": "sglang", "cuda_graph": res.get("cuda_graph")}}


def _int(v):
    try:
        return int(v) if v not in (None, "None") else None
    except ValueError:
        return None
