"""Shared fixtures: tiny models built from configs, saved and reloaded through from_pretrained."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# DeepSpeed picks its accelerator when imported. Without CUDA its detection fails unless told "cpu";
# on a GPU machine the offload tests (and the subprocesses they start) need its CUDA accelerator, so
# nothing is set there. tests/test_distributed.py names "cpu" itself for its CPU-only subprocesses.
if not _cuda_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog.\n",
] * 20


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep tests from reading or writing the user's onegpu cache."""
    old = os.environ.get("ONEGPU_CACHE")
    os.environ["ONEGPU_CACHE"] = str(tmp_path_factory.mktemp("onegpu-cache"))
    yield
    if old is None:
        os.environ.pop("ONEGPU_CACHE", None)
    else:
        os.environ["ONEGPU_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from onegpu.data.tokenizer import train_tokenizer

    return train_tokenizer(CORPUS, vocab_size=512, fingerprint="tests-corpus")


def make_tiny_llama(tokenizer, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    kw.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kw))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A 2-layer Llama saved with save_pretrained (safetensors) plus its tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(tiny_tokenizer).save_pretrained(str(path))
    tiny_tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("".join(CORPUS), encoding="utf-8")
    return p
