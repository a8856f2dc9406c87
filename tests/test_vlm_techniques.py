"""techniques.vision decides what of a vision-language model trains, with full fine-tuning and with
LoRA (weights compared before and after, adapters found where they should be); the fused loss
gives the plain loss's value and gradients on a VLM."""

from __future__ import annotations

import pytest
import torch

from test_vlm import run_cfg
from vlm_zoo import save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-tech")
    return {f: save_tiny_vlm(f, root / f) for f in ("llava", "qwen2_vl")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from onegpu import shapes

    return shapes.write_dataset(tmp_path_factory.mktemp("shapes"), n=8)


def parts(folder) -> dict:
    """{"tower" | "projector" | "lm": {name: tensor}} of a saved model."""
    from transformers import AutoModelForImageTextToText

    from onegpu import vlm

    model = AutoModelForImageTextToText.from_pretrained(str(folder))
    tower, projector = vlm.vision_modules(model)
    out = {"tower": {}, "projector": {}, "lm": {}}
    for name, p in model.named_parameters():
        if any(name.startswith(r + ".") for r in projector):
            out["projector"][name] = p.detach().clone()
        elif any(name.startswith(r + ".") for r in tower):
            out["tower"][name] = p.detach().clone()
        else:
            out["lm"][name] = p.detach().clone()
    return out


def moved(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])  # Qwen2-VL's projector is in its tower
@pytest.mark.parametrize(
    "mode, tower, projector",
    [("frozen", False, False), ("projector", False, True), ("all", True, True)],
)
def test_vision_mode_decides_what_trains(family, mode, tower, projector, models, data, tmp_path):
    from onegpu import train

    final = train(run_cfg(models[family], data, tmp_path, vision=mode)).final_dir
    before, after = parts(models[family]), parts(final)
    assert before["tower"] and before["projector"]
    assert moved(before["lm"], after["lm"])
    assert moved(before["tower"], after["tower"]) is tower
    assert moved(before["projector"], after["projector"]) is projector


@pytest.mark.parametrize(
    "mode, tower_adapters, projector_saved",
    [("frozen", False, False), ("projector", False, True), ("all", True, True)],
)
def test_lora_goes_on_the_language_model_and_the_tower_only_with_all(
    mode, tower_adapters, projector_saved, models, data, tmp_path
):
    from helpers import weights
    from onegpu import train

    cfg = run_cfg(models["llava"], data, tmp_path, vision=mode, lora={"enabled": True, "r": 4})
    keys = list(weights(train(cfg).final_dir))
    assert any("language_model" in k and "lora_A" in k for k in keys)
    assert any("vision_tower" in k and "lora_" in k for k in keys) is tower_adapters
    assert any("multi_modal_projector" in k for k in keys) is projector_saved
    assert not any("multi_modal_projector" in k and "lora_" in k for k in keys)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_fused_loss_equals_the_plain_loss_on_a_vlm(family, models, data):
    """The vision tower's features feed the LM; the head still runs in chunks (and is the fused
    one: no fallback happened), with the plain loss's value and gradients."""
    import datasets
    from transformers import AutoModelForImageTextToText

    from onegpu import vlm
    from onegpu.config import DataConfig
    from onegpu.data.records import ORIGIN
    from onegpu.data.vision import VisionCollator, tokenize_counted
    from onegpu.objectives.tokens import TokenLoss, with_target_positions

    ds = datasets.load_dataset("json", data_files=str(data))["train"]
    ds = ds.add_column(ORIGIN, [f"{data}:{i + 1}" for i in range(len(ds))])
    proc = vlm.load_processor(str(models[family]))
    cfg = DataConfig(seq_len=128, pad_to_multiple=8)
    examples, _ = tokenize_counted(ds, proc, cfg, "train")
    batch = with_target_positions(VisionCollator(proc, cfg)([examples[i] for i in range(3)]))
    model = AutoModelForImageTextToText.from_pretrained(str(models[family]))

    def run(loss):
        model.zero_grad()
        value = loss.loss_sum(model, batch)[1]
        value.backward()
        return value.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    fused = TokenLoss(chunk_size=8)
    (a, ga), (b, gb) = run(TokenLoss()), run(fused)
    assert fused.chunk_size == 8  # still fused
    assert torch.allclose(a, b, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.slow
def test_a_tiny_vlm_learns_the_colour_only_the_image_tells(tmp_path):
    """results/vlm-shapes-cpu.md's claim, smaller: trained on the shapes dataset, the tiny LLaVA
    names the colour of held-out images (>= 0.9); trained on the same records with the images
    blanked, it stays near chance (1/4)."""
    import shapes_score
    from onegpu import shapes

    model = shapes.tiny_vlm(tmp_path / "tiny-vlm")
    held = tmp_path / "held"
    shapes.write_dataset(held, 40, seed=1)
    acc = {}
    for name, blank in (("images", False), ("blanked", True)):
        shapes.write_dataset(tmp_path / name, 400, seed=0, blank=blank)
        final = shapes_score.train_run(tmp_path / name, model, 150, name)
        acc[name] = shapes_score.colour_accuracy(final, held)[0]
    assert acc["images"] >= 0.9
    assert acc["blanked"] <= 0.45
