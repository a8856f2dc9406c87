"""FP8 training (techniques/fp8.py): the layers the rule allows become torchao's Float8Linear and
their matmuls take float8 operands; the others stay; the numerics follow the same model without
FP8; compile, checkpointing, the fused loss, LoRA and the step in backward work with it; a device
without FP8 tensor cores gets one clear error. On CPU torchao's ``emulate`` path runs the casts
and scales of a card and multiplies the float8-rounded operands in fp32; one test runs the card's
own kernel (``aten._scaled_mm``, slow on a CPU) on one small layer and checks both agree."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_tiny_llama, random_batch
from onegpu.config import Config, TechniquesConfig, validate
from onegpu.errors import ConfigError, UnavailableError
from onegpu.hardware import DeviceInfo
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.fp8 import apply_fp8, float8_layers

pytestmark = pytest.mark.usefixtures("one_thread")

EMULATED = TechniquesConfig(fp8="tensorwise", fp8_emulate=True)


def _fp8(model, **kw):
    return apply_fp8(model, TechniquesConfig(**{"fp8": "tensorwise", "fp8_emulate": True, **kw}))


def _loss_and_grads(model, batch, chunk: int = 0):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch, chunk_size=chunk, verify=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_layers_the_rule_allows_become_float8_and_the_rest_stay(tiny_tokenizer):
    from torchao.float8.float8_linear import Float8Linear

    # intermediate 72: gate/up (64 -> 72) and down (72 -> 64) are not multiples of 16
    model = _fp8(make_tiny_llama(tiny_tokenizer, intermediate_size=72), fp8_skip="k_proj")
    layer = model.model.layers[0]
    for name in ("q_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer.self_attn, name), Float8Linear), name
    assert type(layer.self_attn.k_proj) is torch.nn.Linear  # techniques.fp8_skip
    assert (
        type(layer.mlp.gate_proj) is torch.nn.Linear
        and type(layer.mlp.down_proj) is torch.nn.Linear
    )
    assert type(model.lm_head) is torch.nn.Linear  # the output head
    assert len(float8_layers(model)) == 3 * 2


def test_matmuls_take_float8_operands(tiny_tokenizer):
    """Every matmul of a float8 layer (output, input gradient, weight gradient) multiplies float8
    tensors: e4m3 for inputs and weights, e5m2 for the output gradient (tensorwise)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default and hasattr(args[0], "_data"):
                seen.append((args[0]._data.dtype, args[1]._data.dtype))
            return func(*args, **(kwargs or {}))

    model = _fp8(make_tiny_llama(tiny_tokenizer))
    batch = random_batch(len(tiny_tokenizer), 2, 16)
    with Record():
        loss_sum(model, batch, verify=False).backward()
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert len(seen) == 3 * len(float8_layers(model))
    assert seen.count((e4, e4)) == len(float8_layers(model))  # the forward's
    assert all(e4 in pair or e5 in pair for pair in seen) and any(e5 in pair for pair in seen)


