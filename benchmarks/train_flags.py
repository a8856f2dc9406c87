"""The flags of `benchmarks/bench_train.py`'s presets (`onegpu bench train` options), each with
why it is sized as it is."""

from __future__ import annotations


def flags(text: str) -> tuple[str, ...]:
    """A preset's flags, written as on a command line."""
    return tuple(text.split())


# The default job's tokens per step (tiny preset, 16 x 256), split 8 x 2 so that the batch-size
# arm (16 x 1) and the accumulation arm (2 x 8) each change something. 24 steps keep the sweep near
# 20 minutes; that is too short for techniques.compile=auto, so the baseline here runs uncompiled
# and the compile arm shows what compiling adds.
CPU = flags(
    """
    --model.name tiny --data.seq_len 256 --training.micro_batch_size 8
    --training.grad_accum 2 --training.max_steps 24 --bench.warmup_steps 4
    --bench.reps 3 --bench.max_seconds 150
    """
)
# The default job's shape (tiny preset, 16 x 256 tokens a step), long enough (60 steps) that
# techniques.compile=auto compiles, as it does in the default run; compiling falls in the 10 untimed
# steps.
HEADLINE = flags(
    """
    --model.name tiny --data.seq_len 256 --training.micro_batch_size 16
    --training.grad_accum 1 --training.max_steps 60 --bench.warmup_steps 10
    --bench.reps 4 --bench.max_seconds 240
    """
)
# DPO on this CPU, onegpu's two defaults (full with a precomputed reference, LoRA with the adapters
# off) and our loop with a frozen-copy reference, next to TRL's DPOTrainer full and LoRA: pairs from
# the standard library (6 lines of code, then the 4 real next lines over the same words shuffled),
# 4 pairs x 2 a step, 14 steps (4 untimed), 5 interleaved rounds: about 10 minutes, mostly the 25
# processes starting.
CPU_DPO = flags(
    """
    --training.objective dpo --model.name tiny --data.seq_len 256
    --training.micro_batch_size 4 --training.grad_accum 2 --training.max_steps 14
    --bench.warmup_steps 4 --bench.reps 5 --bench.max_seconds 120
    """
)
# GRPO on this CPU: onegpu's default against TRL's GRPOTrainer at its defaults, from the default
# job's trained model (the model the default GRPO job starts from), with the default GRPO job's
# prompts (starts of standard-library functions), reward (python_continues), completion length (48),
# prompt length (128) and lr (2e-5): 2 prompts x 8 completions a step, 20 steps (2 untimed), 5
# interleaved rounds with a seed each; on the shared 2-core CPU about 1.5 minutes an onegpu run and
# 2.5 a TRL one (measured), ~21 minutes in all.
CPU_GRPO = flags(
    """
    --training.objective grpo --model.from_scratch false --data.seq_len 128
    --grpo.group_size 8 --grpo.max_completion_length 48
    --grpo.rewards [python_continues] --training.lr 2e-5 --training.micro_batch_size 16
    --training.grad_accum 1 --training.max_steps 20 --bench.warmup_steps 2
    --bench.reps 5 --bench.max_seconds 400
    """
)
# KTO and reward models on this CPU (bench_train.py cpu-kto, cpu-reward and their -small
# shapes): onegpu's default (full fine-tune; KTO's reference log-probs precomputed once) next to
# TRL's KTOTrainer / RewardTrainer at its defaults on the same pairs (KTO: each pair's two sides a
# desirable and an undesirable example), 4 x 2 a step, 14 steps (4 untimed), 5 interleaved rounds,
# one thread per process (OMP_NUM_THREADS=1, set by bench_train.py for these presets: on a shared,
# oversubscribed CPU two threads spin-waiting on each other slow a process many times over, more
# than the arms differ). The LoRA arms are left out to keep each shape within the time the shared
# machine allows; `--bench.arms lora,trl-kto-lora` adds them.
CPU_UNPAIRED = flags(
    """
    --data.seq_len 256 --training.micro_batch_size 4 --training.grad_accum 2
    --training.max_steps 14 --bench.warmup_steps 4 --bench.reps 5
    --bench.max_seconds 300
    """
)
# Sized for one 10-minute command each: 10 steps of 4 x 2 sequences of 2048 tokens (2 untimed: the
# allocator and the compilers warm up there), 2 repetitions. Micro-batch 8 is the largest that fits
# 80 GB at ~1B in bf16 (16 x 2048 needs ~100 GB of activations).
GPU = flags(
    """
    --data.seq_len 2048 --training.micro_batch_size 4 --training.grad_accum 2
    --training.max_steps 10 --bench.warmup_steps 2 --bench.reps 2
    --bench.max_seconds 240 --bench.max_micro_batch 8 --techniques.precision bf16
    --data.max_bytes 3000000
    """
)
# FP8's 3B shape (the `3b` preset, Llama-3.2-3B's layers; bench_train.py gpu-fp8-3b): the 1b
# presets' 16 x 2048 tokens a step as 2 x 8 (the planner puts 4 x 2048 of a 3B model in bf16 with
# fp32 master weights and AdamW above 80 GB), 8 steps (2 untimed): the arms compile, load and save
# a 12 GB model, so fewer steps keep two rounds of two arms in one 10-minute command.
GPU_3B = flags(
    """
    --data.seq_len 2048 --training.micro_batch_size 2 --training.grad_accum 8
    --training.max_steps 8 --bench.warmup_steps 2 --bench.reps 2 --bench.max_seconds 240
    --techniques.precision bf16 --data.max_bytes 3000000
    """
)
