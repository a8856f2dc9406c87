"""`onegpu bench infer`: generation speed, memory and quality of each decoding setting — onegpu's
decode engine and transformers' ``generate`` — side by side with plain ``model.generate``.

Per setting and batch size: time to first token, decode tokens/s and ms per decode step (median
and range over rounds), peak memory as weights + KV cache + workspace (CUDA), the share of the
device's memory bandwidth a decode step reaches (infer_roofline.py), and agreement with the fp32
model. Rounds are interleaved (A B C A B C ...) within each batch size, after one untimed warm-up
call per setting (compilation, CUDA-graph capture, allocator caches), so that drift in clocks or
load hits every setting alike. The machine's 1-minute load is recorded with every call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from onegpu.bench import infer_roofline as roof
from onegpu.bench import provenance
from onegpu.bench.infer_report import to_markdown, write_outputs
from onegpu.bench.infer_settings import BASELINE, Setting, batch_sizes, parse_settings, preset_argv
from onegpu.bench.infer_summary import summarize
from onegpu.bench.infer_timing import Memory, time_engine, time_generate
from onegpu.errors import ConfigError
from onegpu.infer import InferConfig, SamplingConfig

log = logging.getLogger(__name__)


@dataclass
class BenchInferConfig:
    preset: Optional[str] = None
    """gpu or cpu: a documented run's model, settings, batch sizes, lengths and repeats (flags given
    as well override it). gpu: 1b, bf16, batch 1 and 8; cpu: tiny, fp32, batch 1 and 16."""
    model: str = "small"
    """A preset (tiny, small, 125m, 1b: random-init Llama built from its config) or a model
    directory."""
    vocab_size: int = 32000
    """Vocabulary size of preset models."""
    settings: str = (
        "engine,engine+compile,fp32,bf16,int8,nf4,ao-int8,ao-int8-dynamic,static-compile"
    )
    """Comma-separated settings, each "+"-joined from: fp32 fp16 bf16 eager sdpa int8 nf4 fp4
    ao-int8 ao-int8-dynamic ao-int4 static static-compile hf-static-compile engine compile
    ("engine+compile": the decode engine, its step compiled). Plain model.generate is always added
    as hf-default. The default leads with the engine every other command decodes with, eager and
    compiled, then transformers' generate settings beside it."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """dtype of every setting that names none, hf-default's included."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to measure on."""
    batch_size: str = "4"
    """Prompts per call; a comma-separated list measures each size (e.g. 1,8)."""
    prompt_len: int = 64
    """Prompt tokens (random token ids: speed does not depend on the text)."""
    new_tokens: int = 32
    """Generated tokens per prompt (always exactly this many)."""
    repeats: int = 3
    """Timed rounds per batch size, interleaved across settings; medians and ranges reported."""
    sync_every: int = 8
    """The engine's decode steps between read-backs (EngineConfig.sync_every)."""
    policy_off: Optional[str] = None
    """Rows of the engine's device policy table to switch off, comma-separated (ROW[,ROW]; the
    rows and why each is on: `onegpu doctor`)."""
    max_minutes: float = 0.0
    """Stop starting rounds when the next would end after this many minutes (0: no limit); the
    results say how many rounds ran."""
    compile_backend: str = "inductor"
    """torch.compile backend of transformers' static-compile settings."""
    out: str = "bench-infer"
    """Output folder for infer-<device>-<date>.{json,md,png}."""
    name: Optional[str] = None
    """File stem instead of infer-<device>-<date>."""
    seed: int = 0
    """Seed for the random model and prompts."""
    workload: Literal["random", "edits"] = "random"
    """random: prompt_len random token ids per prompt, every setting. edits: held-out code-edit
    tasks (data/edits.py), batch 1, greedy, to EOS, on the engine (the settings, batch sizes and
    lengths do not apply): the model's copy rate, the simulated prompt-lookup acceptance and
    tokens/s (bench/infer_edits.py). Give a trained model: a random one copies nothing."""
    tasks: int = 8
    """Edit tasks per round (workload edits)."""
    speculative: Optional[Literal["ngram"]] = None
    """Workload edits: also time the engine with EngineConfig(speculative=this), interleaved with
    the same engine without, and compare their tokens."""
    num_speculative_tokens: int = 4
    """Tokens proposed per step with speculative."""
    dry_run: bool = False
    """Check the options and list the settings that would be measured, without building a model."""


@dataclass
class Cell:
    """One setting at one batch size: its calls and what its warm-up left behind."""

    setting: Setting
    batch: int
    runs: list = field(default_factory=list)
    quality: dict = field(default_factory=dict)
    growth: Optional[int] = None  # allocated bytes the warm-up call left (CUDA)
    kv_bytes: int = 0
    kv_source: str = ""
    engine: object = None


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