def test_the_cards_float8_kernel_agrees_with_the_emulated_one():
    """emulate=False runs aten._scaled_mm, the kernel a card runs (on CPU torch's slow reference):
    it ran for all three matmuls, and equals the emulated path to rounding."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    x = torch.randn(16, 64)
    out = {}
    for emulate in (True, False):
        layer = copy.deepcopy(base)
        apply_fp8(layer, TechniquesConfig(fp8="tensorwise", fp8_emulate=emulate), "cpu")
        xx = x.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = layer(xx)
            y.pow(2).sum().backward()
        calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
        out[emulate] = (y.detach(), xx.grad, layer[0].weight.grad, calls)
    assert out[False][3] == 3 and out[True][3] == 0
    for a, b in zip(out[True][:3], out[False][:3], strict=True):
        assert _rel(a, b) < 1e-5
    assert _rel(out[True][0], base(x).detach()) < 0.1  # float8's rounding, not another function


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise-gw-hp"])
def test_fp8_loss_and_gradients_track_the_model_without_it(tiny_tokenizer, recipe):
    model = make_tiny_llama(tiny_tokenizer)
    batch = random_batch(len(tiny_tokenizer), 2, 32)
    ref_loss, ref = _loss_and_grads(model, batch)
    loss, grads = _loss_and_grads(_fp8(copy.deepcopy(model), fp8=recipe), batch)
    assert loss != ref_loss  # float8 rounding really happened
    assert abs(loss - ref_loss) / ref_loss < 0.01
    assert grads.keys() == ref.keys()
    assert (
        _rel(
            torch.cat([g.flatten() for g in grads.values()]),
            torch.cat([g.flatten() for g in ref.values()]),
        )
        < 0.1
    )


def test_compiled_fp8_equals_eager_fp8(tiny_tokenizer):
    from helpers import is_compiled
    from onegpu.techniques.compile import apply_compile

    batch = random_batch(len(tiny_tokenizer), 2, 32)
    eager = _fp8(make_tiny_llama(tiny_tokenizer))
    compiled = _fp8(make_tiny_llama(tiny_tokenizer))
    apply_compile(compiled, TechniquesConfig(compile="default", compile_backend="aot_eager"), "cpu")
    torch._dynamo.reset()
    try:
        (l1, g1), (l2, g2) = _loss_and_grads(eager, batch), _loss_and_grads(compiled, batch)
        assert is_compiled(compiled.model.layers[0])
    finally:
        torch._dynamo.reset()
    assert torch.allclose(l1, l2, rtol=1e-5)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6), n


def test_checkpointing_recomputes_the_same_fp8_gradients(tiny_tokenizer):
    from onegpu.techniques.checkpointing import apply_checkpointing

    batch = random_batch(len(tiny_tokenizer), 2, 32)
    plain = _fp8(make_tiny_llama(tiny_tokenizer))
    ckpt = apply_checkpointing(
        _fp8(make_tiny_llama(tiny_tokenizer)), TechniquesConfig(checkpointing="full"), "cpu"
    )
    (l1, g1), (l2, g2) = _loss_and_grads(plain, batch), _loss_and_grads(ckpt, batch)
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_fused_loss_with_fp8_equals_the_plain_loss(tiny_tokenizer):
    batch = random_batch(len(tiny_tokenizer), 2, 32)
    model = _fp8(make_tiny_llama(tiny_tokenizer))
    (l1, g1), (l2, g2) = _loss_and_grads(model, batch), _loss_and_grads(model, batch, chunk=16)
    assert torch.allclose(l1, l2, rtol=1e-5)
    assert all(torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6) for n in g1)


def test_lora_base_layers_run_in_float8_and_only_adapters_train(tiny_tokenizer):
    from torchao.float8.float8_linear import Float8Linear

    from onegpu.config import LoraConfig
    from onegpu.techniques.lora import apply_lora

    tcfg = TechniquesConfig(fp8="tensorwise", fp8_emulate=True, lora=LoraConfig(enabled=True, r=4))
    model = apply_fp8(apply_lora(make_tiny_llama(tiny_tokenizer), tcfg), tcfg)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, Float8Linear)
    assert type(q.lora_A["default"]) is torch.nn.Linear  # adapters stay in high precision
    _, grads = _loss_and_grads(model, random_batch(len(tiny_tokenizer), 2, 32))
    assert grads and all("lora_" in n for n in grads)


def test_step_in_backward_updates_float8_layers_like_a_plain_step(tiny_tokenizer):
    from onegpu.config import TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    batch = random_batch(len(tiny_tokenizer), 2, 32)
    after = []
    for in_backward in (False, True):
        model = _fp8(make_tiny_llama(tiny_tokenizer))
        tcfg = TechniquesConfig(optimizer="adamw", optimizer_in_backward=in_backward)
        opt = build_optimizer(model, tcfg, TrainingConfig(max_grad_norm=0.0, lr=1e-3))
        for _ in range(2):
            loss_sum(model, batch, verify=False).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after.append(model.model.layers[0].self_attn.q_proj.weight.detach().clone())
    start = make_tiny_llama(tiny_tokenizer).model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(after[1], start)
    assert torch.allclose(after[0], after[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "device",
    [
        DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0)),
        DeviceInfo("cpu", "CPU", 8 * 2**30),
    ],
    ids=["a100", "cpu"],
)
def test_a_device_without_fp8_tensor_cores_is_refused_by_name(device):
    from onegpu.techniques.precision import resolve_precision

    with pytest.raises(UnavailableError) as err:
        resolve_precision(TechniquesConfig(fp8="tensorwise"), device)
    assert device.name in str(err.value) and "FP8 tensor cores" in str(err.value)
    assert "fp8_emulate" in err.value.hint and "bf16" in err.value.hint
    resolve_precision(TechniquesConfig(fp8="tensorwise", fp8_emulate=True), device)  # allowed


def test_fp8_capable_cards_pass_and_auto_trains_without_fp8(caplog):
    from onegpu.techniques.precision import resolve_precision
    from onegpu.techniques.prepare import resolved_techniques

    for cap in ((8, 9), (9, 0)):
        device = DeviceInfo("cuda", "card", 80 * 2**30, cap)
        assert resolve_precision(TechniquesConfig(fp8="rowwise"), device) == "bf16"
    assert resolved_techniques(Config(), "cuda").fp8 == "off"  # auto: the planner decides
    assert resolved_techniques(Config(techniques=EMULATED), "cpu").fp8 == "tensorwise"
    off = Config(techniques=TechniquesConfig(fp8="off", fp8_emulate=True))
    assert resolved_techniques(off, "cpu").fp8 == "off"
    assert "fp8_emulate ignored: FP8 is off" in caplog.text  # an ignored setting says so


def test_conflicting_settings_and_unknown_layer_names_are_errors(tiny_tokenizer):
    from onegpu.config import LoraConfig

    lora = LoraConfig(enabled=True, quantize_base="nf4")
    with pytest.raises(ConfigError, match="quantize_base"):
        validate(Config(techniques=TechniquesConfig(fp8="tensorwise", lora=lora)))
    with pytest.raises(ConfigError, match="offload"):
        validate(Config(techniques=TechniquesConfig(fp8="rowwise", offload="zero2-cpu")))
    with pytest.raises(ConfigError, match="fp8_skip: kproj"):
        _fp8(make_tiny_llama(tiny_tokenizer), fp8_skip="kproj")
