"""The settings `onegpu bench infer` measures, and its presets.

A setting is "+"-joined tokens: a dtype, a quantization, and a decoding path — transformers'
``generate`` (the default; ``static``/``static-compile``/``hf-static-compile`` give it a static
cache, and torch.compile) or onegpu's decode engine (``engine``, with ``compile`` for its compiled
one-token step). ``hf-default``, plain ``model.generate`` at its defaults, is always measured first:
every "vs HF" figure is against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onegpu.errors import ConfigError
from onegpu.infer import InferConfig, SamplingConfig

BASELINE = "hf-default"
BNB = ("int8", "nf4", "fp4")
TOKENS = {
    "fp32": ("dtype", "fp32"),
    "fp16": ("dtype", "fp16"),
    "bf16": ("dtype", "bf16"),
    "eager": ("attention", "eager"),
    "eager-attention": ("attention", "eager"),  # the same, unmistakable beside an eager engine
    "sdpa": ("attention", "sdpa"),
    **{q: ("quantization", q) for q in (*BNB, "ao-int8", "ao-int8-dynamic", "ao-int4")},
    "static": ("static_cache", True),
    "static-compile": ("compile", "default"),
    "hf-static-compile": ("compile", "default"),  # the same: transformers' static cache + compile
    "engine": ("engine", True),
    "compile": ("engine_compile", "on"),
}

# The GPU presets' model, lengths and time budget
_GPU = dict(
    model="1b",
    vocab_size=128256,
    device="cuda",
    dtype="bf16",
    prompt_len=512,
    new_tokens=128,
    max_minutes=8.5,
)

# One command each: what it measures is written out in benchmarks/README.md and docs/inference.md.
PRESETS: dict[str, dict] = {
    # ~1B on a GPU in one 10-minute command each (gpu_check.sh's `infer` and `infer-quant` steps).
    # The H200 run of 2026-11-25 (benchmarks/results/h200-20261125/) took 98 s for this preset's
    # bf16 setting at both batch sizes, model build included, while inductor's compile of the 1B
    # model's torchao int8 step did not end within the ~3 minutes left of a 280 s step: the
    # quantized settings get a command of their own.
    "gpu": dict(
        **_GPU,
        settings="engine+bf16+compile,engine+int8,engine+nf4",
        batch_size="8,1",
        repeats=5,
    ),
    # torchao weight-only int8 / int4 under the compiled engine against bf16, at batch 1 (where
    # decode reads the weights and little else)
    "gpu-quant": dict(
        **_GPU,
        settings="engine+bf16+compile,engine+ao-int8+compile,engine+ao-int4+compile",
        batch_size="1",
        repeats=3,
    ),
    # the CPU target: the engine's ms per token against plain generate's, tiny model, fp32; the
    # last setting gives the compiled step transformers' eager attention, which inductor fuses,
    # instead of SDPA's CPU kernel
    "cpu": dict(
        model="tiny",
        vocab_size=32000,
        device="cpu",
        dtype="fp32",
        settings="hf-static-compile,engine+fp32,engine+fp32+compile,"
        "engine+fp32+eager-attention+compile",
        batch_size="1,16",
        prompt_len=512,
        new_tokens=128,
        repeats=5,
        max_minutes=0,
    ),
    # transformers' generate settings (dtypes, bitsandbytes, torchao, static cache + compile) on
    # this CPU (the random-init `small` preset) or on a card (`1b`): minutes, not hours
    "hf-cpu": dict(
        model="small",
        vocab_size=32000,
        device="cpu",
        settings="fp32,bf16,int8,nf4,ao-int8,ao-int8-dynamic,static-compile",
        batch_size="4",
        prompt_len=64,
        new_tokens=32,
        repeats=3,
    ),
    "hf-gpu": dict(
        model="1b",
        vocab_size=128256,
        device="cuda",
        settings="fp32,bf16,fp16,int8,nf4,fp4,ao-int8,ao-int8-dynamic,bf16+ao-int4,"
        "bf16+static-compile,bf16+eager",
        batch_size="8",
        prompt_len=512,
        new_tokens=128,
        repeats=5,
    ),
}


@dataclass
class Setting:
    name: str
    infer: InferConfig
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(greedy=True))
    engine: bool = False
    """Decode with onegpu's engine instead of transformers' generate."""
    engine_compile: str = "off"
    """The engine's EngineConfig.compile."""

    @property
    def hf_compiled(self) -> bool:
        """transformers' generate with a static cache + torch.compile ("auto" runs it eager)."""
        return self.sampling.compile not in ("off", "auto")

    @property
    def bnb(self) -> bool:
        return self.infer.quantization in BNB

    def note(self, device: str) -> str:
        """How the setting decodes, in words, for the report."""
        parts = []
        if self.name == BASELINE:
            parts.append("transformers generate, defaults, eager")
        elif self.engine:
            parts.append("engine, compiled (inductor" if self.engine_compile == "on" else "engine")
            if self.engine_compile == "on":
                parts[-1] += ", CUDA graphs)" if device == "cuda" else ")"
            else:
                parts[-1] += ", eager"
        elif self.hf_compiled:
            parts.append(f"generate, static cache + compile ({self.sampling.compile_backend})")
        else:
            parts.append("generate" + (", static cache" if self.sampling.static_cache else ""))
        if self.infer.attention == "eager":
            parts.append("attention: matmul + softmax (transformers' eager)")
        if self.bnb:
            parts.append("memory saving, decodes slower")
        return "; ".join(parts)


