"""The memory model against measurement on CPU.

Activations: the planner fits one decoder block and the head from a 1- and a 2-layer copy at tiny
batch/length (matmuls skipped); here the whole 4-layer model runs for real at other lengths, and
the bytes it keeps for backward must match within 5%, for each architecture and checkpointing mode.
"""

from __future__ import annotations

import pytest
import torch

from helpers import peak_cpu_bytes
from onegpu.plan import activation_model, memory
from onegpu.plan import activations as acts
from onegpu.plan.arch import _shape_of
from onegpu.plan.candidate import setup


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    )


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=512, n_positions=512)


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    )


ARCHS = {"llama": _llama, "gpt2": _gpt2, "mixtral": _mixtral}


@pytest.fixture(scope="module")
def fitted():
    return {name: acts.activation_model(make()) for name, make in ARCHS.items()}


def _real_model(config, mode: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return acts.prepare_like_training(model, mode)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("mode", ["off", "full", "every-n"])
def test_activation_bytes_within_5_percent(fitted, arch, mode):
    config = ARCHS[arch]()
    model = _real_model(config, mode)
    for batch, seq in ((2, 64), (1, 160), (3, 256)):
        measured = acts.measure(model, batch, seq, "fp32")  # real matmuls, real weights
        predicted = fitted[arch].retained(batch, seq, config.num_hidden_layers, mode)
        assert predicted == pytest.approx(measured, rel=0.05), (arch, mode, batch, seq)


def test_checkpointing_modes_order_and_offload_keeps_nothing_per_layer(fitted):
    am, b, s, layers = fitted["llama"], 4, 512, 4
    off, every, full, offload = (
        am.retained(b, s, layers, m) for m in ("off", "every-n", "full", "offload")
    )
    assert off > every > full > offload
    assert offload == pytest.approx(
        am.base.at(b, s)
    )  # only embedding/head/loss; block inputs go to the host
    assert (
        activation_model.checkpointed_layers(5, "every-n", 2) == 3
    )  # layers 0, 2, 4: transformers' every_n_layers rule
    assert am.recompute_peak(b, s, "full") == pytest.approx(am.block.at(b, s))


def test_fit_is_linear_in_batch_and_length(fitted):
    block = fitted["llama"].block
    assert block.at(8, 1024) == pytest.approx(8 * block.at(1, 1024), rel=1e-6)
    assert block.at(1, 2048) == pytest.approx(
        2 * block.at(1, 1024), rel=1e-3
    )  # sdpa keeps no s^2 scores


def test_components_follow_dtypes_and_methods():
    shape = _shape_of("llama", _llama())
    n = shape.params
    full = setup(8, 1, precision="bf16")
    assert memory.weight_bytes(shape, full) == n * 4  # fp32 master weights under autocast
    assert memory.grad_bytes(shape, full) == n * 4
    assert memory.optimizer_bytes(shape, full) == n * 8  # AdamW: two fp32 states
    pure = setup(8, 1, precision="bf16-pure")
    assert (
        memory.weight_bytes(shape, pure) == n * 2 and memory.optimizer_bytes(shape, pure) == n * 4
    )
    eight = setup(8, 1, precision="bf16", optimizer="adamw-8bit")
    per_value = 2 + 8 / 256  # two 1-byte states, an fp32 absmax per 256 values each
    assert memory.optimizer_bytes(shape, eight) == pytest.approx(n * per_value)
    four = setup(8, 1, precision="bf16", optimizer="adamw-4bit-ao")
    assert memory.optimizer_bytes(shape, four) == pytest.approx(n * 1, rel=0.1)
    ada = setup(8, 1, precision="bf16", optimizer="adafactor")
    assert memory.optimizer_bytes(shape, ada) < n * 4 / 4  # factored second moment
    sgd = setup(8, 1, precision="bf16", optimizer="sgd")
    assert memory.optimizer_bytes(shape, sgd) == n * 4
    qlora = setup(8, 1, precision="bf16", lora={"r": 8, "quantize_base": "nf4"})
    lora_n = 8 * shape.lora_params_per_rank
    assert memory.trainable_params(shape, qlora) == lora_n
    assert memory.weight_bytes(shape, qlora) == pytest.approx(
        shape.linear_params * memory.NF4_BYTES + (n - shape.linear_params) * 2 + lora_n * 4
    )
    assert memory.optimizer_bytes(shape, qlora) == lora_n * 8
    assert memory.optimizer_bytes(shape, setup(8, 1, precision="bf16", offload="zero2-cpu")) == 0


def test_shapes_from_meta_models():
    moe = _shape_of("mixtral", _mixtral())
    assert moe.experts == 4 and moe.top_k == 2 and moe.expert_params > 0
    assert moe.active_params < moe.params - moe.input_embed_params  # only 2 of 4 experts per token
    gpt2 = _shape_of("gpt2", _gpt2())
    assert gpt2.linear_params > 0  # Conv1D counts as linear (what LoRA and bitsandbytes replace)


class _PeakTracker:
    """Running peak of the bytes created inside a training step and still alive."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.tracker, self.peak = acts._Tracker(skip_matmul=False), 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.tracker._record(out)
                outer.peak = max(outer.peak, outer.tracker.alive(set()))
                return out

        self.mode = Mode()


def test_end_to_end_peak_against_a_measured_cpu_step(tiny_tokenizer):
    """Whole step (forward, backward, AdamW step) on CPU: the prediction is loose but must be
    close."""
    import functools

    from helpers import make_tiny_llama
    from onegpu.config import TechniquesConfig, TrainingConfig
    from onegpu.objectives.sft import loss_sum
    from onegpu.techniques.optimizers import build_optimizer

    model = make_tiny_llama(
        tiny_tokenizer, hidden_size=128, intermediate_size=256, num_hidden_layers=3
    )
    model.train()
    opt = build_optimizer(model, TechniquesConfig(optimizer="adamw"), TrainingConfig())
    ids = torch.randint(0, len(tiny_tokenizer), (4, 128))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    loss_fn = functools.partial(loss_sum, chunk_size=0)

    def step():
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state now exists, as in every later step
    resident = sum(p.numel() * 4 for p in model.parameters())
    resident += sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    pt = _PeakTracker()
    with pt.mode:
        step()
    measured = resident + pt.peak
    shape = _shape_of("tiny", model.config)
    predicted = memory.estimate(
        shape, setup(4, 1, precision="fp32", optimizer="adamw"), 128, on_gpu=False
    )
    assert predicted.peak == pytest.approx(measured, rel=0.15)  # about -8% here
    assert predicted.components["optimizer"] == pytest.approx(
        resident - sum(p.numel() * 4 for p in model.parameters()), rel=0.01
    )


def test_paged_optimizer_state_is_host_backed_on_a_gpu():
    """bitsandbytes' paged state lives in unified memory, outside torch's allocator (so outside
    max_memory_allocated): shown as its own component, not in the device peak."""
    shape = _shape_of("llama", _llama())
    eight, paged = (
        setup(8, 1, precision="bf16", optimizer="adamw-8bit"),
        setup(8, 1, precision="bf16", optimizer="paged-adamw-8bit"),
    )
    on_device = memory.estimate(shape, eight, 64)
    host = memory.estimate(shape, paged, 64)
    state = memory.optimizer_bytes(shape, eight)
    assert state > 0 and memory.optimizer_bytes(shape, paged) == 0
    assert host.components["paged optimizer state (host-backed)"] == pytest.approx(state)
    assert host.peak == pytest.approx(on_device.peak - state)
    # Off a GPU the paged optimizer is the plain 8-bit one, in ordinary memory.
    assert memory.optimizer_bytes(shape, paged, on_gpu=False) == pytest.approx(state)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "down_proj"])
def test_lora_on_a_subset_of_modules_is_planned_as_trained(tiny_tokenizer, targets):
    """The planner counts exactly the adapter parameters PEFT creates for lora.targets."""
    pytest.importorskip("peft")
    from helpers import make_tiny_llama
    from onegpu.config import Config, LoraConfig, TechniquesConfig
    from onegpu.models import count_parameters
    from onegpu.techniques.lora import apply_lora

    model = make_tiny_llama(tiny_tokenizer)
    shape = _shape_of("tiny", model.config)
    adapted = apply_lora(
        model, TechniquesConfig(lora=LoraConfig(enabled=True, r=8, targets=targets))
    )
    _, trainable = count_parameters(adapted)
    c = setup(4, 1, precision="fp32", lora={"r": 8, "targets": targets})
    assert memory.lora_params(shape, c) == trainable
    every = setup(4, 1, precision="fp32", lora={"r": 8})
    assert memory.lora_params(shape, c) <= memory.lora_params(shape, every)
    assert c.apply(Config()).techniques.lora.targets == targets


@pytest.mark.parametrize(
    "name,needs",
    [
        ("adamw", None),
        ("adamw-foreach", None),
        ("sgd", None),
        ("adafactor", None),
        ("adamw-8bit", "bitsandbytes"),
        ("adamw-8bit-ao", "torchao"),
        ("adamw-4bit-ao", "torchao"),
    ],
)
def test_optimizer_step_temporaries_as_measured_on_cpu(name, needs):
    """The planner's step temporaries (on CPU) against the allocator's peak during a real step of
    one 1024 x 1024 fp32 weight, after a first step made the state (and compiled torchao's)."""
    if needs:
        pytest.importorskip(needs)
    from dataclasses import replace

    from onegpu.config import TechniquesConfig, TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    dim = 1024
    torch.manual_seed(0)
    model = torch.nn.Linear(dim, dim, bias=False)
    opt = build_optimizer(model, TechniquesConfig(optimizer=name), TrainingConfig(lr=1e-3))
    for first in (True, False):
        model(torch.randn(8, dim)).square().mean().backward()
        if first:
            opt.step()
            opt.zero_grad(set_to_none=True)
    measured = peak_cpu_bytes(opt.step)  # allocator events see into custom ops and compiled code
    shape = replace(_shape_of("llama", _llama()), params=dim * dim, largest_param=dim * dim)
    c = setup(1, 1, precision="fp32", optimizer=name)
    predicted = memory.optimizer_temp_bytes(shape, c, on_gpu=False)
    assert predicted == pytest.approx(measured, rel=0.05, abs=dim * dim * 0.1), (measured, name)


@pytest.mark.parametrize("fp8", ["off", "tensorwise"])
def test_ops_on_large_tensors_run_from_shapes_alone_and_keep_the_same_bytes(monkeypatch, fp8):
    """Above SKIP_NUMEL elements every op is made from its shapes (the fused loss's weight-sized
    gradient buffer, FP8's scales of the weights): a forward keeps the same bytes, eager and as
    compiled code would, as when every op but the matmuls runs."""
    from transformers import LlamaConfig

    from onegpu.plan import saved_tensors

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    )
    model = acts.build_probe_model(config, 2, "bf16", fp8=fp8)
    skip, names = saved_tensors._skip_large, []

    def counted(func, args, kwargs):
        out = skip(func, args, kwargs)
        if out is not None:
            names.append(func.__name__.split(".")[0])
        return out

    monkeypatch.setattr(saved_tensors, "_skip_large", counted)
    monkeypatch.setattr(saved_tensors, "SKIP_NUMEL", 1 << 62)  # nothing is that large: all run
    every_op = [
        acts.measure(model, b, s, "bf16", 32, skip_matmul=True, both=True)
        for b, s in ((1, 48), (2, 64))
    ]
    assert names == []
    monkeypatch.setattr(saved_tensors, "SKIP_NUMEL", 4096)  # the head and MLP weights are large
    shapes_only = [
        acts.measure(model, b, s, "bf16", 32, skip_matmul=True, both=True)
        for b, s in ((1, 48), (2, 64))
    ]
    assert shapes_only == every_op
    # the fused loss: its weight-gradient buffer (zeroed, accumulated) and the chunk's log-softmax
    assert {"zeros_like", "add_", "_log_softmax"} <= set(names), names
    if fp8 != "off":
        assert "abs" in names, names  # the weights' float8 scales
