"""The HTTP routes (FastAPI): OpenAI's schemas in, engine requests out.

/v1/models, /v1/completions, /v1/chat/completions (stream or not), /health, /metrics (and
tokens.py's /tokenize, /detokenize, /tokenizer_info). Every refusal
and every failure is an OpenAI-style error body (a stream's, as its last event before [DONE]); a
caller that goes away cancels its sequences, so their slots are free for the next step. Prompts are
templated and tokenized on a thread of their own, never on the event loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from onegpu.infer.requests import EngineFeatures
from onegpu.serve.adapters import ServedModels
from onegpu.serve.media import Media
from onegpu.serve.metrics import Metrics
from onegpu.serve.openapi import describe
from onegpu.serve.prepare import Plan, chat_plan, check_features, completion_plan, constraint_field
from onegpu.serve.responses import DONE, Reply, Tally, event
from onegpu.serve.scheduler import Scheduler, Ticket
from onegpu.serve.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ignored_fields,
    parse_body,
)
from onegpu.serve.tokens import token_routes
from onegpu.serve.tools import reader

log = logging.getLogger(__name__)
IGNORED_HEADER = "X-Onegpu-Ignored-Fields"


@dataclass
class Service:
    scheduler: Scheduler
    tokenizer: object
    models: ServedModels
    metrics: Metrics
    max_len: int
    api_key: Optional[str] = None
    features: EngineFeatures = field(default_factory=EngineFeatures)
    tool_format: Optional[str] = None  # tools.parser_for: how the model writes tool calls
    check_constraint: Optional[Callable] = None  # compiles a Constraint; raises on a bad one
    json_schema_strict: bool = True  # ServeConfig.json_schema_strict: unlisted keys forbidden
    media: Media = field(default_factory=Media)  # image parts: a vision-language model's reading
    warned: set = field(default_factory=set)  # ignored field names already logged
    # one thread: the tokenizer is not safe to use from several at once, and order is kept
    prep: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    )

    def ignored(self, req) -> dict:
        """The response header naming the fields ignored; each name logged once."""
        names = ignored_fields(req)
        for name in names:
            if name not in self.warned:
                self.warned.add(name)
                log.warning("ignoring the request field '%s': this server does not know it", name)
        return {IGNORED_HEADER: ", ".join(names)} if names else {}

    async def plan(self, make, req, *args) -> Plan:
        """``make(tokenizer, req, *args)`` on the tokenizer thread, with the grammar and the
        engine's features checked there too."""

        def run() -> Plan:
            plan = make(self.tokenizer, req, *args, self.json_schema_strict)
            if self.check_constraint is not None:
                for where, name, constraint in plan.tool_schemas:
                    _check_tool(self.check_constraint, constraint, where, name)
            if plan.params.constraint is not None and self.check_constraint is not None:
                _check(self.check_constraint, plan.params.constraint, req)
            check_features(plan.params, self.features, req)
            return plan

        return await asyncio.get_running_loop().run_in_executor(self.prep, run)


def _check(check: Callable, constraint, req) -> None:
    """A grammar that does not compile is this request's 400, naming the field that asked."""
    from onegpu.infer.constraints import ConstraintError

    try:
        check(constraint)
    except ConstraintError as exc:
        raise APIError(
            400, exc.message, param=constraint_field(req), code="invalid_grammar"
        ) from None


def _check_tool(check: Callable, constraint, where: str, name: str) -> None:
    """A tool whose parameters do not compile as a grammar: a 400 naming the tool, whatever the
    tool_choice (a forced call would fail on it later)."""
    from onegpu.infer.constraints import ConstraintError

    try:
        check(constraint)
    except ConstraintError as exc:
        message = f"tool '{name}': its parameters schema {exc.message.removeprefix('the ')}"
        raise APIError(400, message, param=where, code="invalid_tool_schema") from None


