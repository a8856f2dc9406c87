"""The data section: where the records are, their shape, how they become training sequences, and
how images in them are read (vision-language models, docs/vlm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Local file or folder (jsonl/json/csv/parquet/txt) or a Hub dataset name. Default: the
    Python standard library's own source files."""
    format: Literal["auto", "text", "prompt_completion", "messages", "preference", "unpaired"] = (
        "auto"
    )
    """Record shape. "auto" detects it from the columns (text / prompt+completion / messages /
    prompt+chosen+rejected / a label with prompt+completion or messages: unpaired, KTO's)."""
    text_field: str = "text"
    """Column holding raw text."""
    prompt_field: str = "prompt"
    """Column holding the prompt (prompt_completion format)."""
    completion_field: str = "completion"
    """Column holding the completion (prompt_completion format)."""
    messages_field: str = "messages"
    """Column holding chat messages (messages format)."""
    images_field: str = "images"
    """Column holding a record's image files, in the order of the messages' image parts (a
    vision-language model's chat records; the parts can also name the image themselves)."""
    chosen_field: str = "chosen"
    """Column holding the preferred response (preference format: text, or a list of chat messages).
    """
    rejected_field: str = "rejected"
    """Column holding the dispreferred response (preference format)."""
    label_field: str = "label"
    """Column holding whether a completion is desirable, true or false (unpaired format, KTO)."""
    margin_field: str = "margin"
    """Column holding a pair's margin, if any (reward models subtract it in the loss, as TRL)."""
    seq_len: int = 256
    """Tokens per training sequence (packed block length, or truncation length)."""
    overlong: Literal["truncate", "drop", "split"] = "split"
    """Chat/prompt-completion records over seq_len (counted in the log and summary). split: a chat
    is cut on turn boundaries (system message kept, an assistant turn too long alone left out);
    prompt/completion, with no turn to cut on, is dropped. drop: left out. truncate: cut at seq_len,
    a cut assistant turn not trained on (its EOS is gone), a prompt cut from its start. Default
    split: never trains on a cut turn, keeps every turn that fits."""
    val_fraction: float = 0.05
    """Share of files (or records) held out for validation."""
    max_bytes: int = 6_000_000
    """Read at most this many bytes of the default standard-library corpus (0 = all)."""
    corpus: Literal["stdlib", "edits", "copy"] = "stdlib"
    """The built-in records, read when data.path is unset. stdlib: the standard library's source
    files as text (the default job). edits: code-edit tasks made from its functions (rename a
    variable, add a parameter, re-indent, double quotes: data/edits.py) as prompt + completion,
    the training tasks from the training files and the validation tasks from the held-out ones;
    as many as the run uses. copy: lines of code drawn at random, to be copied unchanged
    (data/copy_task.py), the first stage of a copying model (examples/copy/). sft only."""
    edit_max_chars: int = 900
    """data.corpus=edits: the longest function of a task, in characters (the shortest: a third of
    it). 900: ~100-300 tokens a function, ~200-600 a task; smaller gives short tasks, a first stage
    of a copying curriculum."""
    num_proc: int = 2
    """Processes used to tokenize."""
    pin_memory: bool = True
    """Page-lock host batches so copies to the GPU run asynchronously (GPU only)."""
    num_workers: int = 0
    """DataLoader worker processes preparing batches in the background."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (num_workers > 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs and evals (num_workers > 0)."""
    pad_to_multiple: int = 64
    """Pad variable-length batches to a multiple of this (tensor cores; torch.compile recompiles
    less)."""
    on_bad_record: Literal["error", "skip"] = "error"
    """An image that is missing or cannot be read: error stops with its file and line; skip leaves
    the record out and counts it in the data summary."""
    max_pixels: int = 0
    """Largest image area the processor resizes to (pixels; 0 = the processor's own limit), where
    the processor has one (Qwen2-VL). Fewer pixels, fewer image tokens."""
    min_pixels: int = 0
    """Smallest image area the processor resizes to (0 = the processor's own), as max_pixels."""
    image_size: int = 0
    """Resize each image so its longest side is at most this (0 = as given), before the processor:
    for processors without max_pixels, whose image tokens grow with the image (Idefics3,
    LLaVA-NeXT).
    """
