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
    max_slots: int = 64
    """Sequences decoded together at most. How many fit at once is the KV pool's to say: its
    blocks are shared, each sequence holding what its real length needs."""
    queue_size: int = 64
    """Sequences that may wait for a slot; a request past that gets 503 with Retry-After."""
    kv_memory: Optional[float] = None
    """Upper bound for the KV cache in GiB (default: 90% of free GPU memory, or half the available
    RAM up to 8 GiB on CPU)."""
    prefix_caching: bool = True
    """Keep the KV of finished requests' full blocks and reuse it for a later request that starts
    with the same tokens (a chat's next turn, a shared system prompt): only the rest of its
    prompt is computed."""
    compile: Literal["auto", "off", "on"] = "auto"
    """torch.compile the engine's decode step (auto: on a GPU)."""
    warmup: Literal["auto", "off", "on"] = "auto"
    """Compile the decode step of every batch and KV-length bucket, for greedy and sampled
    requests, before listening, so that no request waits for a compile (auto: whenever the step
    compiles). Other kinds (penalties, top-k/top-p, logprobs, grammars) compile when first asked
    for; /metrics counts every compile after the warm-up."""
    compile_cache: Optional[str] = "~/.cache/onegpu/compile"
    """Folder where torch keeps compiled steps (inductor's and AOTAutograd's caches): a second
    start of the same model and settings loads them instead of compiling. TORCHINDUCTOR_CACHE_DIR,
    when set, wins; null: torch's default (a folder under /tmp)."""
    sync_every: int = 8
    """Tokens decoded per engine step before the host looks, when no prompt is being computed
    (new requests join between steps)."""
    flush_ms: Optional[float] = 25.0
    """A stream's tokens are sent at least this often: where decode steps are slow (a large model,
    a full batch) fewer than sync_every run before the host looks, down to one token per event.
    --sync_every 1: one token per event always; --flush_ms null: sync_every steps always."""
    speculative: Optional[Literal["ngram"]] = None
    """Speculative decoding: ngram proposes, for each request, what followed its last few tokens
    earlier in its prompt and answer (prompt lookup), verified in one forward: the same answers,
    fewer forwards where an answer copies its input (editing code, answering from a document).
    Default: off. /metrics counts the proposals and acceptances (onegpu_spec_decode_*)."""
    num_speculative_tokens: int = 4
    """With --speculative: the most tokens proposed per step and request."""
    ngram_min: int = 2
    """With --speculative ngram: the shortest run of last tokens looked up."""
    ngram_max: int = 4
    """With --speculative ngram: the longest run of last tokens looked up (tried first)."""
    policy_off: Optional[str] = None
    """Rows of the engine's device policy table to switch off, comma-separated (ROW[,ROW]; the
    rows and why each is on: `onegpu doctor`)."""
    token_budget: Optional[int] = None
    """Tokens one engine step computes: the running requests' next tokens plus pieces of new
    prompts; a longer prompt is computed in pieces over several steps, so the running streams keep
    their pace (default: 256 on a CPU, 2048 on a GPU)."""
    tool_parser: Literal["auto", "hermes", "llama3", "none"] = "auto"
    """How the model writes tool calls, read back into OpenAI's tool_calls: hermes
    (<tool_call>{json}</tool_call>, Qwen and Hermes models), llama3 (a JSON answer), none (tools
    refused), auto (read from the chat template)."""
    json_schema_strict: bool = True
    """A JSON schema's objects that list "properties" and leave "additionalProperties" out allow
    no other keys (as vLLM's default backend and OpenAI's strict mode): response_format,
    guided_json, structured_outputs and tool parameters. false: JSON Schema's own default, any
    other key allowed (a model may then invent keys until max_tokens)."""
    grace: float = 30.0
    """Seconds a SIGTERM waits for in-flight requests before it cancels them."""
    allowed_local_media: Optional[str] = None
    """A folder a vision-language model's chat requests may name images in, as a path or a
    file:// URL (vLLM's flag); anything outside it is a 400. Default: none (data URLs only)."""

    def check(self) -> None:
        from onegpu.infer.policy import parse_off

        checks = {
            "port": 0 <= self.port < 65536,
            "max_len": self.max_len is None or self.max_len >= 2,
            "max_slots": self.max_slots >= 1,
            "queue_size": self.queue_size >= 0,
            "kv_memory": self.kv_memory is None or self.kv_memory > 0,
            "sync_every": self.sync_every >= 1,
            "flush_ms": self.flush_ms is None or self.flush_ms > 0,
            "token_budget": self.token_budget is None or self.token_budget >= 1,
            "grace": self.grace >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"--{name} has an invalid value: {getattr(self, name)}.",
                    hint="port 0-65535; max_len >= 2; max_slots, sync_every, token_budget >= 1; "
                    "queue_size, grace >= 0; kv_memory > 0 (GiB); flush_ms > 0",
                )
        parse_off(self.policy_off)  # before the model loads: a typo is named now
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api_key is empty.", hint="give a key, or drop --api_key")
