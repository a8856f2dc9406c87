"""The text methods on a vision-language model: checkpointing recomputes (less saved, same
gradients), an 8-bit optimizer keeps 8-bit state, bf16 autocast computes in bf16, and a resumed run
equals the straight one, loss for loss and weight for weight."""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import assert_same_weights, losses, saved_tensor_bytes
from test_vlm import run_cfg
from vlm_zoo import save_tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from onegpu import shapes

    return shapes.write_dataset(tmp_path_factory.mktemp("shapes"), n=10)


def a_batch(model_dir, data, n=2):
    import datasets

    from onegpu import vlm
    from onegpu.config import DataConfig
    from onegpu.data.records import ORIGIN
    from onegpu.data.vision import VisionCollator, tokenize_counted
    from onegpu.objectives.tokens import with_target_positions

    ds = datasets.load_dataset("json", data_files=str(data))["train"]
    ds = ds.add_column(ORIGIN, [f"{data}:{i + 1}" for i in range(len(ds))])
    proc = vlm.load_processor(str(model_dir))
    cfg = DataConfig(seq_len=128, pad_to_multiple=8)
    examples, _ = tokenize_counted(ds, proc, cfg, "train")
    return with_target_positions(VisionCollator(proc, cfg)([examples[i] for i in range(n)]))


def test_checkpointing_recomputes_the_language_model_with_equal_gradients(llava, data):
    from transformers import AutoModelForImageTextToText

    from onegpu.config import TechniquesConfig
    from onegpu.objectives.sft import loss_sum
    from onegpu.techniques.checkpointing import apply_checkpointing, checkpointed_layers

    batch = a_batch(llava, data)

    def run(mode):
        model = AutoModelForImageTextToText.from_pretrained(str(llava)).train()
        model = apply_checkpointing(model, TechniquesConfig(checkpointing=mode), "cpu")
        kept = saved_tensor_bytes(model, lambda: loss_sum(model, batch).backward())
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return model, kept, grads

    _, kept_off, g_off = run("off")
    model, kept_on, g_on = run("full")
    assert len(checkpointed_layers(model)) >= 2  # the language model's blocks at least
    assert kept_on < kept_off
    for k in g_off:
        assert torch.allclose(g_off[k], g_on[k], rtol=1e-4, atol=1e-6), k


def test_an_8bit_optimizer_and_bf16_autocast_are_active_on_a_vlm(llava, data, tmp_path):
    pytest.importorskip("bitsandbytes")
    from onegpu import train
    from onegpu.training.state import Callback

    seen = {}

    class Look(Callback):
        def on_step_end(self, run, state):
            # bitsandbytes keeps 8-bit state for tensors of 4096 elements and more
            big = [s for p, s in run.optimizer.state.items() if p.numel() >= 4096]
            seen["8bit"] = bool(big) and all(s["state1"].dtype == torch.uint8 for s in big)
            head = run.model.get_output_embeddings()
            out = {}
            handle = head.register_forward_hook(lambda m, a, o: out.setdefault("dtype", o.dtype))
            batch = {k: v for k, v in run.collator([run.train_ds[0]]).items() if k != "labels"}
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                run.model(**batch)
            handle.remove()
            seen["dtype"] = out["dtype"]

    cfg = run_cfg(llava, data, tmp_path, steps=1, optimizer="adamw-8bit", precision="bf16")
    train(cfg, callbacks=[Look()])
    assert seen["8bit"]
    assert seen["dtype"] == torch.bfloat16


def test_a_resumed_vlm_run_equals_the_straight_one(llava, data, tmp_path):
    from onegpu import train

    cfg = run_cfg(llava, data, tmp_path, steps=4)
    cfg["training"]["save_every"] = 2
    cfg["output"]["keep_last"] = 5
    first = train(cfg)
    straight = losses(first.run_dir)
    shutil.copytree(first.run_dir / "final", tmp_path / "final-straight")
    cfg["output"]["resume"] = str(first.run_dir / "checkpoint-00000002")
    second = train(cfg)
    assert losses(second.run_dir) == straight
    assert_same_weights(tmp_path / "final-straight", second.run_dir / "final")


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_leaves_a_frozen_tower_out_of_backward(llava, data, lora):
    """transformers' checkpointing switch makes every input embedding's output require grad, the
    tower's patch embedding too: a frozen tower then kept its layers' inputs and ran a backward to
    the pixels. Now its output needs no gradient, and the trained parameters' gradients are the
    same as without checkpointing."""
    from transformers import AutoModelForImageTextToText

    from onegpu import vlm
    from onegpu.config import LoraConfig, TechniquesConfig
    from onegpu.objectives.sft import loss_sum
    from onegpu.techniques.prepare import prepare_model

    batch = a_batch(llava, data)

    def run(mode):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_pretrained(str(llava)).train()
        t = TechniquesConfig(
            precision="fp32", compile="off", checkpointing=mode, lora=LoraConfig(enabled=lora, r=4)
        )
        model = prepare_model(model, t, "cpu")
        (tower,), _ = vlm.vision_modules(model)
        seen = []
        handle = dict(model.named_modules())[tower].register_forward_hook(
            lambda m, i, out: seen.append(out.last_hidden_state.requires_grad)
        )
        loss_sum(model, batch).backward()
        handle.remove()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return seen, grads

    seen_off, g_off = run("off")
    seen_on, g_on = run("full")
    assert seen_on == seen_off == [False]
    assert g_on.keys() == g_off.keys() and g_on
    for k in g_off:
        assert torch.allclose(g_off[k], g_on[k], rtol=1e-4, atol=1e-6), k
