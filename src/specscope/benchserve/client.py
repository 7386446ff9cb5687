"""One streaming request, timed like `vllm bench serve`: TTFT (first content chunk), inter-chunk gaps, latency up
to the last content chunk, tokens (the server's usage, else a tokenizer's count of the text, else the chunks)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None                          # send to the last content chunk (vLLM's latency)
    start_s: float | None = None                        # time.perf_counter() at send (vLLM's start_times)
    queue_s: float = 0.0                                # arrival to send: waiting for --max-concurrency
    itl_s: list[float] = field(default_factory=list)   # gaps between content chunks
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    spec: dict | None = None                            # specscope's per-request verify count, if sent

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "itl_s"}
        d["tpot_s"] = self.tpot_s
        d["itl_s"] = [round(x, 6) for x in self.itl_s]
        return d


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float | None,
                 ignore_eos: bool = False, extra: dict | None = None) -> dict:
    """extra: sampling parameters and --extra-body, merged last (vLLM's order)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True       # vLLM / SGLang / specscope extension: decode exactly max_tokens
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if extra:
        body.update(extra)
    return body


def _clip(text: str, n: int = 200) -> str:
    """Server text fit for a one-line error: whitespace runs (newlines) collapsed, cut to n characters."""
    return " ".join(str(text).split())[:n]


def _content(obj: dict, endpoint: str) -> tuple[str | None, str | None]:
    """(text, finish_reason) of a chunk; None for parts a conforming server would not send (a number as text)."""
    ch = obj.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        return None, None
    c = ch[0]
    delta = c.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else None) if endpoint == "chat" else c.get("text")
    finish = c.get("finish_reason")
    return (text if isinstance(text, str) else None), (finish if isinstance(finish, str) else None)


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


@dataclass
class _Stream:
    """One response being read: its result so far and the clock of its content chunks (t0: the send)."""
    r: RequestResult
    endpoint: str
    t0: float
    last: float | None = None                          # time of the last content chunk
    parts: list[str] = field(default_factory=list)

    def take(self, obj: dict) -> None:
        """One parsed chunk: its text (timed), finish reason, usage and specscope's per-request verify count."""
        r = self.r
        text, finish = _content(obj, self.endpoint)
        if text:
            now = time.perf_counter()
            if r.ttft_s is None:
                r.ttft_s = now - self.t0
            else:
                r.itl_s.append(now - self.last)
            self.last = now
            self.parts.append(text)
            r.chunks += 1
        if finish:
            r.finish_reason = finish
        u = obj.get("usage")
        if isinstance(u, dict):
            r.completion_tokens = _count(u.get("completion_tokens")) or 0
            r.prompt_tokens = _count(u.get("prompt_tokens"))
        if isinstance(obj.get("spec"), dict):
            r.spec = obj["spec"]


async def _http_error(resp: httpx.Response) -> str:
    """A non-200 answer as one line: the OpenAI error's message, else the body."""
    raw = (await resp.aread()).decode(errors="replace")
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError, RecursionError):
        msg = raw
    return f"HTTP {resp.status_code}: {_clip(msg) or '(empty body)'}"


async def _read_events(resp: httpx.Response, s: _Stream) -> None:
    """The SSE stream up to [DONE]: each data line a chunk; an error chunk or a bad one is kept as the error."""
    r = s.r
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            r.ok = r.error is None
            break
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):   # garbage, or JSON that is not a chunk (a list, a number)
            r.error = f"bad SSE chunk {_clip(data, 80)!r}"
            continue
        if "error" in obj:
            err = obj["error"]
            r.error = _clip(err.get("message", err) if isinstance(err, dict) else err)
            continue
        s.take(obj)
    else:
        r.error = r.error or "the stream ended without [DONE]"


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, endpoint: str, index: int,
                     headers: dict, tokenizer=None) -> RequestResult:
    r = RequestResult(index)
    t0 = r.start_s = time.perf_counter()
    s = _Stream(r, endpoint, t0)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = await _http_error(resp)
                return r
            await _read_events(resp, s)
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {_clip(e)}"
    # vLLM's latency ends at the last token chunk, not at the usage chunk or [DONE] after it
    r.e2e_s = (s.last if s.last is not None else time.perf_counter()) - t0
    r.text = "".join(s.parts)
    if not r.completion_tokens:
        # server sent no usage: the tokenizer's count of the text (vLLM), else one token per chunk
        r.completion_tokens = (len(tokenizer.tok.encode(r.text, add_special_tokens=False))
                               if tokenizer is not None and r.text else r.chunks)
    return r
