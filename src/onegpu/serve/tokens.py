"""vLLM's /tokenize and /detokenize: a prompt (text, or chat messages through the model's chat
template) to the server's token ids, and token ids back to text, with the same tokenizer the
completions use, on the server's tokenizer thread; and vLLM's /tokenizer_info, the tokenizer's
settings and special tokens (lm-evaluation-harness probes it to tokenize through the server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Optional

from fastapi import FastAPI, Request
from pydantic import Field, model_validator

from onegpu.serve.chat_template import need_template, render_chat
from onegpu.serve.messages import Lenient, Message, Tool
from onegpu.serve.schemas import APIError, WholeInt, parse_body


class TokenizeRequest(Lenient):
    """vLLM's two forms: ``prompt`` (a text), or ``messages`` rendered by the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = Field(None, min_length=1)
    tools: Optional[list[Tool]] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    add_special_tokens: Optional[bool] = None  # vLLM's default: True for a prompt, not for chat
    return_token_strs: Optional[bool] = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give 'prompt' (a text) or 'messages' (a chat), one of them")
        return self


class DetokenizeRequest(Lenient):
    model: Optional[str] = None
    tokens: list[WholeInt]


def tokenize(tokenizer, req: TokenizeRequest, max_len: int) -> dict:
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer(req.prompt, add_special_tokens=special)["input_ids"]
    else:
        ids = _chat_ids(tokenizer, req)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_len, "tokens": list(ids), "token_strs": strs}


def _chat_ids(tokenizer, req: TokenizeRequest) -> list[int]:
    need_template(tokenizer, " Send 'prompt'.")
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(
            400,
            "add_generation_prompt and continue_final_message cannot both be true.",
            param="continue_final_message",
            code="invalid_value",
        )
    text = render_chat(
        tokenizer,
        [m.for_template() for m in req.messages],
        [t.for_template() for t in req.tools] if req.tools else None,
        add_generation_prompt=bool(req.add_generation_prompt),
        continue_final_message=bool(req.continue_final_message),
        tokenize=False,
    )
    # the template writes the special tokens itself: none added unless asked (vLLM's default)
    return tokenizer(text, add_special_tokens=bool(req.add_special_tokens))["input_ids"]


def detokenize(tokenizer, req: DetokenizeRequest) -> dict:
    bad = [t for t in req.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is not in the vocabulary (ids 0-{len(tokenizer) - 1}).",
            param="tokens",
            code="invalid_value",
        )
    return {"prompt": tokenizer.decode(req.tokens)}


# init_kwargs fields that name files on the server's disk: vLLM drops the first two; the others say
# only where this server keeps its files, nothing a client can use
_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_info(tokenizer) -> dict:
    """vLLM's shape: the tokenizer's ``init_kwargs`` as JSON, its class name and its chat template.
    The special tokens are read from the tokenizer as it is now, not as it was built (a pad token
    set after loading is only there); lm-eval's remote tokenizer needs ``eos_token`` and reads
    ``bos_token`` for a context that is empty."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = {k: _plain(v) for k, v in kwargs.items() if k not in _PATHS}
    info.update({name: _plain(getattr(tokenizer, name, None)) for name in SPECIAL})
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = getattr(tokenizer, "chat_template", None)  # the one chat requests use
    return info


def _plain(value):
    """JSON of a tokenizer setting: an AddedToken is its text, containers recurse, and anything
    else that is not a JSON value is its str()."""
    if hasattr(value, "content"):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def token_routes(app: FastAPI, s, authorize: Callable) -> None:
    """``s``: the app's Service (its tokenizer, tokenizer thread, context and API key)."""

    async def on_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(s.prep, fn, *args)

    @app.post("/tokenize", openapi_extra={"x-onegpu": "tokenize"})
    async def tokenize_route(request: Request):
        authorize(request, s.api_key)
        req = parse_body(await request.body(), TokenizeRequest)
        s.models.adapter_for(req.model)  # an unknown model is a 404, as on the other routes
        return await on_thread(tokenize, s.tokenizer, req, s.max_len)

    @app.get("/tokenizer_info", openapi_extra={"x-onegpu": "tokenizer_info"})
    async def tokenizer_info_route(request: Request):
        authorize(request, s.api_key)
        return await on_thread(tokenizer_info, s.tokenizer)

    @app.post("/detokenize", openapi_extra={"x-onegpu": "detokenize"})
    async def detokenize_route(request: Request):
        authorize(request, s.api_key)
        req = parse_body(await request.body(), DetokenizeRequest)
        s.models.adapter_for(req.model)
        return await on_thread(detokenize, s.tokenizer, req)
