"""`--format gguf`: llama.cpp's own converter writes an unquantized GGUF from the merged folder and
its own quantizer (llama_model_quantize) makes the quantized type, each in a child process
(convert_driver.py, llama_child.py). What the converter cannot learn from the folder is decided
here from the tokenizer: the pre-tokenizer's name (pretokenizer.py), the BOS rule and the
end-of-turn id; the chat template and EOS travel with the tokenizer files."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from onegpu.errors import ConfigError, OnegpuError
from onegpu.export.config import UNQUANTIZED
from onegpu.models import save_tokenizer

HERE = Path(__file__).parent
SENTINEL = "\u2063ANSWER\u2063"  # an answer's stand-in, to find what the template puts after it


class ConversionError(OnegpuError):
    """llama.cpp's converter or quantizer failed."""


@dataclass
class TokenizerFacts:
    pre: Optional[str]
    pre_reason: str
    add_bos: bool
    end_of_turn: list[int]  # ids that end an assistant turn (EOS first)

    def spec(self) -> dict:
        """What convert_driver.py is told (the end-of-turn id other than EOS, if any)."""
        eot = next((t for t in self.end_of_turn[1:]), None)
        return {"pre": self.pre, "add_bos": self.add_bos, "eot": eot}


# Settings of a family that llama.cpp's converter does not carry, because its runtime computes one
# value only: (config key, the value llama.cpp computes, what it does). Found by the export's check
# (greedy tokens diverged in f32 as in f16 until the setting matched).
FIXED_SETTINGS = {
    "qwen3_moe": ("norm_topk_prob", True, "it always renormalizes the chosen experts' weights"),
}


# Families whose llama.cpp architecture has as many K/V heads as heads: the converter writes no
# K/V head count for them, and llama.cpp refuses the K/V weights of a grouped-query model at load
# ("tensor 'blk.0.attn_k.weight' has wrong shape", found by exporting the test zoo's phi).
NO_GROUPED_KV = {"phi": "phi2"}


def refuse_unsupported(model_dir: Path, family: str, llama_dir: Path) -> None:
    """One error before anything is written when the converter has no class for the model, or
    the model sets what llama.cpp computes one way only."""
    from onegpu.export.llama_setup import supported_architectures

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    archs = config.get("architectures") or ["?"]
    if family in FIXED_SETTINGS:
        key, value, why = FIXED_SETTINGS[family]
        if config.get(key) != value:
            raise ConfigError(
                f"family {family} with {key}={json.dumps(config.get(key))} cannot be exported to "
                f"GGUF: llama.cpp computes {key}={json.dumps(value)} only ({why}).",
                hint="export --format safetensors (transformers, vLLM) instead",
            )
    kv, heads = config.get("num_key_value_heads"), config.get("num_attention_heads")
    if family in NO_GROUPED_KV and kv not in (None, heads):
        raise ConfigError(
            f"family {family} with num_key_value_heads={kv} (grouped K/V heads, {heads} heads) "
            f"cannot be exported to GGUF: llama.cpp's {NO_GROUPED_KV[family]} architecture has "
            "as many K/V heads as heads.",
            hint="export --format safetensors (transformers, vLLM) instead",
        )
    supported = supported_architectures(llama_dir)
    if not any(a in supported for a in archs):
        raise ConfigError(
            f"family {family} ({', '.join(archs)}) cannot be exported to GGUF: llama.cpp's "
            "converter (llama-cpp-python's) has no model class for it.",
            hint="export --format safetensors (transformers, vLLM) instead",
        )


