"""Datasets -> tokens: find the records, check them, tokenize (cached, multi-process), pack or mask.

Four shapes: raw ``text`` (tokenized, joined with EOS, packed into fixed blocks), ``prompt`` /
``completion`` (loss on the completion only), chat ``messages`` (loss on assistant turns only) and
preference pairs ``prompt`` / ``chosen`` / ``rejected`` (tokenized by pairs.py).
Labels are aligned with ``input_ids`` (the loss shifts them); -100 marks tokens that never count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import DataConfig
from onegpu.data.validate import check_file
from onegpu.errors import DataError

log = logging.getLogger(__name__)

# A column added to the records read from files: where each came from ("data.jsonl:5"), so that an
# error found while tokenizing names the file and line, whatever split or shuffle came in between.
ORIGIN = "__origin__"

EXTENSIONS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".py": "text",
    ".md": "text",
}


@dataclass
class Source:
    """Where records come from: a datasets builder and its train/validation file lists (or a Hub
    name)."""

    builder: str
    train_files: list[str]
    val_files: list[str]
    fingerprint: str
    hub_name: str | None = None


# ---------------------------------------------------------------------------------------- sources
def stdlib_source(max_bytes: int, val_fraction: float) -> Source:
    """The Python standard library's own .py files: on every machine, no download, deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "dist-packages"}
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts):
            continue
        try:
            size = path.stat().st_size
            path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if size == 0:
            continue
        if max_bytes and total + size > max_bytes:
            break
        files.append(str(path))
        total += size
    if len(files) < 2:
        raise DataError(
            f"found too few standard-library sources under {root}.",
            hint="set data.path to your own text",
        )
    train, val = split_files(files, val_fraction, key=lambda f: str(Path(f).relative_to(root)))
    finger = _fingerprint(files)
    log.info("stdlib corpus: %d files (%.1f MB), %d held out", len(files), total / 1e6, len(val))
    return Source("text", train, val, finger)


def split_files(files: list[str], val_fraction: float, key=str) -> tuple[list[str], list[str]]:
    """Hold out whole files, chosen by a hash of their name (stable across machines and runs),
    until they hold ``val_fraction`` of the bytes: a count of files could pick only tiny ones."""
    if val_fraction <= 0 or len(files) < 2:
        return files, []
    sizes = {f: Path(f).stat().st_size for f in files}
    budget = val_fraction * sum(sizes.values())
    val, held = set(), 0
    for f in sorted(files, key=lambda f: hashlib.md5(key(f).encode()).hexdigest()):
        if held >= budget or len(val) == len(files) - 1:
            break
        val.add(f)
        held += sizes[f]
    return [f for f in files if f not in val], [f for f in files if f in val]


def looks_like_hub_name(path: str) -> bool:
    """'org/name' and nothing more: no other separator, no leading ./ / ~, no data-file extension
    (a missing 'data/train.jsonl' is a typo in a path, not a dataset to download)."""
    parts = path.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and "\\" not in path
        and not path.startswith((".", "~"))
        and Path(path).suffix.lower() not in EXTENSIONS
    )


def file_source(path: str, val_fraction: float, messages_field: str = "messages") -> Source:
    p = Path(path).expanduser()
    if not p.exists():
        if looks_like_hub_name(path):
            return Source("hub", [], [], f"hub:{path}", hub_name=path)
        where = (
            ""
            if p.is_absolute()
            else f" (looked for {Path.cwd() / p}: relative paths are read from {Path.cwd()})"
        )
        raise DataError(
            f"data.path '{path}' does not exist{where}.",
            hint="give an existing file or folder, or a Hub dataset as org/name",
        )
    files = (
        sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
        if p.is_dir()
        else [str(p)]
    )
    if not files:
        raise DataError(
            f"no data files in '{path}'.", hint=f"use files ending in {', '.join(EXTENSIONS)}"
        )
    builders = {EXTENSIONS.get(Path(f).suffix) for f in files}
    if None in builders:
        raise DataError(
            f"'{files[0]}': unsupported file type.", hint=f"use one of {', '.join(EXTENSIONS)}"
        )
    if len(builders) > 1:
        raise DataError(
            f"'{path}' mixes file types ({', '.join(sorted(builders))}).",
            hint="keep one type per folder",
        )
    for f in files:
        check_file(f, messages_field)
    train, val = split_files(files, val_fraction) if len(files) > 1 else (files, [])
    return Source(builders.pop(), train, val, _fingerprint(files))


