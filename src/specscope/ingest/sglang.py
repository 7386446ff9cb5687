"""SGLang scheduler lines (`Decode batch.` / `Decode batch,`, with or without `accept len`; `Prefill batch`) and
the `server_args=ServerArgs(...)` startup line.

Forms read (SGLang's scheduler `log_decode_stats`, 2024 to 2026): the stamp "[2025-10-22 10:27:57 TP0]",
"[2025-10-22 10:27:57]", the time-of-day-only "[04:40:55 TP0]" of 2024 releases, or Python logging's
"2025-10-22 10:27:57,123 - ..."; "#token" or "#full token"; a "<backend> graph: True" field ("cuda", "npu").

τ over the log is the mean of `accept len` weighted by #running-req: each line averages (accepted + 1) over the
(request, verify) pairs of its interval, and an interval of N forward steps holds about N × running of them — the
plain mean is kept beside it. `accept rate` changed meaning between SGLang versions, so it is kept only as
`reported_accept_rate_mean` and the acceptance per draft token is recomputed from τ and the draft-token count.
`gen throughput` is tokens over the time since the previous line, idle time included: lines with no running
request are left out of tok/s, and so are idle gaps — a line whose per-request rate is under IDLE_GAP_FRACTION of
the median (requests arrived after a pause: the interval was mostly idle). Data-parallel ranks ("DP1 TP0") log
separately: tok/s is summed over them.
"""

from __future__ import annotations

import re
from array import array
from statistics import median

from specscope.engines import sglang
from specscope.ingest.base import OK, FormatParser, Malformed
from specscope.ingest.lines import Clock, Series, boolean, key_values, number, sglang_time, stats

ANCHOR = re.compile(r"\b(Decode|Prefill) batch[.,]")
_DP = re.compile(r"\bDP(\d+)\b")

DECODE_REQUIRED = ("#running-req", "gen throughput (token/s)", "#queue-req")
PREFILL_REQUIRED = ("#new-seq", "#new-token", "#queue-req")
IDLE_GAP_FRACTION = 0.1
DECODE, PREFILL, ARGS = "decode", "prefill", "server_args"


