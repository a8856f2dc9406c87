"""The HTTP routes (FastAPI): OpenAI's schemas in, engine requests out.

/v1/models, /v1/completions, /v1/chat/completions (stream or not), /health, /metrics. Every refusal
is an OpenAI-style error body naming the field; a caller that goes away cancels its sequences, so
their slots are free for the next step."""

from __future__ import annotations

import asyncio
import hmac
import random
from dataclasses import asdict, dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from onegpu.errors import OnegpuError
from onegpu.infer.requests import SamplingParams
from onegpu.serve.adapters import ServedModels
from onegpu.serve.metrics import Metrics
from onegpu.serve.responses import CHAT, DONE, TEXT, Reply, Tally, event
from onegpu.serve.scheduler import Scheduler, Ticket
from onegpu.serve.schemas import APIError, ChatRequest, CompletionRequest, parse_body

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Service:
    scheduler: Scheduler
    tokenizer: object
    models: ServedModels
    metrics: Metrics
    max_len: int
    api_key: Optional[str] = None


def build_app(service: Service) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        service.scheduler.start()
        yield
        service.scheduler.stop()  # after the server has drained: in-flight requests are done

    app = FastAPI(title="onegpu", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, _api_error)
    app.add_middleware(CountRequests, metrics=service.metrics)
    _routes(app, service)
    return app


def _routes(app: FastAPI, s: Service) -> None:
    @app.get("/health")
    async def health():
        h = s.scheduler.health()
        return JSONResponse(
            {"status": "ok" if h.accepting else "draining", **asdict(h)},
            status_code=200 if h.accepting else 503,
        )

    @app.get("/metrics")
    async def metrics():
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, s.api_key)
        data = [{"id": n, "object": "model", "owned_by": "onegpu"} for n in s.models.names()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        _authorize(request, s.api_key)
        req = parse_body(await request.body(), CompletionRequest)
        adapter = s.models.adapter_for(req.model)
        prompts = completion_prompts(s.tokenizer, req.prompt)
        limit = req.max_tokens or DEFAULT_COMPLETION_TOKENS
        check_context(prompts, limit, s.max_len, "prompt")
        return await answer(s, request, req, prompts, limit, adapter, TEXT)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _authorize(request, s.api_key)
        req = parse_body(await request.body(), ChatRequest)
        adapter = s.models.adapter_for(req.model)
        ids = chat_prompt(s.tokenizer, req)
        limit = req.limit() or max(1, s.max_len - len(ids))  # OpenAI: up to the context
        check_context([ids], limit, s.max_len, "messages")
        return await answer(s, request, req, [ids], limit, adapter, CHAT)


def _authorize(request: Request, key: Optional[str]) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key):
        raise APIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>' with the server's "
            "--api_key.",
            kind="authentication_error",
            code="invalid_api_key",
        )


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# ---------------------------------------------------------------------------- prompts
def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    from onegpu.infer.generation import prompt_ids

    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if max(prompt) >= len(tokenizer):
            raise APIError(
                400,
                f"token id {max(prompt)} is not in the vocabulary (size {len(tokenizer)}).",
                param="prompt",
                code="invalid_value",
            )
        return [list(prompt)]
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    return [list(ids) for ids in prompt_ids(tokenizer, texts, chat=False)]  # as `generate` does


def chat_prompt(tokenizer, req: ChatRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "this model's tokenizer has no chat template, so chat messages cannot be encoded.",
            param="messages",
            code="no_chat_template",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in 5.x


def check_context(prompts: list[list[int]], limit: int, max_len: int, prompt_field: str) -> None:
    for ids in prompts:
        if len(ids) >= max_len:
            raise APIError(
                400,
                f"the prompt is {len(ids)} tokens; this server's context is {max_len} tokens "
                "(its --max_len). Shorten the prompt.",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if len(ids) + limit > max_len:
            raise APIError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({limit}) = {len(ids) + limit} is over "
                f"this server's context of {max_len} tokens; ask for at most "
                f"{max_len - len(ids)} tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )


def sequences(req, prompts: list[list[int]], limit: int) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt n times; choice j samples with seed + j, so n sampled choices differ while a
    seeded request repeats exactly."""
    seed = req.seed if req.seed is not None else random.randrange(2**62)
    out = []
    for ids in prompts:
        for j in range(req.n):
            params = SamplingParams(
                max_new_tokens=limit,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=(seed + j) % 2**63,
                stop=req.stops(),
                ignore_eos=req.ignore_eos,
            )
            try:
                params.check()
            except OnegpuError as exc:
                raise APIError(400, exc.message, code="invalid_value") from None
            out.append((ids, params))
    return out


# ---------------------------------------------------------------------------- answers
async def answer(s: Service, request: Request, req, prompts, limit, adapter, kind: str):
    ticket = Ticket(sequences(req, prompts, limit), adapter, asyncio.get_running_loop())
    s.scheduler.submit(ticket)  # 503 when full: nothing was queued
    tally, reply = Tally(len(ticket.sequences), req.n), Reply(kind, req.model)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _events(s, ticket, tally, reply, usage), media_type="text/event-stream"
        )
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
    return reply.full(tally)


async def _gather(s: Service, ticket: Ticket, tally: Tally) -> None:
    while not tally.done():
        tally.add(*await ticket.next())
    _observe(s.metrics, tally)


async def _events(s: Service, ticket: Ticket, tally: Tally, reply: Reply, usage: bool):
    try:
        if reply.kind == CHAT:
            for i in range(tally.choices):
                yield reply.chunk(i, "", None, role=True)
        while not tally.done():
            index, update = await ticket.next()
            tally.add(index, update)
            if update.text or update.finished:
                yield reply.chunk(index, update.text, update.finish_reason)
        _observe(s.metrics, tally)
        if usage:
            yield reply.usage_chunk(tally)
    except APIError as exc:  # the status line is sent: the error goes in the stream, as OpenAI's
        yield event(exc.body())
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
