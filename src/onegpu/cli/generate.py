"""`onegpu generate`: sample from a run's model or any causal LM; flags come from InferConfig and
SamplingConfig (onegpu.infer), plus where the prompts come from and where completions go.

Flags are spelled as everywhere in onegpu (underscores). generate's settings are one flat set,
`--max_new_tokens`, `--dtype`, ... (no name is in two sections, so none needs a prefix); the
settings it shares with `onegpu train` also take train's names (`--model.name`, `--model.tokenizer`,
`--model.trust_remote_code`, `--techniques.attention`), so flags copied from a train command work.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from onegpu.cli.args import add_options, make_parser, parse
from onegpu.errors import ConfigError, DataError

DESCRIPTION = (
    'Generate text from a onegpu run (onegpu generate --model runs/<name> "def fib("), a '
    "save_pretrained folder or a Hub model. Prompts: arguments, --prompts_file (one per line, "
    "or .jsonl with a \"prompt\" field), or '-' for stdin. --chat true feeds them as chat turns "
    "(on by itself for a model onegpu trained on chat data)."
)
# train's name for a setting generate shares with it -> generate's flag
TRAIN_NAMES = {
    "--model.name": "--model",
    "--model.tokenizer": "--tokenizer",
    "--model.trust_remote_code": "--trust_remote_code",
    "--techniques.attention": "--attention",
}


def build_parser():
    from jsonargparse import ActionConfigFile

    from onegpu.infer import InferConfig, SamplingConfig

    parser = make_parser(
        "onegpu generate", DESCRIPTION, usage="onegpu generate --model MODEL [options] [PROMPT ...]"
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        metavar="FILE",
        help="YAML file with any of the options below",
    )
    parser.add_argument(
        "prompts", nargs="*", help="prompts ('-' reads them from stdin, one per line)"
    )
    add_options(
        parser,
        InferConfig,
        "model",
        "Which model to load, and how (dtype, attention, quantization, placement, adapter).",
    )
    add_options(parser, SamplingConfig, "generation", SamplingConfig.__doc__)
    parser.add_argument(
        "--prompts_file",
        type=Optional[str],
        default=None,
        help="file with one prompt per line, or .jsonl records with a 'prompt' field",
    )
    parser.add_argument(
        "--image",
        type=list[str],
        default=[],
        help="an image file for a vision-language model, given with each prompt (repeat it "
        "for several images, in order); a .jsonl prompts file can name its own per record",
    )
    for action in parser._actions:
        if action.option_strings == ["--chat"]:
            action.metavar = "{auto,true,false}"
    parser.add_argument(
        "--output",
        type=Optional[str],
        default=None,
        help="write one JSON record per completion to this .jsonl file",
    )
    parser.add_argument(
        "--stream",
        type=Optional[bool],
        default=None,
        help="print tokens as they come (default: on for a single prompt on a terminal)",
    )
    return parser


def cli(argv: Sequence[str]) -> int:
    from onegpu.config import from_dict
    from onegpu.infer import InferConfig, SamplingConfig

    _, ns = parse(build_parser(), _repeatable(_repeatable(train_names(argv), "--stop"), "--image"))
    raw = ns.as_dict()
    raw["stop"] = [_unescape(s) for s in raw.get("stop") or []]
    icfg = from_dict(_fields(raw, InferConfig), InferConfig)
    scfg = from_dict(_fields(raw, SamplingConfig), SamplingConfig)
    prompts = collect_prompts(raw.get("prompts") or [], raw.get("prompts_file"))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return run(icfg, scfg, prompts, raw.get("output"), raw.get("stream"), raw.get("image") or [])


def train_names(argv: Sequence[str]) -> list[str]:
    """train's spelling of a shared setting, as generate's own flag."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        out.append(TRAIN_NAMES[flag] + eq + value if flag in TRAIN_NAMES else arg)
    return out


def _repeatable(argv: Sequence[str], flag: str) -> list[str]:
    """Let `--stop X` (``flag``) be given once per value (jsonargparse alone wants a JSON list or
    --stop+)."""
    out: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        value = (
            arg.split("=", 1)[1]
            if arg.startswith(flag + "=")
            else args.pop(0)
            if arg == flag and args
            else None
        )
        if value is None:
            out.append(arg)
        else:
            out += [flag, value] if value.lstrip().startswith("[") else [flag + "+", value]
    return out