def parse_settings(
    text: str, model_dir: str, device: str, backend: str, dtype: str = "auto"
) -> list[Setting]:
    """hf-default, then each named setting. ``dtype`` is every setting's dtype unless it names
    one (hf-default's too, so that the baseline computes like the others; "auto": as loading
    decides, and hf-default as the weights are stored)."""
    base = InferConfig(model=model_dir, device=device, dtype=dtype)
    settings = [Setting(BASELINE, base)]
    for name in [s.strip() for s in text.split(",") if s.strip()]:
        setting = Setting(name, InferConfig(model=model_dir, device=device, dtype=dtype))
        for token in name.split("+"):
            if token not in TOKENS:
                raise ConfigError(
                    f"--settings: unknown token '{token}' in '{name}'.",
                    hint=f"use tokens from: {' '.join(TOKENS)}",
                )
            key, value = TOKENS[token]
            target = next(t for t in (setting, setting.infer, setting.sampling) if hasattr(t, key))
            setattr(target, key, value)
        _check(setting)
        setting.sampling.compile_backend = backend
        settings.append(setting)
    if len(settings) == 1:
        raise ConfigError("--settings is empty.", hint="e.g. --settings fp32,bf16,int8")
    return settings


def _check(s: Setting) -> None:
    if s.engine_compile != "off" and not s.engine:
        raise ConfigError(
            f"--settings: '{s.name}': compile is the engine's (engine+compile).",
            hint="for transformers' static cache + compile use hf-static-compile",
        )
    if s.engine and (s.sampling.static_cache or s.hf_compiled):
        raise ConfigError(
            f"--settings: '{s.name}' mixes the engine with transformers' static cache.",
            hint="the engine has its own static cache; use engine+compile",
        )


def preset_argv(argv: list[str]) -> list[str]:
    """``--preset NAME`` becomes the preset's flags, put before the rest so that any flag given
    after it overrides the preset's."""
    name = None
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
    if name is None:
        return argv
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset '{name}'.", hint=f"use {' or '.join(PRESETS)}")
    flags = [item for key, value in PRESETS[name].items() for item in (f"--{key}", str(value))]
    return flags + argv


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in str(text).split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"--batch_size must be a positive integer or a list of them, got '{text}'.",
            hint="e.g. --batch_size 8 or --batch_size 1,8",
        )
    return sizes
