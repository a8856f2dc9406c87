"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, checked field by field,
and the error every refusal is sent as: ``{"error": {"message", "type", "param", "code"}}``.

Fields are strict (no "5" for 5, no 1 for true) and unknown ones are refused: a typo such as
``max_token`` silently ignored would generate 16 tokens where the caller asked for 500."""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16  # choices per request: each is a sequence in the engine, so n bounds one caller's share
MAX_STOPS = 4  # as OpenAI


class APIError(Exception):
    """A refused request: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        kind: str = "invalid_request_error",
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    user: Optional[str] = None
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens whatever the model says

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("a stop string is empty (it would stop at once)")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: Literal[False] = False  # accepted when off, as clients send it; echoing is not offered

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if (isinstance(value, str) and not value) or (isinstance(value, list) and not value):
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and any(isinstance(p, str) and not p for p in value):
            raise ValueError("one of the prompts is empty")
        if isinstance(value, list) and any(isinstance(t, int) and t < 0 for t in value):
            raise ValueError("token ids are >= 0")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


def parse_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """The request body as ``schema``, or a 400 naming the first field that is wrong."""
    try:
        data = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object.", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc, schema) from None


def _field_error(exc: ValidationError, schema: type[BaseModel]) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        known = ", ".join(schema.model_fields)
        message = f"unknown field '{param}'. Fields of this endpoint: {known}."
    elif err["type"] == "missing":
        message = f"'{param}' is required."
    else:
        message = f"'{param}': {err['msg']} (got {json.dumps(err.get('input'))[:80]})."
    return APIError(400, message, param=param, code="invalid_value")


def _is_type_tag(part) -> bool:
    """pydantic names the union member it tried in the location ("prompt.list[int].0"): the
    caller wrote no such field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
