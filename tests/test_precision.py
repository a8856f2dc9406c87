"""Precision switches are active: loss scaling skips overflowing steps, autocast changes op dtypes,
bf16 is refused where the GPU lacks it, TF32 flags follow the device, bf16-pure stores bf16 weights.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import make_tiny_llama, random_batch
from onegpu.config import Config, TechniquesConfig
from onegpu.errors import UnavailableError
from onegpu.hardware import DeviceInfo
from onegpu.techniques import precision as P

CPU = DeviceInfo("cpu", "CPU", 8 * 2**30)
A100 = DeviceInfo("cuda", "NVIDIA A100", 80 * 2**30, (8, 0))
T4 = DeviceInfo("cuda", "Tesla T4", 16 * 2**30, (7, 5))


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state; each test here picks its own precision."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def _prepared(tok, precision):
    from onegpu.training.assemble import make_accelerator

    acc = make_accelerator(Config(), CPU, precision)
    model = make_tiny_llama(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _linear_output_dtypes(model, batch):
    seen = []
    handle = model.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    handle.remove()
    return seen


def test_fp16_overflow_step_is_skipped_and_scale_drops(tiny_tokenizer):
    from onegpu.training.step import train_step

    acc, model, opt = _prepared(tiny_tokenizer, "fp16")
    assert acc.scaler is not None
    batch = random_batch(len(tiny_tokenizer))
    assert _linear_output_dtypes(model, batch) == [torch.float16]  # autocast really is fp16
    weight = model.model.layers[0].self_attn.q_proj.weight
    handle = weight.register_hook(lambda g: torch.full_like(g, float("inf")))  # inject an overflow
    before, scale = weight.detach().clone(), acc.scaler.get_scale()
    train_step(model, opt, [batch], acc, max_grad_norm=1.0)
    assert torch.equal(weight.detach(), before)
    assert acc.scaler.get_scale() < scale
    assert opt.step_was_skipped
    handle.remove()
    train_step(model, opt, [batch], acc, max_grad_norm=1.0)  # finite gradients: a real update
    assert not torch.equal(weight.detach(), before)
    assert not opt.step_was_skipped


def test_bf16_autocast_changes_op_dtype(tiny_tokenizer):
    acc, model, _ = _prepared(tiny_tokenizer, "bf16")
    assert _linear_output_dtypes(model, random_batch(len(tiny_tokenizer))) == [torch.bfloat16]
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_fp32_runs_in_fp32(tiny_tokenizer):
    acc, model, _ = _prepared(tiny_tokenizer, "fp32")
    assert acc.scaler is None
    assert _linear_output_dtypes(model, random_batch(len(tiny_tokenizer))) == [torch.float32]


def test_bf16_pure_stores_bf16_weights(tiny_model_dir, tiny_tokenizer):
    from onegpu.config import ModelConfig
    from onegpu.models import load_model

    model = load_model(
        str(tiny_model_dir), ModelConfig(), tiny_tokenizer, dtype=P.weights_dtype("bf16-pure")
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert P.accelerate_mixed_precision("bf16-pure") == "no"


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_bf16_refused_on_gpu_without_bf16(precision):
    with pytest.raises(UnavailableError, match="no bf16 support") as err:
        P.resolve_precision(TechniquesConfig(precision=precision), T4)
    assert "fp16" in err.value.hint
    assert P.resolve_precision(TechniquesConfig(precision=precision), A100) == precision


def test_auto_precision_follows_device():
    auto = TechniquesConfig(precision="auto")
    assert P.resolve_precision(auto, CPU) == "fp32"
    assert P.resolve_precision(auto, A100) == "bf16"
    assert P.resolve_precision(auto, T4) == "fp16"


@pytest.fixture
def restore_tf32():
    saved = P.tf32_state()
    yield
    P.set_tf32(saved)


def test_tf32_flags_default_on_for_ampere_and_off_elsewhere(restore_tf32, caplog):
    """The decision and the flags it sets; tests/gpu measures the effect on a real fp32 matmul."""
    caplog.set_level(logging.INFO, logger="onegpu")
    assert P.apply_tf32(TechniquesConfig(), A100) is True
    assert P.tf32_state() == ("tf32", "tf32", "tf32")
    assert "TF32 matmuls on" in caplog.text
    assert P.apply_tf32(TechniquesConfig(tf32=False), A100) is False
    assert P.tf32_state() == ("ieee", "ieee", "ieee")
    assert P.apply_tf32(TechniquesConfig(), T4) is False


def test_run_switches_are_put_back_after_the_run(restore_tf32):
    """TF32 and dynamo's error fallback are process-wide: a run sets them and restores them."""
    import torch._dynamo

    from onegpu.config import Config
    from onegpu.techniques.compile import auto_compiles
    from onegpu.techniques.prepare import global_switches

    P.set_tf32(False)
    torch._dynamo.config.suppress_errors = False
    cfg = Config(techniques=TechniquesConfig(tf32=None, compile="auto"))
    cfg.training.max_steps = 200  # long enough for compile=auto to compile where a compiler exists
    with global_switches(cfg, A100):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    if not auto_compiles(cfg, "cpu"):
        pytest.skip("no C++ compiler: compile=auto does not compile here")
    with global_switches(cfg, CPU):
        assert (
            torch._dynamo.config.suppress_errors is True
        )  # auto compiles: a compiler failure falls back
    assert torch._dynamo.config.suppress_errors is False


