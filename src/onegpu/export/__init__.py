"""`onegpu export`: a trained model written for another runtime and checked there.

``export(cfg)`` resolves the source (source.py), says what it takes (plan.py), writes every format
into one temporary folder renamed when whole (folder.py): merged safetensors (merged.py), a GGUF
made by llama.cpp's converter and quantizer (gguf.py), an Ollama folder (ollama.py); then the check
(check.py, gguf_check.py) loads each export in its runtime and compares it with onegpu's engine."""

from __future__ import annotations

import logging
import resource
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from onegpu.export.config import ExportConfig

__all__ = ["ExportConfig", "ExportResult", "export", "default_output"]

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    folder: Path
    passed: bool  # every check passed (True too when the check is off)
    checked: bool
    summaries: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def default_output(model: str) -> Path:
    path = Path(model).expanduser()
    return path / "export" if (path / "final").is_dir() else path.with_name(path.name + "-export")


def export(cfg: ExportConfig, say: Callable[[str], None] = print) -> ExportResult:
    from onegpu.export.folder import atomic_folder, check_room, check_target, free_bytes
    from onegpu.export.plan import available_memory, check_memory, count_params, make_plan
    from onegpu.export.source import resolve

    start = time.perf_counter()
    cfg.validate()
    formats = cfg.formats()
    src = resolve(cfg.model, cfg.adapter, cfg.dtype)
    out = Path(cfg.output).expanduser() if cfg.output else default_output(cfg.model)
    check_target(out, cfg.force)
    plan = make_plan(count_params(src.model_dir), src.dtype, formats, cfg.quant)
    say(plan.message(available_memory(), free_bytes(out)))
    check_memory(plan, available_memory())
    check_room(out, plan.disk_bytes)
    with ExitStack() as stack:
        converter, facts = _llama_ready(src, formats, cfg.trust_remote_code, stack, say)
        for note in src.notes:
            say(f"note: {note}")
        tmp = stack.enter_context(atomic_folder(out, cfg.force))
        passed, summaries = _write_and_check(cfg, src, formats, tmp, converter, facts, say)
    result = ExportResult(
        out,
        passed,
        cfg.check == "on",
        summaries,
        src.notes,
        time.perf_counter() - start,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    peak = result.peak_rss_bytes / 2**20
    say(
        f"exported to {out} in {result.seconds:.1f}s (peak memory {peak:,.0f} MiB)"
        + ("" if result.passed else "; the CHECK FAILED: the export is unchecked")
    )
    return result


def _write_and_check(cfg, src, formats, tmp: Path, converter, facts, say) -> tuple[bool, list]:
    """Into the temporary folder: the merged model, the GGUF and Ollama folders, the checks.
    (every check passed, their summary lines)."""
    from onegpu.export.merged import write_safetensors
    from onegpu.export.source import load_merged

    say(
        f"merging {src.model_dir}"
        + (f" + {src.adapter}" if src.adapter else "")
        + f" ({src.dtype})"
    )
    model, tokenizer = load_merged(src, cfg.trust_remote_code)
    merged_dir = tmp / ("safetensors" if "safetensors" in formats else ".merged")
    write_safetensors(model, tokenizer, merged_dir)
    del model
    gguf_file = None
    if converter is not None:
        gguf_file = _write_gguf(cfg, merged_dir, tokenizer, tmp, formats, converter, facts, say)
        converter.close()  # its memory back before the check loads the models
    if merged_dir.name == ".merged":
        shutil.rmtree(merged_dir)
    passed, summaries = True, []
    if cfg.check == "on":
        reports = _check(cfg, src, merged_dir, formats, gguf_file, tokenizer)
        for report in {id(r): r for _, r in reports}.values():  # ollama's is gguf's
            report.summary += f" (prompts: {report.prompts})"
            summaries.append(report.summary)
            say(report.summary)
            passed &= report.passed
        for folder, report in reports:
            report.write(tmp / folder)
    return passed, summaries


def _llama_ready(src, formats: list[str], trust_remote_code: bool, stack: ExitStack, say):
    """Before anything is written: llama.cpp's binding is here, its converter unpacked, it has a
    model class for the family and reads its vocabulary (else one error naming the family).
    (the converter's process, kept on ``stack`` for the conversion, and the tokenizer facts), or
    (None, None) without a GGUF format."""
    if not {"gguf", "ollama"} & set(formats):
        return None, None
    from onegpu.export.gguf import Converter, check_vocab, refuse_unsupported
    from onegpu.export.llama_setup import converter_dir, require_binding
    from onegpu.export.source import tokenizer_dir
    from onegpu.models import load_tokenizer

    require_binding()
    llama_dir = converter_dir(say)
    refuse_unsupported(Path(src.model_dir), src.family, llama_dir)
    converter = stack.enter_context(Converter(llama_dir))  # importing while the tokenizer loads
    tokenizer = load_tokenizer(tokenizer_dir(src), trust_remote_code)
    facts = check_vocab(converter, Path(src.model_dir), src.family, tokenizer)
    say(
        f"tokenizer: pre-tokenizer {facts.pre or 'from llama.cpp'} ({facts.pre_reason}), "
        f"BOS {'added' if facts.add_bos else 'not added'}, end of turn ids {facts.end_of_turn}"
    )
    return converter, facts


def _write_gguf(cfg, merged_dir: Path, tokenizer, tmp: Path, formats, converter, facts, say):
    from onegpu.export.gguf import convert

    folder = tmp / ("gguf" if "gguf" in formats else "ollama")
    gguf_file = convert(merged_dir, folder, cfg.quant, facts, converter, say)
    if "ollama" in formats:
        from onegpu.export.ollama import write_ollama

        write_ollama(tmp / "ollama", gguf_file, tokenizer, merged_dir, facts)
    return gguf_file


def _check(cfg: ExportConfig, src, merged_dir: Path, formats: list[str], gguf_file, tokenizer):
    from onegpu.export.check import check_greedy, make_reference
    from onegpu.export.prompts import check_prompts, run_config_of
    from onegpu.export.runtimes import load_transformers, transformers_greedy

    prompts = check_prompts(cfg.prompts, run_config_of(src.model_dir, src.adapter), tokenizer)
    ref = make_reference(
        src.model_dir,
        src.adapter,
        prompts.texts,
        cfg.check_tokens,
        cfg.trust_remote_code,
        prompts.ids,
        prompts.source,
    )
    reports = []
    if "safetensors" in formats:
        exported, _ = load_transformers(merged_dir, cfg.trust_remote_code)
        greedy = lambda ids, n: transformers_greedy(exported, ids, n)  # noqa: E731
        reports.append(
            ("safetensors", check_greedy(ref, greedy, src.dtype, "safetensors", "transformers"))
        )
        del exported, greedy  # the plan counts one export beside the source at a time
    if gguf_file is not None:
        from onegpu.export.gguf_check import check_gguf

        report = check_gguf(ref, gguf_file, cfg.quant)
        reports += [(f, report) for f in ("gguf", "ollama") if f in formats]
    return reports
