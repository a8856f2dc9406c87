"""GRPO runs on the loop every objective shares: rewards as TRL calls them, the log, bitwise resume
(sampling included), the out-of-memory retry, rollouts reused over num_iterations, the references,
the prompt order, and the default job's model."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import onegpu
from helpers import make_cfg, oom_above
from onegpu.data.prompts import GroupOrder
from onegpu.objectives import make_objective
from test_grpo_inputs import write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

TRL_STYLE = '''
SEEN = {}
def answer_length(prompts, completions, answer, **kwargs):
    """A reward written for TRL: reads the extra column `answer` by name."""
    SEEN["columns"] = sorted(kwargs) + ["answer"]
    SEEN.setdefault("n", []).append(len(completions))
    return [1.0 if len(c) < 3 * len(a) else 0.0 for c, a in zip(completions, answer)]
'''


def grpo_cfg(tmp_path, model_dir, name="run", grpo=None, **training):
    cfg = make_cfg(tmp_path, model_dir, name, **training)
    cfg["data"]["path"] = str(write_prompts(tmp_path, n=24))
    cfg["training"].update(objective="grpo", micro_batch_size=4, grad_accum=2)
    cfg["training"].update(training)
    cfg["grpo"] = {"group_size": 4, "max_completion_length": 6, "rewards": ["length"]}
    cfg["grpo"].update(grpo or {})
    return cfg


def metrics(run_dir, split="train"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split and "loss" in r]


def test_a_reward_written_for_trl_runs_unchanged_and_everything_is_logged(
    tmp_path, tiny_model_dir, monkeypatch
):
    (tmp_path / "trl_rewards.py").write_text(textwrap.dedent(TRL_STYLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = grpo_cfg(
        tmp_path, tiny_model_dir, max_steps=2, save_every=0, eval_every=0,
        grpo={"rewards": ["trl_rewards:answer_length", "length"], "reward_weights": [1.0, -0.5],
              "beta": 0.04},
    )  # fmt: skip
    result = onegpu.train(cfg)
    import trl_rewards

    assert 8 in trl_rewards.SEEN["n"]  # a training step: 2 prompts x group 4 (eval: 1 x 4)
    assert "completion_ids" in trl_rewards.SEEN["columns"]  # as TRL passes them
    train = metrics(result.run_dir)[-1]
    for key in ("reward", "reward_std", "rewards/trl_rewards:answer_length/mean",
                "rewards/length/std", "completion_length", "completion_length_max",
                "truncated_ratio", "clip_ratio", "entropy", "kl", "gen_tokens_per_s",
                "train_tokens_per_s", "tokens_per_s", "frac_reward_zero_std"):  # fmt: skip
        assert key in train, key
    assert train["completion_length_max"] <= 6 and 0 <= train["truncated_ratio"] <= 1
    assert train["entropy"] > 0 and train["kl"] >= 0
    val = metrics(result.run_dir, "val")[-1]
    assert "reward" in val and "rewards/length/mean" in val  # validation prompts, same figures


def test_resume_is_bitwise_with_sampling_included(tmp_path, tiny_model_dir):
    full = onegpu.train(grpo_cfg(tmp_path, tiny_model_dir, "full", max_steps=4, save_every=2))
    cut = grpo_cfg(tmp_path, tiny_model_dir, "cut", max_steps=4, save_every=2)
    cut["training"]["max_steps"] = 2
    onegpu.train(cut)
    cut["training"]["max_steps"] = 4
    cut["output"]["resume"] = "latest"
    resumed = onegpu.train(cut)
    a = load_file(str(full.final_dir / "model.safetensors"))
    b = load_file(str(resumed.final_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rewards = [(r["step"], r["reward"], r["loss"]) for r in metrics(full.run_dir)]
    assert rewards == [(r["step"], r["reward"], r["loss"]) for r in metrics(resumed.run_dir)]


def test_out_of_memory_retry_keeps_the_step_s_completions(tmp_path, tiny_model_dir, monkeypatch):
    from onegpu.training import assemble

    monkeypatch.setattr(assemble, "make_objective", oom_above(2, make_objective))
    result = onegpu.train(grpo_cfg(tmp_path, tiny_model_dir, max_steps=2, save_every=0))
    assert (result.state.micro_batch_size, result.state.grad_accum) == (2, 4)  # 8 per step
    assert len(metrics(result.run_dir)) == 2


def test_rollouts_serve_num_iterations_steps_then_are_sampled_again(tiny_model_dir, tiny_tokenizer):
    from onegpu.config import from_dict
    from onegpu.data.prompts import PROMPT_IDS, ROW
    from onegpu.objectives.grpo import OLD

    cfg = from_dict({"training": {"objective": "grpo", "micro_batch_size": 4},
                     "data": {"path": "x"},
                     "grpo": {"group_size": 4, "num_iterations": 2, "max_completion_length": 5,
                              "rewards": ["length"]}})  # fmt: skip
    objective = make_objective(cfg, len(tiny_tokenizer), False, tokenizer=tiny_tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    ids = tiny_tokenizer("def f(x):")["input_ids"]
    micro = [{PROMPT_IDS: [ids] * 4, ROW: [0] * 4, "prompt": ["def f(x):"] * 4}]
    torch.manual_seed(0)
    first = objective.begin_cycle(model, micro)
    objective.end_cycle()
    second = objective.begin_cycle(model, micro)
    objective.end_cycle()
    third = objective.begin_cycle(model, micro)
    assert OLD in first[0]  # the log-probs at sampling, for the ratio of the second use
    assert torch.equal(first[0]["input_ids"], second[0]["input_ids"])
    assert not torch.equal(first[0]["input_ids"], third[0]["input_ids"])  # sampled again


def test_group_order_keeps_groups_and_steps_whole_and_survives_a_smaller_micro_batch():
    from onegpu.training.recovery import convert_position

    order = GroupOrder(10, batch_size=4, per_step=8, group=4, seed=3)
    rows = [i for _, b in zip(range(10), order, strict=False) for i in b]
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    assert all(len(set(g)) == 1 for g in groups)  # a prompt's completions side by side
    assert len({g[0] for g in groups[:5]}) == 5  # one epoch: 5 different prompts (10 // 2 steps)
    # after 3 micro-batches of 4, an out-of-memory retry halves the micro-batch: same rows follow
    start = convert_position(3, order.rows_per_epoch, 4, 2)
    halved = GroupOrder(10, batch_size=2, per_step=8, group=4, seed=3, start=start)
    assert [i for _, b in zip(range(4), halved, strict=False) for i in b] == rows[12:20]
    again = GroupOrder(10, batch_size=4, per_step=8, group=4, seed=3, repeat=2)
    step = [i for _, b in zip(range(4), again, strict=False) for i in b]
    assert step[:8] == step[8:]  # num_iterations=2: each step's prompts twice


@pytest.mark.parametrize("lora", [False, True])
def test_references_start_equal_to_the_policy(tmp_path, tiny_model_dir, lora):
    """beta > 0: a copy (full fine-tune) or the adapters switched off (LoRA); at the first step the
    policy is the reference, so the KL is 0."""
    cfg = grpo_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=0, eval_every=0, log_every=1,
                   grpo={"beta": 0.1})  # fmt: skip
    cfg["techniques"]["lora"] = {"enabled": lora}
    result = onegpu.train(cfg)
    assert metrics(result.run_dir)[0]["kl"] == pytest.approx(0.0, abs=1e-7)


def test_default_job_takes_the_newest_default_run_and_only_unset_settings(tmp_path):
    from onegpu.config import Config, save_yaml
    from onegpu.training import rl_default

    runs = tmp_path / "runs"
    for name, objective in (("old", "sft"), ("new", "sft"), ("dpo", "dpo")):
        c = Config()
        c.training.objective = objective
        (runs / name / "final").mkdir(parents=True)
        save_yaml(c, runs / name / "config.yaml")
        (runs / name / "final" / "config.json").write_text("{}")
    (runs / "dpo" / "final" / "config.json").touch()  # newest, but not the default job
    import os

    os.utime(runs / "old" / "final", (1, 1))
    assert rl_default.newest_default_final(runs) == runs / "new" / "final"
    cfg = Config()
    cfg.training.objective, cfg.output.dir = "grpo", str(runs)
    cfg.grpo.max_completion_length = 20  # the user's choice stays
    settled = rl_default.settle(cfg, train_default=None)
    assert settled.model.name == str(runs / "new" / "final")
    assert settled.grpo.max_completion_length == 20 and settled.training.max_steps == 60
    cfg.data.path = "mine.jsonl"  # not the default job: nothing changes
    assert rl_default.settle(cfg) is cfg


CHAT_REWARD = """
SEEN = []
def is_message(prompts, completions, **kwargs):
    SEEN.append((prompts[0], completions[0]))
    return [float(c[0]["role"] == "assistant") for c in completions]
