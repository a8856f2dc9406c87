"""GRPO arms of `onegpu bench train --objective grpo`, in the arm's own process (see
train_child.py): TRL's ``GRPOTrainer`` at its defaults as the peer, and both arms' per-step figures.

Both arms start from the same saved model (the same ``final/`` folder), sample groups of the same
prompts in the same order with the same reward function objects (onegpu.objectives.rewards, which
have TRL's signature), and count the same tokens: a step's tokens are the real prompt + completion
tokens of its completions. TRL tokenizes the prompts itself; the bench records the prompt ids its
``generate`` really received and checks them against ours, step by step.

Per step, both arms report: whole-step seconds (generation plus training), the seconds spent
sampling (inside ``generate``), the step's tokens and completion tokens, and the mean reward. The
rest of the step (scoring, the loss's forward and backward, the optimizer) is its training part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from onegpu.bench import train_peers


# ---------------------------------------------------------------------------------------- onegpu
def onegpu_steps(records: list[dict], rows: int) -> list[dict]:
    """Our per-step figures from metrics.jsonl logged every step: a record's window is the steps
    since the previous record (one, unless the loop skipped a step); its completion tokens are the
    mean completion length times the window's ``rows`` completions a step, and its sampling
    seconds those tokens over gen_tokens_per_s (our loop's own clock on rollout.sample).

    A step the loop skipped (non-finite loss or gradients) leaves a record of its own with only
    ``skipped``: no tokens, no clock. Its sampling and tokens are in the next record's window
    (the loop keeps that window open), so it is passed over here, not read as a step."""
    out, prev_step, prev_tokens = [], 0, 0
    for r in records:
        if "skipped" in r:
            continue
        steps = r["step"] - prev_step
        tokens = r["tokens_seen"] - prev_tokens
        prev_step, prev_tokens = r["step"], r["tokens_seen"]
        completion = round(r["completion_length"] * rows * steps)
        out.append(
            {
                "step": r["step"],
                "steps": steps,
                "tokens": tokens,
                "completion_tokens": completion,
                "seconds": tokens / max(r["tokens_per_s"], 1e-9),
                "gen_seconds": completion / max(r["gen_tokens_per_s"], 1e-9),
                "reward": r["reward"],
            }
        )
    return out


# ------------------------------------------------------------------------------------------ TRL
@dataclass
class GRPOSetup:
    """The TRL arm's inputs: run settings, device, model (from the run's saved folder), tokenizer,
    the prompt records in our loop's order (one row per prompt of each step) and, per step, the
    prompt ids our loop samples from (each prompt group_size times)."""

    cfg: Any
    device: Any
    model: Any
    tokenizer: Any
    records: Any  # datasets.Dataset: TRL's train_dataset
    step_prompt_ids: list[list[list[int]]]


def setup(spec: dict) -> GRPOSetup:
    from onegpu.data.prompts import PROMPT_IDS, ROW, GroupOrder

    cfg, device, _, recs, data, model = train_peers.load(spec)
    t, g = cfg.training, cfg.grpo
    per_step = t.micro_batch_size * t.grad_accum
    order = iter(GroupOrder(len(data.train_ds), t.micro_batch_size, per_step, g.group_size, t.seed))
    steps = [[i for _ in range(t.grad_accum) for i in next(order)] for _ in range(t.max_steps)]
    prompts = [i for step in steps for i in step[:: g.group_size]]  # one row per group
    rows = data.train_ds[ROW]
    ids = data.train_ds[PROMPT_IDS]
    records = recs.train.select([rows[i] for i in prompts]).select_columns([cfg.data.prompt_field])
    if cfg.data.prompt_field != "prompt":
        records = records.rename_column(cfg.data.prompt_field, "prompt")
    step_ids = [[list(ids[i]) for i in step] for step in steps]
    return GRPOSetup(cfg, device, model, data.tokenizer, records, step_ids)


class GenerateClock:
    """Wraps the policy's ``generate`` (an attribute of this one model object, in this process):
    the seconds spent sampling, and the prompt ids each call received (the left padding dropped),
    so the bench can check that TRL sampled from the same tokens as our loop."""

    def __init__(self, model, cuda: bool):
        self.model, self.cuda, self.inner = model, cuda, model.generate
        self.seconds, self.calls = 0.0, 0
        self.prompts: list[list[int]] = []
        model.generate = self

    def __call__(self, *args, **kw):
        ids, mask = kw.get("input_ids"), kw.get("attention_mask")
        if ids is not None and mask is not None:
            self.prompts += [
                r[m.bool()].tolist() for r, m in zip(ids.cpu(), mask.cpu(), strict=True)
            ]
        t0 = time.perf_counter()
        out = self.inner(*args, **kw)
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def step_recorder(clock: GenerateClock, budget_s: float, cuda: bool):
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Per step: the wall time since the previous step ended (generation is inside TRL's
        training_step, so this is the whole step), the tokens TRL counted (prompt + completion,
        state.num_input_tokens_seen) and the sampling seconds; the time budget as other arms."""

        def __init__(self):
            self.steps: list[dict] = []
            self.t0 = self.last = time.perf_counter()
            self.tokens, self.gen = 0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                import torch

                torch.cuda.synchronize()
            now = time.perf_counter()
            self.steps.append(
                {
                    "step": state.global_step,
                    "steps": 1,
                    "tokens": state.num_input_tokens_seen - self.tokens,
                    "seconds": now - self.last,
                    "gen_seconds": clock.seconds - self.gen,
                }
            )
            self.last, self.tokens, self.gen = now, state.num_input_tokens_seen, clock.seconds
            control.should_log = True  # the step's reward, whatever logging_steps says
            if now - self.t0 > budget_s:
                control.should_training_stop = True

    return StepRecorder()


