"""What serves: one model, one worker thread running a continuous-batching engine, a bounded queue of jobs.

The HTTP side only tokenizes, enqueues and relays events; the engine (engine/batch.py) is touched from the worker
thread alone. Between engine steps the worker moves queued jobs into the engine while it has room for them
(`--max-num-seqs` sequences), so the queue holds exactly the requests not yet admitted and stays the thing a full
server answers 429 from; when the engine is idle the worker blocks on the queue. Each request's tokens stream
through its `on_tokens` callback (on the worker thread) into its job's asyncio queue via
`loop.call_soon_threadsafe`. A callback that raises (client gone, stop string) ends only its own sequence; a
client that leaves is also cancelled in the engine at the next step, which frees its KV region for a waiting job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from specscope import session   # session.load_target looked up per call: tests stub it
from specscope.economics.policy import spec_policy
from specscope.economics.prices import host_prices
from specscope.engine import BatchEngine, Finished, Request
from specscope.errors import SpecscopeError
from specscope.models.hub import parse_hub_id
from specscope.models.loader import compute_dtype
from specscope.runtime.sampling import SamplingParams
from specscope.runtime.tokenizer import StreamDecoder
from specscope.server.metrics import ServerMetrics
from specscope.server.protocol import ApiError, GenParams, SpecCounts
from specscope.speculative.decode import DraftOptions

log = logging.getLogger("specscope.server")

DEFAULT_MAX_SEQ_LEN = 4096   # the default KV region per sequence is min(model context, this)


@dataclass
class ServeConfig:
    model: str = "smollm2-135m"
    served_name: str | None = None
    # --draft and its knobs; the budget: each sequence's cycles in the declared shape ("fixed") or priced as if it
    # ran alone ("priced"); the batch-size pricing is spec_policy's
    drafting: DraftOptions = field(default_factory=lambda: DraftOptions(budget="fixed"))
    dtype: str = "auto"
    device: str = "cpu"
    max_queue: int = 64                    # requests not yet admitted to the engine; more get 429
    max_num_seqs: int = 16                 # sequences decoded together (1 = one request at a time)
    max_num_batched_tokens: int = 2048     # prompt tokens + decode rows one engine step may take
    max_seq_len: int | None = None         # prompt + completion per sequence; default min(context, 4096)
    enable_prefix_caching: bool = True     # a new request reuses the keys of the longest prompt prefix it shares
    spec_policy: str = "priced"            # economics.policy.spec_policy: the draft shape per batch size
    max_prompt_tokens: int | None = None   # default: max_seq_len - 1
    max_tokens_cap: int = 2048
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0           # a client slower than this sending its body gets 408 and is dropped
    api_key: str | None = None
    profile_phases: bool = True            # record each engine step's wall time (cycle_phase_seconds{phase=step})
    metrics_prefix: str = "specscope"

    def decoding(self) -> session.DecodeSpec:
        return session.decode_spec(self.model, self.drafting, dtype=self.dtype, device=self.device)


class Cancelled(Exception):
    """Raised inside on_tokens when the client went away."""


class StopString(Exception):
    """Raised inside on_tokens when a stop string appeared; the text is already cut."""


@dataclass(frozen=True)
class Tokens:
    """Text ready to send (what a stop string could still claim is held back) and the token ids it came from."""
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Done:
    """A choice that finished: its whole text and ids, why it stopped, the usage counts and, with a drafter, its
    speculative counters (`spec`)."""
    text: str
    finish: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    spec: SpecCounts | None


@dataclass(frozen=True)
class Failed:
    """A choice that cannot be answered: the error the client gets."""
    error: ApiError


@dataclass(frozen=True)
class Dropped:
    """A choice cancelled because its client left: nobody is told."""


Event = Tokens | Done | Failed | Dropped


class Job:
    def __init__(self, params: GenParams, prompt_ids: list[int], loop: asyncio.AbstractEventLoop, rid: str = ""):
        self.rid = rid or "req-" + uuid.uuid4().hex[:16]   # the engine's request id: must be unique
        self.params = params
        self.prompt_ids = prompt_ids
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_enqueue = time.perf_counter()
        self.t_first: float | None = None
        self.text = ""      # streamed so far: decoded text, and how much of it was sent (the rest is holdback)
        self.sent = 0
        # the engine's logprob records (engine/request.py TokenLogprob), filled on the worker thread before the
        # event that carries their tokens is posted: a reader of that event finds them here
        self.lps: list = []
        self.prompt_lps: list | None = None

    def post(self, event: Event) -> None:
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
    """Model + tokenizer (+ drafter): encodes requests, makes the engine, turns a job into an engine Request and
    a Finished back into the job's last events."""

    def __init__(self, cfg: ServeConfig, spec: session.DecodeSpec | None = None):
        """`spec`: the one `serve` checked its flags with (cfg.decoding()'s), used as is; else made here."""
        self.cfg = cfg
        spec = spec or cfg.decoding()
        self.model, self.tokenizer, self.path = spec.load()
        hub = None if Path(cfg.model).expanduser().exists() else parse_hub_id(cfg.model)
        self.name = cfg.served_name or (hub[0] if hub else self.path.name)   # a hub id, as vLLM serves it
        self.stop_ids = session.stop_ids_for(self.model, self.tokenizer)
        self.context = int(self.model.config.max_position_embeddings)
        self.vocab = int(self.model.config.vocab_size)
        if cfg.max_seq_len is not None and not 2 <= cfg.max_seq_len <= self.context:
            raise SpecscopeError(f"--max-seq-len {cfg.max_seq_len} must be in [2, {self.context}] (the model's "
                                 f"context, max_position_embeddings)")
        self.max_seq_len = cfg.max_seq_len or min(self.context, DEFAULT_MAX_SEQ_LEN)
        self.max_prompt = min(cfg.max_prompt_tokens or self.max_seq_len - 1, self.max_seq_len - 1)
        self.tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads unguarded
        self.spec_cfg, self.drafter, self.policy = spec.shape, spec.drafter(self.model), None
        if spec.drafting is not None:
            prices = host_prices(self.model) if cfg.spec_policy == "priced" else None
            self.policy = spec_policy(cfg.spec_policy, self.spec_cfg, model=cfg.model, draft=cfg.drafting.draft,
                                      dtype=str(compute_dtype(self.model)), prices=prices)

    def new_engine(self) -> BatchEngine:
        c = self.cfg
        return BatchEngine(self.model, self.drafter, self.spec_cfg, max_num_seqs=c.max_num_seqs,
                           max_seq_len=self.max_seq_len, max_num_batched_tokens=c.max_num_batched_tokens,
                           spec_policy=self.policy, prefix_caching=c.enable_prefix_caching)

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
        limit = self.max_seq_len   # one sequence's KV region: what the engine can hold, not only the model
        if p.max_tokens is None:
            p.max_tokens = min(self.cfg.max_tokens_cap, limit - len(ids))
        if len(ids) + max(p.max_tokens, 1) > limit:   # max_tokens 0 (echo) still decodes one token
            whose = (f"this model's maximum context length is {limit} tokens" if limit == self.context else
                     f"this server's maximum context length is {limit} tokens (--max-seq-len; the model's is "
                     f"{self.context})")
            raise ApiError(400, f"{whose}, but the request asks for {len(ids)} prompt + {p.max_tokens} completion "
                                f"tokens; lower max_tokens", "max_tokens")
        return ids

    # -- called on the worker thread ------------------------------------------------------------------------------
    def request(self, job: Job, metrics: ServerMetrics) -> Request:
        """The engine's view of a job; its on_tokens streams text (stop strings held back) to the job."""
        p = job.params
        dec = StreamDecoder(self.tokenizer)

        def on_tokens(new):
            if job.cancelled.is_set():
                raise Cancelled()
            if job.t_first is None:
                job.t_first = time.perf_counter()
                metrics.ttft.observe(job.t_first - job.t_enqueue)
            if p.max_tokens == 0:   # echo of the prompt alone: the one token decoded for it is not part of it
                return
            with self.tok_lock:
                job.text += dec.push(new)
            self._emit(job, list(new))

        def on_logprobs(records, prompt):
            if prompt:
                job.prompt_lps = records
            elif p.max_tokens:
                job.lps += records

        sp = SamplingParams(p.temperature, p.top_k, p.top_p, p.seed)
        stop_ids = () if p.ignore_eos else self.stop_ids    # ignore_eos: benchmarks want exactly max_tokens
        # max_tokens 0 (echo): the engine decodes one token, as vLLM does, and the answer leaves it out
        return Request(job.rid, list(job.prompt_ids), max(p.max_tokens, 1), sp, tuple(stop_ids), on_tokens,
                       p.logprobs, p.prompt_logprobs, on_logprobs)

    def complete(self, job: Job, f: Finished, finish: str, metrics: ServerMetrics) -> None:
        """Send what the holdback kept and the `done` event of a request that finished normally."""
        ids = list(f.token_ids) if job.params.max_tokens else []
        if not job.params.max_tokens:
            finish = "length"
        with self.tok_lock:
            full = self.tokenizer.decode(ids)
        cut = self._find_stop(full, job.params.stop)
        text = full if cut is None else full[:cut]
        if len(text) > job.sent:
            job.post(Tokens(text[job.sent:], []))
        spec = None
        if self.drafter is not None:
            st = f.stats   # None when no step drafted for it (max_tokens 1, --spec-policy off): zero counters
            if st is not None:
                metrics.observe_spec(st)
            spec = SpecCounts.of(st)
        job.post(Done(text, finish, ids, len(job.prompt_ids), f.cached_tokens, spec))

    def _emit(self, job: Job, new_ids: list[int]) -> None:
        text, stops = job.text, job.params.stop
        cut = self._find_stop(text, stops, start=max(0, job.sent - max((len(s) for s in stops), default=0)))
        if cut is not None:
            if cut > job.sent:
                job.post(Tokens(text[job.sent:cut], new_ids))
                job.sent = cut
            raise StopString()
        safe = len(text) - _holdback(text, stops)
        if safe > job.sent or new_ids:
            job.post(Tokens(text[job.sent:safe] if safe > job.sent else "", new_ids))
            job.sent = max(safe, job.sent)

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        return min(hits) if hits else None


