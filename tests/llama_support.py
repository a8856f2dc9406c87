"""What the llama.cpp export tests share: the binding installed and the converter where the build
script left it (tests/conftest.py gives each session a fresh ONEGPU_CACHE, which has neither)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def llama_cpp_ready():
    from onegpu.export.llama_setup import VERSION, require_binding

    require_binding()  # one error naming scripts/build_llama_cpp.sh when absent
    root = os.environ.get("ONEGPU_LLAMA_CPP_DIR") or f"~/.cache/onegpu/llama-cpp/{VERSION}"
    old = os.environ.get("ONEGPU_LLAMA_CPP_DIR")
    os.environ["ONEGPU_LLAMA_CPP_DIR"] = str(Path(root).expanduser())
    yield
    if old is None:
        os.environ.pop("ONEGPU_LLAMA_CPP_DIR")


def save(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
