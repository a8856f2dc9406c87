"""`onegpu bench infer`: generation speed, memory and quality of each loading/decoding setting,
side by side with plain ``model.generate`` at its defaults.

Per setting: time to first token (TTFT), prefill tokens/s (prompt tokens / TTFT), decode tokens/s
(tokens after the first / time after the first), peak GPU memory, weight bytes, and agreement with
the fp32 model (greedy tokens, and the largest logit difference on the fp32 model's continuation).
Repetitions are interleaved (A B C A B C ...) so that drift in clocks or load hits every setting
alike; the median repetition is reported.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from onegpu.bench.infer_report import to_markdown, write_outputs
from onegpu.errors import ConfigError
from onegpu.infer import InferConfig, SamplingConfig

log = logging.getLogger(__name__)

BASELINE = "hf-default"
# A setting is "+"-joined tokens, e.g. "bf16+static-compile": dtypes, quantizations, decoding paths.
TOKENS = {
    "fp32": ("dtype", "fp32"),
    "fp16": ("dtype", "fp16"),
    "bf16": ("dtype", "bf16"),
    "eager": ("attention", "eager"),
    "sdpa": ("attention", "sdpa"),
    **{
        q: ("quantization", q)
        for q in ("int8", "nf4", "fp4", "ao-int8", "ao-int8-dynamic", "ao-int4")
    },
    "static": ("static_cache", True),
    "static-compile": ("compile", "default"),
}


@dataclass
class BenchInferConfig:
    model: str = "small"
    """A preset (tiny, small, 125m, 1b: random-init Llama built from its config) or a model
    directory."""
    vocab_size: int = 32000
    """Vocabulary size of preset models."""
    settings: str = "fp32,bf16,int8,nf4,ao-int8,ao-int8-dynamic,static-compile"
    """Comma-separated settings, each "+"-joined from: fp32 fp16 bf16 eager sdpa int8 nf4 fp4
    ao-int8 ao-int8-dynamic ao-int4 static static-compile. Plain model.generate is always added as
    hf-default."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to measure on."""
    batch_size: int = 4
    """Prompts per generate call."""
    prompt_len: int = 64
    """Prompt tokens (random token ids: speed does not depend on the text)."""
    new_tokens: int = 32
    """Generated tokens per prompt (always exactly this many)."""
    repeats: int = 3
    """Timed repetitions per setting, interleaved across settings; the median is reported."""
    compile_backend: str = "inductor"
    """torch.compile backend for static-compile settings."""
    out: str = "bench-infer"
    """Output folder for infer-<device>-<date>.{json,md,png}."""
    name: Optional[str] = None
    """File stem instead of infer-<device>-<date>."""
    seed: int = 0
    """Seed for the random model and prompts."""
    dry_run: bool = False
    """Check the options and list the settings that would be measured, without building a model."""


@dataclass
class Setting:
    name: str
    infer: InferConfig
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(greedy=True))
    runs: list = field(default_factory=list)
    quality: dict = field(default_factory=dict)
    weight_mb: float = 0.0


def parse_settings(text: str, model_dir: str, device: str, backend: str) -> list[Setting]:
    settings = [Setting(BASELINE, InferConfig(model=model_dir, device=device))]
    for name in [s.strip() for s in text.split(",") if s.strip()]:
        infer, sampling = InferConfig(model=model_dir, device=device), SamplingConfig(greedy=True)
        for token in name.split("+"):
            if token not in TOKENS:
                raise ConfigError(
                    f"--settings: unknown token '{token}' in '{name}'.",
                    hint=f"use tokens from: {' '.join(TOKENS)}",
                )
            key, value = TOKENS[token]
            target = infer if hasattr(infer, key) else sampling
            setattr(target, key, value)
        sampling.compile_backend = backend
        settings.append(Setting(name, infer, sampling))
    if len(settings) == 1:
        raise ConfigError("--settings is empty.", hint="e.g. --settings fp32,bf16,int8")
    return settings


