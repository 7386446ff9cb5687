"""FastAPI app: OpenAI-compatible routes, vLLM's /tokenize and /detokenize, /health, /metrics, API-key check,
x-request-id on every response, JSON errors everywhere."""

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
from specscope.server import tokenize as T
from specscope.server.metrics import DraftingInfo, ServerMetrics
from specscope.server.protocol import ApiError
from specscope.server.respond import Answer, wait_whole
from specscope.server.worker import ServedModel, Worker

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
    """A streaming response that cancels its jobs however it ends (done, client gone, server stopping)."""

    def __init__(self, content, answer: Answer, **kw):
        super().__init__(content, **kw)
        self.answer = answer

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.cancel()


class RequestIdMiddleware:
    """Every response carries x-request-id: the client's own, echoed (as vLLM does), else one made here. Added
    last, so it wraps the API-key check and the 404s too; the 500 handler runs outside all middleware and sets
    the header itself from request.state.request_id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode("latin-1")

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                kept = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"]
                msg = {**msg, "headers": kept + [(b"x-request-id", rid)]}
            await send(msg)

        return await self.app(scope, receive, send_with_id)


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


async def read_body(request: Request, cfg) -> dict:
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


def check_model(served: ServedModel, name) -> None:
    """A request's 'model' must name this server's model (its served name, --model, or its path)."""
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", "model")
    if name is not None and name not in (served.name, served.cfg.model, str(served.path)):
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {served.name!r}", "model")


def encode(served: ServedModel, p: P.GenParams, k: int | None) -> list[int]:
    """One prompt's token ids; a refusal names prompt k of a batch."""
    try:
        return served.encode(p)
    except ApiError as e:
        if k is not None:
            e.message = f"prompt[{k}]: {e.message}"
        raise


def create_app(served: ServedModel, metrics: ServerMetrics | None = None) -> FastAPI:
    cfg = served.cfg
    metrics = metrics or ServerMetrics(cfg.metrics_prefix, DraftingInfo.of(cfg, served.spec_cfg))
    worker = Worker(served, metrics, cfg.max_queue)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        # uvicorn has already drained in-flight requests (SIGTERM); now stop the decoding thread
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specscope", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served, app.state.worker, app.state.metrics = served, worker, metrics
    _add_error_handlers(app)
    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, key=cfg.api_key)
    app.add_middleware(RequestIdMiddleware)
    _add_info_routes(app, served, worker, metrics)
    _add_generate_routes(app, served, worker)
    return app


def _add_error_handlers(app: FastAPI) -> None:
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
        rid = getattr(request.state, "request_id", None) or "err-" + uuid.uuid4().hex[:16]
        log.error("internal error in %s %s (request id %s)", request.method, request.url.path, rid,
                  exc_info=(type(e), e, e.__traceback__))
        return error_response(ApiError(500, f"internal error (request id {rid}); the server log has the traceback "
                                            f"under this id; please report it"), {"X-Request-Id": rid})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(e.status_code, msg.get(e.status_code, str(e.detail))))


def _add_info_routes(app: FastAPI, served: ServedModel, worker: Worker, metrics: ServerMetrics) -> None:
    """/health, /metrics, the model list and card, vLLM's /tokenize and /detokenize."""
    card = {"id": served.name, "object": "model", "created": int(time.time()), "owned_by": "specscope",
            "root": str(served.path), "max_model_len": served.max_seq_len}

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
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")   # :path: hub ids have a slash
    async def model(model_id: str):
        check_model(served, model_id)
        return card

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, served.cfg)
        check_model(served, body.get("model"))
        return T.tokenize(served, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, served.cfg)
        check_model(served, body.get("model"))
        return T.detokenize(served, body)


def _add_generate_routes(app: FastAPI, served: ServedModel, worker: Worker) -> None:
    cfg = served.cfg

    async def handle(request: Request, kind: str):
        body = await read_body(request, cfg)
        parse = P.parse_chat if kind == "chat" else P.parse_completion
        p = parse(body, cfg.max_tokens_cap)
        check_model(served, p.model)
        parts = P.per_prompt(p)
        jobs, room = len(parts) * p.n, worker.q.maxsize   # a request's jobs are all queued at once, or none
        if jobs > room and len(parts) == 1:
            raise ApiError(400, f"'n' must be at most {room} (this server's --max-queue), got {p.n}", "n")
        if jobs > room:
            raise ApiError(400, f"{len(parts)} prompts x 'n' {p.n} are {jobs} choices, over the {room} this server "
                                f"queues at once (--max-queue); send the batch in parts", "prompt")
        prompts = [(q, encode(served, q, k if len(parts) > 1 else None)) for k, q in enumerate(parts)]
        answer = Answer(served, p, P.new_id(kind, request.state.request_id), prompts, asyncio.get_running_loop())
        worker.submit(*answer.jobs)   # a batch's prompts go to the engine together: it decodes them as one batch
        if p.stream:
            return CancellingStream(answer.stream(), answer, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})
        try:
            whole = await wait_whole(answer, request)
            return Response(status_code=499) if whole is None else whole
        finally:
            answer.cancel()  # a non-streaming client that hangs up stops its decode too

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")
