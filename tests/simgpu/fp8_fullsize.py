"""FP8 setups for the full-size memory check (fullsize.py's harness, unchanged): the planner's peak
with torchao's float8 layers against PyTorch's MemTracker for one real optimizer step at the 1B, 3B
and 8B shapes. The float8 layers run the card's own path: ``torch._scaled_mm`` (its fake kernel:
shapes and dtypes) on float8 casts made by torchao's real code, the input cast to the autocast
dtype as under a card's CUDA autocast (techniques/fp8.float8_class). Every row:
benchmarks/simgpu_memory.py --fp8 -> benchmarks/results/simgpu-fp8-memory.md."""

from __future__ import annotations

from fullsize import SHAPES, Setup

from onegpu.plan.candidate import setup


def _fused(model: str) -> int:
    """The chunk loss=auto picks on a GPU for this model's vocabulary."""
    from onegpu.techniques.fused_loss import auto_chunk

    return auto_chunk(SHAPES[model]().vocab_size, on_gpu=True)


def _setups() -> list[Setup]:
    def c(mb, precision, checkpointing="off", optimizer="adamw", fp8="tensorwise", **more):
        return setup(
            mb,
            1,
            precision=precision,
            checkpointing=checkpointing,
            optimizer=optimizer,
            fp8=fp8,
            **more,
        )

    in_bwd = {"optimizer_in_backward": True}
    rows = [
        # bf16 autocast over fp32 weights, nothing checkpointed: every block saved its 16-bit
        # weight copies before; float8 layers save none (1.81 GiB less at 1B)
        ("Llama-3.2-1B", c(2, "bf16", loss_chunk_size=_fused("Llama-3.2-1B")), 2048),
        ("Llama-3.2-1B", c(4, "bf16-pure", "every-n", fp8="rowwise"), 2048),
        ("Llama-3.2-3B", c(2, "bf16", "every-n", loss_chunk_size=_fused("Llama-3.2-3B")), 2048),
        (
            "Llama-3.2-3B",
            c(2, "bf16-pure", "full", loss_chunk_size=_fused("Llama-3.2-3B"), **in_bwd),
            4096,
        ),
        # autocast's cache at the forward's end (the peak with the step in backward) holds no
        # float8 layer's weight
        ("1b", c(2, "bf16", "full", loss_chunk_size=_fused("1b"), **in_bwd), 4096),
        # LoRA: the frozen base in float8, adapters in fp32
        (
            "Llama-3.1-8B",
            c(2, "bf16", "full", lora={"r": 16}, loss_chunk_size=_fused("Llama-3.1-8B")),
            4096,
        ),
        ("Llama-3.1-8B", c(1, "bf16-pure", "every-n", "sgd", fp8="rowwise-gw-hp"), 4096),
    ]
    return [Setup(m, cand, seq) for m, cand, seq in rows]


FP8_SETUPS = _setups()
CHEAP = FP8_SETUPS[0]  # the test tier's row: the 1B shape, the float8 layers' saving
