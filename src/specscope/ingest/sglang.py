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
from specscope.ingest.lines import Clock, boolean, histogram, key_values, number, sglang_time, stats

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
        self.decode: list[dict] = []
        self.prefill = {"lines": 0, "new_seq": 0, "new_tokens": 0, "cached_tokens": 0}
        self.args: dict = {}
        self.ranks: set[str] = set()

    def feed(self, piece: str, lineno: int) -> str | None:
        m = ANCHOR.search(piece)
        if m is None:
            if SERVER_ARGS.search(piece):
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

    def _decode(self, kv: dict, t: float | None):
        missing = [k for k in DECODE_REQUIRED if k not in kv]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (truncated?)")
        d = {"t": t, "running": int(number(kv["#running-req"])), "tokens": int(number(kv["#token"])),
             "gen_tok_s": number(kv["gen throughput (token/s)"]), "queue": int(number(kv["#queue-req"]))}
        if "token usage" in kv:
            d["token_usage"] = number(kv["token usage"])
        if "accept len" in kv:
            d["accept_len"] = number(kv["accept len"])
            if d["accept_len"] < 1.0:
                raise ValueError(f"accept len {d['accept_len']} < 1")
        if "accept rate" in kv:
            d["accept_rate_reported"] = number(kv["accept rate"])
        if "cuda graph" in kv:
            d["cuda_graph"] = boolean(kv["cuda graph"])
        self.decode.append(d)

    def _prefill(self, kv: dict):
        missing = [k for k in PREFILL_REQUIRED if k not in kv]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (truncated?)")
        p = self.prefill
        p["lines"] += 1
        p["new_seq"] += int(number(kv["#new-seq"]))
        p["new_tokens"] += int(number(kv["#new-token"]))
        p["cached_tokens"] += int(number(kv.get("#cached-token", "0")))

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
        dec = self.decode
        active = [d for d in dec if d["running"] > 0]
        spec = [d for d in active if "accept_len" in d]
        res: dict = {"decode_lines": len(dec), "prefill_lines": self.prefill["lines"]}
        if spec:
            w = sum(d["running"] for d in spec)
            tau = sum(d["accept_len"] * d["running"] for d in spec) / w
            res["accept_length"] = tau
            res["accept_length_unweighted"] = sum(d["accept_len"] for d in spec) / len(spec)
            res["accept_length_stats"] = stats([d["accept_len"] for d in spec])
            if draft_tokens and draft_tokens > 1:
                # per draft token, from τ and the configured tree size — not SGLang's own `accept rate`
                res["draft_acceptance_rate"] = (tau - 1.0) / (draft_tokens - 1)
            rates = [d["accept_rate_reported"] for d in spec if "accept_rate_reported" in d]
            if rates:
                res["reported_accept_rate_mean"] = sum(rates) / len(rates)
                warnings.append("SGLang's 'accept rate' changed definition between versions; it is stored as "
                                "reported_accept_rate_mean and not used")
            if len(spec) < len(active):
                warnings.append(f"{len(active) - len(spec)} active decode lines have no 'accept len' "
                                "(a non-speculative run mixed in?)")
        if active:
            tput = [d["gen_tok_s"] for d in active]
            res["tok_per_s"] = sum(tput) / len(tput)
            res["tok_per_s_stats"] = stats(tput)
            res["tok_per_s_per_request"] = sum(d["gen_tok_s"] / d["running"] for d in active) / len(active)
            res["batch_size"] = stats([d["running"] for d in active])
            res["batch_size_hist"] = histogram(d["running"] for d in active)
            single = [d["gen_tok_s"] for d in active if d["running"] == 1 and d["gen_tok_s"] > 0]
            if single:
                # at batch 1 the generation rate is one request's rate: ms per token (per cycle τ tokens)
                res["decode_ms_per_token"] = 1e3 / stats(single)["median"]
        res["idle_lines"] = len(dec) - len(active)
        graphs = [d["cuda_graph"] for d in dec if "cuda_graph" in d]
        if graphs:
            res["cuda_graph"] = True if all(graphs) else False if not any(graphs) else "mixed"
            res["cuda_graph_share"] = sum(graphs) / len(graphs)
        elif "disable_cuda_graph" in a:
            res["cuda_graph"] = a["disable_cuda_graph"] != "True"
        if dec:
            res["max_queue"] = max(d["queue"] for d in dec)
            usage = [d["token_usage"] for d in dec if "token_usage" in d]
            if usage:
                res["max_token_usage"] = max(usage)
        p = self.prefill
        if p["lines"]:
            res["prefill"] = dict(p)
            seen = p["new_tokens"] + p["cached_tokens"]
            res["prefill"]["cache_hit_rate"] = p["cached_tokens"] / seen if seen else None
        times = [d["t"] for d in dec if d["t"] is not None]
        if times:
            res["duration_s"] = max(times) - min(times)
        if self.ranks:
            res["ranks"] = sorted(self.ranks)
            if len({r.split()[0] for r in self.ranks}) > 1:
                warnings.append(f"lines from {len(self.ranks)} ranks: tok/s and batch sizes are per logging rank")
        samples = {"series": {"t_s": [d["t"] for d in dec], "gen_tok_per_s": [d["gen_tok_s"] for d in dec],
                              "running": [d["running"] for d in dec],
                              "accept_length": [d.get("accept_len") for d in dec],
                              "queue": [d["queue"] for d in dec]}}
        return {"config": config, "results": res, "samples": samples, "warnings": warnings,
                "env": {"engine": "sglang", "cuda_graph": res.get("cuda_graph")}}


def _int(v):
    try:
        return int(v) if v not in (None, "None") else None
    except ValueError:
        return None
