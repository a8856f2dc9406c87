"""The model's chat template over a request's messages, for a tokenizer or a vision-language
model's processor: no template, or a template that refuses the messages, is a 400 naming
``messages``."""

from __future__ import annotations

from typing import Optional

from onegpu.serve.schemas import APIError


def need_template(tokenizer, fix: str = "") -> None:
    """A 400 naming ``messages`` when the model has no chat template (``fix`` follows)."""
    if not tokenizer.chat_template:
        raise APIError(
            400,
            "this model's tokenizer has no chat template, so chat messages cannot be encoded."
            + fix,
            param="messages",
            code="no_chat_template",
        )


def render_chat(tokenizer, messages: list[dict], tools: Optional[list], **kwargs):
    """The model's chat template over ``messages`` (``kwargs`` go to ``apply_chat_template``); no
    template, or a template that refuses them (roles out of order, a field it needs missing...),
    is a 400 naming ``messages``."""
    from jinja2 import TemplateError

    need_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise APIError(
            400,
            f"the model's chat template refused these messages: {type(exc).__name__}: {exc}",
            param="messages",
            code="chat_template_error",
        ) from None
