"""Training answers from a running OpenAI-compatible server (vLLM, SGLang, `specscope serve`, ...).

The server applies the target's chat template (POST /v1/chat/completions) and answers; specscope keeps the answer
text. The hidden states are still computed by specscope, from the target checkpoint, in the capture step: the server
only saves the autoregressive decoding, which is most of the data stage's time. This is what SpecForge's
`scripts/regenerate_train_data.py` and speculators' data generation do.

Multi-turn conversations are answered as SpecForge does: every user turn in order, the original assistant turns
dropped, and the server's own earlier answers as the context of later turns (system turns are kept where they are).
If a later turn fails (a context-length 400, say), the turns answered so far are kept. `all_turns=False` answers the
first user turn only, as the local `--regenerate` does.

Answers are cached one conversation per line in a JSONL file, each under a key of everything that produced it (the
turns sent, the endpoint URL, the served model, max_tokens, temperature, top_p, seed): a killed run resumes with
only the missing requests, and another endpoint, model, length or prompt is asked again instead of reusing answers
to something else.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specscope.engines import OUTSIDE_ENGINES
from specscope.errors import SpecscopeError
from specscope.train.data import conv_hash, open_for_append, read_jsonl

MULTI_TURN = "every user turn in order, with the server's own earlier answers as context (as SpecForge)"
FIRST_TURN = "the first user turn only"
KEY_ENV = "SPECSCOPE_API_KEY or OPENAI_API_KEY"
EARLY_FAILURES = 16         # this many requests failing with no success at all: the setup is wrong, stop

# how each outside engine's server is started, for the hint when none answers
_STARTS = " / ".join(e.START for e in OUTSIDE_ENGINES.values())


class ItemFailed(Exception):
    """One request the server refused for reasons of its own (a 4xx such as a too-long context)."""


ANSWERS_URL = "the server's URL, e.g. http://127.0.0.1:8000"


def base_url(url: str, flag: str = "--answers-from", takes: str = ANSWERS_URL) -> str:
    """'host:port' (SpecForge's --server-address), 'http://host:port' or '.../v1' -> 'http://host:port'. A bad
    value is one line naming `flag` and what it `takes`."""
    u = (url or "").strip()
    if not u:
        raise SpecscopeError(f"{flag} needs {takes}")
    if "://" not in u:
        u = "http://" + u
    u = u.rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    try:
        parsed = httpx.URL(u)
    except (httpx.InvalidURL, ValueError) as e:
        raise SpecscopeError(f"{flag} {url!r} is not a URL ({e}); {flag} takes {takes}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SpecscopeError(f"{flag} {url!r} is not an http(s) URL with a host; {flag} takes {takes}")
    return u


def _one_line(text: str, n: int = 200) -> str:
    text = re.sub(r"\s+", " ", str(text)).strip()
    return text if len(text) <= n else text[:n - 3] + "..."


def _server_message(r: httpx.Response) -> str:
    """The error text of an OpenAI-style body ({"error": {"message"}}, FastAPI's {"detail"}, or plain text)."""
    try:
        body = r.json()
    except ValueError:
        return _one_line(r.text) or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return _one_line(err)
    return _one_line(body)


@dataclass
class Endpoint:
    """Where answers come from and how they are asked for. `url`: the server's base URL (normalised by base_url);
    `model`: the id to request (None = the first of /v1/models, filled in by `connect`); greedy by default."""

    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)      # never in a repr, a log or a record
    max_tokens: int = 192
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0                   # sampled answers only: each request's seed derives from it and the turns
    concurrency: int = 8            # requests in flight (conversations answered at once)
    timeout_s: float = 600.0        # per request
    retries: int = 3                # after a connection error, a timeout, 429 or 5xx
    retry_wait_s: float = 0.5       # doubled each retry; a Retry-After header wins (up to 30 s)
    key_as: str | None = None       # names the server in cache keys and records instead of `url`: a server specscope
                                    # starts itself (train --capture vllm) gets a new port each run
    listed: list[dict] = field(default_factory=list, repr=False)   # /v1/models' entries, as `connect` read them

    def __post_init__(self):
        self.url = base_url(self.url)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def info(self, all_turns: bool = True) -> dict:
        """What the training run records about its answers (never the API key)."""
        return {"source": "endpoint", "endpoint": self.key_as or self.url, "served_model": self.model,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed if self.sampled else None, "turns": MULTI_TURN if all_turns else FIRST_TURN}

    def key(self, turns: list[dict], all_turns: bool = True) -> str:
        return conv_hash({"turns": turns, "all_turns": all_turns, "endpoint": self.key_as or self.url,
                          "model": self.model,
                          "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                          "seed": self.seed if self.sampled else None})

    def describe(self) -> str:
        how = "greedy" if not self.sampled else f"temperature {self.temperature:g}, top_p {self.top_p:g}"
        return (f"{self.url} (model {self.model!r}, {how}, at most {self.max_tokens} tokens, "
                f"{self.concurrency} in flight)")

    # -- requests -----------------------------------------------------------------------------------------------
    def _give_up(self, what: str, last: str, hint: str) -> SpecscopeError:
        tries = self.retries + 1
        return SpecscopeError(f"{what}: {last} ({tries} tr{'y' if tries == 1 else 'ies'}); {hint}")

    def _retry_wait(self, attempt: int, r: httpx.Response | None = None) -> float:
        wait = self.retry_wait_s * 2 ** attempt
        if r is not None:
            try:
                wait = max(wait, min(30.0, float(r.headers.get("retry-after", 0))))
            except ValueError:
                pass
        return wait

    def _fatal_status(self, where: str, r: httpx.Response) -> SpecscopeError | None:
        msg = _server_message(r)
        if r.status_code in (401, 403):
            return SpecscopeError(f"{where} refused the request (HTTP {r.status_code}: {msg}); pass --api-key KEY or "
                                  f"set {KEY_ENV}")
        if r.status_code in (404, 405):
            return SpecscopeError(f"{where}: HTTP {r.status_code} ({msg}); --answers-from must be the base URL of "
                                  f"an OpenAI-compatible server (vLLM, SGLang, specscope serve) and "
                                  f"--served-model-name a model it serves")
        return None

    def connect(self, log=print, client: httpx.Client | None = None) -> Endpoint:
        """GET /v1/models (through `client` when given): fills in `model` (the first id listed) when not given; a
        clear error when the server is down, wants a key, or is not an OpenAI-compatible server. Returns self."""
        where, get = self.url + "/v1/models", (client or httpx).get
        last, hint = "", ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self._retry_wait(attempt - 1))
            try:
                r = get(where, headers=self.headers(), timeout=min(self.timeout_s, 30.0))
            except httpx.TimeoutException:
                last, hint = "no answer within the timeout", "is the server up and not overloaded?"
                continue
            except httpx.TransportError as e:
                last = f"cannot connect ({type(e).__name__}: {_one_line(e, 120)})"
                hint = f"is the server running? start it ({_STARTS} / specscope serve) or fix --answers-from"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last, hint = f"HTTP {r.status_code} ({_server_message(r)})", "is the server healthy?"
                continue
            bad = self._fatal_status(where, r)
            if bad:
                raise bad
            try:
                cards = [m for m in r.json()["data"] if isinstance(m, dict)]
            except (ValueError, KeyError, TypeError, RecursionError):
                cards = []
            self.listed = [m for m in cards if isinstance(m.get("id"), str) and m["id"].strip()]
            ids = [m["id"] for m in self.listed]
            if r.status_code != 200 or not ids:
                if self.model:      # a server without a usable model list can still answer by name
                    log(f"{where} lists no model (HTTP {r.status_code}); asking for {self.model!r} anyway")
                    return self
                raise SpecscopeError(f"{where} lists no model id (HTTP {r.status_code}); pass --served-model-name")
            if self.model is None:
                self.model = ids[0]
            elif self.model not in ids:
                log(f"note: {where} lists {ids[:5]}, not {self.model!r}; asking for {self.model!r} anyway")
            return self
        raise self._give_up(where, last, hint)

    async def chat(self, client: httpx.AsyncClient, messages: list[dict], seed: int | None) -> tuple[str, str]:
        """One chat completion -> (answer text, finish_reason). ItemFailed when the server refuses this request
        (4xx); SpecscopeError when no request can succeed (down, wrong key/URL/model, retries spent)."""
        where = self.url + "/v1/chat/completions"
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": False}
        if self.top_p != 1.0:
            body["top_p"] = self.top_p
        if seed is not None:
            body["seed"] = seed
        last, hint, wait = "", "", 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(wait)
            wait = self._retry_wait(attempt)
            try:
                r = await client.post(where, json=body, headers=self.headers())
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout_s:g} s"
                hint = "raise --timeout, or lower --max-concurrency / --max-tokens"
                continue
            except httpx.TransportError as e:
                last = f"cannot connect ({type(e).__name__}: {_one_line(e, 120)})"
                hint = "is the server still running? restart it and rerun: answers so far are kept"
                continue
            if r.status_code == 200:
                try:
                    choice = r.json()["choices"][0]
                    text, finish = choice["message"]["content"], choice.get("finish_reason")
                except (ValueError, KeyError, IndexError, TypeError, RecursionError):
                    raise SpecscopeError(f"{where} answered HTTP 200 without choices[0].message.content; is it an "
                                         f"OpenAI-compatible chat endpoint?") from None
                if not isinstance(text, str):
                    raise ItemFailed("the answer has no text content (a reasoning parser may have moved it all "
                                     "into reasoning_content)")
                return text, str(finish)
            if r.status_code in (408, 429) or r.status_code >= 500:
                wait = self._retry_wait(attempt, r)
                last, hint = f"HTTP {r.status_code} ({_server_message(r)})", "is the server healthy? rerun to resume"
                continue
            bad = self._fatal_status(where, r)
            if bad:
                raise bad
            raise ItemFailed(f"HTTP {r.status_code}: {_server_message(r)}")
        raise self._give_up(where, last, hint)


def _request_turns(messages: list[dict]) -> list[dict]:
    """What is sent of a conversation: its turns other than the assistant's."""
    return [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "assistant"]


def _item_turns(item: dict) -> list[dict]:
    if "messages" in item:
        return _request_turns(item["messages"])
    return [{"role": "user", "content": item["prompt"]}]


async def _answer_one(ep: Endpoint, client: httpx.AsyncClient, item: dict, key: str,
                      all_turns: bool) -> tuple[dict | None, str | None]:
    """One conversation -> (record, None), or (None, why) when its first turn failed."""
    turns = _item_turns(item)
    ctx: list[dict] = []
    answered, truncated, dropped, why = 0, False, 0, None
    n_users = sum(m["role"] == "user" for m in turns)
    for m in turns:
        ctx.append(dict(m))
        if m["role"] != "user":
            continue
        seed = None
        if ep.sampled:
            seed = (int(key, 16) + answered) % (1 << 31)       # the key covers the turns and --seed
        try:
            text, finish = await ep.chat(client, ctx, seed)
        except ItemFailed as e:
            why = str(e)
            ctx.pop()
            dropped = n_users - answered
            break
        ctx.append({"role": "assistant", "content": text.strip()})
        truncated |= finish == "length"
        answered += 1
        if not all_turns:
            dropped = n_users - answered
            break
    if answered == 0:
        return None, why or "no user turn"
    while ctx and ctx[-1]["role"] != "assistant":       # a conversation ends with an answer
        ctx.pop()
    rec = {"id": item["id"], "source": item.get("source", "endpoint"), "key": key, "truncated": truncated,
           "messages": ctx}
    if dropped and all_turns:
        rec["turns_dropped"] = dropped
        rec["why_dropped"] = why
    return rec, None


def _read_cache(cache_path: Path) -> dict[str, dict]:
    """The cached answers by key (records without a key or messages are not answers)."""
    cached = {}
    for rec in read_jsonl(cache_path):
        if isinstance(rec.get("key"), str) and isinstance(rec.get("messages"), list):
            cached[rec["key"]] = rec
    return cached


def _unasked(items: list[dict], keys: list[str], cached: dict) -> list[tuple[dict, str]]:
    """(item, key) of the items still to ask, each key once: items asked exactly alike (duplicates) are asked once."""
    todo, seen = [], set()
    for it, k in zip(items, keys):
        if k not in cached and k not in seen:
            seen.add(k)
            todo.append((it, k))
    return todo


@dataclass
class _Asking:
    """One run of requests: what is left to ask, and what came back (answers, failures, the progress count)."""

    ep: Endpoint
    todo: list[tuple[dict, str]]
    share: Counter                  # how many items ask each key (duplicates share one answer)
    any_cached: bool
    all_turns: bool
    progress: object = None
    done: int = 0
    got: dict[str, dict] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    n_failed: int = 0

    def failed(self, item: dict, why: str) -> None:
        self.n_failed += 1
        if len(self.failures) < 3:
            self.failures.append(f"{item['id']}: {why}")
        if self.n_failed >= min(EARLY_FAILURES, len(self.todo)) and not self.got and not self.any_cached:
            raise SpecscopeError(f"{self.ep.url}/v1/chat/completions refused the first {self.n_failed} "
                                 f"requests (first: {self.failures[0]}); check --served-model-name, "
                                 f"--max-tokens and the server's context length")

    def answered(self, f, key: str, rec: dict) -> None:
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        self.got[key] = rec

    def advance(self, key: str) -> None:
        self.done += self.share[key]
        if self.progress:
            self.progress(self.done)


async def _worker(run: _Asking, client: httpx.AsyncClient, queue, f) -> None:
    for it, k in queue:         # one shared iterator: each item goes to one worker
        rec, why = await _answer_one(run.ep, client, it, k, run.all_turns)
        if rec is None:
            run.failed(it, why)
        else:
            run.answered(f, k, rec)
        run.advance(k)


async def _ask_all(run: _Asking, f) -> None:
    """`run.todo` asked `concurrency` at a time; answers appended to `f` as they come."""
    ep = run.ep
    limits = httpx.Limits(max_connections=ep.concurrency + 2, max_keepalive_connections=ep.concurrency + 2)
    timeout = httpx.Timeout(ep.timeout_s, connect=min(ep.timeout_s, 30.0))
    queue = iter(run.todo)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(_worker(run, client, queue, f))
                 for _ in range(min(ep.concurrency, len(run.todo)))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _in_item_order(items: list[dict], keys: list[str], got: dict, cached: dict) -> list[dict]:
    """One record per answered item, in item order, under the item's own id and source."""
    records = []
    for it, k in zip(items, keys):      # an item asked like an earlier one (a duplicate) shares its answer
        r = got.get(k) or cached.get(k)
        if r is not None:
            records.append(r if r["id"] == it["id"] else dict(r, id=it["id"], source=it.get("source", r["source"])))
    return records


def answer_via_endpoint(endpoint: Endpoint | str, items: list[dict], cache_path: str | Path, *,
                        all_turns: bool = True, progress=None, log=print) -> tuple[list[dict], dict]:
    """Answers to `items` from an OpenAI-compatible server, cached in `cache_path` (JSONL, appended, resumable).

    endpoint: an Endpoint, or a base URL (then: greedy, max_tokens 192, model = the first of /v1/models).
    items: [{"id", "prompt", "source"?}] (one user turn each: --prompt-file prompts) or [{"id", "messages",
      "source"?}] (conversations; their assistant turns are replaced). Ids name records; the cache is keyed by
      Endpoint.key (the turns sent and every setting), so a changed prompt, endpoint, model or length is asked again.
    progress: called with the number answered (first with what the cache already held), as Rate expects.

    Returns (records, info). records: one per item that has an answer, in item order, each
      {"id", "source", "key", "truncated", "messages": [... {"role": "assistant", "content"}]} (the shape of the
      local answers.jsonl records, plus the key); items the server refused (a 4xx on their first turn) are left out
      and counted. info: Endpoint.info() plus answered_now / reused / failed / first_failures.
    Errors (SpecscopeError, one line naming the URL and the fix): server down or failing after retries, wrong API
    key, not an OpenAI-compatible server or model, or every one of the first requests refused."""
    ep = endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint)
    if ep.model is None:
        ep.connect(log)
    cache_path = Path(cache_path)
    keys = [ep.key(_item_turns(it), all_turns) for it in items]
    cached = _read_cache(cache_path)
    run = _Asking(ep, _unasked(items, keys, cached), Counter(keys), bool(cached), all_turns, progress,
                  done=sum(k in cached for k in keys))
    if progress:
        progress(run.done)
    if run.todo:
        log(f"asking {ep.describe()} for {len(run.todo)} answers"
            + (f" ({run.done} already in {cache_path.name})" if run.done else ""))
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        with open_for_append(cache_path) as f:
            asyncio.run(_ask_all(run, f))
        if run.n_failed:
            log(f"{run.n_failed} of {len(run.todo)} requests to {ep.url} failed and are left out (first: "
                f"{run.failures[0]}); a rerun asks for them again")
    records = _in_item_order(items, keys, run.got, cached)
    if not records:
        raise SpecscopeError(f"{ep.url} answered none of the {len(items)} requests (first failure: "
                             f"{run.failures[0] if run.failures else 'none'})")
    info = dict(ep.info(all_turns), answered_now=len(run.got), reused=sum(k in cached for k in keys),
                failed=run.n_failed)
    if run.failures:
        info["first_failures"] = run.failures
    return records, info
