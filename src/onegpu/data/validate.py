"""Checks of raw records before datasets reads them: a data file's encoding, JSON lines and chat
messages, each problem reported with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

from onegpu.errors import DataError


def check_file(path: str, messages_field: str = "messages") -> None:
    """Catch the common breakages with file and line before datasets sees them."""
    raw = Path(path).read_bytes()
    if not raw.strip():
        raise DataError(f"{path}: file is empty.", hint="remove it or add records")
    suffix = Path(path).suffix
    if suffix == ".parquet":
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: not valid UTF-8 (byte {exc.start}).",
            hint="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    if suffix == ".jsonl" or (suffix == ".json" and not text.lstrip().startswith("[")):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                # json's messages may end in "at" ("Unterminated string starting at"): one "at" only
                msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
                raise DataError(
                    f"{path}:{n}: malformed JSON ({msg} at column {exc.colno}).",
                    hint="fix or remove that line; each line must be one JSON object",
                ) from None
            if not isinstance(rec, dict):
                raise DataError(
                    f"{path}:{n}: expected a JSON object, got {type(rec).__name__}.",
                    hint='make each line one object, e.g. {"text": "..."}',
                )
            problem = chat_problem(rec[messages_field]) if messages_field in rec else None
            if problem:
                raise DataError(f"{path}:{n}: {problem[0]}", hint=problem[1])
            for key in (
                PAIR_FIELDS if "chosen" in rec and "rejected" in rec else ()
            ):  # preference pairs
                value = rec.get(key)
                if value is not None and not isinstance(value, (str, list)):
                    raise DataError(
                        f"{path}:{n}: '{key}' must be text or a list of chat messages, got "
                        f"{type(value).__name__}.",
                        hint=f"check the '{key}' column",
                    )
                problem = chat_problem(value) if isinstance(value, list) else None
                if problem:
                    raise DataError(f"{path}:{n}, '{key}': {problem[0]}", hint=problem[1])


ROLES = ("system", "user", "assistant", "tool")
PAIR_FIELDS = ("prompt", "chosen", "rejected")


def chat_problem(conv) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) for a malformed chat record, or None. Checked when a .jsonl
    file is read (so the error names its line) and again when tokenizing other formats."""
    if not isinstance(conv, list) or not conv:
        return (
            "each 'messages' value must be a non-empty list of {role, content} objects.",
            'e.g. [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
        )
    for i, m in enumerate(conv, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return (
                f"malformed chat message {i} {_short(m)}: needs 'role' and 'content'.",
                'write each message as {"role": "user", "content": "..."}',
            )
        if m["role"] not in ROLES:
            return (
                f"chat message {i} has unknown role {m['role']!r}.",
                f"use one of {', '.join(ROLES)} (rename e.g. 'bot' or 'gpt' to 'assistant', "
                "'human' to 'user')",
            )
    return None


def image_problem(conv) -> tuple[str, str] | None:
    """An image part in a record for a text-only model: its chat template would render the part
    as text (or drop it), and the model would train on a picture it never sees."""
    for i, m in enumerate(conv, 1):
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in content
        ):
            return (
                f"chat message {i} has an image part, but the model is a text-only causal LM.",
                "train a vision-language model (LLaVA, Gemma 3, Idefics3, Qwen2-VL: docs/vlm.md), "
                "or remove the image parts",
            )
    return None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