class SGLangParser(FormatParser):
    name = "sglang"
    description = "SGLang scheduler log (Decode batch / Prefill batch lines)"

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        # running aggregates and compact arrays: memory stays small however long the log is
        self.n_decode = 0
        self.active_tput, self.active_running, self.active_dp = array("d"), array("d"), array("i")
        self.spec_al, self.spec_w = array("d"), array("d")
        self.rates_reported = array("d")
        self.graph = [0, 0]                  # lines with (cuda|npu) graph True / False
        self.graph_backend: str | None = None
        self.max_queue = 0
        self.max_usage = None
        self.series = Series(("t_s", "gen_tok_per_s", "running", "accept_length", "queue"))
        self.prefill = {"lines": 0, "new_seq": 0, "new_tokens": 0, "cached_tokens": 0}
        self.args: dict = {}
        self.ranks: set[str] = set()
        self.undated = 0

    def feed(self, piece: str, lineno: int) -> str | None:
        m = ANCHOR.search(piece) if "batch" in piece else None  # substring test first: this runs on every line
        if m is None:
            if "server_args" in piece and sglang.SERVER_ARGS_LINE.search(piece):
                self.args.update({k: v for k, v in sglang.server_args(piece).items() if k in sglang.RUN_CONFIG_ARGS})
                self.info_lines += 1
                self.saw(ARGS)
                return OK
            return None
        kv = key_values(piece[m.end():])
        dt, rank, wrap = sglang_time(piece)
        kind = DECODE if m.group(1) == "Decode" else PREFILL
        try:
            if kind == DECODE:
                self._decode(kv, dt, wrap, rank)
            else:
                self._prefill(kv)
        except (ValueError, KeyError) as e:
            self.malformed(kind)
            raise Malformed(f"{m.group(1).lower()} line: {e}") from None
        self.saw(kind)
        if rank:
            self.ranks.add(rank)
        self.data_lines += 1
        return OK

    def has_data(self) -> bool:
        return self.n_decode > 0 or self.prefill["lines"] > 0

    def _decode(self, kv: dict, dt, wrap, rank):
        missing = [k for k in DECODE_REQUIRED if k not in kv]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (truncated?)")
        running = int(number(kv["#running-req"]))
        tput = number(kv["gen throughput (token/s)"])
        queue = int(number(kv["#queue-req"]))
        usage = number(kv["token usage"]) if "token usage" in kv else None
        al = number(kv["accept len"]) if "accept len" in kv else None
        if al is not None and al < 1.0:
            raise ValueError(f"accept len {al} < 1")
        rate = number(kv["accept rate"]) if "accept rate" in kv else None
        graph = backend = None
        for k in kv:
            if k.endswith(" graph"):            # "cuda graph", "npu graph"
                graph, backend = boolean(kv[k]), k[:-6]
        # all fields parsed: only now touch the aggregates, so a malformed line leaves no trace
        t = self.clock.seconds(dt, wrap)
        if dt is None:
            self.undated += 1
        self.n_decode += 1
        if running > 0:
            self.active_tput.append(tput)
            self.active_running.append(running)
            dp = _DP.search(rank) if rank else None
            self.active_dp.append(int(dp.group(1)) if dp else 0)
            if al is not None:
                self.spec_al.append(al)
                self.spec_w.append(running)
                if rate is not None:
                    self.rates_reported.append(rate)
        if graph is not None:
            self.graph[0 if graph else 1] += 1
            self.graph_backend = backend
        self.max_queue = max(self.max_queue, queue)
        if usage is not None:
            self.max_usage = usage if self.max_usage is None else max(self.max_usage, usage)
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

    def _throughput(self, res: dict, warnings: list) -> None:
        """tok/s while decoding: idle lines and idle gaps out, per data-parallel rank, summed over ranks."""
        n_active = len(self.active_tput)
        per_req = [t / r for t, r in zip(self.active_tput, self.active_running)]
        med = median(per_req)
        keep = [i for i in range(n_active) if per_req[i] >= IDLE_GAP_FRACTION * med]
        gaps = n_active - len(keep)
        res["idle_gap_lines"] = gaps
        if gaps:
            self.partial(DECODE, f"idle gap: per-request tok/s under {IDLE_GAP_FRACTION:g} × the median "
                                 "(the interval was mostly idle); left out of tok/s, kept in τ", gaps)
        tput = [self.active_tput[i] for i in keep]
        running = [self.active_running[i] for i in keep]
        groups = sorted({self.active_dp[i] for i in keep})
        if len(groups) > 1:
            per_dp = {}
            for g in groups:
                vals = [self.active_tput[i] for i in keep if self.active_dp[i] == g]
                per_dp[f"DP{g}"] = sum(vals) / len(vals)
            res["tok_per_s"] = sum(per_dp.values())
            res["tok_per_s_per_dp_rank"] = per_dp
            warnings.append(f"{len(groups)} data-parallel ranks log separately: tok/s is the sum of their means; "
                            "batch sizes are per rank")
        else:
            res["tok_per_s"] = sum(tput) / len(tput)
        res["tok_per_s_stats"] = stats(tput)
        res["tok_per_s_per_request"] = sum(t / r for t, r in zip(tput, running)) / len(tput)
        res["batch_size"] = stats(running)
        hist: dict[int, int] = {}
        for r in running:
            hist[int(r)] = hist.get(int(r), 0) + 1
        res["batch_size_hist"] = {str(k): hist[k] for k in sorted(hist)}
        single = [t for t, r in zip(tput, running) if r == 1 and t > 0]
        if single and len(groups) == 1:
            # at batch 1 the generation rate is one request's rate: ms per token (per cycle τ tokens)
            res["decode_ms_per_token"] = 1e3 / stats(single)["median"]

    def _acceptance(self, res: dict, warnings: list, draft_tokens: int | None) -> None:
        """τ: the mean of `accept len` weighted by running requests (the plain mean beside it); the acceptance per
        draft token from τ and the configured draft tokens."""
        n_active, n_spec = len(self.active_tput), len(self.spec_al)
        w = sum(self.spec_w)
        tau = sum(a * wi for a, wi in zip(self.spec_al, self.spec_w)) / w
        res["accept_length"] = tau
        res["accept_length_weighting"] = "running requests"
        res["accept_length_unweighted"] = sum(self.spec_al) / n_spec
        res["accept_length_stats"] = stats(self.spec_al)
        if draft_tokens and draft_tokens > 1:
            # per draft token, from τ and the configured tree size — not SGLang's own `accept rate`
            res["draft_acceptance_rate"] = (tau - 1.0) / (draft_tokens - 1)
            res["system_efficiency"] = tau / draft_tokens   # of the most a verify can emit
        if self.rates_reported:
            res["reported_accept_rate_mean"] = sum(self.rates_reported) / len(self.rates_reported)
            warnings.append("SGLang's 'accept rate' changed definition between versions; it is stored as "
                            "reported_accept_rate_mean and not used")
        if n_spec < n_active:
            self.partial(DECODE, "no 'accept len': in tok/s, not in τ", n_active - n_spec)
            warnings.append(f"{n_active - n_spec} active decode lines have no 'accept len' "
                            "(a non-speculative run mixed in?)")

    def _engine_figures(self, res: dict) -> None:
        """CUDA graphs (from the decode lines, else server_args), the longest queue, peak token usage, prefill."""
        on, off = self.graph
        if on + off:
            res["cuda_graph"] = True if not off else False if not on else "mixed"
            res["cuda_graph_share"] = on / (on + off)
            if self.graph_backend and self.graph_backend != "cuda":
                res["graph_backend"] = self.graph_backend
        elif "disable_cuda_graph" in self.args:
            res["cuda_graph"] = self.args["disable_cuda_graph"] != "True"
        if self.n_decode:
            res["max_queue"] = self.max_queue
            if self.max_usage is not None:
                res["max_token_usage"] = self.max_usage
        p = self.prefill
        if p["lines"]:
            res["prefill"] = dict(p)
            seen = p["new_tokens"] + p["cached_tokens"]
            res["prefill"]["cache_hit_rate"] = p["cached_tokens"] / seen if seen else None

    def result(self) -> dict:
        config = sglang.run_config(self.args)
        warnings = []
        res: dict = {"decode_lines": self.n_decode, "prefill_lines": self.prefill["lines"]}
        if self.spec_al:
            self._acceptance(res, warnings, config["draft_tokens"])
        n_active = len(self.active_tput)
        idle = self.n_decode - n_active
        res["idle_lines"] = idle
        self.skip(DECODE, "idle: no running request", idle)
        if n_active:
            self._throughput(res, warnings)
        self._engine_figures(res)
        span = self.clock.span()
        if span is not None:
            res["duration_s"] = span
            if self.clock.span_warning():
                warnings.append(self.clock.span_warning())
        if self.undated and self.undated < self.n_decode:
            self.partial(DECODE, "no timestamp: left out of duration_s", self.undated)
        if self.ranks:
            res["ranks"] = sorted(self.ranks)
        samples = {"series": self.series.to_dict()}
        return {"config": config, "results": res, "samples": samples, "warnings": warnings,
                "env": {"engine": "sglang", "cuda_graph": res.get("cuda_graph")}}
