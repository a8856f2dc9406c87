"""Search: enumerate setups, drop those that do not fit, rank the rest by predicted tokens/s.

Setups come in tiers. Tier 0 keeps the training math of the user's config (batch split,
checkpointing, precision, fused loss, compile); later tiers change what is trained or how the
optimizer works, and are only searched when no earlier tier fits: a memory-saving optimizer, then
LoRA, then QLoRA, then DeepSpeed offload as the last resort.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from onegpu.config import Config
from onegpu.errors import ConfigError
from onegpu.hardware import GpuSpec
from onegpu.plan import memory, speed
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate, setup
from onegpu.plan.vision import ImageLoad

log = logging.getLogger(__name__)

TIERS = (
    "as configured",
    "bf16 weights, 8-bit or paged 8-bit optimizer state, optimizer step in backward",
    "LoRA adapters",
    "QLoRA (4-bit base)",
    "DeepSpeed CPU offload",
)
LORA_RANK = 16


@dataclass
class Row:
    candidate: Candidate
    tier: int
    memory: memory.MemoryEstimate
    speed: speed.SpeedEstimate
    fits: bool
    why: str = ""


@dataclass
class Plan:
    gpu: GpuSpec
    shape: ModelShape
    seq_len: int
    batch: int
    rows: list = field(default_factory=list)  # fitting rows first, fastest first

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None


def micro_batches(target: int, multiple: int = 8) -> list[int]:
    """Divisors of the effective batch (so it is kept exactly): multiples of the GPU's tensor-core
    multiple, plus the small powers of two that rescue a setup that is short of memory."""
    divisors = [d for d in range(1, target + 1) if target % d == 0]
    picked = [d for d in divisors if d % multiple == 0 or d in (1, 2, 4)]
    return picked or divisors


def precisions(spec: GpuSpec, requested: str) -> list[str]:
    if requested != "auto":
        if spec.key != "CPU" and requested in ("bf16", "bf16-pure") and not spec.has_bf16:
            raise ConfigError(
                f"techniques.precision={requested}: {spec.name} has no bf16.",
                hint="use techniques.precision=fp16 or auto on this GPU",
            )
        return [requested]
    if spec.key == "CPU":
        return ["fp32"]  # bf16/fp16 math is emulated and many times slower on CPUs
    return ["bf16", "bf16-pure"] if spec.has_bf16 else ["fp16"]


def tier_candidates(
    tier: int,
    cfg: Config,
    spec: GpuSpec,
    shape: ModelShape,
    batch: int,
    seq_len: int | None = None,
) -> list[Candidate]:
    import itertools

    t = cfg.techniques
    on_gpu = spec.key != "CPU"
    compiles = _compiles(cfg, on_gpu)
    ckpts = ["off", "every-n", "full"] if tier < 4 else ["full"]
    if on_gpu and tier < 4:
        ckpts.append(
            "offload"
        )  # layer inputs in pinned host memory: slower, ranked by the PCIe time it adds
    lora_on = t.lora.enabled
    if tier in (2, 3) and (lora_on and (tier == 2 or t.lora.quantize_base != "none")):
        return []  # already training adapters (on a quantized base): this tier adds nothing
    lora = {}  # full fine-tuning, or the adapters as configured
    if tier in (2, 3) and not lora_on:
        lora = {
            "lora": {
                "r": LORA_RANK,
                "quantize_base": "nf4" if tier == 3 else "none",
                "targets": "all-linear",
            }
        }
    elif tier == 3:
        lora = {"lora": {"quantize_base": "nf4"}}
    offloads = ["zero2-cpu", "zero3-cpu"] if tier == 4 else [t.offload]
    chunks = {off: loss_chunk(cfg, shape.vocab, on_gpu, off) for off in offloads}
    # Activation offload changes no numerics: offered wherever it can run (a GPU, no ZeRO offload).
    act_offloads = (
        [t.activation_offload] if t.activation_offload or not on_gpu or tier == 4 else [False, True]
    )
    out = []
    for mb, (prec, opt, in_bwd), ck, comp, off, act, fp8 in itertools.product(
        micro_batches(batch, spec.tc_multiple),
        _numerics(tier, spec, t),
        ckpts,
        compiles,
        offloads,
        act_offloads,
        fp8_recipes(spec, t),
    ):
        if in_bwd and (mb != batch or off != "none"):
            # an update inside backward needs the whole batch in one micro-batch, and no offload
            continue
        if act and ck == "offload":
            # both would send the checkpointed inputs to the host (config/checks.py refuses it)
            continue
        for tiled in _tiling(t, shape, mb, seq_len):
            c = setup(
                mb,
                batch // mb,
                cfg,
                precision=prec,
                checkpointing=ck,
                optimizer=opt,
                loss_chunk_size=chunks[off],
                compile=comp,
                offload=off,
                optimizer_in_backward=in_bwd,
                activation_offload=act,
                tiled_mlp=tiled,
                fp8=fp8,
                **lora,
            )
            c = with_fp8_layers(c, shape, spec, seq_len or cfg.data.seq_len, t.fp8_skip)
            if c is not None:
                out.append(c)
    return out


def fp8_recipes(spec: GpuSpec, t) -> list[str]:
    """FP8 settings to try: off and tensorwise (torchao's fastest recipe) on a card with FP8
    tensor cores when left to auto; a recipe the user fixed, where it can run; off otherwise."""
    if t.fp8 == "auto":
        return ["off", "tensorwise"] if spec.fp8 and spec.key != "CPU" else ["off"]
    if t.fp8 != "off" and not spec.fp8 and not t.fp8_emulate:
        raise ConfigError(
            f"techniques.fp8={t.fp8}: {spec.name} has no FP8 tensor cores.",
            hint="plan for an Ada or Hopper card (--gpu L40S, --gpu H100), or set "
            "techniques.fp8=off",
        )
    return [t.fp8]


def with_fp8_layers(c: Candidate, shape: ModelShape, spec: GpuSpec, seq_len: int, skip: str):
    """A float8 candidate with its layers chosen: those the user left in high precision
    (techniques.fp8_skip), else every layer whose float8 time the roofline puts below bf16's
    (plan/fp8.choose_skip; emulated float8 gains nothing anywhere, so there the rule's layers
    all stay float8). None for a setup FP8 cannot be part of (a bitsandbytes base, DeepSpeed
    offload: refused by config/checks.py; fp32 or fp16 compute on a card) or with no float8 layer
    left."""
    import dataclasses

    from onegpu.plan.fp8 import choose_skip, float8_layers

    t = c.techniques
    if t.fp8 == "off":
        return c
    if c.quantize_base != "none" or t.offload != "none":
        return None
    if spec.key != "CPU" and t.precision not in ("bf16", "bf16-pure"):
        return None
    if not skip and spec.fp8 and not t.fp8_emulate:
        tokens = c.training.micro_batch_size * c.rows_per_example * c.sequence_tokens(seq_len)
        skip = choose_skip(shape, c, spec, tokens)
    c = dataclasses.replace(c, techniques=dataclasses.replace(t, fp8_skip=skip))
    return c if float8_layers(shape, skip) else None


def _tiling(t, shape: ModelShape, micro_batch: int, seq_len: int | None) -> list[str]:
    """tiled_mlp settings to try. auto is the planner's to settle: off and on both, where tiling
    can apply at this length (the faster that fits wins, so on only where memory needs it);
    a setting the user fixed is kept."""
    if t.tiled_mlp != "auto":
        return [t.tiled_mlp]
    tile = t.tiled_mlp_tile_tokens or shape.hidden
    if seq_len is None or shape.experts or not shape.intermediate or micro_batch * seq_len <= tile:
        return ["off"]
    return ["off", "on"]


def _compiles(cfg: Config, on_gpu: bool) -> list[str]:
    """Compile settings to try: both on a GPU when left to auto (the probe measures which pays);
    on a CPU, what auto settles to (its compile time is long against the gain)."""
    from onegpu.techniques.compile import resolve_compile

    if cfg.techniques.compile != "auto":
        return [cfg.techniques.compile]
    return ["off", "default"] if on_gpu else [resolve_compile(cfg, "cpu")]


def loss_chunk(cfg: Config, vocab: int, on_gpu: bool, offload: str) -> int:
    """The loss a candidate trains with, as training resolves techniques.loss (ZeRO-3 offload
    shards the head's weights, so it takes the plain loss)."""
    from onegpu.techniques.fused_loss import fused_chunk

    return fused_chunk(cfg.techniques, vocab, on_gpu, sharded=offload.startswith("zero3"))


def _numerics(tier: int, spec: GpuSpec, t) -> list[tuple[str, str, bool]]:
    """(precision, optimizer, step in backward) of a tier. bf16 weights change the numerics (updates
    below bf16 resolution are lost), and so do an 8-bit optimizer and an update in backward (no
    global clipping): they wait for tier 1, which crosses them all: bf16 weights or not, the
    configured, 8-bit or paged 8-bit state, the step in backward or not (never with fp16)."""
    precs = precisions(spec, t.precision)
    plain = [p for p in precs if p != "bf16-pure" or t.precision == "bf16-pure"]
    in_bwd = t.optimizer_in_backward
    if tier == 0:
        return [(p, t.optimizer, in_bwd) for p in plain]
    if tier == 1:
        weights = precs if t.precision == "auto" else plain
        states = [t.optimizer] + ([] if t.optimizer in memory.STATE_BYTES else list(EIGHT_BIT))
        if (
            spec.key == "CPU"
        ):  # paged state is CUDA unified memory: on a CPU it is the plain 8-bit one
            states = [s for s in states if s not in memory.PAGED] or states
        steps = [in_bwd] if in_bwd else [False, True]
        out = [(p, o, b) for p in weights for o in states for b in steps if not (b and p == "fp16")]
        return [n for n in out if n not in set(_numerics(0, spec, t))]  # tier 0 offered those
    return [(p, t.optimizer if tier < 4 else "adamw", in_bwd and tier < 4) for p in plain]


EIGHT_BIT = ("adamw-8bit", "paged-adamw-8bit")


def search(
    cfg: Config,
    spec: GpuSpec,
    shape: ModelShape,
    seq_len: int,
    batch: int,
    capacity_gib: float | None = None,
    attention: str = "sdpa",
    images: ImageLoad | None = None,
) -> Plan:
    """All setups of the first tier that has any that fit, ranked; the best few that do not fit
    follow. ``images``: a vision-language model's images per row (plan/vision.py)."""
    capacity = (capacity_gib or spec.memory_gib) * 2**30
    plan = Plan(spec, shape, seq_len, batch)
    tf32 = cfg.techniques.tf32 if cfg.techniques.tf32 is not None else True
    for tier in range(len(TIERS)):
        rows = [
            _evaluate(c, tier, shape, spec, seq_len, capacity, tf32, attention, images)
            for c in tier_candidates(tier, cfg, spec, shape, batch, seq_len)
        ]
        fitting = sorted((r for r in rows if r.fits), key=lambda r: -r.speed.tokens_per_s)
        losing = sorted((r for r in rows if not r.fits), key=lambda r: r.memory.peak)
        plan.rows.extend(fitting)
        if fitting:
            plan.rows.extend(losing[:3])
            break
        plan.rows.extend(losing[:2])
        log.info(
            "nothing fits with %s; trying %s",
            TIERS[tier],
            TIERS[tier + 1] if tier + 1 < len(TIERS) else "-",
        )
    plan.rows.sort(key=lambda r: (not r.fits, -r.speed.tokens_per_s if r.fits else r.memory.peak))
    return plan


def _evaluate(
    c: Candidate,
    tier: int,
    shape: ModelShape,
    spec: GpuSpec,
    seq_len: int,
    capacity: float,
    tf32: bool,
    attention: str,
    images: ImageLoad | None = None,
) -> Row:
    on_gpu = spec.key != "CPU"
    mem = memory.estimate(shape, c, seq_len, on_gpu=on_gpu, attention=attention, images=images)
    spd = speed.estimate(shape, c, seq_len, spec, tf32, mem.host_activations)
    fits = mem.fits(capacity)
    if fits:
        why = f"{_gb(capacity - mem.reserved())} GB spare"
    else:
        why = f"needs {_gb(mem.reserved())} GB of {_gb(capacity)} GB"
    if tier:
        why += f"; {TIERS[tier]} (nothing fits without it)"
    return Row(c, tier, mem, spd, fits, why)


def _gb(nbytes: float) -> str:
    gib = nbytes / 2**30
    return f"{gib:.1f}" if gib >= 10 else f"{gib:.2f}"
