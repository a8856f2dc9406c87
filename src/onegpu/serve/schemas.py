"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, checked field by field,
and the error every refusal is sent as: ``{"error": {"message", "type", "param", "code"}}``.

Lenient where OpenAI and vLLM are: a field this server does not know is ignored, with a warning
(``ignored_fields`` finds them; the route logs and reports them), whole-number floats fill integer
fields (``"max_tokens": 4.0``), null means the default, and ``model`` may be left out (the base
model answers). Strict where a wrong type would mislead: no "5" for 5, no 1 for true, and values
out of range are refused naming the field."""

from __future__ import annotations

import json
from typing import Annotated, Optional, Union

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, field_validator

from onegpu.infer.requests import MAX_LOGPROBS
from onegpu.serve.messages import Lenient, Message, ResponseFormat, Tool, ToolChoice

MAX_N = 16  # choices per request: each is a sequence in the engine, so n bounds one caller's share
MAX_STOPS = 4  # as OpenAI
INT64 = 2**63


def _whole(value):
    """4.0 -> 4, as OpenAI accepts; 4.5 stays a float and fails the integer check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WholeInt = Annotated[int, BeforeValidator(_whole)]


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


class StreamOptions(Lenient):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's: usage in every chunk


class StructuredOutputs(Lenient):
    """vLLM's ``structured_outputs``: one of a JSON schema, a regex, a choice of strings, a Lark
    grammar, or any JSON object."""

    json_: Optional[Union[dict, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = Field(None, min_length=1)
    json_object: Optional[bool] = None

    def given(self) -> list[str]:
        names = ("json_", "regex", "choice", "grammar")
        found = [n.rstrip("_") for n in names if getattr(self, n) is not None]
        return found + (["json_object"] if self.json_object else [])


class _Sampling(Lenient):
    """The fields both endpoints share."""

    model: Optional[str] = None  # None: the base model, as vLLM
    max_tokens: Optional[WholeInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[WholeInt] = Field(None, ge=-1)  # vLLM's; 0 and -1 are off
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)  # vLLM's
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    n: Optional[WholeInt] = Field(None, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[WholeInt] = Field(None, ge=-INT64, lt=INT64)
    user: Optional[str] = None
    ignore_eos: Optional[bool] = False  # vLLM's: decode max_tokens whatever the model says
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[dict, str]] = None  # vLLM's
    guided_regex: Optional[str] = None  # vLLM's
    guided_choice: Optional[list[str]] = Field(None, min_length=1)  # vLLM's
    guided_grammar: Optional[str] = Field(None, min_length=1)  # vLLM's: Lark (llguidance's)
    structured_outputs: Optional[StructuredOutputs] = None  # vLLM's newer form of guided_*
    # OpenAI's: token id (a string key in JSON) -> a bias in -100..100 added to its logit
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: Optional[WholeInt] = Field(None, ge=0)  # vLLM's: no EOS before this many

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"the key '{key}' is not a token id (a whole number >= 0)")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is {bias}; it is in -100..100")
        return value

    def biases(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

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

    def choices(self) -> int:
        return self.n or 1

    def usage_options(self) -> tuple[bool, bool]:
        """(usage at the end of a stream, usage in every chunk)."""
        o = self.stream_options
        if not self.stream or o is None:
            return False, False
        return bool(o.include_usage), bool(o.continuous_usage_stats)


class CompletionRequest(_Sampling):
    # a text, texts, token ids, or a batch of token ids (what lm-evaluation-harness sends)
    prompt: Union[str, list[str], list[WholeInt], list[list[WholeInt]]]
    max_tokens: Optional[WholeInt] = Field(None, ge=0)  # 0: with echo, the prompt scored alone
    echo: Optional[bool] = False  # the prompt's text before each choice's
    logprobs: Optional[WholeInt] = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if (isinstance(value, str) and not value) or (isinstance(value, list) and not value):
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and any(isinstance(p, (str, list)) and not p for p in value):
            raise ValueError("one of the prompts is empty")
        if isinstance(value, list):
            ids = [t for p in value for t in (p if isinstance(p, list) else [p])]
            if any(isinstance(t, int) and t < 0 for t in ids):
                raise ValueError("token ids are >= 0")
        return value

    def top_logprobs_asked(self) -> Optional[int]:
        return self.logprobs


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[WholeInt] = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: Optional[bool] = False
    top_logprobs: Optional[WholeInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # accepted; every call in the answer is returned

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs 'logprobs': true")
        return value

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_asked(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """The request body as ``schema``, or a 400 naming the first field that is wrong."""
    data = _json(raw)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc) from None


def _json(raw: bytes) -> dict:
    try:
        data = json.loads(raw or b"")
        # "\ud800" parses to a lone surrogate no tokenizer takes: refused here, not a 500 there
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(
            400,
            "the body has a lone UTF-16 surrogate escape (such as \\ud800) in a string; send "
            "whole characters.",
            code="invalid_json",
        ) from None
    except RecursionError:  # a body nested thousands deep
        raise APIError(400, "the body is nested too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object.", code="invalid_json")
    return data


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Every field the caller sent that no model here knows, as a dotted path (list positions
    left out: "messages.foo" once, however many messages carry it)."""
    found = [f"{prefix}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        found += _ignored_in(getattr(model, name), f"{prefix}{name}.")
    return sorted(set(found))


def _ignored_in(value, prefix: str) -> list[str]:
    if isinstance(value, BaseModel):
        return ignored_fields(value, prefix)
    if isinstance(value, list):
        return [f for item in value for f in _ignored_in(item, prefix)]
    return []


def _field_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
    param = ".".join(loc) or None
    if err["type"] == "missing":
        message = f"'{param}' is required."
    else:
        got = json.dumps(err.get("input"), default=str)[:80]
        message = f"'{param}': {err['msg']} (got {got})."
    return APIError(400, message, param=param, code="invalid_value")


def _is_type_tag(part) -> bool:
    """pydantic names the union member it tried in the location ("prompt.list[int].0"): the
    caller wrote no such field."""
    if not isinstance(part, str):
        return False
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool")
