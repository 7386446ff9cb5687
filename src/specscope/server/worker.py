"""What serves: one model, one worker thread, a bounded queue of jobs.

Requests are decoded one at a time (decoding is batch-1); the HTTP side only tokenizes, enqueues and relays
events. The worker talks back through each job's asyncio queue via `loop.call_soon_threadsafe`. Cancellation
works through the decoding loop's `on_tokens` callback: raising from it aborts decoding at the next token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specscope import session   # session.load_target looked up per call: tests stub it
from specscope.errors import SpecscopeError
from specscope.generate import generate
from specscope.models.hub import parse_hub_id
from specscope.profile import CycleProfiler
from specscope.runtime.sampling import SamplingParams
from specscope.runtime.tokenizer import StreamDecoder
from specscope.server.metrics import ServerMetrics
from specscope.server.protocol import ApiError, GenParams
from specscope.speculative.decode import SpecConfig, build_drafter, speculative_generate

log = logging.getLogger("specscope.server")


@dataclass
class ServeConfig:
    model: str = "smollm2-135m"
    served_name: str | None = None
    draft: str | None = None
    steps: int | None = None
    topk: int | None = None
    draft_tokens: int | None = None
    ngram_tokens: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_queue: int = 64
    max_prompt_tokens: int | None = None   # default: context - 1
    max_tokens_cap: int = 2048
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0           # a client slower than this sending its body gets 408 and is dropped
    api_key: str | None = None
    profile_phases: bool = True
    metrics_prefix: str = "specscope"


class Cancelled(Exception):
    """Raised inside on_tokens when the client went away."""


class StopString(Exception):
    """Raised inside on_tokens when a stop string appeared; the text is already cut."""


class Job:
    def __init__(self, params: GenParams, prompt_ids: list[int], loop: asyncio.AbstractEventLoop, rid: str = ""):
        self.rid = rid
        self.params = params
        self.prompt_ids = prompt_ids
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_enqueue = time.perf_counter()
        self.t_first: float | None = None

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown); nobody is listening
            pass

    def cancel(self) -> None:
        self.cancelled.set()


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string (must not be sent yet)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


class ServedModel:
    """Model + tokenizer (+ drafter) and a `run(job)` that decodes one request."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.model, self.tokenizer, self.path = session.load_target(cfg.model, cfg.dtype, cfg.device)
        hub = None if Path(cfg.model).expanduser().exists() else parse_hub_id(cfg.model)
        self.name = cfg.served_name or (hub[0] if hub else self.path.name)   # a hub id, as vLLM serves it
        self.stop_ids = session.stop_ids_for(self.model, self.tokenizer)
        self.context = int(self.model.config.max_position_embeddings)
        self.vocab = int(self.model.config.vocab_size)
        self.max_prompt = min(cfg.max_prompt_tokens or self.context - 1, self.context - 1)
        self.tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads unguarded
        self.drafter = self.spec_cfg = None
        if cfg.draft:
            self.spec_cfg = SpecConfig.for_drafter(cfg.draft, cfg.steps, cfg.topk, cfg.draft_tokens,
                                                  cfg.ngram_tokens)
            self.drafter = build_drafter(cfg.draft, self.model)

    # -- called on the event loop ---------------------------------------------------------------------------------
    def encode(self, p: GenParams) -> list[int]:
        try:
            with self.tok_lock:
                if p.kind == "chat":
                    ids = self.tokenizer.encode_messages(p.messages)
                elif p.prompt_ids is not None:
                    ids = p.prompt_ids
                else:
                    ids = self.tokenizer.encode(p.prompt)
        except SpecscopeError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # a chat template can reject a conversation (e.g. roles out of order)
            raise ApiError(400, f"cannot tokenize the request ({type(e).__name__}: {e})") from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", "prompt")
        if any(not 0 <= t < self.vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab})", "prompt")
        if len(ids) > self.max_prompt:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt}",
                           "prompt")
        if p.max_tokens is None:
            p.max_tokens = min(self.cfg.max_tokens_cap, self.context - len(ids))
        if len(ids) + p.max_tokens > self.context:
            raise ApiError(400, f"this model's maximum context length is {self.context} tokens, but the request "
                                f"asks for {len(ids)} prompt + {p.max_tokens} completion tokens; lower max_tokens",
                           "max_tokens")
        return ids

    # -- called on the worker thread ------------------------------------------------------------------------------
    def run(self, job: Job, metrics: ServerMetrics) -> None:
        p = job.params
        dec = StreamDecoder(self.tokenizer)
        ids: list[int] = []
        st = {"text": "", "sent": 0}

        def on_tokens(new):
            if job.cancelled.is_set():
                raise Cancelled()
            if job.t_first is None:
                job.t_first = time.perf_counter()
                metrics.ttft.observe(job.t_first - job.t_enqueue)
            ids.extend(int(t) for t in new)
            with self.tok_lock:
                st["text"] += dec.push(new)
            self._emit(job, st, list(new))

        sp = SamplingParams(p.temperature, p.top_k, p.top_p, p.seed)
        stop_ids = () if p.ignore_eos else self.stop_ids    # ignore_eos: benchmarks want exactly max_tokens
        prof = self._profiler()
        res = None
        finish = "stop"
        try:
            if self.drafter is None:
                res = generate(self.model, job.prompt_ids, p.max_tokens, sp, stop_ids, on_tokens=on_tokens,
                               profiler=prof)
            else:
                res = speculative_generate(self.model, self.drafter, job.prompt_ids, p.max_tokens, sp,
                                           stop_ids, self.spec_cfg, on_tokens=on_tokens, profiler=prof)
            finish = "length" if res.stop_reason == "length" else "stop"
        except StopString:
            pass
        finally:
            metrics.prompt_tokens.inc(len(job.prompt_ids))
            metrics.generation_tokens.inc(len(ids))
        with self.tok_lock:
            full = self.tokenizer.decode(ids)
        cut = self._find_stop(full, p.stop)
        text = full if cut is None else full[:cut]
        if len(text) > st["sent"]:
            job.post("tokens", text[st["sent"]:], [])
        spec = None
        if res is not None and self.drafter is not None:
            st = res.stats
            metrics.observe_spec(st)
            spec = {"verify_ct": st.cycles, "accepted_tokens": sum(st.accepted_per_pos),
                    "draft_tokens": sum(st.drafts_per_pos), "accept_length": round(st.accept_length, 4)}
        if res is not None:
            cycle_ms = self._cycle_ms(prof) if prof is not None else None
            metrics.observe_phases(cycle_ms or {"decode" if self.drafter is None else "cycle": res.step_ms})
        metrics.request_success.labels(finished_reason=finish).inc()
        metrics.e2e.observe(time.perf_counter() - job.t_enqueue)
        job.post("done", {"text": text, "finish": finish, "token_ids": ids, "prompt_tokens": len(job.prompt_ids),
                          "spec": spec})

    def _emit(self, job: Job, st: dict, new_ids: list[int]) -> None:
        text, stops = st["text"], job.params.stop
        cut = self._find_stop(text, stops, start=max(0, st["sent"] - max((len(s) for s in stops), default=0)))
        if cut is not None:
            if cut > st["sent"]:
                job.post("tokens", text[st["sent"]:cut], new_ids)
                st["sent"] = cut
            raise StopString()
        safe = len(text) - _holdback(text, stops)
        if safe > st["sent"] or new_ids:
            job.post("tokens", text[st["sent"]:safe] if safe > st["sent"] else "", new_ids)
            st["sent"] = max(safe, st["sent"])

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def _profiler(self):
        if not self.cfg.profile_phases:
            return None
        return CycleProfiler(device=str(self.model.device), sync=False)

    @staticmethod
    def _cycle_ms(prof) -> dict | None:
        s = prof.samples()
        cyc = s.get("cycle_ms", s) if isinstance(s, dict) else None
        if not isinstance(cyc, dict):
            return None
        return {k: v for k, v in cyc.items() if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)}


