"""`onegpu plan [MODEL] --gpu NAME [train flags] [--batch B]`: will it fit, and how fast will it
run?

The planner plans a training config, so plan takes the flags of `onegpu train` as they are
(`--data.seq_len`, `--training.micro_batch_size`, `--techniques.lora.enabled`, `--config FILE`,
...): a train command line with `train` replaced by `plan` predicts that run, and the techniques it
fixes are respected in the recommendation. On top come the flags only a plan has: the GPU (`--gpu`),
the effective batch to keep (`--batch`, default micro_batch_size x grad_accum), the memory to plan
for (`--memory_gib`) and the output (`--top`, `--json`, `--save`). MODEL is short for
`--model.name`. The old spellings `--seq-len` and `--memory-gib` still work, with a note.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import Optional

from onegpu.cli.args import (
    make_parser,
    model_shorthand,
    note_model_shorthand,
    parse,
    renamed,
)
from onegpu.config import Config, to_dict
from onegpu.errors import OnegpuError

RENAMED = {"--seq-len": "--data.seq_len", "--memory-gib": "--memory_gib"}


def build_parser():
    p = make_parser(
        "onegpu plan",
        "Predict peak memory and tokens/s of training setups for a model on a GPU "
        "(detected, or named with --gpu), and print the fastest that fits as a config. Takes "
        "every 'onegpu train' flag; the setup it describes is what gets planned.",
        Config,
        usage="onegpu plan [MODEL] [--gpu NAME] [--batch B] [--section.field VALUE ...]",
        skip={"plan"},
    )  # train's --plan (probe while training) means nothing here
    p.add_argument(
        "preset",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="preset name, local model directory or Hub id (same as --model.name)",
    )
    p.add_argument(
        "--gpu",
        type=Optional[str],
        default=None,
        help="plan for this GPU (e.g. H100, A100-40GB, T4); 'list' shows the catalog",
    )
    p.add_argument(
        "--batch",
        type=Optional[int],
        default=None,
        help="effective batch in sequences, kept exactly (default: micro_batch_size x grad_accum)",
    )
    p.add_argument(
        "--memory_gib",
        type=Optional[float],
        default=None,
        help="memory to plan for instead of the GPU's total",
    )
    p.add_argument(
        "--max_context",
        type=bool,
        default=False,
        help="print, per setup, the longest sequence that fits at batch 1 and its tokens/s",
    )
    p.add_argument(
        "--image_size",
        type=Optional[int],
        default=None,
        help="a vision-language model: print the tokens one image of this side becomes (default: "
        "the images of --data.path, when given)",
    )
    p.add_argument(
        "--export",
        type=str,
        default="safetensors,gguf",
        help="formats whose export needs (memory, disk) the plan's last line gives, as "
        "onegpu export --format takes them; 'none' leaves the line out",
    )
    p.add_argument("--export_quant", type=str, default="q8_0", help="the GGUF type of that line")
    p.add_argument("--top", type=int, default=12, help="rows of the table")
    p.add_argument(
        "--json",
        type=bool,
        default=False,
        help="print JSON instead of the table and YAML",
    )
    p.add_argument(
        "--save",
        type=Optional[str],
        default=None,
        help="also write the recommended config to this YAML file",
    )
    note_model_shorthand(p)
    return p


def cli(argv: Sequence[str]) -> int:
    switches = {
        "--json": "--json=true",
        # one flag style (underscores); the hyphenated spelling works too
        "--max-context": "--max_context=true",
        "--max_context": "--max_context=true",
    }
    argv = [switches.get(a, a) for a in renamed(argv, RENAMED)]  # a switch alone means on
    cfg, ns = parse(build_parser(), model_shorthand(argv), Config)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ns.gpu and ns.gpu.lower() == "list":
        return _print_catalog()
    if ns.max_context:
        return _print_max_context(cfg, ns)
    from onegpu.plan import make_plan
    from onegpu.plan.images import image_tokens

    images = image_tokens(cfg, ns.preset or cfg.model.name, ns.image_size)
    load = images.load if images is not None else None  # the tower's activations are planned too
    plan, recommended = make_plan(cfg, ns.preset, ns.gpu, None, ns.batch, ns.memory_gib, load)
    needs = export_needs(cfg, plan.shape, ns.export, ns.export_quant)
    if ns.json:
        out = plan_json(plan, recommended)
        if images is not None:
            out["image_tokens"] = {
                "examples": images.examples,
                "image": images.image,
                "text": images.text,
                "source": images.source,
            }
        if needs is not None:
            out["export"] = {
                "formats": needs.formats,
                "quant": needs.quant or None,
                "dtype": needs.dtype,
                "memory_bytes": needs.memory_bytes,
                "disk_bytes": needs.disk_bytes,
                "disk_parts": needs.disk_parts,
            }
        print(json.dumps(out, indent=1))
    else:
        print_plan(plan, recommended, ns.top, needs)
        if images is not None:
            print("\n" + images.describe(plan.seq_len))
    if ns.save and recommended is not None:
        from onegpu.config import save_yaml

        save_yaml(recommended, ns.save)
        print(
            f"\nsaved: {ns.save}  (train with: onegpu train --config {ns.save})",
            file=sys.stderr,
        )
    if recommended is None:
        raise OnegpuError(
            f"no setup of {plan.shape.name} fits in {plan.gpu.memory_gib:.0f} GB at "
            f"seq_len={plan.seq_len}, batch={plan.batch}.",
            hint="shorten --data.seq_len, pick a bigger GPU with --gpu, or a smaller model",
        )
    return 0


def export_needs(cfg: Config, shape, formats: str, quant: str):
    """What `onegpu export --format FORMATS` of the trained model will take (onegpu.export.plan's
    arithmetic, the one the export's own pre-flight prints), or None ('none', a reward model:
    export writes causal LMs). The dtype is what the run saves: bf16 under bf16-pure, else the
    model config's own, else float32."""
    if formats.strip().lower() == "none" or cfg.training.objective == "reward":
        return None
    from onegpu.export.config import ExportConfig
    from onegpu.export.plan import make_plan

    ecfg = ExportConfig(model=shape.name, format=formats, quant=quant)
    ecfg.validate()  # an unknown format or quant type: the export's own error
    own = str(getattr(shape.config, "dtype", None) or "float32").replace("torch.", "")
    dtype = "bfloat16" if cfg.techniques.precision == "bf16-pure" else own
    return make_plan(shape.params, dtype, ecfg.formats(), quant)


