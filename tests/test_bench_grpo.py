"""`onegpu bench train --objective grpo`: onegpu's GRPO next to TRL's GRPOTrainer on the same
model, prompts (in the same order, checked token by token), rewards and groups; whole-step,
generation and training figures and the reward curve per arm."""

from __future__ import annotations

import json

import pytest

from onegpu.bench import train as bench_train
from onegpu.bench.settings import BenchTrainConfig
from onegpu.bench.train_grpo import onegpu_steps, same_prompts, step_timing
from onegpu.training.state import Callback

GRPO_ARMS = ["baseline", "trl-grpo"]  # the runs below; the compile arm is listed, not run


def grpo_bench(tmp_path, model_dir) -> BenchTrainConfig:
    """A saved tiny Llama on the default job's prompts and reward (python_continues): 2 prompts x
    4 completions a step (4 x 2), 6 tokens each, 2 steps, 1 round."""
    b = BenchTrainConfig()
    b.training.objective = "grpo"
    b.model.name, b.model.from_scratch = str(model_dir), False
    b.data.seq_len, b.data.max_bytes = 240, 200_000
    b.grpo.group_size, b.grpo.max_completion_length = 4, 6
    b.training.micro_batch_size, b.training.grad_accum, b.training.max_steps = 4, 2, 2
    b.bench.warmup_steps, b.bench.reps, b.bench.max_seconds = 1, 1, 60
    b.bench.out, b.bench.name = str(tmp_path / "results"), "grpo"
    b.bench.arms = ",".join(GRPO_ARMS)
    return b