class Worker:
    """One thread that pulls jobs off a bounded queue and runs them on the served model."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics, max_queue: int):
        self.served = served
        self.metrics = metrics
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.stopping = False
        self.current: Job | None = None
        self.service_s = 1.0  # running mean of one request's decode time, for Retry-After
        self.thread = threading.Thread(target=self._loop, name="specscope-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping:
            raise ApiError(503, "the server is shutting down")
        try:
            self.q.put_nowait(job)
        except queue.Full:
            # 429 + Retry-After (as vLLM / OpenAI do under load): the server is fine, it is just busy
            self.metrics.requests_rejected.inc()
            wait = max(1, min(600, math.ceil(self.service_s * (self.q.qsize() + 1))))
            raise ApiError(429, f"the request queue is full ({self.q.maxsize} waiting); retry in about {wait} s",
                           retry_after=wait) from None
        self.metrics.waiting.set(self.q.qsize())

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            self.metrics.waiting.set(self.q.qsize())
            if job is None:
                return
            if job.cancelled.is_set():  # the client left while it waited: no decode for nobody
                self.metrics.request_failed.labels(reason="cancelled").inc()
                continue
            self.current = job
            self.metrics.running.set(1)
            t_start = time.perf_counter()
            self.metrics.queue_time.observe(t_start - job.t_enqueue)
            try:
                self.served.run(job, self.metrics)
            except Cancelled:
                self.metrics.request_failed.labels(reason="cancelled").inc()
                job.post("cancelled", None)
            except SpecscopeError as e:
                self.metrics.request_failed.labels(reason="invalid").inc()
                job.post("error", ApiError(400, str(e)))
            except Exception as e:  # a bug: keep serving; the client gets a 500 and an id to find the traceback by
                log.exception("request %s failed", job.rid)
                self.metrics.request_failed.labels(reason="error").inc()
                job.post("error", ApiError(500, f"internal error during generation ({type(e).__name__}; request id "
                                                f"{job.rid}); the server log has the traceback; please report it"))
            finally:
                took = time.perf_counter() - t_start
                self.metrics.inference_time.observe(took)
                self.service_s = 0.8 * self.service_s + 0.2 * took
                self.current = None
                self.metrics.running.set(0)

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, fail what is queued, cancel what runs, and join the thread."""
        self.stopping = True
        while True:
            try:
                job = self.q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.post("error", ApiError(503, "the server is shutting down"))
        if self.current is not None:
            self.current.cancel()
        self.q.put(None)
        self.thread.join(timeout)