def print_plan(plan, recommended, top: int, needs=None) -> None:
    calibrated = any(r.speed.calibrated for r in plan.rows)
    tag = "" if calibrated else " (uncalibrated)"
    shape = plan.shape
    print(
        f"model {shape.name}: {shape.params / 1e6:,.1f}M parameters, {shape.layers} layers, vocab "
        f"{shape.vocab}"
    )
    print(
        f"gpu   {plan.gpu.name}: {plan.gpu.memory_gib:.1f} GB, seq_len {plan.seq_len}, effective "
        f"batch {plan.batch}\n"
    )
    width = max([52] + [len(r.candidate.label()) for r in plan.rows[:top]])
    print(f"{'#':>2}  {'plan':<{width}} {'peak GB':>8} {'tokens/s' + tag:>24}  why")
    for i, r in enumerate(plan.rows[:top], 1):
        mark = "" if r.fits else "x"
        print(
            f"{mark or i:>2}  {r.candidate.label():<{width}} {r.memory.peak / 2**30:>8.2f} "
            f"{r.speed.tokens_per_s:>24,.0f}  {r.why}"
        )
    from onegpu.plan.fp8 import gain, gain_line

    print("\n" + gain_line(gain(plan.rows, plan.gpu, plan.shape), plan.gpu))
    assumed = sorted({a for r in plan.rows[:top] for a in r.speed.assumptions})
    if assumed:
        print("\nassumed, not measured: " + "; ".join(assumed))
    if not calibrated:
        print(
            "\n(uncalibrated): speeds assume the default efficiency; a probe on this GPU "
            "(onegpu train --plan auto) measures and stores the real one."
        )
    if needs is not None:
        print(
            f"\nexport (onegpu export --format {needs.formats}"
            + (f" --quant {needs.quant}" if needs.quant else "")
            + f"): needs {needs.needs()}"
        )
    if recommended is not None:
        import yaml

        print("\n# recommended config (onegpu train --config FILE):")
        print(yaml.safe_dump(to_dict(recommended), sort_keys=False), end="")