def build_app(service: Service) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        service.scheduler.start()
        yield
        service.scheduler.stop()  # after the server has drained: in-flight requests are done
        service.prep.shutdown(wait=False)

    app = FastAPI(title="onegpu", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(CountRequests, metrics=service.metrics)
    _routes(app, service)
    token_routes(app, service, _authorize)
    describe(app)
    return app


def _routes(app: FastAPI, s: Service) -> None:
    @app.get("/health", openapi_extra={"x-onegpu": "health"})
    async def health():
        h = s.scheduler.health()
        status = "failed" if h.error else "ok" if h.accepting else "draining"
        return JSONResponse(
            {"status": status, **asdict(h)}, status_code=200 if h.accepting else 503
        )

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, not JSON
    async def metrics():
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", openapi_extra={"x-onegpu": "models"})
    async def models(request: Request):
        _authorize(request, s.api_key)
        data = [{"id": n, "object": "model", "owned_by": "onegpu"} for n in s.models.names()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions", openapi_extra={"x-onegpu": "completions"})
    async def completions(request: Request):
        _authorize(request, s.api_key)
        req = parse_body(await request.body(), CompletionRequest)
        headers = s.ignored(req)
        adapter = s.models.adapter_for(req.model)
        plan = await s.plan(completion_plan, req, s.max_len)
        return await answer(s, request, req, plan, adapter, headers)

    @app.post("/v1/chat/completions", openapi_extra={"x-onegpu": "chat"})
    async def chat(request: Request):
        _authorize(request, s.api_key)
        req = parse_body(await request.body(), ChatRequest)
        headers = s.ignored(req)
        adapter = s.models.adapter_for(req.model)
        plan = await s.plan(chat_plan, req, s.max_len, s.tool_format, s.media)
        return await answer(s, request, req, plan, adapter, headers)


def _authorize(request: Request, key: Optional[str]) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    # bytes, not str: compare_digest refuses a str with characters outside ASCII
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8")
    ):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>' with the server's "
            "--api_key.",
            kind="authentication_error",
            code="invalid_api_key",
        )


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, str(exc.detail), kind=kind, code=str(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    error = APIError(500, f"internal error: {type(exc).__name__}", kind="server_error")
    return JSONResponse(error.body(), status_code=500)


# ---------------------------------------------------------------------------- answers
async def answer(s: Service, request: Request, req, plan: Plan, adapter, headers: dict):
    n = req.choices()
    ticket = Ticket(plan.sequences(n), adapter, asyncio.get_running_loop(), plan.images)
    s.scheduler.submit(ticket)  # 503 when full: nothing was queued
    lengths = [len(ids) for ids, _ in ticket.sequences]
    readers = [reader(plan.tool_format, plan.tool_name) for _ in lengths]
    tally = Tally(lengths, n, readers if plan.tool_format else None, score_only=plan.score_only)
    final_usage, every_usage = req.usage_options()
    echo = [text for text in plan.echo for _ in range(n)] if plan.echo else None
    name = req.model or s.models.base
    asked = plan.params.prompt_logprobs is not None  # the echoed prompt's logprobs
    prompts = [ids for ids, _ in ticket.sequences] if asked else None
    reply = Reply(plan.kind, name, _token_text(s.tokenizer), echo, every_usage, prompts)
    if req.stream:
        stream = _events(s, ticket, tally, reply, final_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    gather = asyncio.ensure_future(_gather(s, ticket, tally))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gather.done():  # the caller left (or we are cancelled): free the slots
            gather.cancel()
            s.scheduler.cancel(ticket)
    if not gather.done() or gather.cancelled():
        return Response(status_code=499)  # nobody reads it; the code says why in the access log
    gather.result()
    return JSONResponse(reply.full(tally), headers=headers)


def _token_text(tokenizer) -> Callable[[int], str]:
    return lambda token_id: tokenizer.decode([token_id])


async def _gather(s: Service, ticket: Ticket, tally: Tally) -> None:
    while not tally.done():
        tally.add(*await ticket.next())
    _observe(s.metrics, tally)


async def _events(s: Service, ticket: Ticket, tally: Tally, reply: Reply, usage: bool):
    try:
        # a choice opens at once, or with its first update where that brings the echoed
        # prompt's logprobs
        opened = set(range(tally.choices)) if reply.prompts is None else set()
        for i in opened:
            opening = reply.opening(tally, i)
            if opening:
                yield opening
        while not tally.done():
            index, update = await ticket.next()
            news = tally.add(index, update)
            if index not in opened:
                opened.add(index)
                opening = reply.opening(tally, index, news.prompt_logprobs)
                if opening:
                    yield opening
            if not news.empty():
                yield reply.chunk(tally, index, news)
        _observe(s.metrics, tally)
        if usage:
            yield reply.usage_chunk(tally)
    except APIError as exc:  # the status line is sent: the error goes in the stream, as OpenAI's
        yield event(exc.body())
    except Exception as exc:  # noqa: BLE001 - a bug in one stream ends it, with its error event
        log.exception("stream failed")
        yield event(
            APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").body()
        )
    finally:
        if not tally.done():  # the client went away (Starlette cancels this generator)
            s.scheduler.cancel(ticket)
    yield DONE


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so the next message the
    server sends is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _observe(metrics: Metrics, tally: Tally) -> None:
    import time

    if tally.first_token_at is not None:
        metrics.ttft.observe(tally.first_token_at - tally.arrived)
    metrics.e2e.observe(time.perf_counter() - tally.arrived)


class CountRequests:
    """ASGI middleware counting answered requests by route and status (a plain ASGI wrapper:
    Starlette's BaseHTTPMiddleware would sit between a stream and its disconnect)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
ROUTES |= {"/tokenize", "/detokenize", "/tokenizer_info"}
