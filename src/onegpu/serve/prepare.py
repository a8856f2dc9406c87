"""From a checked request body to what the engine runs: the prompts' token ids (chat template with
the tools, or the completion prompts), each choice's SamplingParams, the grammar that constrains
the answer, and the reader of tool calls. Runs on the server's tokenizer thread, never on the
event loop: a long template or prompt must not hold up the other requests' streams."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from typing import Optional

from onegpu.errors import OnegpuError
from onegpu.infer.images import PromptImages
from onegpu.infer.requests import Constraint, EngineFeatures, SamplingParams
from onegpu.serve.chat_template import render_chat
from onegpu.serve.json_schemas import SchemaFault, check_schema, closed
from onegpu.serve.media import Media
from onegpu.serve.responses import CHAT, TEXT
from onegpu.serve.schemas import APIError, ChatRequest, CompletionRequest
from onegpu.serve.tools import forced_call

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Plan:
    kind: str
    prompts: list  # token ids of each prompt
    params: SamplingParams  # choice j of a request samples with seed + j
    echo: Optional[list] = None  # each prompt's text (completions with echo)
    tool_format: Optional[str] = None  # the reader for the answer's tool calls
    tool_name: Optional[str] = None  # the named tool of a forced call in vLLM's JSON form
    # each tool's parameters as a grammar, compiled on arrival (tools.<i>.function.parameters)
    tool_schemas: list = field(default_factory=list)
    score_only: bool = False  # completions' max_tokens 0 with echo: the prompt, no answer
    images: Optional[PromptImages] = None  # a chat prompt's images (serve/media.py)

    def sequences(self, n: int) -> list:
        """Each prompt n times; choice j samples with seed + j, so n sampled choices differ while
        a seeded request repeats exactly."""
        out = []
        for ids in self.prompts:
            for j in range(n):
                out.append((ids, replace(self.params, seed=(self.params.seed + j) % 2**63)))
        return out


def completion_plan(tokenizer, req: CompletionRequest, max_len: int, strict: bool = True) -> Plan:
    prompts = completion_prompts(tokenizer, req.prompt)
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(
            400,
            "max_tokens 0 generates nothing: it needs 'echo': true (the prompt scored, with "
            "'logprobs' for its tokens' logprobs).",
            param="max_tokens",
            code="invalid_value",
        )
    # max_tokens 0: the engine computes the prompt and draws one token, which is not returned
    limit = 1 if score_only else req.max_tokens or DEFAULT_COMPLETION_TOKENS
    check_context(prompts, limit, max_len, "prompt")
    echo = (
        [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts] if req.echo else None
    )
    params = sampling(req, limit, request_constraint(req, strict), len(tokenizer))
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens come with theirs
        params = replace(params, prompt_logprobs=req.logprobs)
    return Plan(TEXT, prompts, params, echo=echo, score_only=score_only)


def chat_plan(
    tokenizer,
    req: ChatRequest,
    max_len: int,
    tool_format: Optional[str],
    media: Optional[Media] = None,
    strict: bool = True,
) -> Plan:
    """``media``: how image parts are read (a vision-language model's processor renders every
    chat then, serve/media.py)."""
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise APIError(
            400,
            "tool_choice asks for a tool call, but the request gives no 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )
    schemas = tool_schemas(req.tools or [], strict)
    tools_on = bool(req.tools) and req.tool_choice != "none"
    forced = tools_on and req.tool_choice not in (None, "auto")
    if tools_on and not forced and tool_format is None:
        raise APIError(
            400,
            "tool_choice 'auto' (the default with 'tools') needs the model's tool-call format, "
            "and this model's chat template shows none: start the server with --tool_parser "
            "hermes or llama3 if the model writes one of them, or ask for the call with "
            "tool_choice 'required' or a named function (answered in vLLM's JSON form).",
            param="tools",
            code="tools_unsupported",
        )
    tools = [t.for_template() for t in req.tools] if tools_on else None
    found = media.prompt(req, tools) if media is not None else None
    ids, images = found or (chat_prompt(tokenizer, req, tools_on), None)
    limit = req.limit() or max(1, max_len - len(ids))  # OpenAI: up to the context
    check_context([ids], limit, max_len, "messages")
    constraint = request_constraint(req, strict)
    fmt, name = (tool_format if tools_on else None), None
    if forced:
        name = None if req.tool_choice == "required" else req.tool_choice.function.name
        constraint = _forced(req, tool_format, constraint, name, strict)
        fmt = tool_format or "json"
    return Plan(
        CHAT,
        [ids],
        sampling(req, limit, constraint, len(tokenizer)),
        tool_format=fmt,
        tool_name=name,
        tool_schemas=schemas,
        images=images,
    )


def tool_schemas(tools: list, strict: bool) -> list:
    """Each tool's parameters checked as a JSON schema (a 400 naming the tool and the path inside
    its schema), and as the grammar the server compiles on arrival, whatever the tool_choice."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}.function.parameters"
        try:
            check_schema(tool.parameters())
        except SchemaFault as fault:
            raise APIError(
                400,
                f"tool '{tool.function.name}': its parameters schema is not valid at "
                f"'{fault.path or '(root)'}': {fault.message}",
                param=f"{where}.{fault.path}" if fault.path else where,
                code="invalid_tool_schema",
            ) from None
        params = closed(tool.parameters()) if strict else tool.parameters()
        out.append((where, tool.function.name, Constraint("json_schema", json.dumps(params))))
    return out