def plan_json(plan, recommended) -> dict:
    from onegpu.plan.fp8 import gain

    rows = [
        {
            "plan": r.candidate.label(),
            "fits": r.fits,
            "peak_gb": r.memory.peak / 2**30,
            "reserved_gb": r.memory.reserved() / 2**30,
            "tokens_per_s": r.speed.tokens_per_s,
            "calibrated": r.speed.calibrated,
            "assumptions": list(r.speed.assumptions),
            "why": r.why,
            "components_gb": {k: v / 2**30 for k, v in r.memory.components.items()},
            "micro_batch": r.candidate.training.micro_batch_size,
            "grad_accum": r.candidate.training.grad_accum,
        }
        for r in plan.rows
    ]
    return {
        "model": plan.shape.name,
        "params": plan.shape.params,
        "gpu": plan.gpu.key,
        "memory_gb": plan.gpu.memory_gib,
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "rows": rows,
        "fp8": gain(plan.rows, plan.gpu, plan.shape),
        "recommended": to_dict(recommended) if recommended is not None else None,
    }


def _print_max_context(cfg, ns) -> int:
    """--max-context: the longest sequence per setup (plan/context.py), and a published figure for
    the same model, method and card class where there is one."""
    from onegpu.plan import resolve
    from onegpu.plan.context import max_context
    from onegpu.plan.published import published_context

    spec, _, shape, attention = resolve(cfg, ns.preset, ns.gpu)
    rows = max_context(cfg, spec, shape, ns.memory_gib, attention)
    gib = ns.memory_gib or spec.memory_gib
    print(f"model {shape.name}: {shape.params / 1e6:,.1f}M parameters, {shape.layers} layers")
    print(
        f"gpu   {spec.name}: {gib:.1f} GB; batch 1, attention {attention}; method "
        f"{rows[0].candidate.method}\n"
    )
    print(f"{'setup':<40} {'longest seq':>12} {'peak GB':>8} {'host GB':>8} {'tokens/s':>10}  plan")
    for r in rows:
        if not r.seq_len:
            print(f"{r.label:<40} {'none fits':>12}")
            continue
        host = r.memory.host_activations / 2**30
        print(
            f"{r.label:<40} {r.seq_len:>12,} {r.memory.peak / 2**30:>8.2f} {host:>8.1f} "
            f"{r.speed.tokens_per_s:>10,.0f}  {r.candidate.label()}"
        )
    if shape.max_positions and any(r.seq_len > shape.max_positions for r in rows):
        print(
            f"\nbeyond max_position_embeddings={shape.max_positions}: memory allows it; the "
            "model's positions need extending (rope scaling) to train there"
        )
    pub = published_context(shape.config, gib, cfg.techniques.lora)
    if pub is not None:
        best = max(r.seq_len for r in rows)
        print(
            f"\npublished, {pub.model} {pub.method} on a {pub.card_gb} GB card: Unsloth "
            f"{pub.tokens:,} tokens, Hugging Face + FA2 {pub.baseline_tokens:,} ({pub.source}); "
            f"ours {best:,} ({best / pub.tokens:.2f}x Unsloth's)"
        )
    assumed = sorted({a for r in rows if r.speed for a in r.speed.assumptions})
    if assumed:
        print("\nassumed, not measured: " + "; ".join(assumed))
    return 0


def _print_catalog() -> int:
    from onegpu.hardware import CATALOG

    print(
        f"{'gpu':<11} {'memory GB':>9} {'fp32':>6} {'tf32':>7} {'bf16':>7} {'fp8':>7} {'GB/s':>6}  "
        "name"
    )
    for g in CATALOG:
        print(
            f"{g.key:<11} {g.memory_gib:>9.1f} {g.fp32:>6.1f} {g.tf32:>7.1f} {g.bf16:>7.1f} "
            f"{g.fp8:>7.1f} {g.bandwidth_gbs:>6.0f}  {g.name}"
        )
    print("\nTFLOP/s are dense peaks from the vendors' datasheets.")
    return 0