class Worker:
    """One thread that runs the engine: admits queued jobs between steps, steps while anything runs, and maps each
    finished sequence onto its job's events and the metrics."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics, max_queue: int):
        self.served = served
        self.metrics = metrics
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.max_num_seqs = served.cfg.max_num_seqs
        self.engine = served.new_engine()     # allocated here, before the server listens
        self.jobs: dict[str, Job] = {}        # in the engine (admitted or about to be), by request id
        self.cancelling: set[str] = set()     # of those, cancelled in the engine: their regions free at the next step
        self.engine_waiting = 0               # jobs the engine holds but has not admitted yet (token budget)
        self.stopping = False
        self.service_s = 1.0  # running mean of one request's time in the engine, for Retry-After
        self.policy_said: dict[int, float] = {}   # batch size -> when the log last said why it ran plain
        self.thread = threading.Thread(target=self._loop, name="specscope-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, *jobs: Job) -> None:
        """Queue one request's jobs (its n choices) all or none."""
        if self.stopping:
            raise ApiError(503, "the server is shutting down")
        try:
            if self.q.maxsize - self.q.qsize() < len(jobs):   # (stop()'s None racing in: Full below, 429)
                raise queue.Full
            for job in jobs:
                self.q.put_nowait(job)
        except queue.Full:
            for job in jobs:   # any already queued are dropped when their turn comes
                job.cancel()
            # 429 + Retry-After (as vLLM / OpenAI do under load): the server is fine, it is just busy. The queue
            # drains max_num_seqs requests per service time.
            self.metrics.requests_rejected.inc()
            rounds = math.ceil((self.q.qsize() + len(jobs)) / self.max_num_seqs)
            wait = max(1, min(600, math.ceil(self.service_s * rounds)))
            raise ApiError(429, f"the request queue is full ({self.q.maxsize} waiting); retry in about {wait} s",
                           retry_after=wait) from None
        self._gauge_waiting()

    def _gauge_waiting(self) -> None:
        self.metrics.waiting.set(self.q.qsize() + self.engine_waiting)

    # -- the worker thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        exiting = False
        while True:
            if not self.engine.busy:
                if exiting:
                    break
                job = self.q.get()             # idle: sleep until a job (or stop's None) arrives
                if job is None:
                    break
                self._add(job)
            for rid, job in self.jobs.items():  # clients that left: their regions free at this step
                if job.cancelled.is_set() and rid not in self.cancelling:
                    self.engine.cancel(rid)
                    self.cancelling.add(rid)
            while not exiting and len(self.jobs) - len(self.cancelling) < self.max_num_seqs:
                try:
                    job = self.q.get_nowait()
                except queue.Empty:
                    break
                if job is None:   # stop(): cancel what runs (also a job added as stop() looked), drop it, go
                    exiting = True
                    for j in self.jobs.values():
                        j.cancel()
                else:
                    self._add(job)
            if self.engine.busy:
                self._step()
            self.engine_waiting = len(self.engine.waiting)
            self._gauge_waiting()
            self.metrics.running.set(len(self.engine.running))
        self.metrics.running.set(0)
        self._fail_queued()   # a submit that raced stop() past its drain

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while it waited: no decode for nobody
            self.metrics.request_failed.labels(reason="cancelled").inc()
            return
        try:
            self.engine.add(self.served.request(job, self.metrics))
        except Exception as e:
            self._fail(job, e)
            return
        self.jobs[job.rid] = job

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            done = self.engine.step()
        except Exception as e:
            # a bug in the step itself, not in one request's callback: every sequence in it is lost and the
            # engine's state is unknown; answer each with a 500 and go on with a fresh engine
            log.error("engine step failed with %d requests in it: %s", len(self.jobs), ", ".join(self.jobs),
                      exc_info=(type(e), e, e.__traceback__))
            lost = list(self.jobs.values())
            self.jobs.clear()
            self.cancelling.clear()
            self.engine = None                 # free the old cache before allocating the new one
            self.engine = self.served.new_engine()
            for job in lost:                   # answered once the fresh engine is in place
                self._fail(job, e, logged=True)
            return
        if self.served.cfg.profile_phases:   # the step's wall time and its split (engine/batch.py StepRecord)
            rec = self.engine.last_step
            phases = {"step": [(time.perf_counter() - t0) * 1e3]}
            if rec is not None:
                phases.update({k: [v] for k, v in rec.phases_ms.items()})
            self.metrics.observe_phases(phases)
            if rec is not None and self.served.drafter is not None:
                self._observe_policy(rec)
        for f in done:
            self._finish(f)

    def _observe_policy(self, rec) -> None:
        """/metrics' step counters, and one log line (per batch size, at most every 5 minutes) when the priced
        policy runs plain steps because drafting does not pay: a user who expects speculation sees why not."""
        decision = getattr(self.served.policy, "last", None)
        self.metrics.observe_step(rec, decision)
        if decision != ("plain", "predicted_slower"):
            return
        now, said = time.monotonic(), self.policy_said.get(rec.batch)
        if said is None or now - said > 300:
            self.policy_said[rec.batch] = now
            log.warning("spec policy: plain steps at batch %d: %s", rec.batch,
                        self.served.policy.why_plain(rec.batch))

    def _finish(self, f: Finished) -> None:
        job = self.jobs.pop(f.id)
        self.cancelling.discard(f.id)
        m = self.metrics
        if f.t_scheduled is not None:
            took = f.t_finished - f.t_scheduled
            m.queue_time.observe(f.t_scheduled - job.t_enqueue)
            m.inference_time.observe(took)
            self.service_s = 0.8 * self.service_s + 0.2 * took
            m.prompt_tokens.inc(f.prompt_len)
            m.prefix_cache_queries.inc(f.prompt_len)
            m.prefix_cache_hits.inc(f.cached_tokens)
        m.generation_tokens.inc(len(f.token_ids))
        exc = f.exc
        if f.stop_reason == "cancelled" or isinstance(exc, Cancelled):
            m.request_failed.labels(reason="cancelled").inc()
            job.post(Dropped())
            return
        if exc is not None and not isinstance(exc, StopString):
            self._fail(job, exc)
            return
        finish = "length" if f.stop_reason == "length" else "stop"
        try:
            self.served.complete(job, f, finish, m)
        except Exception as e:
            self._fail(job, e)
            return
        m.request_success.labels(finished_reason=finish).inc()
        m.e2e.observe(time.perf_counter() - job.t_enqueue)

    def _fail(self, job: Job, e: BaseException, logged: bool = False) -> None:
        if isinstance(e, SpecscopeError):
            self.metrics.request_failed.labels(reason="invalid").inc()
            job.post(Failed(ApiError(400, str(e))))
            return
        # a bug: keep serving; the client gets a 500 and an id to find the traceback by
        if not logged:
            log.error("request %s failed", job.rid, exc_info=(type(e), e, e.__traceback__))
        self.metrics.request_failed.labels(reason="error").inc()
        job.post(Failed(ApiError(500, f"internal error during generation ({type(e).__name__}; request id "
                                        f"{job.rid}); the server log has the traceback; please report it")))

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self.q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel()
                job.post(Failed(ApiError(503, "the server is shutting down")))

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, fail what is queued, cancel what runs, and join the thread."""
        self.stopping = True
        self._fail_queued()
        for job in list(self.jobs.values()):
            job.cancel()
        try:
            self.q.put(None, timeout=timeout)
        except queue.Full:   # submits raced the drain and the thread is not taking them: nothing left to wake
            pass
        self.thread.join(timeout)
