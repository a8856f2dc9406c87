"""GPU paths of the optimizers and adapters (skipped without a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

from onegpu.config import LoraConfig, ModelConfig, TechniquesConfig, TrainingConfig
from onegpu.techniques.optimizers import build_optimizer, state_bytes

pytestmark = pytest.mark.gpu
DIM = 1024


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, DIM, bias=False).cuda()
    x = torch.randn(64, DIM, device="cuda")
    return model, x, x @ (torch.randn(DIM, DIM, device="cuda") / DIM**0.5)


def _train(model, opt, x, target, steps=20):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _build(model, name):
    return build_optimizer(
        model, TechniquesConfig(optimizer=name), TrainingConfig(lr=1e-2, weight_decay=0.0)
    )


def test_adamw_is_fused_on_cuda_and_trains():
    model, x, target = _problem()
    opt = _build(model, "adamw")
    assert opt.param_groups[0]["fused"] is True
    losses = _train(model, opt, x, target)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize(
    "name", ["adamw-8bit", "paged-adamw-8bit", "adamw-8bit-ao", "adamw-4bit-ao"]
)
def test_low_bit_optimizers_on_cuda(name):
    model, x, target = _problem()
    ref_model = _problem()[0]
    ref = _build(ref_model, "adamw")
    _train(ref_model, ref, x, target, steps=1)
    opt = _build(model, name)
    losses = _train(model, opt, x, target)
    assert losses[-1] < 0.8 * losses[0]
    # The moments live on the GPU (torchao keeps its scalar step counter on the host); paged ones
    # in CUDA unified memory, which bitsandbytes wraps as host tensors (torch.frombuffer over the
    # managed pointer) marked is_paged and prefetched to page_deviceid before each update.
    weight = model.weight
    for s in opt.state.values():
        for k, v in s.items():
            if not isinstance(v, torch.Tensor) or k == "step":
                continue
            if name.startswith("paged") and k in ("state1", "state2"):
                assert getattr(v, "is_paged", False), k
                assert v.page_deviceid == weight.device.index, k
            else:
                assert v.is_cuda, k
    assert state_bytes(opt) < 0.3 * state_bytes(ref)  # 8-bit ~1/4, 4-bit ~1/8 of fp32 Adam state


def test_qlora_on_cuda_trains_adapters_over_a_4bit_base(tiny_model_dir, tiny_tokenizer):
    import bitsandbytes as bnb

    from onegpu import models
    from onegpu.techniques.lora import apply_lora, quantization_config

    tcfg = TechniquesConfig(
        lora=LoraConfig(enabled=True, r=8, quantize_base="nf4"), checkpointing="full"
    )
    quant = quantization_config(tcfg, "bf16", str(tiny_model_dir), ModelConfig())
    model = models.load_model(
        str(tiny_model_dir),
        ModelConfig(name=str(tiny_model_dir)),
        tiny_tokenizer,
        extra={"quantization_config": quant},
    )
    model = apply_lora(model, tcfg)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, bnb.nn.Linear4bit) and q.base_layer.weight.device.type == "cuda"
    ids = torch.randint(0, len(tiny_tokenizer), (4, 32), device="cuda")
    opt = build_optimizer(
        model, TechniquesConfig(optimizer="adamw-8bit"), TrainingConfig(lr=1e-2, weight_decay=0.0)
    )
    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_qlora_end_to_end_run_on_cuda(tmp_path, tiny_model_dir, text_file):
    from onegpu import train

    cfg = {
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(text_file), "seq_len": 64, "num_proc": 1},
        "training": {
            "micro_batch_size": 4,
            "max_steps": 6,
            "eval_every": 0,
            "eval_batches": 2,
            "lr": 1e-2,
        },
        "techniques": {
            "optimizer": "paged-adamw-8bit",
            "lora": {"enabled": True, "quantize_base": "nf4", "merge_on_save": True},
        },
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }
    result = train(cfg)
    assert (result.final_dir / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "final-merged" / "model.safetensors").is_file()
