"""The server's tests start `onegpu serve` as a subprocess on 127.0.0.1 (a free port) and call it
with the real openai client; this module starts, waits for and stops that process, and makes the
tiny LoRA adapters the tests serve."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
SERVE = [sys.executable, "-m", "onegpu", "serve"]  # the command as a user runs it
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A live `onegpu serve` process: ``url``, ``log`` (its stderr+stdout), ``stop()``."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
        with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(
                [*SERVE, *args, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"server not up in {START_TIMEOUT_S} s:\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (``labels`` as written there: 'reason="cancelled"'); 0 if
        absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def make_adapters(tokenizer, folder: Path) -> dict[str, Path]:
    """Two LoRA adapters on the tiny Llama, with random (non-zero) B matrices: each answers
    differently from the base and from the other."""
    import torch
    from peft import LoraConfig, get_peft_model

    from helpers import make_tiny_llama

    out = {}
    for i, name in enumerate(("alpha", "beta")):
        lora = LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        model = get_peft_model(make_tiny_llama(tokenizer), lora)
        torch.manual_seed(100 + i)  # make_tiny_llama reseeds to 0: each adapter draws its own
        for n, p in model.named_parameters():
            if "lora_" in n:
                torch.nn.init.normal_(p, std=0.5)
        model.save_pretrained(str(folder / name))
        out[name] = folder / name
    return out


def openai_client(server: Server, api_key: str = "unused"):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)