def _fingerprint(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = Path(f).stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------- loading
def load_records(cfg: DataConfig, seed: int):
    """Return (train, validation) `datasets.Dataset`s of raw records."""
    import datasets

    src = (
        stdlib_source(cfg.max_bytes, cfg.val_fraction)
        if cfg.path is None
        else file_source(cfg.path, cfg.val_fraction, cfg.messages_field)
    )
    kw = {"sample_by": "document"} if src.builder == "text" else {}
    try:
        if src.hub_name:
            ds = datasets.load_dataset(src.hub_name)
            train, val = ds["train"], ds["validation"] if "validation" in ds else None
            rows = range(len(train))
            train = _with_origins(train, [f"{src.hub_name} train row {i}" for i in rows])
            if val is not None:
                val = _with_origins(
                    val, [f"{src.hub_name} validation row {i}" for i in range(len(val))]
                )
        else:
            files = {"train": src.train_files} | (
                {"validation": src.val_files} if src.val_files else {}
            )
            ds = datasets.load_dataset(src.builder, data_files=files, **kw)
            train = _with_origins(ds["train"], file_origins(src.train_files, src.builder))
            val = ds.get("validation")
            if val is not None:
                val = _with_origins(val, file_origins(src.val_files, src.builder))
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
        where = src.hub_name or cfg.path or "data"
        msg = (
            str(exc.__cause__ or exc).splitlines()[0]
            if str(exc.__cause__ or exc)
            else type(exc).__name__
        )
        raise DataError(
            f"cannot read {where}: {msg}",
            hint="check the file format (and the network for Hub datasets)",
        ) from None
    if len(train) == 0:
        raise DataError(f"{cfg.path or 'data'}: no records.")
    if val is None and cfg.val_fraction > 0 and len(train) >= 2:
        split = train.train_test_split(
            test_size=max(1, round(len(train) * cfg.val_fraction)), seed=seed
        )
        train, val = split["train"], split["test"]
    return train, val, src.fingerprint


def _with_origins(ds, origins: list[str] | None):
    """The records with their ORIGIN column; unchanged if the origins do not match them one to one
    (errors then name the split and record number instead)."""
    if origins is None or len(origins) != len(ds) or ORIGIN in ds.column_names:
        return ds
    return ds.add_column(ORIGIN, origins)


def file_origins(files: list[str], builder: str) -> list[str] | None:
    """Where each record of `files`, read by the datasets `builder` in order, comes from:
    "file:line" for JSON lines and CSV, "file item N" for a JSON array, "file row N" for Parquet,
    the file for a text document. None where a file cannot be read here (its records then go
    without)."""
    import csv

    out: list[str] = []
    for f in files:
        try:
            if builder == "text":
                out.append(f)
            elif Path(f).suffix == ".parquet":
                import pyarrow.parquet as pq

                out += [f"{f} row {i}" for i in range(pq.ParquetFile(f).metadata.num_rows)]
            elif builder == "csv":
                with open(f, newline="", encoding="utf-8") as fh:
                    reader, start, rows = csv.reader(fh), None, []
                    for n, row in enumerate(reader):
                        if n and row:  # after the header; blank lines hold no record
                            rows.append(f"{f}:{start}")
                        # a quoted field may span lines: a record starts after the last one's end
                        start = reader.line_num + 1
                out += rows
            else:
                text = Path(f).read_text(encoding="utf-8")
                if text.lstrip().startswith("["):
                    out += [f"{f} item {i}" for i in range(len(json.loads(text)))]
                else:  # JSON lines: datasets skips blank ones
                    lines = enumerate(text.split("\n"), 1)
                    out += [f"{f}:{n}" for n, line in lines if line.strip()]
        except (OSError, ValueError, ImportError):
            return None
    return out


def where(batch: dict, i: int, idx: int, split: str) -> str:
    """Where record `i` of a `datasets.map` batch came from (its index in the split: `idx`)."""
    origins = batch.get(ORIGIN)
    return origins[i] if origins is not None else f"{split} record {idx}"


def detect_format(cfg: DataConfig, columns: list[str]) -> str:
    columns = [c for c in columns if c != ORIGIN]
    if cfg.format != "auto":
        needed = {
            "text": [cfg.text_field],
            "prompt_completion": [cfg.prompt_field, cfg.completion_field],
            "messages": [cfg.messages_field],
            "preference": [cfg.chosen_field, cfg.rejected_field],
            "unpaired": [cfg.label_field],
        }[cfg.format]
        missing = [c for c in needed if c not in columns]
        if missing:
            raise DataError(
                f"data.format={cfg.format} needs column(s) {missing}, found {columns}.",
                hint=_field_hint(cfg.format, columns),
            )
        return cfg.format
    if cfg.chosen_field in columns and cfg.rejected_field in columns:
        return "preference"
    if cfg.label_field in columns and (
        cfg.completion_field in columns or cfg.messages_field in columns
    ):
        return "unpaired"
    if cfg.messages_field in columns:
        return "messages"
    if cfg.prompt_field in columns and cfg.completion_field in columns:
        return "prompt_completion"
    if cfg.text_field in columns:
        return "text"
    raise DataError(
        f"cannot tell the data format from columns {columns}.",
        hint="name the columns text / prompt+completion / messages / prompt+chosen+rejected, or "
        "set data.text_field etc.",
    )


def _field_hint(fmt: str, columns: list[str]) -> str:
    key = {
        "text": "data.text_field",
        "prompt_completion": "data.prompt_field / data.completion_field",
        "messages": "data.messages_field",
        "preference": "data.chosen_field / data.rejected_field",
        "unpaired": "data.label_field",
    }[fmt]
    return f"set {key} to one of the columns: {', '.join(columns)}"


def corpus_texts(ds, fmt: str, cfg: DataConfig):
    """Plain text of the records, to train a tokenizer on."""
    for rec in ds:
        if fmt == "text":
            yield rec[cfg.text_field] or ""
        elif fmt == "prompt_completion":
            yield f"{rec[cfg.prompt_field]}{rec[cfg.completion_field]}"
        elif fmt == "prompt":
            yield _plain(rec.get(cfg.prompt_field))
        elif fmt == "unpaired":
            yield "\n".join(
                _plain(rec.get(k))
                for k in (cfg.prompt_field, cfg.completion_field, cfg.messages_field)
            )
        elif fmt == "preference":
            yield "\n".join(
                _plain(rec.get(k)) for k in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field)
            )
        else:
            yield "\n".join(str(m.get("content", "")) for m in rec[cfg.messages_field] or [])


def _plain(value) -> str:
    """Text of a field that is text or a list of chat messages."""
    if isinstance(value, list):
        return "\n".join(
            str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value
        )
    return value or ""
