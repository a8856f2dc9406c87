"""The planner and vision-language models: the tower's and projector's weights are counted, frozen
ones carry no gradient or optimizer state, LoRA's count leaves the tower out, and `onegpu plan`
prints the image tokens per example by the processor's own rules."""

from __future__ import annotations

import json

import pytest

from vlm_zoo import save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("qwen"))


def real_counts(folder):
    from transformers import AutoModelForImageTextToText

    from onegpu import vlm

    model = AutoModelForImageTextToText.from_pretrained(str(folder))
    tower, projector = vlm.vision_modules(model)
    named = dict(model.named_parameters())

    def under(roots, skip=()):
        return sum(
            p.numel()
            for n, p in named.items()
            if n.startswith(tuple(r + "." for r in roots))
            and not n.startswith(tuple(s + "." for s in skip))
        )

    return model, under(tower, projector), under(projector)


def test_the_shape_counts_the_tower_and_projector(qwen):
    from onegpu.plan.arch import model_shape

    model, tower, projector = real_counts(qwen)
    shape = model_shape(str(qwen))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.tower_params, shape.projector_params) == (tower, projector)
    assert tower > 0 and projector > 0
    # LoRA's per-rank count is the language model's linear layers only
    lm_linears = [
        m
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear" and ".visual." not in f".{n}." and n != "lm_head"
    ]
    assert shape.lora_params_per_rank == sum(sum(m.weight.shape) for m in lm_linears)


@pytest.mark.parametrize(
    "mode, frozen", [("frozen", "tower+projector"), ("projector", "tower"), ("all", "")]
)
def test_frozen_vision_parts_have_no_gradients_or_optimizer_state(qwen, mode, frozen):
    import dataclasses

    from onegpu.config import TechniquesConfig, TrainingConfig
    from onegpu.plan.arch import model_shape
    from onegpu.plan.candidate import Candidate
    from onegpu.plan.memory import grad_bytes, trainable_params

    shape = model_shape(str(qwen))
    c = Candidate(
        TrainingConfig(), dataclasses.replace(TechniquesConfig(precision="fp32"), vision=mode)
    )
    parts = {"tower": shape.tower_params, "projector": shape.projector_params}
    expect = shape.params - sum(parts[p] for p in frozen.split("+") if p)
    assert trainable_params(shape, c) == expect
    assert grad_bytes(shape, c) == expect * 4


def test_plan_prints_image_tokens_per_example(qwen, tmp_path, capsys):
    """A 64x64 image under the tiny Qwen2-VL's max_pixels (32x32): 16 patches of 8x8, merged 2x2
    into 4 tokens; the same count from the data and from --image_size."""
    from PIL import Image

    from onegpu.cli.plan import cli

    Image.new("RGB", (64, 64), (0, 0, 200)).save(tmp_path / "a.png")
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
            {"role": "assistant", "content": "blue"},
        ]
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    base = [str(qwen), "--gpu", "H100", "--data.seq_len", "64", "--json"]
    cli([*base, "--data.path", str(tmp_path / "d.jsonl"), "--data.val_fraction", "0"])
    from_data = json.loads(capsys.readouterr().out)["image_tokens"]
    assert from_data["image"] == [4, 4, 4] and from_data["source"] == "the data"
    cli([*base, "--image_size", "64"])
    assert json.loads(capsys.readouterr().out)["image_tokens"]["image"] == [4, 4, 4]
