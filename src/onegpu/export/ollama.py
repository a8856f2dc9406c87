"""`--format ollama`: a folder with the GGUF and a Modelfile (`ollama create NAME -f Modelfile`):
FROM the GGUF, a TEMPLATE (Go text/template, Ollama's) that renders the model's chat template,
PARAMETER stop for each end-of-turn token and the sampling defaults from generation_config.json.

The TEMPLATE is built from the chat template itself: each role's text before and after a message's
content, and the generation prompt, read off renderings with stand-in contents. It is written only
when those pieces rebuild the chat template's rendering of a whole conversation exactly (and
go_template.py renders it to the same text); otherwise the Modelfile leaves TEMPLATE out, so
Ollama takes the template from the GGUF, and says why."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from onegpu.export.modelfile import validate_modelfile

ROLES = ("system", "user", "assistant")
STAND_IN = "\u2063{}\u2063"
# generation_config.json's names -> Ollama's PARAMETER names
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repeat_penalty",
}
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


def role_pieces(tokenizer) -> Optional[dict[str, tuple[str, str]]]:
    """{role: (text before the content, text after)}, or None where a role is refused."""
    pieces = {}
    for role in ROLES:
        mark = STAND_IN.format(role)
        try:
            text = tokenizer.apply_chat_template([{"role": role, "content": mark}], tokenize=False)
        except Exception:  # noqa: BLE001 - a template may refuse a lone system or assistant turn
            return None
        if text.count(mark) != 1:
            return None
        before, after = text.split(mark)
        pieces[role] = (before, after)
    return pieces


def go_template(tokenizer) -> tuple[Optional[str], str]:
    """(Ollama TEMPLATE, why) or (None, why not)."""
    from onegpu.export.go_template import render

    if not getattr(tokenizer, "chat_template", None):
        return None, "the tokenizer has no chat template"
    pieces = role_pieces(tokenizer)
    if pieces is None:
        return None, "the chat template does not render single turns of each role"
    plain = tokenizer.apply_chat_template(PROBE[:2], tokenize=False)
    gen = tokenizer.apply_chat_template(PROBE[:2], tokenize=False, add_generation_prompt=True)
    if not gen.startswith(plain):
        return None, "its generation prompt is not text added at the end"
    branches = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
        f"{_literal(before)}{{{{ .Content }}}}{_literal(after)}"
        for i, (role, (before, after)) in enumerate(pieces.items())
    )
    generation = _literal(gen[len(plain) :])
    template = f"{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{generation}"
    want = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    if render(template, PROBE) != want:
        return None, "the chat template is not one fixed text per message (e.g. it numbers turns)"
    return template, "rebuilt from the chat template; renders a 4-turn conversation identically"


def write_ollama(folder: Path, gguf: Path, tokenizer, merged_dir: Path, facts) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / gguf.name
    if gguf.parent != folder:
        try:  # the same bytes twice cost nothing on one file system
            os.link(gguf, target)
        except OSError:
            shutil.copy2(gguf, target)
    template, why = go_template(tokenizer)
    lines = ["# ollama create NAME -f Modelfile", f"FROM ./{target.name}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    else:
        lines.append(f"# no TEMPLATE: {why}; Ollama reads the GGUF's tokenizer.chat_template")
    for tok_id in facts.end_of_turn:
        lines.append(f"PARAMETER stop {json.dumps(tokenizer.convert_ids_to_tokens(tok_id))}")
    lines += [f"PARAMETER {name} {value}" for name, value in sampling(merged_dir)]
    text = "\n".join(lines) + "\n"
    validate_modelfile(text)
    (folder / "Modelfile").write_text(text, encoding="utf-8")
    return folder


def sampling(merged_dir: Path) -> list[tuple[str, object]]:
    path = merged_dir / "generation_config.json"
    if not path.is_file():
        return []
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("do_sample") is False:  # greedy: Ollama's way of saying so
        return [("temperature", 0)]
    return [(SAMPLING[k], cfg[k]) for k in SAMPLING if cfg.get(k) is not None]


def _literal(text: str) -> str:
    """Text as Go template literal text: '{{' cannot appear raw, and '\"\"\"' would end the
    Modelfile's TEMPLATE."""
    text = text.replace("{{", '{{ "{{" }}')
    if '"""' in text:
        raise ValueError('the chat template holds """, which a Modelfile TEMPLATE cannot')
    return text
