"""`onegpu serve`'s own settings (the model's loading options are infer.InferConfig's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from onegpu.errors import ConfigError


@dataclass
class ServeConfig:
    """Where the server listens, who may call it, and how much it runs at once."""

    host: str = "127.0.0.1"
    """Address to bind. 127.0.0.1 answers this machine only; 0.0.0.0 opens it to the network
    (then set --api_key)."""
    port: int = 8000
    """TCP port."""
    api_key: Optional[str] = None
    """Require 'Authorization: Bearer KEY' on /v1/ routes (default: ONEGPU_API_KEY if set)."""
    adapter: list[str] = field(default_factory=list)
    """A PEFT (LoRA) adapter to serve as NAME=DIR; give the flag once per adapter. A request picks
    it with "model": NAME."""
    served_name: Optional[str] = None
    """The name the base model answers to in "model" (default: --model as given)."""
    max_len: Optional[int] = None
    """KV positions per sequence: prompt + max_tokens must fit (default: the model's context, at
    most 4096)."""
    max_slots: int = 8
    """Sequences decoded together; lowered to what the KV-cache budget holds."""
    queue_size: int = 64
    """Sequences that may wait for a slot; a request past that gets 503 with Retry-After."""
    kv_memory: Optional[float] = None
    """Upper bound for the KV cache in GiB (default: 90% of free GPU memory, or half the available
    RAM up to 8 GiB on CPU)."""
    compile: Literal["auto", "off", "on"] = "auto"
    """torch.compile the engine's decode step (auto: on a GPU)."""
    sync_every: int = 8
    """Tokens decoded per engine step before the host looks (new requests join between steps)."""
    prefill_thread: Literal["auto", "off", "on"] = "auto"
    """Prefill new requests on a second thread while the running ones decode (auto: on a CPU
    with a core to spare beyond the torch threads, e.g. OMP_NUM_THREADS=1 on two cores)."""
    tool_parser: Literal["auto", "hermes", "llama3", "none"] = "auto"
    """How the model writes tool calls, read back into OpenAI's tool_calls: hermes
    (<tool_call>{json}</tool_call>, Qwen and Hermes models), llama3 (a JSON answer), none (tools
    refused), auto (read from the chat template)."""
    grace: float = 30.0
    """Seconds a SIGTERM waits for in-flight requests before it cancels them."""

    def check(self) -> None:
        checks = {
            "port": 0 <= self.port < 65536,
            "max_len": self.max_len is None or self.max_len >= 2,
            "max_slots": self.max_slots >= 1,
            "queue_size": self.queue_size >= 0,
            "kv_memory": self.kv_memory is None or self.kv_memory > 0,
            "sync_every": self.sync_every >= 1,
            "grace": self.grace >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"--{name} has an invalid value: {getattr(self, name)}.",
                    hint="port 0-65535; max_len >= 2; max_slots, sync_every >= 1; queue_size, "
                    "grace >= 0; kv_memory > 0 (GiB)",
                )
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api_key is empty.", hint="give a key, or drop --api_key")
