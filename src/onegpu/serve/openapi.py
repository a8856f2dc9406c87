"""/openapi.json with the request and response bodies and the error responses of each route.

The routes read their bodies themselves (so that a bad one is a 400 naming its field, not FastAPI's
422), so FastAPI cannot see their models: this module adds them. Response models here describe
what responses.py writes; the schemathesis test checks every answer against them."""

from __future__ import annotations

from typing import Literal, Optional

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from onegpu.serve.schemas import ChatRequest, CompletionRequest
from onegpu.serve.tokens import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CalledFunction(BaseModel):
    name: str
    arguments: str


class CalledTool(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AnswerMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[CalledTool]] = None


FinishReason = Optional[Literal["stop", "length", "tool_calls", "cancelled", "error"]]


class ChatChoice(BaseModel):
    index: int
    message: AnswerMessage
    logprobs: Optional[dict]
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict]
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "draining", "failed"]
    running: int
    waiting: int
    in_flight: int
    capacity: int
    kv_positions_used: int
    kv_positions_total: int
    accepting: bool
    error: Optional[str] = None


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]]


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """tokens.tokenizer_info: these fields, and the rest of the tokenizer's settings."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: Optional[str]
    eos_token: Optional[str]
    pad_token: Optional[str]
    unk_token: Optional[str]
    chat_template: Optional[str]


MODELS = [CompletionRequest, ChatRequest, Completion, ChatCompletion, ModelList, Health]
MODELS += [TokenizeRequest, Tokenized, DetokenizeRequest, Detokenized, TokenizerInfo]
ERRORS = {
    "400": "the body or one of its fields is wrong (the error names it)",
    "401": "missing or wrong API key",
    "404": "no such model",
    "500": "the server failed",
    "503": "the server is full (Retry-After) or shutting down",
}
ROUTES: dict[str, tuple[Optional[type], type, bool]] = {
    # x-onegpu tag: (request body, 200 body, streams)
    "completions": (CompletionRequest, Completion, True),
    "chat": (ChatRequest, ChatCompletion, True),
    "models": (None, ModelList, False),
    "health": (None, Health, False),
    "tokenize": (TokenizeRequest, Tokenized, False),
    "detokenize": (DetokenizeRequest, Detokenized, False),
    "tokenizer_info": (None, TokenizerInfo, False),
}


def describe(app: FastAPI) -> None:
    """Make ``app.openapi()`` publish the bodies (built once, on first use)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _schema(app)
        return app.openapi_schema

    app.openapi = openapi


def _schema(app: FastAPI) -> dict:
    from fastapi.openapi.utils import get_openapi

    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = [*MODELS, ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path in spec["paths"].values():
        for op in path.values():
            tag = op.pop("x-onegpu", None)
            if tag in ROUTES:
                _operation(op, *ROUTES[tag])
            if tag == "health":  # draining: the same body, with 503
                op["responses"]["503"] = {**op["responses"]["200"], "description": "draining"}
    return spec


def _ref(model: type) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _operation(op: dict, request: Optional[type], answer: type, streams: bool) -> None:
    ok: dict = {"application/json": {"schema": _ref(answer)}}
    if streams:
        ok["text/event-stream"] = {
            "schema": {"type": "string", "description": "server-sent events, then [DONE]"}
        }
    op["responses"] = {"200": {"description": "the answer", "content": ok}}
    codes = ERRORS if request is not None else {k: ERRORS[k] for k in ("401", "503")}
    for code, why in codes.items():
        body = {"application/json": {"schema": _ref(ErrorResponse)}}
        op["responses"][code] = {"description": why, "content": body}
    if request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        }
