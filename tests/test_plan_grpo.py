"""The planner on GRPO: rows are prompt + completion, sampling's KV cache and logits are a peak of
their own, the reference is counted as GRPO chooses it, and `--plan auto` probes GRPO setups with
real rollouts."""

from __future__ import annotations

import pytest
import torch

from onegpu.config import Config
from onegpu.plan import memory, speed
from onegpu.plan.arch import _shape_of, model_shape
from onegpu.plan.candidate import setup

pytestmark = pytest.mark.usefixtures("one_thread")


def grpo_setup(mb=8, accum=2, lora=None, **grpo):
    base = Config()
    base.training.objective = "grpo"
    return setup(mb, accum, base=base, grpo=grpo, **({"lora": lora} if lora else {}))


@pytest.fixture(scope="module")
def shape():
    return model_shape("tiny")


def test_rows_are_prompt_plus_completion_and_sampling_is_a_peak_of_its_own(shape):
    short, long = grpo_setup(max_completion_length=64), grpo_setup(max_completion_length=1024)
    a, b = memory.estimate(shape, short, 256), memory.estimate(shape, long, 256)
    key = "rollout KV cache and sampling logits"
    assert key in a.components and b.components[key] > a.components[key]
    assert b.components["activations"] > a.components["activations"]  # longer rows to train on
    sft = setup(8, 2)
    assert key not in memory.estimate(shape, sft, 256).components
    assert (
        speed.estimate(shape, long, 256, _cpu()).step_seconds
        > speed.estimate(shape, short, 256, _cpu()).step_seconds
    )


def test_multi_turn_rollouts_count_every_turn_and_tool_result(shape):
    """With grpo.tools a row is the prompt and a conversation: max_turns turns and the tool
    results between them, each up to max_completion_length, in the rollout's KV cache, the rows
    trained on and the decode steps sampled."""
    one = grpo_setup(max_completion_length=64)
    tools = grpo_setup(max_completion_length=64, tools=["calculator"], max_turns=3)
    assert tools.sequence_tokens(256) == 256 + 5 * 64 and one.sequence_tokens(256) == 256 + 64
    kv = memory.rollout_bytes(shape, tools, 256) - 3 * tools.effective_batch * shape.vocab * 4
    kv_one = memory.rollout_bytes(shape, one, 256) - 3 * one.effective_batch * shape.vocab * 4
    assert kv / kv_one == pytest.approx((256 + 5 * 64) / (256 + 64))
    a, b = memory.estimate(shape, one, 256), memory.estimate(shape, tools, 256)
    assert b.components["activations"] > a.components["activations"]
    assert speed.rollout_seconds(shape, tools, 256, _cpu()) > speed.rollout_seconds(
        shape, one, 256, _cpu()
    )


def test_reference_is_counted_only_where_grpo_keeps_one(shape):
    def ref(c):
        return memory.estimate(shape, c, 128).components.get("reference copy", 0)

    assert ref(grpo_setup(beta=0.0)) == 0  # TRL's default: no reference at all
    assert ref(grpo_setup(beta=0.04)) > 0  # full fine-tune: a frozen copy
    assert ref(grpo_setup(beta=0.04, lora={"r": 8})) == 0  # LoRA: the adapters switched off
    assert grpo_setup(beta=0.04, lora={"r": 8}).reference_kind == "adapters"


def test_kv_cache_formula_equals_what_generate_keeps(tiny_tokenizer):
    """The cache part of rollout_bytes against the tensors of transformers' own cache after a
    generate of the same rows and lengths (fp32 on a CPU)."""
    from helpers import make_tiny_llama

    model = make_tiny_llama(tiny_tokenizer).eval()
    rows, prompt, new = 4, 12, 9
    ids = torch.randint(5, len(tiny_tokenizer), (rows, prompt))
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
            min_new_tokens=new, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    cache = out.past_key_values
    kept = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    c = grpo_setup(mb=rows, accum=1, group_size=4, max_completion_length=new)
    shape = _shape_of("tiny-llama", model.config)
    logits = 3 * rows * shape.vocab * 4
    predicted = memory.rollout_bytes(shape, c, prompt) - logits
    # the cache holds every position but the last sampled token's
    assert kept == pytest.approx(predicted * (prompt + new - 1) / (prompt + new), rel=1e-6)


