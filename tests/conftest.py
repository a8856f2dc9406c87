"""Shared fixtures: tiny models built from configs, saved and reloaded through from_pretrained.
Plain helpers (the corpus, the tiny model, random batches, small runs) are in helpers.py."""

from __future__ import annotations

import os

import pytest

# Under pytest-xdist (make test, make test-all) each of the workers runs on one torch thread: the
# tiny models run fastest single-threaded, and two workers on two cores would fight over threads.
# Set before torch is imported, so that the processes a test starts inherit it as well.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

from helpers import CORPUS, make_tiny_llama  # noqa: E402 - after the thread settings

# the fast tier's limit (tests/tier_guard.py); pytester: the guard's own test (test_house.py)
pytest_plugins = ["tier_guard", "pytester"]


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


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


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


@pytest.fixture
def one_thread():
    """Tiny models run fastest single-threaded, and a shared CPU makes 2 threads crawl. Modules of
    small training runs use it for every test:
    pytestmark = pytest.mark.usefixtures("one_thread")."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
