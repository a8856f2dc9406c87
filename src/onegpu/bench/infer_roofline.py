"""Where a decode step stands against the device's memory bandwidth, and what its peak memory is
made of. Each figure is computed here and only here; the bench hands in what it measured.

A decode step reads every weight it multiplies by once (the input embedding only for the rows it
looks up, so it is left out unless the output head shares it) and the K and V of every position
each row attends. At batch sizes where the step is bound by memory rather than by arithmetic, that
many bytes per step over the device's bandwidth is the fastest a step can be: the bandwidth share
is bytes per step x steps per second / bandwidth.
"""

from __future__ import annotations

from typing import Optional


def weight_read_bytes(model) -> int:
    """Weight bytes a decode step reads: everything the model stores (quantized tensors as really
    stored) but the input embedding table, unless the output head is that same table."""
    from onegpu.techniques.quantization import weight_bytes

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    return weight_bytes(model) - (0 if tied else weight_bytes(model.get_input_embeddings()))


def mean_context(prompt_len: int, new_tokens: int) -> float:
    """Positions a row attends, averaged over the decode steps: step i (1 .. new_tokens - 1) writes
    position prompt_len + i - 1 and attends prompt_len + i positions."""
    steps = new_tokens - 1
    return prompt_len + (steps + 1) / 2 if steps > 0 else float(prompt_len)


def kv_read_bytes(rows: int, positions: float, kv_bytes_per_position: int) -> float:
    """K and V bytes a step reads: rows x positions attended x bytes per position (all layers)."""
    return rows * positions * kv_bytes_per_position


def bytes_per_step(weights: int, rows: int, positions: float, kv_bytes_per_position: int) -> float:
    return weights + kv_read_bytes(rows, positions, kv_bytes_per_position)


def bandwidth_share(step_bytes: float, ms_per_step: Optional[float], gbs: float) -> Optional[float]:
    """Fraction of the bandwidth limit reached: bytes per step x steps per second / bandwidth."""
    if not ms_per_step or not gbs:
        return None
    return step_bytes * (1000.0 / ms_per_step) / (gbs * 1e9)


def memory_breakdown(
    weights: int, kv: int, resident_growth: Optional[int], transient_peak: Optional[int]
) -> dict:
    """A setting's peak memory as weights + KV cache + workspace, in bytes.

    ``resident_growth``: what the setting's first (warm-up) call left allocated (the engine's KV
    cache and state, CUDA-graph pools, a static cache); ``transient_peak``: how far allocated
    memory rose above its level at the start of a timed call. Both None where not measured (CPU).
    The setting's peak is its weights + both: other settings' models, resident at the same time,
    are not part of it. Workspace is the rest of that peak: peak - weights - KV."""
    if resident_growth is None or transient_peak is None:
        return {"weights": weights, "kv": kv, "workspace": None, "peak": None}
    peak = weights + resident_growth + transient_peak
    return {"weights": weights, "kv": kv, "workspace": peak - weights - kv, "peak": peak}


def cache_bytes(rows: int, positions: int, kv_bytes_per_position: int) -> int:
    """Bytes of a KV cache holding ``positions`` positions for each of ``rows`` rows."""
    return rows * positions * kv_bytes_per_position
