"""One request's answer from its jobs (one per choice; `n` of them): the whole response, or its SSE stream.

The jobs' events meet in one queue, tagged with the choice's index. A stream sends nothing until a choice has a
token: a chat choice's role rides in its first chunk with content (as vLLM sends it), so a client that starts
timing at the first chunk (vLLM's benchmark, the OpenAI SDK) times the first token, not the request's arrival.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from specscope.runtime.params import SEED_MAX
from specscope.server import protocol as P
from specscope.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from specscope.server.protocol import ApiError, GenParams
from specscope.server.worker import Done, Failed, Job, Tokens


class _Tagged:
    """Stands in for a job's event queue: puts (choice index, event) into the answer's one queue."""

    def __init__(self, q: asyncio.Queue, index: int):
        self.q, self.index = q, index

    def put_nowait(self, event) -> None:
        self.q.put_nowait((self.index, event))


def choice_params(p: GenParams, i: int) -> GenParams:
    """Choice i's parameters: with a seed, choice i draws from seed + i (choice 0 is the n = 1 answer)."""
    return p if i == 0 or p.seed is None else dataclasses.replace(p, seed=(p.seed + i) % (SEED_MAX + 1))


@dataclasses.dataclass
class _Sent:
    """What a stream has sent of one choice."""
    ids: int = 0           # token ids (their logprob records are job.lps[:ids])
    chars: int = 0         # text, for text_offset
    started: bool = False  # any chunk (the chat role went with it; an echo's prompt too)


class Answer:
    """The jobs of one request (built here, submitted by the caller) and what their events become: one job per
    prompt and choice, prompt k's choice j at index k * n + j (OpenAI's and vLLM's order)."""

    def __init__(self, served, p: GenParams, rid: str, prompts: list[tuple[GenParams, list[int]]], loop):
        self.served, self.p, self.rid = served, p, rid
        self.q: asyncio.Queue = asyncio.Queue()
        self.jobs = []
        self.prompt_text = []   # per prompt: what an echo starts with (what the client sent, or its ids decoded)
        for pk, ids in prompts:
            for j in range(p.n):   # engine ids unique even when clients reuse an x-request-id
                i = len(self.jobs)
                job = Job(choice_params(pk, j), ids, loop, f"{rid}-{i}-{uuid.uuid4().hex[:6]}")
                job.events = _Tagged(self.q, i)
                self.jobs.append(job)
            text = ""
            if p.echo:
                if pk.prompt is not None:
                    text = pk.prompt
                else:
                    with served.tok_lock:
                        text = served.tokenizer.decode(ids)
            self.prompt_text.append(text)
        self.text_of = TokenText(served.tokenizer, served.tok_lock)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    def _logprobs(self, i: int, ids: list[int], recs: list, echo: bool, offset: int) -> dict | None:
        """Choice i's logprobs for `ids` (their records `recs`), the prompt's first when `echo`."""
        p, job = self.p, self.jobs[i]
        if p.logprobs is None:
            return None
        if p.kind == "chat":
            return chat_logprobs(self.text_of, ids, recs)
        if echo:
            ids, recs = job.prompt_ids + ids, (job.prompt_lps or [None] * len(job.prompt_ids)) + recs
        return completion_logprobs(self.text_of, ids, recs, offset)

    # -- the whole answer -----------------------------------------------------------------------------------------
    def whole(self, done: dict[int, Done]) -> dict:
        p, choices = self.p, []
        for i, job in enumerate(self.jobs):
            d = done[i]
            ids = d.token_ids
            text = self.prompt_text[i // p.n] + d.text
            lp = self._logprobs(i, ids, job.lps[:len(ids)], p.echo, 0)
            choices.append(P.choice(p, i, text, d.finish, lp, ids))
        prompt_tokens, completion_tokens, cached = self._usage(done)
        return P.full_response(p, self.rid, self.served.name, choices, prompt_tokens, completion_tokens,
                               self._spec(done), cached)

    def _spec(self, done: dict[int, Done]) -> P.SpecCounts | None:
        return P.SpecCounts.merged([done[i].spec for i in range(len(self.jobs))])

    def _usage(self, done: dict[int, Done]) -> tuple[int, int, int]:
        """Prompt tokens (each prompt once, however many choices it has), completion tokens, cached tokens."""
        firsts = [done[i] for i in range(0, len(self.jobs), self.p.n)]
        return (sum(d.prompt_tokens for d in firsts), sum(len(d.token_ids) for d in done.values()),
                sum(d.cached_tokens for d in firsts))

    # -- the stream -----------------------------------------------------------------------------------------------
    async def stream(self):
        created, sent, done = int(time.time()), [_Sent() for _ in self.jobs], {}
        while len(done) < len(self.jobs):
            i, ev = await self.q.get()
            if isinstance(ev, Tokens):
                c = self._chunk(i, sent[i], created, ev.text, ev.token_ids)
                if c is not None:
                    yield P.sse(c)
            elif isinstance(ev, Done):
                done[i] = ev
                yield P.sse(self._chunk(i, sent[i], created, None, [], ev.finish))
            elif isinstance(ev, Failed):
                yield P.sse(ev.error.body())
                yield P.sse("[DONE]")
                return
            else:  # Dropped: the client is gone, nothing to say
                return
        if self.p.include_usage:
            last = {"id": self.rid, "object": "chat.completion.chunk" if self.p.kind == "chat" else "text_completion",
                    "created": created, "model": self.served.name, "choices": [],
                    "usage": P.usage(*self._usage(done))}
            spec = self._spec(done)
            if spec is not None:
                last["spec"] = spec.to_json()
            yield P.sse(last)
        yield P.sse("[DONE]")

    def _chunk(self, i: int, s: _Sent, created: int, text: str | None, tids: list[int],
               finish: str | None = None) -> dict | None:
        """Choice i's next chunk (None: nothing to send yet); `finish` makes it the choice's last."""
        p = self.p
        recs = self.jobs[i].lps[s.ids:s.ids + len(tids)]
        s.ids += len(tids)
        echo = p.echo and not s.started
        if echo:
            text = self.prompt_text[i // p.n] + (text or "")
        has_lp = p.logprobs is not None and (tids or echo)
        # every generated token gets its chunk, empty text too (an EOS under ignore_eos, a token the decoder or a
        # stop string holds back), as vLLM sends it: a client times its first token when the server made it
        if finish is None and not (text or tids or has_lp):
            return None
        lp = self._logprobs(i, tids, recs, echo, s.chars) if has_lp else None
        if text is None and p.kind == "completion":
            text = ""
        s.chars += len(text or "")
        role = p.kind == "chat" and not s.started
        s.started = True
        return P.chunk(p, self.rid, self.served.name, created, text=text, finish=finish, role=role,
                       token_ids=tids if finish is None else None, index=i, logprobs=lp)


async def wait_whole(answer: Answer, request) -> dict | None:
    """Every choice's `done` -> the whole answer; None when the client hung up (its jobs are cancelled)."""
    done: dict[int, Done] = {}
    next_check = time.monotonic() + 0.1
    while len(done) < len(answer.jobs):
        try:
            i, ev = await asyncio.wait_for(answer.q.get(), timeout=0.1)
        except asyncio.TimeoutError:
            i, ev = None, None
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 0.1
            if await request.is_disconnected():  # nobody will read the answer: stop decoding it
                answer.cancel()
                return None
        if ev is None or isinstance(ev, Tokens):
            continue
        if isinstance(ev, Done):
            done[i] = ev
        elif isinstance(ev, Failed):
            raise ev.error
        else:
            raise ApiError(503, "the request was cancelled")
    return answer.whole(done)
