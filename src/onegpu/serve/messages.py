"""The parts of a chat request beyond sampling: messages (tool calls and tool results included),
the tools a model may call and how it must call them, and the format of its answer."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Lenient(BaseModel):
    """Types are checked strictly (no "5" for 5, no 1 for true) but fields this server does not
    know are kept aside, not refused: the route logs each name once and names them in the
    X-Onegpu-Ignored-Fields header, as vLLM ignores what it does not know."""

    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ImageURL(Lenient):
    url: str  # a data URL, or with --allowed_local_media a path or file:// URL (serve/media.py)
    detail: Optional[str] = None  # OpenAI's resolution hint: the model's processor decides


class ImagePart(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends and expects it


class ToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[Part]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # the call a tool message answers

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries 'tool_calls'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, and each earlier call's arguments
        as a mapping (Qwen's and Llama's templates write them with ``tojson``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _args(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return out


def _args(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # the template gets what the caller sent


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema; none means no arguments
    strict: Optional[bool] = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDef

    def for_template(self) -> dict:
        fn = self.function
        spec: dict[str, Any] = {"name": fn.name, "parameters": self.parameters()}
        if fn.description is not None:
            spec["description"] = fn.description
        return {"type": "function", "function": spec}

    def parameters(self) -> dict:
        return self.function.parameters or {"type": "object", "properties": {}}


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class JSONSchemaFormat(Lenient):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema': {'name', 'schema'}")
        return self