def prepare_model_dir(cfg: BenchInferConfig, workdir: Path) -> str:
    """Presets become a random-init Llama saved with save_pretrained, so every setting goes through
    the real from_pretrained path (bitsandbytes quantizes while loading)."""
    from onegpu import models

    if not models.is_preset(cfg.model):
        return cfg.model
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.data.tokenizer import train_tokenizer

    tok = train_tokenizer([Path(__file__).read_text()], vocab_size=512, fingerprint="bench-infer")
    torch.manual_seed(cfg.seed)
    config = models.preset_config(cfg.model, tok, vocab_size=cfg.vocab_size)
    path = workdir / f"{cfg.model}-random"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


class _Clock:
    """A generate() streamer that only timestamps: put() is called with the prompt, then once per
    new token. On CUDA it synchronises first, so each stamp is when the token really exists."""

    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.sync()
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generate(model, inputs: dict, kwargs: dict, device: str) -> tuple[dict, Any]:
    import torch

    batch, prompt_len = inputs["input_ids"].shape
    new = kwargs["max_new_tokens"]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clock = _Clock(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs, min_new_tokens=new, streamer=clock)
    first, last = clock.stamps[1], clock.stamps[-1]
    run = {
        "ttft_ms": 1000 * (first - start),
        "prefill_tps": batch * prompt_len / (first - start),
        "decode_tps": batch * (new - 1) / (last - first) if new > 1 else None,
        "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }
    return run, out[:, prompt_len:]


def _kwargs(setting: Setting, loaded, new_tokens: int) -> dict:
    from onegpu.infer import generation_kwargs

    if setting.name == BASELINE:  # model.generate with its defaults: only the length is fixed
        return {"max_new_tokens": new_tokens, "pad_token_id": loaded.tokenizer.pad_token_id}
    return generation_kwargs(loaded.model, loaded.tokenizer, setting.sampling, new_tokens)


def _load(setting: Setting, ref):
    from transformers import AutoModelForCausalLM

    from onegpu.infer import Loaded, load

    if setting.name != BASELINE:
        return load(setting.infer)
    model = AutoModelForCausalLM.from_pretrained(ref.source).to(ref.device).eval()
    return Loaded(model, ref.tokenizer, ref.device, model.dtype, ref.source)


def run_bench(cfg: BenchInferConfig, workdir: Path) -> dict:
    import torch

    from onegpu.infer import generation_kwargs, load
    from onegpu.techniques.quantization import weight_bytes

    model_dir = prepare_model_dir(cfg, workdir)
    settings = parse_settings(cfg.settings, model_dir, cfg.device, cfg.compile_backend)
    ref = load(
        InferConfig(model=model_dir, device=cfg.device, dtype="fp32")
    )  # the full-precision yardstick
    loaded = {s.name: _load(s, ref) for s in settings}
    gen = torch.Generator().manual_seed(cfg.seed)
    low = len(ref.tokenizer.all_special_ids) + 1  # random ordinary tokens
    ids = torch.randint(
        low, ref.model.config.vocab_size, (cfg.batch_size, cfg.prompt_len), generator=gen
    )
    greedy = generation_kwargs(
        ref.model, ref.tokenizer, SamplingConfig(greedy=True), cfg.new_tokens
    )
    _, ref_tokens = time_generate(ref.model, _inputs(ids, ref.device), greedy, ref.device)
    for s in settings:  # warm-up (compiles graphs, fills allocator caches) and the quality pass
        lm = loaded[s.name]
        _, tokens = time_generate(
            lm.model, _inputs(ids, lm.device), _kwargs(s, lm, cfg.new_tokens), lm.device
        )
        s.quality = quality(lm.model, ref.model, ids, ref_tokens, tokens)
        s.weight_mb = weight_bytes(lm.model) / 2**20
        log.info("warm-up %s done (%.0f MB of weights)", s.name, s.weight_mb)
    for rep in range(cfg.repeats):
        for s in settings:
            lm = loaded[s.name]
            s.runs.append(
                time_generate(
                    lm.model, _inputs(ids, lm.device), _kwargs(s, lm, cfg.new_tokens), lm.device
                )[0]
            )
        log.info("repetition %d/%d done", rep + 1, cfg.repeats)
    return summarize(cfg, settings, ref.device)


def _inputs(ids, device: str) -> dict:
    import torch

    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def quality(model, ref_model, ids, ref_tokens, tokens) -> dict:
    """Greedy-token agreement with the fp32 reference, and the max logit difference when both
    models read the reference's own continuation (so one early divergence does not snowball)."""
    import torch

    seq = torch.cat([ids, ref_tokens.cpu()], dim=1)
    dev = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        ref_logits = (
            ref_model(seq.to(ref_model.device)).logits[:, ids.shape[1] - 1 : -1].float().cpu()
        )
        logits = model(seq.to(dev)).logits[:, ids.shape[1] - 1 : -1].float().cpu()
    return {
        "token_agreement": (tokens.cpu() == ref_tokens.cpu()).float().mean().item(),
        "argmax_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
        "max_logit_diff": (logits - ref_logits).abs().max().item(),
    }


def summarize(cfg: BenchInferConfig, settings: list[Setting], device: str) -> dict:
    import torch

    rows = []
    for s in settings:
        med = {
            k: _median([r[k] for r in s.runs])
            for k in ("ttft_ms", "prefill_tps", "decode_tps", "peak_mb")
        }
        rows.append(
            {
                "setting": s.name,
                **med,
                "weight_mb": s.weight_mb,
                **s.quality,
                "runs": s.runs,
                "infer": dataclasses.asdict(s.infer),
                "sampling": dataclasses.asdict(s.sampling),
            }
        )
    base = rows[0]
    for row in rows:
        row["decode_speedup"] = (
            row["decode_tps"] / base["decode_tps"] if base["decode_tps"] else None
        )
    return {
        "benchmark": "infer",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": None,
        "device": _device_name(device),
        "device_type": device,
        "versions": _versions(),
        "config": dataclasses.asdict(cfg),
        "threads": torch.get_num_threads(),
        "results": rows,
    }


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _versions() -> dict:
    import importlib.metadata as md

    found = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "torchao", "onegpu"):
        try:
            found[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return found


def cli(argv: Sequence[str]) -> int:
    import tempfile

    from onegpu.cli.args import make_parser, parse

    parser = make_parser("onegpu bench infer", __doc__.splitlines()[0], BenchInferConfig)
    cfg, _ = parse(parser, argv, BenchInferConfig)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _check(cfg)
    if cfg.dry_run:
        settings = parse_settings(cfg.settings, cfg.model, cfg.device, cfg.compile_backend)
        print(
            f"dry run: {cfg.model} on {cfg.device}, batch {cfg.batch_size} x prompt "
            f"{cfg.prompt_len}, {cfg.new_tokens} new tokens, {cfg.repeats} repeats"
        )
        for setting in settings:
            print(f"  {setting.name}")
        return 0
    with tempfile.TemporaryDirectory(prefix="onegpu-bench-") as tmp:
        result = run_bench(cfg, Path(tmp))
    result["command"] = " ".join(["onegpu bench infer", *argv])
    stem = cfg.name or f"infer-{result['device_type']}-{time.strftime('%Y%m%d')}"
    print(to_markdown(result))
    for p in write_outputs(result, cfg.out, stem):
        print(f"wrote {p}")
    return 0


def _check(cfg: BenchInferConfig) -> None:
    for name in ("batch_size", "prompt_len", "new_tokens", "repeats", "vocab_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(
                f"--{name} must be >= 1, got {getattr(cfg, name)}.", hint=f"set --{name} 1 or more"
            )