class Converter:
    """llama.cpp's converter in one child process for the whole export (convert_driver.py):
    started before the merge so that its imports overlap onegpu's own work, asked for the
    vocabulary before anything is written, then for the conversion. Its output goes to a file,
    not a pipe, so that a long conversion log never blocks it."""

    def __init__(self, llama_dir: Path):
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        self._proc = subprocess.Popen(
            [sys.executable, str(HERE / "convert_driver.py"), str(llama_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.pid = self._proc.pid

    def request(self, model_dir: Path, out: Path, outtype: str, facts: TokenizerFacts) -> dict:
        """The driver's answer; {"rc": the exit status} if it died (negative: a signal)."""
        ask = {"model_dir": str(model_dir), "outfile": str(out), "outtype": outtype}
        try:
            self._proc.stdin.write(json.dumps({**ask, **facts.spec()}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        return json.loads(line) if line else {"rc": self._proc.wait() or 1}

    def log_tail(self) -> str:
        self._log.seek(0)
        return _tail(self._log.read())

    def close(self, failed: bool = False) -> None:
        """Ends the driver (at once when the export failed: it may be mid-conversion)."""
        if self._proc.poll() is None:
            if not failed:
                self._proc.stdin.close()  # the driver's loop ends at end of input
            try:
                self._proc.wait(timeout=None if not failed else 0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout, self._log):
            stream.close()

    def __enter__(self) -> Converter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(failed=exc_type is not None)


def check_vocab(converter: Converter, model_dir: Path, family: str, tokenizer) -> TokenizerFacts:
    """Before anything is written: the tokenizer as the export will save it, beside the model's
    config.json, through the converter's vocabulary step alone. A vocabulary the converter cannot
    read for this family is one error naming the family and the reason."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp)
        shutil.copy2(model_dir / "config.json", probe / "config.json")
        save_tokenizer(tokenizer, probe)
        facts = tokenizer_facts(probe, tokenizer)
        done = converter.request(probe, probe / "vocab.gguf", "vocab", facts)
    if done["rc"] == 3:
        raise ConfigError(
            f"family {family} cannot be exported to GGUF: {done['reason']}.",
            hint="export --format safetensors (transformers, vLLM) instead",
        )
    if done["rc"]:
        raise ConversionError(
            f"llama.cpp's converter cannot read the tokenizer: {converter.log_tail()}",
            hint="rerun with --debug; the converter's own message is above",
        )
    return facts


def tokenizer_facts(model_dir: Path, tokenizer) -> TokenizerFacts:
    from onegpu.export.pretokenizer import decide

    pre, reason = decide(model_dir)
    ids = tokenizer("a")["input_ids"]
    add_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    return TokenizerFacts(pre, reason, add_bos, end_of_turn_ids(tokenizer))


def end_of_turn_ids(tokenizer) -> list[int]:
    """EOS, then the special tokens the chat template writes right after an assistant's answer."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not getattr(tokenizer, "chat_template", None):
        return eos
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}],
        tokenize=False,
    )
    after = text.split(SENTINEL, 1)[1] if SENTINEL in text else ""
    special = set(tokenizer.all_special_tokens)
    ids = []
    for tok in sorted(special, key=len, reverse=True):
        if after.lstrip().startswith(tok):
            ids = [tokenizer.convert_tokens_to_ids(tok)]
            break
    return list(dict.fromkeys(eos + ids))


def convert(
    merged_dir: Path,
    out_dir: Path,
    quant: str,
    facts: TokenizerFacts,
    converter: Converter,
    say: Callable[[str], None] = print,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    outtype = quant if quant in UNQUANTIZED else "f16"
    plain = out_dir / f"model-{outtype}.gguf"
    say(f"converting to GGUF ({outtype}) with llama.cpp's converter")
    done = converter.request(merged_dir, plain, outtype, facts)
    if done.get("errno") == errno.ENOSPC:  # the export's folder turns it into its disk-full error
        raise OSError(errno.ENOSPC, f"llama.cpp's converter writing {plain.name}: disk full")
    if done["rc"]:
        raise ConversionError(
            f"llama.cpp's converter failed ({_how(done['rc'])}): "
            f"{done.get('reason') or converter.log_tail()}",
            hint="rerun with --debug; the converter's own message is above",
        )
    if quant in UNQUANTIZED:
        return plain
    target = out_dir / f"model-{quant}.gguf"
    say(f"quantizing to {quant} with llama.cpp's quantizer")
    run_child({"op": "quantize", "src": str(plain), "dst": str(target), "quant": quant})
    plain.unlink()
    return target


def run_child(spec: dict) -> dict[str, np.ndarray]:
    """llama_child.py in its own process; a crash there is one error naming the signal."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.npz"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        done = subprocess.run(
            [sys.executable, str(HERE / "llama_child.py"), str(spec_path), str(out)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            crashed = done.returncode < 0
            raise ConversionError(
                f"llama.cpp ({spec['op']}) failed, {_how(done.returncode)}: {_tail(done.stderr)}",
                hint="a native llama.cpp crashes on quantized types on some AVX-512 CPUs: build "
                "llama-cpp-python with bash scripts/build_llama_cpp.sh (pinned flags)"
                if crashed
                else "rerun with --debug for the whole message",
            )
        with np.load(out) as data:
            return {k: data[k] for k in data.files}


def _how(rc: int) -> str:
    return f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"


def _tail(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:])[:600] or "(no output)"