def _kwargs(setting: Setting, loaded, new_tokens: int) -> dict:
    from onegpu.infer import generation_kwargs

    if setting.name == BASELINE:  # model.generate with its defaults: only the length is fixed
        return {"max_new_tokens": new_tokens, "pad_token_id": loaded.tokenizer.pad_token_id}
    return generation_kwargs(loaded.model, loaded.tokenizer, setting.sampling, new_tokens)


def _load(setting: Setting, ref):
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.infer import Loaded, load

    if setting.name != BASELINE:
        return load(setting.infer)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    kw = {"dtype": dtypes[setting.infer.dtype]} if setting.infer.dtype in dtypes else {}
    model = AutoModelForCausalLM.from_pretrained(ref.source, **kw).to(ref.device).eval()
    return Loaded(model, ref.tokenizer, ref.device, model.dtype, ref.source)


class _Bench:
    """The state of one benchmark run: models, prompts, the reference and the cells measured."""

    def __init__(self, cfg: BenchInferConfig, workdir: Path):
        import torch

        from onegpu.infer import generation_kwargs, load
        from onegpu.infer.paged_cache import kv_bytes_per_position
        from onegpu.techniques.quantization import weight_bytes

        self.cfg, self.batches = cfg, batch_sizes(cfg.batch_size)
        model_dir = prepare_model_dir(cfg, workdir)
        self.settings = parse_settings(
            cfg.settings, model_dir, cfg.device, cfg.compile_backend, cfg.dtype
        )
        self.ref = load(InferConfig(model=model_dir, device=cfg.device, dtype="fp32"))
        self.device = self.ref.device
        self.memory = Memory(self.device)
        self.loaded, self.facts = {}, {}
        for s in self.settings:
            before = self.memory.allocated()
            lm = self.loaded[s.name] = _load(s, self.ref)
            after = self.memory.allocated()
            self.facts[s.name] = {
                "weight_bytes": weight_bytes(lm.model),
                "weight_alloc": after - before if after is not None else None,
                "weight_read_bytes": roof.weight_read_bytes(lm.model),
                "kv_bytes_per_position": kv_bytes_per_position(lm.model),
            }
        gen = torch.Generator().manual_seed(cfg.seed)
        low = len(self.ref.tokenizer.all_special_ids) + 1  # random ordinary tokens
        vocab = self.ref.model.config.vocab_size
        self.ids = torch.randint(low, vocab, (max(self.batches), cfg.prompt_len), generator=gen)
        greedy = generation_kwargs(
            self.ref.model, self.ref.tokenizer, SamplingConfig(greedy=True), cfg.new_tokens
        )
        _, self.ref_tokens = time_generate(
            self.ref.model, _inputs(self.ids, self.device), greedy, self.device
        )
        self.cells: list[Cell] = []
        self.bandwidth: list[float] = []
        self.bandwidth_source = ""
        self.rounds: dict[int, int] = {}

    def call(self, cell: Cell):
        s, lm, ids = cell.setting, self.loaded[cell.setting.name], self.ids[: cell.batch]
        if s.engine:
            return time_engine(cell.engine, ids.tolist(), self.cfg.new_tokens, self.device)
        kwargs = _kwargs(s, lm, self.cfg.new_tokens)
        return time_generate(lm.model, _inputs(ids, self.device), kwargs, self.device)

    def warm_up(self, cell: Cell) -> None:
        """The untimed first call: compiles, captures, allocates caches; its tokens give quality."""
        from onegpu.infer.engine import Engine

        s, lm = cell.setting, self.loaded[cell.setting.name]
        before = self.memory.allocated()
        kv_pos = self.facts[s.name]["kv_bytes_per_position"]
        if s.engine:
            config = engine_config(self.cfg, cell.batch, s.engine_compile)
            cell.engine = Engine(lm.model, None, config)
        _, tokens = self.call(cell)
        after = self.memory.allocated()
        cell.growth = after - before if after is not None else None
        if s.engine:
            cell.kv_bytes, cell.kv_source = cell.engine.stats().kv_bytes, "engine.stats().kv_bytes"
        else:  # what generate's cache holds at the end (a static cache is sized to the same)
            positions = self.cfg.prompt_len + self.cfg.new_tokens
            cell.kv_bytes = roof.cache_bytes(cell.batch, positions, kv_pos)
            cell.kv_source = "computed: batch x (prompt + new) x kv bytes/position"
        ids, ref = self.ids[: cell.batch], self.ref_tokens[: cell.batch]
        cell.quality = quality(lm.model, self.ref.model, ids, ref, tokens)

    def measure_bandwidth(self) -> None:
        from onegpu import hardware

        gbs, self.bandwidth_source = hardware.memory_bandwidth(hardware.detect())
        self.bandwidth.append(gbs)


