"""OpenAI request parsing and validation, and the response / SSE chunk shapes.

Validation is hand-written (not pydantic) so every rejection is one clear message with the offending field,
returned as an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

from specscope.runtime.params import ParamError, check_sampling


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 retry_after: int | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After (429 / 503)
        self.close = close              # answer with Connection: close (the request was not read to its end)
        self.type = type_ or {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                              429: "rate_limit_error", 503: "service_unavailable",
                              500: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


@dataclass
class GenParams:
    """What decoding needs from one request, validated."""
    kind: str                      # "completion" | "chat"
    prompt: str | None = None      # completions
    prompt_ids: list[int] | None = None
    batch: list | None = None      # completions: two or more prompts (each a str or token ids); per_prompt splits
    messages: list[dict] | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False       # vLLM / SGLang extension
    model: str | None = None
    n: int = 1                     # independent choices (jobs) of one request
    logprobs: int | None = None    # per generated token: None = off, k = with the k likeliest alternatives
    prompt_logprobs: int | None = None   # the same per prompt token (completions' echo with logprobs)
    echo: bool = False             # completions: the answer starts with the prompt


def _num(body, key, typ, lo=None, hi=None, default=None):
    v = body.get(key, default)
    if v is None:
        return default
    integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())  # is_integer: False for inf / nan
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not integral):
        raise ApiError(400, f"'{key}' must be {'an integer' if typ is int else 'a number'}, got {v!r}", key)
    v = typ(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        shown = str(v) if len(str(v)) <= 40 else f"a {len(str(v))}-digit number"
        raise ApiError(400, f"'{key}' must be in [{lo}, {hi}], got {shown}", key)
    return v


def _bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be true or false, got {v!r}", key)
    return v


def parse_json(raw: bytes) -> dict:
    try:
        # NaN / Infinity (a Python extension to JSON) parse, then fail the field checks by name
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to be a request") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _finite_numbers(body: dict) -> None:
    """NaN and ±Infinity (which Python's JSON reader accepts) anywhere in the body are a 400 naming the field.
    Iterative: a body nested hundreds deep must not hit the recursion limit here."""
    stack = [(k, k, v) for k, v in body.items()]
    while stack:
        top, path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ApiError(400, f"'{path}' must be a finite number, got {v}", top)
        if isinstance(v, dict):
            stack.extend((top, f"{path}.{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((top, f"{path}[{i}]", x) for i, x in enumerate(v))


def _off(value, harmless: tuple) -> bool:
    """null, false, "", [], {} or one of `harmless` (never a bool standing in for 0 or 1): the feature is off."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return not isinstance(value, bool) and value in harmless


# OpenAI / vLLM request fields this server does not implement -> the values that ask for nothing (accepted). Any
# other value is a 400 naming the field: a client that asked for JSON output, tool calls or a penalty must learn it
# will not get them, not receive free text with a 200. Fields not listed here are ignored, as vLLM does.
UNSUPPORTED = {
    "suffix": (), "tools": (), "functions": (),
    "tool_choice": ("none",), "function_call": ("none",), "response_format": ({"type": "text"},),
    "logit_bias": (), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "min_tokens": (0,), "stop_token_ids": (), "bad_words": (), "use_beam_search": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "audio": (), "prediction": (), "modalities": (["text"],),
}


MAX_LOGPROBS = 20   # alternatives per token, as vLLM's default --max-logprobs
MAX_N = 128


def _unsupported(body: dict, extra: dict | None = None) -> None:
    for key, harmless in {**UNSUPPORTED, **(extra or {})}.items():
        v = body.get(key)
        if not _off(v, harmless):
            shown = json.dumps(v)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            ok = " or ".join(["null", *(json.dumps(h) for h in harmless)])
            raise ApiError(400, f"'{key}' is not supported by this server (got {shown}; only {ok} is accepted)",
                           key)


def _common(body: dict, kind: str, max_tokens_cap: int, extra_unsupported: dict | None = None) -> GenParams:
    _finite_numbers(body)
    _unsupported(body, extra_unsupported)
    p = GenParams(kind=kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    p.model = model
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    # OpenAI: completions default to 16 tokens; chat runs to the end of the context (None, set after tokenizing)
    p.max_tokens = _num({key: mt}, key, int, 0, max_tokens_cap, default=16 if kind == "completion" else None)
    # the CLI's schema (runtime/params.py); null means the default, as in OpenAI's API
    get = lambda k, d: d if body.get(k) is None else body[k]  # noqa: E731
    top_k = get("top_k", 0)
    if top_k == -1 and not isinstance(top_k, bool):
        top_k = 0  # vLLM uses -1 for "off"
    try:
        p.temperature, p.top_p, p.top_k, p.seed = check_sampling(get("temperature", 1.0), get("top_p", 1.0), top_k,
                                                                 body.get("seed"), style="api")
    except ParamError as e:
        raise ApiError(400, str(e), e.field) from None
    p.n = _num(body, "n", int, 1, MAX_N, default=1)
    stop = body.get("stop")
    if stop is None:
        p.stop = []
    elif isinstance(stop, str):
        p.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4:
        p.stop = list(stop)
    else:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 non-empty strings", "stop")
    p.stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        p.include_usage = _bool(so, "include_usage")
    p.return_token_ids = _bool(body, "return_token_ids")
    p.ignore_eos = _bool(body, "ignore_eos")
    if body.get("best_of") not in (None, 1, p.n):   # best_of == n returns all it draws: n independent choices
        raise ApiError(400, "only 'best_of': 1 (or equal to 'n') is supported", "best_of")
    return p


def parse_completion(body: dict, max_tokens_cap: int) -> GenParams:
    p = _common(body, "completion", max_tokens_cap, {"top_logprobs": (0,)})   # chat's name for it
    if body.get("logprobs") is not False:   # legacy: the number of alternatives, 0 = the token's own only
        p.logprobs = _num(body, "logprobs", int, 0, MAX_LOGPROBS)
    p.echo = _bool(body, "echo")
    if p.echo and p.logprobs is not None:
        p.prompt_logprobs = p.logprobs
    if p.max_tokens == 0 and not p.echo:
        raise ApiError(400, "'max_tokens' must be at least 1 (0 is accepted only with 'echo': true)", "max_tokens")
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        # a batch, as OpenAI and vLLM take it: one choice per prompt and n, prompt k's at k * n + j
        batch = [_one_prompt(x, f"prompt[{k}]") for k, x in enumerate(prompt)]
    else:
        batch = [_one_prompt(prompt, "prompt")]
    if len(batch) > 1:
        p.batch = batch
    elif isinstance(batch[0], str):
        p.prompt = batch[0]
    else:
        p.prompt_ids = batch[0]
    return p


def _one_prompt(x, name: str) -> str | list[int]:
    if isinstance(x, str) and x:
        return x
    if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return list(x)
    if x == "" or x == []:
        raise ApiError(400, f"'{name}' is empty", "prompt")
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of either (a batch of prompts)",
                   "prompt")


def per_prompt(p: GenParams) -> list[GenParams]:
    """A completion request's parameters per prompt of its batch (itself when it has one prompt)."""
    if not p.batch:
        return [p]
    return [replace(p, batch=None, prompt=x if isinstance(x, str) else None,
                    prompt_ids=None if isinstance(x, str) else x) for x in p.batch]


def parse_chat(body: dict, max_tokens_cap: int) -> GenParams:
    p = _common(body, "chat", max_tokens_cap, {"echo": ()})
    if p.max_tokens == 0:
        raise ApiError(400, "'max_tokens' must be at least 1", "max_completion_tokens"
                       if "max_completion_tokens" in body else "max_tokens")
    top = _num(body, "top_logprobs", int, 0, MAX_LOGPROBS, default=0)
    if _bool(body, "logprobs"):
        p.logprobs = top
    elif top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    p.messages = parse_messages(body)
    return p


def parse_messages(body: dict) -> list[dict]:
    """A chat's 'messages' (chat completions, /tokenize) -> [{role, content}] with text content."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a 'role' of system, user, assistant or developer", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: keep the text ones
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return out


# ---- responses ---------------------------------------------------------------------------------------------------

def new_id(kind: str, request_id: str | None = None) -> str:
    """The completion's id: the request's id (x-request-id) behind the kind's prefix, as vLLM makes it."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + (request_id or uuid.uuid4().hex)


@dataclass(frozen=True)
class SpecCounts:
    """A request's speculative counters, the answer's `spec` object (like SGLang's meta_info.spec_verify_ct: lets a
    client compute τ per request): verify cycles, draft tokens accepted and drafted, τ."""
    verify_ct: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    accept_length: float = 0.0

    @classmethod
    def of(cls, stats) -> "SpecCounts":
        """From a choice's SpecStats; zero counters where no step drafted for it (None)."""
        if stats is None:
            return cls()
        return cls(stats.cycles, sum(stats.accepted_per_pos), sum(stats.drafts_per_pos),
                   round(stats.accept_length, 4))

    @classmethod
    def merged(cls, counts: list["SpecCounts | None"]) -> "SpecCounts | None":
        """The choices' counters added up (τ weighted by their verify cycles); None without a drafter."""
        if counts[0] is None or len(counts) == 1:
            return counts[0]
        n = sum(c.verify_ct for c in counts)
        tau = round(sum(c.accept_length * c.verify_ct for c in counts) / n, 4) if n else 0.0
        return cls(n, sum(c.accepted_tokens for c in counts), sum(c.draft_tokens for c in counts), tau)

    def to_json(self) -> dict:
        return asdict(self)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(p: GenParams, index: int, text: str, finish: str, logprobs: dict | None = None,
           token_ids: list[int] | None = None) -> dict:
    """One entry of a whole answer's choices."""
    if p.kind == "chat":
        out = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
               "finish_reason": finish}
    else:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if p.return_token_ids:
        out["token_ids"] = token_ids
    return out


def full_response(p: GenParams, rid: str, model: str, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int, spec: SpecCounts | None, cached_tokens: int = 0) -> dict:
    out = {"id": rid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    if spec is not None:
        out["spec"] = spec.to_json()
    return out


def chunk(p: GenParams, rid: str, model: str, created: int, text: str | None = None, finish: str | None = None,
          role: bool = False, token_ids: list[int] | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One SSE event of a stream. role: this choice's first chunk (the role rides with its first content, as
    vLLM sends it: a client that times the first chunk times the first token)."""
    if p.kind == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None or role:
            delta["content"] = text or ""
        choice_ = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice_ = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    if p.return_token_ids and token_ids is not None:
        choice_["token_ids"] = token_ids
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice_]}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"