def test_tf32_requested_without_support_warns(restore_tf32, caplog):
    assert P.apply_tf32(TechniquesConfig(tf32=True), T4) is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert "tf32=true ignored" in caplog.text


def test_fp16_on_bf16_model_warns(tiny_tokenizer, caplog):
    config = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1).config
    config.dtype = torch.bfloat16
    assert P.warn_fp16_on_bf16_model(config, "fp16")
    assert "transformers#14189" in caplog.text
    caplog.clear()
    assert not P.warn_fp16_on_bf16_model(config, "bf16")
    config.dtype = torch.float32
    assert not P.warn_fp16_on_bf16_model(config, "fp16")
    assert caplog.text == ""


# ---------------------------------------------------------------------------- batch-shape advice
def test_misaligned_shapes_warn_with_reason(caplog):
    from onegpu.training.startup import check_shapes

    found = check_shapes(micro_batch=6, seq_len=200, hidden_size=100, precision="fp16", device=A100)
    assert len(found) == 3
    assert "training.micro_batch_size=6 is not a multiple of 8" in caplog.text
    assert "data.seq_len=200 is not a multiple of 64" in caplog.text  # A100-class + 16-bit: 64
    assert "hidden_size=100 is not a multiple of 64" in caplog.text and "tensor-core" in caplog.text
    caplog.clear()
    assert check_shapes(8, 200, 104, "fp16", T4) == []  # older GPU: multiples of 8 are enough
    assert check_shapes(16, 256, 128, "bf16", A100) == []
    assert check_shapes(3, 100, 100, "fp32", CPU) == []  # no tensor cores to fill
    assert caplog.text == ""


def test_assemble_applies_start_up_checks(tiny_tokenizer, tmp_path, caplog, restore_tf32):
    """Building the model of a run (assemble.assemble, what training calls) logs the start-up
    advice: fp16 on a bf16-stored model, and shapes that leave tensor-core tiles half empty."""
    from onegpu.training import assemble

    stored_bf16 = tmp_path / "bf16-model"
    make_tiny_llama(tiny_tokenizer, num_hidden_layers=1).to(torch.bfloat16).save_pretrained(
        str(stored_bf16)
    )
    tiny_tokenizer.save_pretrained(str(stored_bf16))
    cfg = Config()
    cfg.model.name, cfg.training.micro_batch_size, cfg.data.seq_len = str(stored_bf16), 12, 96
    cfg.techniques.compile = "off"
    with caplog.at_level(logging.WARNING):
        parts = assemble.assemble(
            cfg, A100, "fp16", str(stored_bf16), tokenizer=tiny_tokenizer, optimizer=False
        )
    assert "micro_batch_size=12" in caplog.text and "data.seq_len=96" in caplog.text
    assert "transformers#14189" in caplog.text
    assert parts.model is not None  # the checks advise; the model is still built