def run_bench(
    cfg: BenchInferConfig, workdir: Path, checkpoint: Optional[Callable[[dict], None]] = None
) -> dict:
    """Every batch size in turn: warm-ups, then interleaved rounds. ``checkpoint`` receives the
    results so far after every round (so a run cut short leaves what it measured)."""
    import gc

    import torch

    # every (engine, batch, bucket) is one compiled entry of the same step function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    start = time.perf_counter()
    bench = _Bench(cfg, workdir)
    deadline = start + 60 * cfg.max_minutes if cfg.max_minutes > 0 else float("inf")
    for batch in bench.batches:
        cells = [Cell(s, batch) for s in bench.settings]
        if time.perf_counter() > deadline:
            log.warning("batch %d skipped: the time budget (--max_minutes) is spent", batch)
            continue
        for cell in cells:
            bench.warm_up(cell)
            log.info("warm-up %s at batch %d done", cell.setting.name, batch)
        bench.cells += cells
        bench.rounds[batch], last = 0, 0.0
        for rep in range(cfg.repeats):
            if time.perf_counter() + last > deadline:
                log.warning("batch %d: %d of %d rounds (time budget)", batch, rep, cfg.repeats)
                break
            t0 = time.perf_counter()
            bench.measure_bandwidth()
            for cell in cells:
                cell.runs.append(bench.call(cell)[0])
            bench.rounds[batch], last = rep + 1, time.perf_counter() - t0
            log.info("batch %d: round %d/%d done", batch, rep + 1, cfg.repeats)
            if checkpoint is not None:
                checkpoint(summarize(bench))
        for cell in cells:  # an engine's cache and graphs go before the next batch size's
            cell.engine = None
        gc.collect()
        if bench.device == "cuda":
            torch.cuda.empty_cache()
    return summarize(bench)


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


def cli(argv: Sequence[str]) -> int:
    import json
    import tempfile

    from onegpu.cli.args import make_parser, parse

    parser = make_parser("onegpu bench infer", __doc__.splitlines()[0], BenchInferConfig)
    cfg, _ = parse(parser, preset_argv(list(argv)), BenchInferConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    _check(cfg)
    if cfg.dry_run:
        settings = parse_settings(
            cfg.settings, cfg.model, cfg.device, cfg.compile_backend, cfg.dtype
        )
        print(
            f"dry run: {cfg.model} on {cfg.device} ({cfg.dtype}), batch {cfg.batch_size} x "
            f"prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens, {cfg.repeats} rounds"
        )
        for setting in settings:
            print(f"  {setting.name}")
        return 0
    stem = cfg.name or f"infer-{_device_type(cfg)}-{time.strftime('%Y%m%d')}"
    if cfg.workload == "edits":
        from onegpu.bench import infer_edits

        head = provenance.begin(" ".join(["onegpu bench infer", *argv]))
        with tempfile.TemporaryDirectory(prefix="onegpu-bench-") as tmp:
            result = infer_edits.run_edits(cfg, prepare_model_dir(cfg, Path(tmp)))
        result = {**provenance.end(head), **result}
        out = Path(cfg.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{stem}.md").write_text(infer_edits.edits_markdown(result))
        print(infer_edits.edits_markdown(result) + f"wrote {out / stem}.{{json,md}}")
        return 0
    partial = Path(cfg.out).expanduser() / f"{stem}.partial.json"

    head = provenance.begin(" ".join(["onegpu bench infer", *argv]))

    def checkpoint(result: dict) -> None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**provenance.end(head), **result}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="onegpu-bench-") as tmp:
        result = {**provenance.end(head), **run_bench(cfg, Path(tmp), checkpoint)}
    print(to_markdown(result))
    for p in write_outputs(result, cfg.out, stem):
        print(f"wrote {p}")
    partial.unlink(missing_ok=True)
    return 0


def _device_type(cfg: BenchInferConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(cfg: BenchInferConfig, batch: int, compile_: str):
    """A setting's engine: ``batch`` rows sized to the request, its step compiled or not
    (``compile_``: EngineConfig.compile), the device policy's rows but --policy_off's."""
    from onegpu.infer.engine import EngineConfig
    from onegpu.infer.policy import parse_off

    return EngineConfig(
        max_slots=batch,
        max_len=cfg.prompt_len + cfg.new_tokens,
        compile=compile_,
        sync_every=cfg.sync_every,
        policy_off=parse_off(cfg.policy_off),
    )


def _check(cfg: BenchInferConfig) -> None:
    from onegpu.infer.policy import parse_off

    batch_sizes(cfg.batch_size)
    parse_off(cfg.policy_off)
    if cfg.speculative and cfg.workload != "edits":
        raise ConfigError(
            "--speculative compares the engine with and without it on --workload edits.",
            hint="add --workload edits",
        )
    for name in (
        "prompt_len",
        "new_tokens",
        "repeats",
        "vocab_size",
        "sync_every",
        "tasks",
        "num_speculative_tokens",
    ):
        if getattr(cfg, name) < 1:
            raise ConfigError(
                f"--{name} must be >= 1, got {getattr(cfg, name)}.", hint=f"set --{name} 1 or more"
            )