def _forced(
    req: ChatRequest, fmt: Optional[str], other: Optional[Constraint], name, strict: bool
) -> Constraint:
    known = [t.function.name for t in req.tools]
    if name is not None and name not in known:
        raise APIError(
            400,
            f"tool_choice names '{name}', which is not among the tools: {', '.join(known)}.",
            param="tool_choice",
            code="invalid_value",
        )
    if other is not None:
        raise APIError(
            400,
            "a forced tool call and response_format/guided_* cannot constrain one answer together.",
            param="tool_choice",
            code="invalid_value",
        )
    return forced_call(fmt, req.tools, name, strict, req.parallel_tool_calls is not False)


def request_constraint(req, strict: bool = True) -> Optional[Constraint]:
    """The grammar that response_format, vLLM's guided_* fields or its structured_outputs ask for
    (at most one). A JSON schema's objects are closed with ``strict`` (json_schemas.closed)."""

    def schema(value, name: str) -> Constraint:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(
                    400, f"'{name}' is not valid JSON: {exc}", param=name, code="invalid_grammar"
                ) from None
        if strict and isinstance(value, dict):
            value = closed(value)
        return Constraint("json_schema", json.dumps(value))

    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_schema", "")))
    if rf is not None and rf.type == "json_schema":
        found.append(("response_format", schema(rf.json_schema.schema_ or {}, "response_format")))
    if req.guided_json is not None:
        found.append(("guided_json", schema(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", Constraint("choice", json.dumps(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", Constraint("grammar", req.guided_grammar)))
    so = req.structured_outputs
    for kind in so.given() if so is not None else []:
        name = f"structured_outputs.{kind}"
        found.append(
            (name, _structured(so, kind, schema(so.json_, name) if kind == "json" else None))
        )
    if len(found) > 1:
        raise APIError(
            400,
            f"{' and '.join(n for n, _ in found)} each constrain the answer; give one.",
            param=found[1][0],
            code="invalid_value",
        )
    return found[0][1] if found else None


def _structured(so, kind: str, json_constraint: Optional[Constraint]) -> Constraint:
    if kind == "json":
        return json_constraint
    if kind == "json_object":
        return Constraint("json_schema", "")
    if kind == "choice":
        return Constraint("choice", json.dumps(so.choice))
    return Constraint(kind, getattr(so, kind))  # regex, grammar


def sampling(
    req, limit: int, constraint: Optional[Constraint], vocab: Optional[int] = None
) -> SamplingParams:
    seed = req.seed % 2**63 if req.seed is not None else random.randrange(2**62)
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    params = SamplingParams(
        max_new_tokens=limit,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=seed,
        stop=req.stops(),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logprobs=req.top_logprobs_asked(),
        constraint=constraint,
        logit_bias=_biases(req, vocab),
        min_tokens=req.min_tokens or 0,
    )
    if params.min_tokens > limit:
        raise APIError(
            400,
            f"min_tokens ({params.min_tokens}) is over max_tokens ({limit}).",
            param="min_tokens",
            code="invalid_value",
        )
    try:
        params.check()
    except OnegpuError as exc:
        raise APIError(400, exc.message, code="invalid_value") from None
    return params


def _biases(req, vocab: Optional[int]) -> tuple:
    biases = req.biases()
    outside = [t for t, _ in biases if vocab is not None and t >= vocab]
    if outside:
        raise APIError(
            400,
            f"logit_bias names token {outside[0]}, which is not in the vocabulary (ids 0-"
            f"{vocab - 1}).",
            param=f"logit_bias.{outside[0]}",
            code="invalid_value",
        )
    return biases


def check_features(params: SamplingParams, features: EngineFeatures, req) -> None:
    """A 400 naming the field when the request asks for what this engine does not apply."""
    wanted = [
        ("presence_penalty", params.presence_penalty != 0, features.penalties),
        ("frequency_penalty", params.frequency_penalty != 0, features.penalties),
        ("logprobs", params.logprobs is not None, features.logprobs),
        (constraint_field(req), params.constraint is not None, features.constraints),
        ("logit_bias", bool(params.logit_bias), features.bias),
        ("min_tokens", params.min_tokens > 0, features.bias),
    ]
    for name, asked, offered in wanted:
        if asked and not offered:
            raise APIError(
                400,
                f"'{name}' is not applied by this server's decode engine yet; leave it out "
                "(see the README's table of supported fields).",
                param=name,
                code="unsupported_parameter",
            )


def constraint_field(req) -> str:
    names = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    for name in (*names, "structured_outputs"):
        if getattr(req, name) is not None:
            return name
    return "tool_choice"


# ---------------------------------------------------------------------------- prompts
def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    from onegpu.infer.generation import prompt_ids

    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # token ids
        top = max(max(ids) for ids in prompt)
        if top >= len(tokenizer):
            raise APIError(
                400,
                f"token id {top} is not in the vocabulary (size {len(tokenizer)}).",
                param="prompt",
                code="invalid_value",
            )
        return [list(ids) for ids in prompt]
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    return [list(ids) for ids in prompt_ids(tokenizer, texts, chat=False)]  # as `generate` does


def chat_prompt(tokenizer, req: ChatRequest, tools_on: bool) -> list[int]:
    messages = [m.for_template() for m in req.messages]
    tools = [t.for_template() for t in req.tools] if tools_on else None
    ids = render_chat(tokenizer, messages, tools, add_generation_prompt=True, tokenize=True)
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
