"""From a checked request body to what the engine runs: the prompts' token ids (chat template with
the tools, or the completion prompts), each choice's SamplingParams, the grammar that constrains
the answer, and the reader of tool calls. Runs on the server's tokenizer thread, never on the
event loop: a long template or prompt must not hold up the other requests' streams."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Optional

from onegpu.errors import OnegpuError
from onegpu.infer.requests import Constraint, EngineFeatures, SamplingParams
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

    def sequences(self, n: int) -> list:
        """Each prompt n times; choice j samples with seed + j, so n sampled choices differ while
        a seeded request repeats exactly."""
        out = []
        for ids in self.prompts:
            for j in range(n):
                out.append((ids, replace(self.params, seed=(self.params.seed + j) % 2**63)))
        return out


def completion_plan(tokenizer, req: CompletionRequest, max_len: int) -> Plan:
    prompts = completion_prompts(tokenizer, req.prompt)
    limit = req.max_tokens or DEFAULT_COMPLETION_TOKENS
    check_context(prompts, limit, max_len, "prompt")
    echo = (
        [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts] if req.echo else None
    )
    params = sampling(req, limit, request_constraint(req))
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens come with theirs
        params = replace(params, prompt_logprobs=req.logprobs)
    return Plan(TEXT, prompts, params, echo=echo)


def chat_plan(tokenizer, req: ChatRequest, max_len: int, tool_format: Optional[str]) -> Plan:
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise APIError(
            400,
            "tool_choice asks for a tool call, but the request gives no 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )
    tools_on = bool(req.tools) and req.tool_choice != "none"
    if tools_on and tool_format is None:
        raise APIError(
            400,
            "this model's chat template shows no tool-call format, so 'tools' cannot be used "
            "(start the server with --tool_parser hermes or llama3 if the model writes one).",
            param="tools",
            code="tools_unsupported",
        )
    ids = chat_prompt(tokenizer, req, tools_on)
    limit = req.limit() or max(1, max_len - len(ids))  # OpenAI: up to the context
    check_context([ids], limit, max_len, "messages")
    constraint = request_constraint(req)
    if tools_on and req.tool_choice not in (None, "auto"):
        constraint = _forced(req, tool_format, constraint)
    return Plan(
        CHAT, [ids], sampling(req, limit, constraint), tool_format=tool_format if tools_on else None
    )


def _forced(req: ChatRequest, fmt: str, other: Optional[Constraint]) -> Constraint:
    name = None if req.tool_choice == "required" else req.tool_choice.function.name
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
    return forced_call(fmt, req.tools, name)


def request_constraint(req) -> Optional[Constraint]:
    """The grammar that response_format or vLLM's guided_* fields ask for (at most one)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_schema", "")))
    if rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ or {}
        found.append(("response_format", Constraint("json_schema", json.dumps(schema))))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        found.append(("guided_json", Constraint("json_schema", text)))
    if req.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", Constraint("choice", json.dumps(req.guided_choice))))
    if len(found) > 1:
        raise APIError(
            400,
            f"{' and '.join(n for n, _ in found)} each constrain the answer; give one.",
            param=found[1][0],
            code="invalid_value",
        )
    return found[0][1] if found else None


def sampling(req, limit: int, constraint: Optional[Constraint]) -> SamplingParams:
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
    )
    try:
        params.check()
    except OnegpuError as exc:
        raise APIError(400, exc.message, code="invalid_value") from None
    return params


def check_features(params: SamplingParams, features: EngineFeatures, req) -> None:
    """A 400 naming the field when the request asks for what this engine does not apply."""
    wanted = [
        ("presence_penalty", params.presence_penalty != 0, features.penalties),
        ("frequency_penalty", params.frequency_penalty != 0, features.penalties),
        ("logprobs", params.logprobs is not None, features.logprobs),
        (constraint_field(req), params.constraint is not None, features.constraints),
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
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice"):
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
    from jinja2 import TemplateError

    if not tokenizer.chat_template:
        raise APIError(
            400,
            "this model's tokenizer has no chat template, so chat messages cannot be encoded.",
            param="messages",
            code="no_chat_template",
        )
    messages = [m.for_template() for m in req.messages]
    tools = [t.for_template() for t in req.tools] if tools_on else None
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        # the template refused these messages (roles out of order, a field it needs missing...)
        raise APIError(
            400,
            f"the model's chat template refused these messages: {type(exc).__name__}: {exc}",
            param="messages",
            code="chat_template_error",
        ) from None
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