def test_dry_run_lists_the_grpo_arms(capsys, tmp_path, tiny_model_dir):
    """`--objective grpo` swaps the arm table for GRPO's, with TRL's GRPOTrainer as the peer;
    nothing is trained or written."""
    from onegpu.cli.main import main

    argv = ["bench", "train", "--objective", "grpo", "--model.name", str(tiny_model_dir)]
    argv += ["--model.from_scratch", "false", "--bench.dry_run", "true"]
    assert main(argv + ["--bench.out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    listed = {
        line.split()[0]: line.split(None, 1)[1]
        for line in out.splitlines()
        if line.startswith("  ")
    }
    assert list(listed) == ["baseline", "compile", "trl-grpo"]
    assert listed["trl-grpo"] == "TRL GRPOTrainer"
    assert "objective grpo" in out and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_both_arms_sample_the_same_prompt_tokens_and_the_report_has_every_row(
    tmp_path, tiny_model_dir
):
    """Real children, 2 steps each: both arms ran, TRL's generate received exactly our prompt ids
    (same prompts, same order, same tokenization), each step's figures add up, and the report has
    the headline ratios, both arms' rows and the reward curve."""
    paths = bench_train.run(grpo_bench(tmp_path, tiny_model_dir))
    doc = json.loads(paths["json"].read_text())
    assert [s["arm"] for s in doc["schedule"]] == GRPO_ARMS
    assert doc["setup"]["data_format"] == "prompt" and doc["uptime_after"] is not None
    arms = doc["arms"]
    for name in GRPO_ARMS:
        a = arms[name]
        assert a["status"] == "ok", (name, a.get("reason"))
        (r,) = a["reps"]
        assert r["steps_done"] == 2 and r["timed_steps"] == 1, name
        assert [s["step"] for s in r["steps"]] == [1, 2], name
        for s in r["steps"]:  # 8 completions of at most 6 tokens, after prompts of >= 1 token
            assert 8 <= s["completion_tokens"] <= 8 * 6 and s["tokens"] > s["completion_tokens"]
            assert 0 < s["gen_seconds"] < s["seconds"] and 0.0 <= s["reward"] <= 1.0, name
        assert r["tokens_per_s"] > 0 and r["train_mem_mb"] > 0, name
        assert r["gen_tokens_per_s"] > 0 and r["train_tokens_per_s"] > r["tokens_per_s"], name
        assert a["reward_curve"][-1]["step"] == 2, name
    ev = arms["trl-grpo"]["reps"][0]["evidence"]
    assert ev["same_tokens"] is True and ev["generate_calls"] == 2
    assert ev["precision"] == "fp32" and ev["loss_type"] == "dapo" and ev["reference"] is None
    assert ev["checkpointing"] is True  # TRL's default, kept
    assert arms["baseline"]["reps"][0]["evidence"]["precision"] == "fp32"
    vs = doc["vs_trl_grpo"]["baseline"]
    assert all(vs[k] > 0 for k in ("speed_x", "gen_x", "train_x", "memory_x"))

    md = paths["md"].read_text()
    assert "onegpu `baseline` / TRL GRPOTrainer (defaults):" in md
    assert "| baseline | onegpu GRPO, full fine-tune |" in md
    assert "| trl-grpo | TRL GRPOTrainer, defaults, full fine-tune |" in md
    assert "Reward per step" in md and "| 2 |" in md and "shuffle_dataset=False" in md
    assert paths["png"].stat().st_size > 0


def test_a_prompt_tokenized_differently_is_refused():
    ours = [[[1, 2, 3], [1, 2, 3]], [[4, 5], [4, 5]]]
    assert same_prompts([[1, 2, 3], [1, 2, 3]], ours, steps=1)
    with pytest.raises(RuntimeError, match="row 3"):
        same_prompts([[1, 2, 3], [1, 2, 3], [4, 5], [4, 6]], ours, steps=2)
    with pytest.raises(RuntimeError, match="sampled 1 rows"):
        same_prompts([[1, 2, 3]], ours, steps=1)


def test_generation_and_training_split_the_timed_steps():
    """Our metrics (one record per step) become per-step figures; the first warmup steps are left
    out, and generation plus training is the whole step."""
    records = [
        {"step": 1, "tokens_seen": 100, "tokens_per_s": 50.0, "completion_length": 5.0,
         "gen_tokens_per_s": 20.0, "reward": 0.1},
        {"step": 2, "tokens_seen": 300, "tokens_per_s": 100.0, "completion_length": 6.0,
         "gen_tokens_per_s": 48.0, "reward": 0.5},
    ]  # fmt: skip
    steps = onegpu_steps(records, rows=8)
    assert steps[1] == {"step": 2, "steps": 1, "tokens": 200, "completion_tokens": 48,
                        "seconds": 2.0, "gen_seconds": 1.0, "reward": 0.5}  # fmt: skip
    t = step_timing(steps, warmup=1)
    assert t["timed_steps"] == 1 and t["timed_tokens"] == 200 and t["timed_seconds"] == 2.0
    assert t["gen_tokens_per_s"] == 48.0 and t["train_tokens_per_s"] == 200.0
    assert t["gen_seconds"] + t["train_seconds"] == t["timed_seconds"]


def test_each_round_samples_with_its_own_seed():
    """Every round would otherwise repeat the same rollouts: round k runs seed + k, for both arms;
    other objectives keep one seed."""
    b = BenchTrainConfig()
    b.training.objective = "grpo"
    assert [bench_train.round_seed(b, k) for k in (0, 2)] == [
        {"training.seed": b.training.seed},
        {"training.seed": b.training.seed + 2},
    ]
    b.training.objective = "dpo"
    assert bench_train.round_seed(b, 1) == {}


class NanInStep(Callback):
    """Makes one step's training forward non-finite (the final norm's output times NaN) so the
    loop skips that update, as a bf16 step on a card did; sampling, in eval mode, stays finite."""

    def __init__(self, step: int):
        self.step, self.hook = step, None

    def on_step_end(self, run, state) -> None:
        if state.step == self.step - 1:
            norm = run.model.model.norm
            self.hook = norm.register_forward_hook(
                lambda m, args, out: out * float("nan") if m.training else out
            )
        elif self.hook is not None:
            self.hook.remove()
            self.hook = None


def test_a_skipped_step_leaves_the_onegpu_arm_its_per_step_figures(tmp_path, tiny_model_dir):
    """The loop logs a skipped step as a record with no tokens_seen (the card's KeyError): the arm
    reads the next record's window as covering both steps, and counts the skipped one."""
    from onegpu.bench.train_child import run_onegpu
    from test_grpo import grpo_cfg

    cfg = grpo_cfg(tmp_path, tiny_model_dir, max_steps=3, save_every=0, eval_every=0)
    out = run_onegpu({"config": cfg, "warmup_steps": 0}, callbacks=(NanInStep(2),))
    assert out["skipped_steps"] == 1 and out["steps_done"] == 3
    assert [(s["step"], s["steps"]) for s in out["steps"]] == [(1, 1), (3, 2)]
    assert out["timed_steps"] == 3 and out["timed_tokens"] == out["tokens_seen"]
    assert all(s["completion_tokens"] > 0 and s["gen_seconds"] > 0 for s in out["steps"])


def test_the_compile_arm_runs_only_where_the_baseline_does_not_compile(tiny_model_dir):
    """A 20-step CPU run leaves compile=auto off, so the compile arm shows what a default run of
    50+ steps samples and trains with; on a GPU it is skipped (gpu-grpo fits one command)."""
    from types import SimpleNamespace

    from onegpu.bench.arms import grpo_arms
    from onegpu.techniques.compile import has_cpu_compiler

    arm = next(a for a in grpo_arms() if a.name == "compile")
    assert arm.overrides == {"techniques.compile": "default"}
    b = BenchTrainConfig()
    b.training.objective, b.training.max_steps = "grpo", 20
    b.model.name, b.model.from_scratch = str(tiny_model_dir), False
    assert "10-minute command" in arm.needs(SimpleNamespace(type="cuda"), b, "prompt")
    if has_cpu_compiler():
        assert arm.needs(SimpleNamespace(type="cpu"), b, "prompt") is None