def _unescape(text: str) -> str:
    """Typed on a shell, a newline stop string arrives as backslash-n."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def _fields(raw: dict, cls: type) -> dict:
    return {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}


def collect_prompts(args: list[str], prompts_file: Optional[str]) -> list[str]:
    prompts: list[str] = []
    for arg in args:
        prompts += _lines(sys.stdin.read()) if arg == "-" else [arg]
    if prompts_file:
        prompts += read_prompts_file(prompts_file)
    if not prompts:
        raise ConfigError(
            "no prompts given.",
            hint='pass them as arguments ("def fib("), with --prompts_file, or "-" for stdin',
        )
    return prompts


def read_prompts_file(path: str) -> list:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(
            f"prompts file not found: {path}", hint="check the path given to --prompts_file"
        )
    text = p.read_text(encoding="utf-8")
    prompts = _jsonl(text, path, p.parent) if p.suffix == ".jsonl" else _lines(text)
    if not prompts:
        raise DataError(
            f"prompts file {path} contains no prompts.", hint="write one prompt per line"
        )
    return prompts


def _lines(text: str) -> list[str]:
    """One prompt per line; a literal \\n inside a line stands for a newline (multi-line
    prompts)."""
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def _jsonl(text: str, path: str, folder: Path) -> list:
    """Prompts, or chats (a list of messages) where a record has images: a "messages" list whose
    parts may be images, or "images" beside its "prompt"; image paths relative to the file."""
    prompts: list = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path} line {n}: not valid JSON ({json_problem(exc)}).",
                hint='one JSON object per line, e.g. {"prompt": "def fib("}',
            ) from None
        chat = _chat_record(record, folder) if isinstance(record, dict) else None
        prompt = record if isinstance(record, str) else (record or {}).get("prompt")
        if chat is None and not isinstance(prompt, str):
            raise DataError(
                f"{path} line {n}: no 'prompt' string field.",
                hint='write {"prompt": "..."} per line (or "messages", with image parts)',
            )
        prompts.append(chat if chat is not None else prompt)
    return prompts


def _chat_record(record: dict, folder: Path) -> Optional[list]:
    """A record's chat with its image paths made absolute, or None for a plain prompt."""
    if isinstance(record.get("messages"), list):
        return [_absolute(m, folder) for m in record["messages"]]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("images"), list):
        return image_chat(record["prompt"], record["images"], folder)
    return None


def image_chat(prompt: str, images: list, folder: Path) -> list:
    """One user turn: the images (paths read relative to ``folder``), then the prompt's text."""
    from onegpu.data.images import resolve

    parts = [{"type": "image", "image": resolve(str(i), folder)} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


def _absolute(message, folder: Path):
    from onegpu.data.images import resolve

    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for part in message["content"]:
        if isinstance(part, dict) and part.get("type") == "image" and part.get("image"):
            part = {**part, "image": resolve(str(part["image"]), folder)}
        parts.append(part)
    return {**message, "content": parts}


def json_problem(exc: json.JSONDecodeError) -> str:
    """json's message with the column it happened at. Its messages may end in "at" ("Unterminated
    string starting at"), the position following only in str(exc): one "at", and a column."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}" if exc.colno else msg


def _print_now(text: str) -> None:
    print(text, end="", flush=True)


def run(icfg, scfg, prompts: list, output: Optional[str], stream: Optional[bool], images=()) -> int:
    from onegpu.infer import generate, load
    from onegpu.infer.policy import parse_off

    parse_off(scfg.policy_off)  # before the model loads: a typo is named now
    loaded = load(icfg)
    chats = [p for p in prompts if not isinstance(p, str)]
    if (images or chats) and loaded.processor is None:
        raise ConfigError(
            f"{'--image' if images else 'a prompts file record with images'} needs a "
            f"vision-language model; {loaded.source} is a text model.",
            hint="drop the images, or pass --model a vision-language model folder",
        )
    if stream is None:
        stream = len(prompts) == 1 and sys.stdout.isatty()
    if stream and len(prompts) > 1:
        raise ConfigError(
            "--stream works with a single prompt.", hint="drop --stream, or give one prompt"
        )
    on_text = None
    if stream:
        print(prompts[0] if isinstance(prompts[0], str) else "", end="", flush=True)
        on_text = _print_now
    if loaded.processor is not None:  # every prompt a chat turn, its images with it
        from onegpu.infer import generate_chats

        chats = [image_chat(p, images, Path.cwd()) if isinstance(p, str) else p for p in prompts]
        completions = generate_chats(loaded.model, loaded.processor, chats, scfg, on_text)
    else:
        completions = generate(
            loaded.model,
            loaded.tokenizer,
            prompts,
            scfg,
            on_text=on_text,
            data_format=loaded.data_format,
        )
    if stream:
        print()
    else:
        for c in completions:
            print(c.prompt + c.text + ("\n" + "-" * 40 if len(completions) > 1 else ""))
    if output:
        Path(output).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(output).expanduser().write_text(
            "".join(c.to_json() + "\n" for c in completions), encoding="utf-8"
        )
    return 0