"""


def test_chat_prompts_reach_the_rewards_as_messages(tmp_path, tiny_model_dir, monkeypatch):
    """A prompt given as chat messages is rendered with the chat template; the rewards receive it as
    given, and each completion as TRL passes it: a list holding the assistant's message."""
    (tmp_path / "chat_rewards.py").write_text(textwrap.dedent(CHAT_REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = grpo_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=0, eval_every=0,
                   grpo={"rewards": ["chat_rewards:is_message"]})  # fmt: skip
    cfg["data"]["path"] = str(path)
    result = onegpu.train(cfg)
    import chat_rewards

    prompt, completion = chat_rewards.SEEN[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"
    assert metrics(result.run_dir)[0]["reward"] == 1.0


# slow: transformers' continuous batching (a generation thread of its own) cost 8.3 CPU seconds in a
# quiet tier run and 22.5 in one with the load at 3: too near the fast tier's limit to be sure of it
@pytest.mark.slow
def test_continuous_batching_sampler_trains_too(tmp_path, tiny_model_dir, monkeypatch):
    """grpo.sampler=continuous: every rollout comes from transformers' continuous batching
    (generate_batch, never generate), the step's 8 completions among them, and the step trains on
    what it returned."""
    from transformers import GenerationMixin
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    batches, real = [], ContinuousMixin.generate_batch

    def generate_batch(self, inputs, *args, **kwargs):
        out = real(self, inputs, *args, **kwargs)
        batches.append([len(r.generated_tokens) for r in out.values()])
        return out

    def generate(self, *args, **kwargs):
        raise AssertionError("grpo.sampler=continuous sampled with generate")

    monkeypatch.setattr(ContinuousMixin, "generate_batch", generate_batch)
    monkeypatch.setattr(GenerationMixin, "generate", generate)
    cfg = grpo_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=0, eval_every=0,
                   grpo={"sampler": "continuous"})  # fmt: skip
    result = onegpu.train(cfg)
    rec = metrics(result.run_dir)[0]
    (step,) = [lengths for lengths in batches if len(lengths) == 8]  # the others: validation's 4s
    assert result.state.step == 1 and rec["gen_tokens_per_s"] > 0
    assert rec["completion_length"] == sum(step) / 8 and rec["completion_length_max"] == max(step)


def test_a_non_finite_step_is_skipped_and_the_run_goes_on(tmp_path, tiny_model_dir, monkeypatch):
    from helpers import nan_at
    from onegpu.training import assemble

    monkeypatch.setattr(assemble, "make_objective", nan_at({1}, make_objective, grad_accum=2))
    result = onegpu.train(grpo_cfg(tmp_path, tiny_model_dir, max_steps=2, save_every=0))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "skipped" in r] == [1]
    assert result.state.step == 2 and result.state.skipped_steps == 1


