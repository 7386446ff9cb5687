"""FastAPI app: OpenAI-compatible routes, /health, /metrics, API-key check, JSON errors everywhere."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specscope.server import protocol as P
from specscope.server.metrics import ServerMetrics
from specscope.server.protocol import ApiError
from specscope.server.worker import Job, ServedModel, Worker

log = logging.getLogger("specscope.server")


def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if e.status in (429, 503):
        headers["Retry-After"] = str(e.retry_after or 1)
    if e.close:  # the rest of this request may still be on the wire: end the connection rather than read it
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


class CancellingStream(StreamingResponse):
    """A streaming response that cancels its job however it ends (done, client gone, server stopping)."""

    def __init__(self, content, job: Job, **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which gets in the way of streaming and disconnects).

    Like vLLM: the OpenAI routes need `Authorization: Bearer KEY`; /health and /metrics stay open for probes.
    """

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = error_response(ApiError(401, "missing or wrong API key; send 'Authorization: Bearer KEY'"))
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(served: ServedModel, metrics: ServerMetrics | None = None) -> FastAPI:
    cfg = served.cfg
    metrics = metrics or ServerMetrics(cfg.metrics_prefix)
    worker = Worker(served, metrics, cfg.max_queue)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        # uvicorn has already drained in-flight requests (SIGTERM); now stop the decoding thread
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specscope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served, app.state.worker, app.state.metrics = served, worker, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, e: ClientDisconnect):
        # the client hung up before its body arrived: nobody to answer and nothing wrong with the server
        log.info("%s %s: the client disconnected before sending its whole body", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        # a bug, not a bad request: the client gets an id to quote, the server log gets the traceback under it
        rid = "err-" + uuid.uuid4().hex[:16]
        log.error("internal error in %s %s (request id %s)", request.method, request.url.path, rid,
                  exc_info=(type(e), e, e.__traceback__))
        return error_response(ApiError(500, f"internal error (request id {rid}); the server log has the traceback "
                                            f"under this id; please report it"), {"X-Request-Id": rid})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(e.status_code, msg.get(e.status_code, str(e.detail))))

    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, key=cfg.api_key)

    @app.get("/health")
    async def health():
        if worker.stopping:
            return error_response(ApiError(503, "shutting down"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specscope", "root": str(served.path),
                                            "max_model_len": served.max_seq_len}]}

    async def read_body(request: Request) -> dict:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > cfg.max_body_bytes:
            raise ApiError(413, f"the request body is over {cfg.max_body_bytes} bytes")
        raw = b""
        # the whole body within body_timeout_s: a client that sends headers and then trickles (or nothing) would
        # otherwise hold its connection forever, and a few of them are a denial of service
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout_s
        parts = request.stream()
        while True:
            try:
                part = await asyncio.wait_for(anext(parts), max(deadline - loop.time(), 0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                log.info("%s %s: body not received within %g s; closing", request.method, request.url.path,
                         cfg.body_timeout_s)
                raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s; send it "
                                    f"whole and promptly", close=True) from None
            raw += part
            if len(raw) > cfg.max_body_bytes:
                raise ApiError(413, f"the request body is over {cfg.max_body_bytes} bytes")
        return P.parse_json(raw)

    async def handle(request: Request, kind: str):
        body = await read_body(request)
        parse = P.parse_chat if kind == "chat" else P.parse_completion
        p = parse(body, cfg.max_tokens_cap)
        if p.model is not None and p.model not in (served.name, cfg.model, str(served.path)):
            raise ApiError(404, f"the model {p.model!r} does not exist; this server serves {served.name!r}",
                           "model")
        ids = served.encode(p)
        rid = P.new_id(kind)
        job = Job(p, ids, asyncio.get_running_loop(), rid)
        worker.submit(job)
        if p.stream:
            return CancellingStream(stream_events(job, p, rid), job, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})
        next_check = time.monotonic() + 0.1
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 0.1
                    if await request.is_disconnected():  # nobody will read the answer: stop decoding it
                        job.cancel()
                        return Response(status_code=499)
                if ev is None:
                    continue
                if ev[0] == "done":
                    d = ev[1]
                    return P.full_response(p, rid, served.name, d["text"], d["finish"], d["prompt_tokens"],
                                           d["token_ids"], d["spec"], d["cached_tokens"])
                if ev[0] == "error":
                    raise ev[1]
                if ev[0] == "cancelled":
                    raise ApiError(503, "the request was cancelled")
        finally:
            job.cancel()  # a non-streaming client that hangs up stops its decode too

    async def stream_events(job: Job, p: P.GenParams, rid: str):
        created = int(time.time())
        if p.kind == "chat":
            yield P.sse(P.chunk(p, rid, served.name, created, role=True))
        while True:
            ev = await job.events.get()
            if ev[0] == "tokens":
                text, tids = ev[1], ev[2]
                if text or (p.return_token_ids and tids):
                    yield P.sse(P.chunk(p, rid, served.name, created, text=text, token_ids=tids))
            elif ev[0] == "done":
                d = ev[1]
                yield P.sse(P.chunk(p, rid, served.name, created, text="" if p.kind == "completion" else None,
                                    finish=d["finish"]))
                if p.include_usage:
                    last = {"id": rid, "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
                            "created": created, "model": served.name, "choices": [],
                            "usage": P.usage(d["prompt_tokens"], len(d["token_ids"]), d["cached_tokens"])}
                    if d["spec"] is not None:
                        last["spec"] = d["spec"]
                    yield P.sse(last)
                yield P.sse("[DONE]")
                return
            elif ev[0] == "error":
                yield P.sse(ev[1].body())
                yield P.sse("[DONE]")
                return
            else:  # cancelled: the client is gone, nothing to say
                return

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    return app
