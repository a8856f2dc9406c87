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


def net_cpu_bytes(fn):
    """(fn's result, bytes torch's CPU allocator still holds of what ``fn()`` allocated), from the
    profiler's trace of every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return out, sum(e.nbytes() for e in events)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("vision", ["frozen", "projector", "all"])
@pytest.mark.parametrize("mode", ["off", "full"])
@pytest.mark.parametrize("lora", [False, True])
def test_the_towers_activations_as_the_allocator_holds_them(family, vision, mode, lora):
    """The planner's bytes for the tower and projector (measured on a 1- and a 2-layer tower,
    matmuls skipped, extrapolated to the tower's depth) against what the CPU allocator still holds
    after a real forward of the image features through a 4-layer tower prepared as training
    prepares it, with real weights and matmuls."""
    import torch
    import transformers
    from PIL import Image

    import vlm_zoo
    from onegpu.config import LoraConfig, TechniquesConfig
    from onegpu.plan.vision import image_features_sum, load_for, vision_activations
    from onegpu.techniques.prepare import prepare_model

    proc, cfg = getattr(vlm_zoo, family)()
    key = "depth" if hasattr(cfg.vision_config, "depth") else "num_hidden_layers"
    setattr(cfg.vision_config, key, 4)
    t = TechniquesConfig(
        precision="fp32",
        compile="off",
        loss="plain",
        checkpointing=mode,
        vision=vision,
        lora=LoraConfig(enabled=lora, r=4),
    )
    load = load_for(proc, [Image.new("RGB", (32, 32), (200, 30, 30))] * 2)  # two images a row
    predicted = vision_activations(cfg, t, load).retained(mode)
    torch.manual_seed(0)
    model = prepare_model(
        transformers.AutoModelForImageTextToText.from_config(cfg).train(), t, "cpu"
    )
    loss, held = net_cpu_bytes(lambda: image_features_sum(model, dict(load.inputs)))
    assert loss.requires_grad == (vision != "frozen")
    if mode == "full" and vision == "all":
        # each checkpointed layer keeps the CPU generator's state for its recompute: host memory
        # on a card (the planner plans the card's), 5 KB of this allocator's here
        held -= 4 * torch.get_rng_state().nbytes
    if vision == "frozen":  # nothing of a frozen tower is kept, checkpointed or not
        assert predicted == 0 and held == 4  # the summed features' float32 scalar
    else:
        assert predicted == pytest.approx(held - 4, rel=0.05), (predicted, held)


def test_the_plan_adds_the_towers_activations_for_each_row(qwen, tmp_path):
    """``onegpu plan`` on data with images: a trained tower's activations are a component of the
    peak, per row of the micro-batch; a frozen tower adds none."""
    import dataclasses

    from PIL import Image

    from onegpu import vlm
    from onegpu.config import TechniquesConfig
    from onegpu.plan import memory
    from onegpu.plan.arch import model_shape
    from onegpu.plan.candidate import setup
    from onegpu.plan.vision import load_for, vision_activations

    shape = model_shape(str(qwen))
    load = load_for(vlm.load_processor(str(qwen)), [Image.new("RGB", (64, 64), (0, 0, 200))])
    peaks = {}
    for vision in ("frozen", "all"):
        for mb in (1, 2):
            c = setup(mb, precision="fp32", vision=vision)
            est = memory.estimate(shape, c, 64, on_gpu=True, images=load)
            plain = memory.estimate(shape, c, 64, on_gpu=True)
            peaks[vision, mb] = est.peak - plain.peak
            part = est.components.get("vision tower and projector activations", 0.0)
            assert part == peaks[vision, mb]
    t = dataclasses.replace(TechniquesConfig(precision="fp32"), vision="all")
    per_row = vision_activations(shape.config, t, load).retained()
    assert peaks["frozen", 1] == peaks["frozen", 2] == 0
    assert peaks["all", 1] == pytest.approx(per_row) and per_row > 10_000
    assert peaks["all", 2] == pytest.approx(2 * per_row)