def aligned_arguments(cfg, device) -> dict:
    """GRPOConfig settings set to our run's, each because the comparison needs it (hf_arguments
    already aligns batch, accumulation, steps, learning rate and schedule, seed)."""
    g = cfg.grpo
    return dict(
        **train_peers.precision_arguments(cfg, device),  # TRL's default bf16, ours fp32 on a CPU
        # the same groups: completions per prompt, their length, how they are sampled
        num_generations=g.group_size,
        max_completion_length=g.max_completion_length,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        # the same objective (our defaults are TRL's: dapo, beta 0, clip 0.2, group scaling)
        loss_type=g.loss_type,
        beta=g.beta,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high if g.epsilon_high is not None else g.epsilon,
        scale_rewards=g.scale_rewards,
        num_iterations=g.num_iterations,
        mask_truncated_completions=g.mask_truncated_completions,
        # the same prompts in the same order: the records are handed over in our loop's order
        shuffle_dataset=False,
        # the reward curve: one log record per step, as our arm's log_every 1
        logging_steps=1,
    )


def run_trl_grpo(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's GRPOTrainer at its defaults on our prompts in our order, with our reward functions."""
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from onegpu.objectives import rewards

    p = setup(spec)
    cfg = p.cfg
    cuda = p.device.type == "cuda"
    funcs = rewards.resolve(cfg.grpo, default_job=cfg.data.path is None)
    args = GRPOConfig(
        **{
            **train_peers.hf_arguments(cfg, spec["arm"], p.device),
            **aligned_arguments(cfg, p.device),
            "reward_weights": [r.weight for r in funcs],
        }
    )
    clock = GenerateClock(p.model, cuda)
    recorder = step_recorder(clock, spec["budget_s"], cuda)
    trainer = GRPOTrainer(
        model=p.model,
        reward_funcs=[r.fn for r in funcs],
        args=args,
        train_dataset=p.records,
        processing_class=p.tokenizer,
        callbacks=[recorder, *callbacks],
    )
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    rows = args.generation_batch_size
    steps = recorder.steps
    for s in steps:
        h = logs.get(s["step"], {})
        s["reward"] = h.get("reward")
        s["completion_tokens"] = round(h.get("completions/mean_length", 0.0) * rows)
    out = step_timing(steps, spec["warmup_steps"])
    out.update(
        steps=steps,
        final_loss=train_peers.final_loss(trainer),
        steps_done=trainer.state.global_step,
        tokens_seen=trainer.state.num_input_tokens_seen,
        evidence={
            **train_peers.trainer_evidence(trainer, args),
            "trl": trl.__version__,
            "loss_type": args.loss_type,
            "beta": args.beta,
            "reference": None if trainer.ref_model is None else type(trainer.ref_model).__name__,
            "generation": "vllm"
            if args.use_vllm
            else "transformers generate"
            + (" (continuous batching)" if args.use_transformers_continuous_batching else ""),
            "generate_calls": clock.calls,
            "same_tokens": same_prompts(
                clock.prompts, p.step_prompt_ids, trainer.state.global_step
            ),
        },
    )
    return out


def same_prompts(sampled: list[list[int]], ours: list[list[list[int]]], steps: int) -> bool:
    """The prompt ids TRL's generate received, row by row, against the rows of our loop's first
    ``steps`` steps: a difference would make the token counts, and so tokens/s, incomparable."""
    expected = [row for step in ours[:steps] for row in step]
    if len(sampled) != len(expected):
        raise RuntimeError(f"TRL sampled {len(sampled)} rows, onegpu {len(expected)}")
    for j, (a, b) in enumerate(zip(sampled, expected, strict=True)):
        if a != b:
            raise RuntimeError(
                f"TRL tokenized completion row {j}'s prompt differently from onegpu: the arms "
                "would not be comparable"
            )
    return True


# ----------------------------------------------------------------------------------- both arms
def step_timing(steps: list[dict], warmup: int) -> dict:
    """The timed steps (after ``warmup``): whole-step, generation and training figures, the same
    definitions for both arms. Generation tokens/s: completion tokens over sampling seconds;
    training tokens/s: the step's tokens over the rest of the step."""
    timed = [s for s in steps if s["step"] > warmup]
    tokens = sum(s["tokens"] for s in timed)
    seconds = sum(s["seconds"] for s in timed)
    gen = sum(s["gen_seconds"] for s in timed)
    completion = sum(s["completion_tokens"] for s in timed)
    return {
        "timed_steps": sum(s["steps"] for s in timed),
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "gen_seconds": gen,
        "train_seconds": seconds - gen,
        "gen_tokens_per_s": completion / gen if gen > 0 else None,
        "train_tokens_per_s": tokens / (seconds - gen) if seconds > gen else None,
    }
