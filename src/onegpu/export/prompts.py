"""The check's prompts: given with --prompts, else a few records of the run's validation split
rendered as training rendered them (the chat template up to the last assistant turn, a record's
prompt, a text's opening tokens), else the built-in ones. Where they came from goes in the report
and the summary line."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# Used when neither --prompts nor a run's validation data is there: code and prose, as onegpu
# trains on both
BUILTIN_PROMPTS = (
    "def fibonacci(n):",
    "The capital of France is",
    "import os\nimport sys\n\n",
    "Once upon a time, in a small village,",
    "class Stack:\n    def push(self, item):",
)
RECORDS = 4  # validation records the check takes
TEXT_TOKENS = 32  # a text record's opening tokens (training packs text: any cut is a prompt)
MAX_PROMPT_TOKENS = 256  # longer rendered prompts are passed over (the check decodes 64 more)


@dataclass
class CheckPrompts:
    texts: list[str]  # shown in the report; llama.cpp's tokenizer is compared on them too
    ids: Optional[list[list[int]]]  # rendered as training did; None: the engine renders texts
    source: str  # "built-in", "--prompts" or "validation data (...)"


def check_prompts(given: list[str], run_config: Optional[Path], tokenizer) -> CheckPrompts:
    if given:
        return CheckPrompts(list(given), None, "--prompts")
    if run_config is not None:
        found = validation_prompts(run_config, tokenizer)
        if found is not None:
            return found
    return CheckPrompts(list(BUILTIN_PROMPTS), None, "built-in")


def run_config_of(model_dir: str, adapter: Optional[str]) -> Optional[Path]:
    """The config.yaml of the onegpu run the model (or adapter) is the final/ folder of."""
    for folder in (adapter, model_dir):
        if folder and Path(folder).is_dir():
            path = Path(folder).resolve()
            for candidate in (path / "config.yaml", path.parent / "config.yaml"):
                if candidate.is_file():
                    return candidate
    return None


def validation_prompts(run_config: Path, tokenizer) -> Optional[CheckPrompts]:
    """Up to RECORDS prompts from the run's validation split, read with the run's own data settings
    and seed as training read them; None (with the reason logged) when the run had none or its
    data is gone."""
    from onegpu.config import from_dict, load_yaml
    from onegpu.errors import OnegpuError
    from onegpu.training.data import read_records

    try:
        cfg = from_dict(load_yaml(run_config))
        records = read_records(cfg)
    except (OnegpuError, OSError, ValueError) as exc:
        log.warning("the check uses the built-in prompts: the run's data cannot be read (%s)", exc)
        return None
    if records.val is None or len(records.val) == 0:
        return None
    texts, ids = [], []
    for rec in records.val:
        rendered = render(rec, records.format, cfg.data, tokenizer)
        if rendered is not None and 0 < len(rendered[1]) <= MAX_PROMPT_TOKENS:
            texts.append(rendered[0])
            ids.append(rendered[1])
        if len(ids) == RECORDS:
            break
    if not ids:
        return None
    where = cfg.data.path or "the standard library corpus"
    return CheckPrompts(
        texts, ids, f"validation data ({len(ids)} records of {where}, {records.format})"
    )


def render(rec: dict, fmt: str, data, tok) -> Optional[tuple[str, list[int]]]:
    """(what the prompt says, its token ids as training tokenized them), or None for a record
    with no prompt in it."""
    if fmt == "messages":
        return _chat_prompt(rec.get(data.messages_field) or [], tok)
    if fmt == "text":
        ids = tok(rec.get(data.text_field) or "", add_special_tokens=False)["input_ids"]
        ids = ids[:TEXT_TOKENS]
        return tok.decode(ids), ids
    prompt = rec.get(data.prompt_field)  # prompt_completion, preference, unpaired, grpo's prompt
    if isinstance(prompt, list):
        return _chat_prompt(prompt + [{"role": "assistant", "content": ""}], tok)
    if not isinstance(prompt, str) or not prompt:
        messages = rec.get(data.messages_field)  # an unpaired record may hold a conversation
        return _chat_prompt(messages, tok) if isinstance(messages, list) else None
    return prompt, tok(prompt, add_special_tokens=True)["input_ids"]


def _chat_prompt(conv: list, tok) -> Optional[tuple[str, list[int]]]:
    """The conversation before its last assistant turn, with the template's generation prompt
    (what the model answers from), tokenized as training tokenizes a rendered chat."""
    turns = [m for m in conv if isinstance(m, dict)]
    last = max((i for i, m in enumerate(turns) if m.get("role") == "assistant"), default=None)
    before = turns[:last] if last is not None else turns
    if not before or not getattr(tok, "chat_template", None):
        return None
    text = tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    said = next(
        (str(m.get("content", "")) for m in reversed(before) if m.get("role") == "user"), ""
    )
    return said, tok(text, add_special_tokens=False)["input_ids"]
