"""The results of `onegpu bench infer`: one row per setting and batch size, from its calls, and
what the run was (device, versions, commit, bandwidth, rounds)."""

from __future__ import annotations

import dataclasses
import platform
from typing import Optional

from onegpu.bench import infer_roofline as roof
from onegpu.bench import provenance
from onegpu.bench.infer_settings import BASELINE
from onegpu.bench.timing import median as _median
from onegpu.bench.timing import span as _range

# The libraries an inference results page names.
PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "torchao", "onegpu")
MEDIANS = ("ttft_ms", "prefill_tps", "decode_tps", "ms_per_step", "mem_rise", "load1")


def rows(bench, gbs: Optional[float]) -> list[dict]:
    cfg = bench.cfg
    positions = roof.mean_context(cfg.prompt_len, cfg.new_tokens)
    base = {c.batch: c for c in bench.cells if c.setting.name == BASELINE}
    out = []
    for cell in bench.cells:
        s, facts = cell.setting, bench.facts[cell.setting.name]
        med = {k: _median([r.get(k) for r in cell.runs]) for k in MEDIANS}
        alloc = facts["weight_alloc"]  # CUDA: what loading allocated; elsewhere as stored
        mem = roof.memory_breakdown(
            alloc if alloc is not None else facts["weight_bytes"],
            cell.kv_bytes,
            cell.growth,
            None if med["mem_rise"] is None else int(med["mem_rise"]),
        )
        step_bytes = roof.bytes_per_step(
            facts["weight_read_bytes"], cell.batch, positions, facts["kv_bytes_per_position"]
        )
        row = {
            "setting": s.name,
            "batch_size": cell.batch,
            "note": s.note(bench.device),
            "path": "engine" if s.engine else "generate",
            "compiled": _compiled(s, bench.device),
            **med,
            "decode_tps_range": _range([r["decode_tps"] for r in cell.runs]),
            "ms_per_step_range": _range([r["ms_per_step"] for r in cell.runs]),
            "load1_range": _range([r["load1"] for r in cell.runs]),
            "weight_mb": facts["weight_bytes"] / 2**20,
            "memory_mb": {k: None if v is None else v / 2**20 for k, v in mem.items()},
            "kv_source": cell.kv_source,
            "kv_bytes_per_position": facts["kv_bytes_per_position"],
            "weight_read_bytes": facts["weight_read_bytes"],
            "mean_context": positions,
            "bytes_per_step": step_bytes,
            "bandwidth_share": roof.bandwidth_share(step_bytes, med["ms_per_step"], gbs),
            **cell.quality,
            "runs": cell.runs,
            "infer": dataclasses.asdict(s.infer),
            "sampling": dataclasses.asdict(s.sampling),
        }
        row.update(_against(cell, base.get(cell.batch)))
        out.append(row)
    return out


def _compiled(s, device: str) -> str:
    if s.engine:
        if s.engine_compile == "off":
            return "no"
        return "inductor + CUDA graphs" if device == "cuda" else "inductor"
    return s.sampling.compile_backend if s.hf_compiled else "no"


def _against(cell, base) -> dict:
    """Decode speed against hf-default at the same batch size: the ratio of medians, and the ratio
    of ms per step round by round (each round's two calls ran minutes apart at most)."""
    if base is None or not base.runs:
        return {"decode_speedup": None, "ms_ratio": None, "ms_ratio_range": None}
    b = _median([r["decode_tps"] for r in base.runs])
    d = _median([r["decode_tps"] for r in cell.runs])
    paired = [
        r["ms_per_step"] / q["ms_per_step"]
        for r, q in zip(cell.runs, base.runs, strict=True)
        if r["ms_per_step"] and q["ms_per_step"]
    ]
    return {
        "decode_speedup": d / b if d and b else None,
        "ms_ratio": _median(paired),
        "ms_ratio_range": _range(paired),
    }


def kv_sizing(bench) -> list[dict]:
    """Per batch size: the engine's KV cache, sized to the request (prompt + new tokens), against a
    cache sized to the model's whole context, as a static cache sized to the context would be."""
    context = bench.ref.model.config.max_position_embeddings
    out = []
    for cell in bench.cells:
        if not cell.setting.engine or any(o["batch_size"] == cell.batch for o in out):
            continue
        per_pos = bench.facts[cell.setting.name]["kv_bytes_per_position"]
        out.append(
            {
                "batch_size": cell.batch,
                "setting": cell.setting.name,
                "positions": bench.cfg.prompt_len + bench.cfg.new_tokens,
                "engine_cache_mb": cell.kv_bytes / 2**20,
                "context_positions": context,
                "context_cache_mb": roof.cache_bytes(cell.batch, context, per_pos) / 2**20,
            }
        )
    return out


def summarize(bench) -> dict:
    import torch

    cfg = bench.cfg
    gbs = _median(bench.bandwidth)
    return {
        "benchmark": "infer",
        "device": _device_name(bench.device),
        "device_type": bench.device,
        "versions": provenance.versions(PACKAGES, missing=False),
        "config": dataclasses.asdict(cfg),
        "threads": torch.get_num_threads(),
        "rounds": bench.rounds,
        "bandwidth": {"gbs": gbs, "source": bench.bandwidth_source, "runs": bench.bandwidth},
        "results": rows(bench, gbs),
        "kv_sizing": kv_sizing(bench),
    }


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
