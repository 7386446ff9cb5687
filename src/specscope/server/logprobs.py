"""OpenAI's logprobs shapes, built from the engine's records (engine/request.py TokenLogprob).

Chat: choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}, the
k likeliest tokens in top_logprobs. Completions (legacy): {"tokens", "token_logprobs", "top_logprobs",
"text_offset"}, each top_logprobs entry a {token: logprob} dict of the k likeliest plus the token itself (up to
k + 1 entries, as OpenAI and vLLM give); an echoed prompt's first token has no logprob: null there. The values
are the target's raw log-softmax (what vLLM reports by default), floored at -9999.0 as vLLM does so that JSON
never has to carry -inf.
"""

from __future__ import annotations

import threading

FLOOR = -9999.0


def _lp(v: float) -> float:
    return max(v, FLOOR)


class TokenText:
    """Token id -> its text as vLLM shows it: the token decoded alone, special tokens kept. Memoised per answer."""

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tok, self.lock, self.memo = tokenizer.tok, lock, {}

    def __call__(self, tid: int) -> str:
        s = self.memo.get(tid)
        if s is None:
            with self.lock:   # the worker thread decodes with the same tokenizer
                s = self.memo[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s


def chat_logprobs(text_of: TokenText, ids: list[int], records: list) -> dict:
    def entry(tid, lp):
        s = text_of(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}

    return {"content": [dict(entry(t, r.logprob), top_logprobs=[entry(i, v) for i, v in r.top])
                        for t, r in zip(ids, records)]}


def completion_logprobs(text_of: TokenText, ids: list[int], records: list, offset: int = 0) -> dict:
    """records[i] is None for a token without one (the prompt's first); offset: the text already sent before
    these tokens (a stream's earlier chunks), where text_offset starts, as in vLLM."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, rec in zip(ids, records):
        s = text_of(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if rec is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {}
        for i, v in rec.top:
            top.setdefault(text_of(i), _lp(v))   # two ids with one text: the likelier keeps it
        top.setdefault(s, _lp(rec.logprob))
        out["token_logprobs"].append(_lp(rec.logprob))
        out["top_logprobs"].append(top)
    return out
