"""The risks found by reading the CUDA-only code (../shared notes §5), each pinned by a check that
failed before its fix. Runs inside a card's process (test_cards.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from onegpu.config import Config
from onegpu.hardware import detect


def test_tf32_switches_survive_the_new_api(card):
    """transformers' TrainingArguments(tf32=True) sets TF32 through torch's new API; a run started
    afterwards in the same process must neither raise on the legacy read nor leave it changed."""
    from onegpu.techniques.prepare import global_switches

    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # what TrainingArguments(tf32=True) does
    try:
        with global_switches(Config(), detect()):
            assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if card.bf16 else "ieee")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