def test_few_prompts_are_enough_for_a_step_of_more_completions(tmp_path, tiny_model_dir):
    """6 prompts, 2 a step of 16 completions: counted as prompts, not as micro-batch rows."""
    cfg = grpo_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=0, eval_every=0,
                   micro_batch_size=16, grad_accum=1, grpo={"group_size": 8})  # fmt: skip
    cfg["data"]["path"] = str(write_prompts(tmp_path, n=6))
    cfg["data"]["val_fraction"] = 0.0
    assert onegpu.train(cfg).state.step == 1


def test_truncated_completions_are_left_out_only_when_masked():
    from onegpu.objectives import rollout

    samples = rollout.Samples([[5, 6, 7], [8, 2]], [True, False], 0.0)
    for masked in (True, False):
        rows = rollout.training_rows([[1, 3], [1, 4]], samples, 0, masked)
        trained = (rows["labels"] != -100).sum(1).tolist()
        assert trained == ([0, 2] if masked else [3, 2])


@pytest.mark.parametrize("narrow", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_and_top_p_narrow_the_sampling(tiny_model_dir, tiny_tokenizer, narrow):
    """top_k=1 or a tiny top_p leave one token to sample: a group's completions are all the same;
    without them (top_k=0, top_p=1) the same group differs."""
    from transformers import AutoModelForCausalLM

    from onegpu.config import GRPOConfig
    from onegpu.objectives import rollout

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    prompt = tiny_tokenizer("def f(x):")["input_ids"]

    def group(**kw):
        torch.manual_seed(0)
        g = GRPOConfig(max_completion_length=8, **kw)
        out = rollout.sample(model, [prompt] * 6, g, tiny_tokenizer, torch.device("cpu"), 6)
        return {tuple(c) for c in out.completion_ids}

    assert len(group(**narrow)) == 1
    assert len(group()) > 1