@pytest.mark.parametrize("hidden, intermediate, length", [(64, 256, 120), (128, 384, 300)])
def test_a_reward_model_folder_is_in_the_grpo_plan(
    tiny_tokenizer, tmp_path, shape, hidden, intermediate, length
):
    """A trained reward model's folder in grpo.rewards: its weights as it loads them (every byte
    of its parameters) stay in every moment of the step, and its scoring forward's peak, measured
    from the CPU allocator's events while it scores a step's completions (40 texts, padded, two
    batches), is what the plan says within 5%; a named reward adds nothing."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from helpers import make_tiny_llama, peak_cpu_bytes
    from onegpu.objectives import reward_model

    tok = tiny_tokenizer
    base = make_tiny_llama(tok, hidden_size=hidden, intermediate_size=intermediate)
    config = LlamaConfig(**{**base.config.to_dict(), "num_labels": 1})
    config.pad_token_id = tok.pad_token_id
    folder = tmp_path / "rm"
    LlamaForSequenceClassification(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    ids = tok("x = 1\n" * length)["input_ids"]
    new = 40
    prompts = [tok.decode(ids[: length - new - (i % 7)]) for i in range(40)]  # padded rows
    completions = [tok.decode(ids[length - new : length])] * 40
    longest = max(
        len(tok(p + c, add_special_tokens=False)["input_ids"])
        for p, c in zip(prompts, completions, strict=True)
    )
    score = reward_model.reward_model(str(folder))
    score(prompts[:1], completions[:1])  # loads the model: its weights are not the forward's
    measured = peak_cpu_bytes(lambda: score(prompts, completions))

    c = grpo_setup(mb=40, accum=1, max_completion_length=new, rewards=[str(folder), "length"])
    est = memory.estimate(shape, c, longest - new, on_gpu=False)
    loaded = reward_model._load(str(folder))["model"]
    assert est.components["reward model weights"] == sum(p.nbytes for p in loaded.parameters())
    assert est.components["reward model scoring"] == pytest.approx(measured, rel=0.05)
    named = grpo_setup(mb=40, accum=1, max_completion_length=new, rewards=["length"])
    plain = memory.estimate(shape, named, longest - new, on_gpu=False)
    assert "reward model weights" not in plain.components
    assert est.peak >= plain.peak + est.components["reward model weights"]


# slow: real rollouts in each probe: 6.3 CPU s quiet, 15-24 on a busy machine (guard limit: 20)
@pytest.mark.slow
def test_plan_auto_probes_grpo_setups_with_real_rollouts(tiny_model_dir, tmp_path, caplog):
    """Every probed GRPO setup runs its steps (a GRPO step trains on the completions its cycle
    sampled, so a measured step is a step with real rollouts) and is measured; the run takes the
    fastest measured one, its effective batch and GRPO settings unchanged (not the first
    prediction that a run falls back to when every probe fails)."""
    import logging
    import re

    from onegpu.config import from_dict
    from onegpu.plan import probe
    from test_grpo_inputs import write_prompts

    cfg = from_dict({
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(write_prompts(tmp_path, n=40)), "seq_len": 32, "num_proc": 1},
        "training": {"objective": "grpo", "micro_batch_size": 8, "grad_accum": 1,
                     "max_steps": 4},
        "grpo": {"group_size": 4, "max_completion_length": 4, "rewards": ["length"]},
        "output": {"dir": str(tmp_path / "runs"), "report_to": "none"},
        "plan": "auto",
    })  # fmt: skip
    with caplog.at_level(logging.INFO, logger="onegpu.plan.probe"):
        out = probe.auto_plan(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "onegpu.plan.probe"]
    table = lines[lines.index("plan: probed setups, predicted vs measured") + 2 :][: probe.TOP]
    rows = [re.fullmatch(r" {2}(\S.*?) +[\d,]+ +(failed: .*|([\d,]+) .*)", x) for x in table]
    assert len(rows) == probe.TOP and all(rows), table
    assert not any(m.group(2).startswith("failed") for m in rows), table
    measured = {m.group(1): float(m.group(3).replace(",", "")) for m in rows}
    chosen = re.fullmatch(r"plan: training with (.+) \(([\d,]+) tokens/s measured\)", lines[-1])
    assert chosen, lines
    assert measured[chosen.group(1)] == max(measured.values()) > 0, (chosen, measured)
    assert out.training.objective == "grpo" and out.plan == "off"
    assert out.training.micro_batch_size * out.training.grad_accum == 8
    assert out.grpo.group_size == 4 and out.grpo.rewards == ["length"]


def _cpu():
    from onegpu import hardware

    return hardware.spec_from_device(hardware.detect())


def test_a_reward_models_weights_count_two_bytes_on_a_gpu_and_their_own_dtype_on_a_cpu():
    """plan/reward_models.load_bytes against reward_model._load: bf16 on a GPU, else the folder's
    dtype (float32 when it names none)."""
    from types import SimpleNamespace

    from onegpu.plan.reward_models import load_bytes

    assert load_bytes(SimpleNamespace(dtype="float32"), on_gpu=True) == 2
    assert load_bytes(SimpleNamespace(dtype="float32"), on_gpu=False) == 4
    assert load_bytes(SimpleNamespace(dtype="bfloat16"), on_gpu=False) == 2
    assert load_bytes(SimpleNamespace(dtype=None), on_gpu=False) == 4
