"""Each optimizer switch builds the optimizer it names, holds the state it promises, and trains."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from onegpu.config import TechniquesConfig, TrainingConfig
from onegpu.errors import UnavailableError
from onegpu.techniques.optimizers import BUILDERS, build_optimizer, param_groups, state_bytes

ALL = list(BUILDERS)
DIM = 256  # >= 4096 values and a multiple of every block size, so low-bit state is really quantized


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, DIM, generator=g)
    target = x @ (torch.randn(DIM, DIM, generator=g) / DIM**0.5)
    torch.manual_seed(seed)
    return torch.nn.Linear(DIM, DIM, bias=False), x, target


def _build(model, name, lr=1e-2, wd=0.0):
    return build_optimizer(
        model, TechniquesConfig(optimizer=name), TrainingConfig(lr=lr, weight_decay=wd)
    )


def _step(model, opt, x, target) -> float:
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


@pytest.mark.parametrize("name", ALL)
def test_every_optimizer_reduces_loss(name):
    model, x, target = _problem()
    opt = _build(model, name, lr=0.1 if name == "sgd" else 1e-2)  # plain SGD needs a larger step
    losses = [_step(model, opt, x, target) for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0], (name, losses[0], losses[-1])


def test_no_weight_decay_on_biases_and_norms(tiny_tokenizer):
    from helpers import make_tiny_llama

    model = make_tiny_llama(tiny_tokenizer, attention_bias=True, mlp_bias=True)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay["params"]}
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    assert names and all(n.endswith("bias") or "norm" in n for n in names)
    biases_and_norms = [n for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n]
    assert sorted(names) == sorted(biases_and_norms)
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_uses_the_fused_kernel_and_named_variants_set_their_flag():
    model, _, _ = _problem()
    assert _build(model, "adamw").param_groups[0]["fused"] is True
    assert _build(model, "adamw-foreach").param_groups[0]["foreach"] is True
    fused = _build(model, "adamw-fused")  # torch >= 2.4 has a fused CPU kernel
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]


def test_fused_and_foreach_compute_the_same_update():
    results = []
    for name in ("adamw-foreach", "adamw-fused"):
        model, x, target = _problem()
        opt = _build(model, name, wd=0.1)
        for _ in range(3):
            _step(model, opt, x, target)
        results.append(model.weight.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_sgd_is_fused_and_computes_foreach_sgds_update():
    """Fused SGD: the same update as torch's foreach SGD with momentum and weight decay, and no
    decayed copy of the gradients at the step (foreach builds one for the whole group at once)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    weights, temps = [], []
    for fused in (True, False):
        model, x, target = _problem()
        opt = _build(model, "sgd", lr=0.1, wd=0.1)
        if not fused:  # the implementation a card otherwise defaults to
            opt = torch.optim.SGD(
                model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True
            )
        assert bool(opt.param_groups[0]["fused"]) is fused
        _step(model, opt, x, target)  # the momentum buffer exists from here on
        torch.nn.functional.mse_loss(model(x), target).backward()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            opt.step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        temps.append(peak["Total"] - 3 * DIM * DIM * 4)  # beyond weight, gradient and momentum
        weights.append(model.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)
    assert temps[0] < DIM * DIM * 4 / 2 and temps[1] >= DIM * DIM * 4, temps


def test_adafactor_steps_one_tensor_at_a_time():
    """Adafactor is built single-tensor (a card would default to foreach): its step holds one
    matrix's variance estimate and its update, where foreach holds every matrix's at once."""

    def step_temp(opt, model, x) -> int:
        from torch.distributed._tools.mem_tracker import MemTracker

        model(x).square().mean().backward()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            opt.step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return peak["Total"] - 2 * 4 * sum(p.numel() for p in model.parameters())  # w + grads

    temps = []
    for foreach in (None, True):  # None: what build_optimizer makes
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(8)])
        opt = _build(model, "adafactor")
        if foreach:
            opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, foreach=True)
        assert opt.defaults["foreach"] is (foreach or False)
        temps.append(step_temp(opt, model, torch.randn(8, DIM)))
    one = DIM * DIM * 4
    assert temps[0] <= 2.5 * one and temps[1] >= 7.5 * one, temps  # two matrices vs eight


def _state_after_one_step(name):
    model, x, target = _problem()
    opt = _build(model, name)
    _step(model, opt, x, target)
    return opt, opt.state[model.weight]


def test_adafactor_state_is_factored():
    opt, state = _state_after_one_step("adafactor")
    assert isinstance(opt, torch.optim.Adafactor)
    assert state["row_var"].shape == (DIM, 1) and state["col_var"].shape == (1, DIM)
    assert state_bytes(opt) < 0.01 * DIM * DIM * 8  # vs AdamW's two full fp32 matrices


@pytest.mark.parametrize("name", ["adamw-8bit", "paged-adamw-8bit"])
def test_bitsandbytes_state_is_8bit_and_4x_smaller(name):
    _, ref = _state_after_one_step("adamw")
    opt, state = _state_after_one_step(name)
    assert type(opt).__module__.startswith("bitsandbytes")
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    ratio = state_bytes(_state_after_one_step("adamw")[0]) / state_bytes(opt)
    assert 3.5 < ratio <= 4.0, ratio
    assert ref["exp_avg"].dtype == torch.float32


def test_torchao_state_is_8bit_and_4bit():
    fp32 = state_bytes(_state_after_one_step("adamw")[0])
    opt8, s8 = _state_after_one_step("adamw-8bit-ao")
    opt4, s4 = _state_after_one_step("adamw-4bit-ao")
    assert s8["exp_avg"].codes.dtype == torch.uint8 and s8["exp_avg"].codes.numel() == DIM * DIM
    assert s4["exp_avg"].codes.numel() == DIM * DIM // 2  # two 4-bit codes per byte
    assert 3.5 < fp32 / state_bytes(opt8) <= 4.0
    assert state_bytes(opt4) < 0.6 * state_bytes(opt8)


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_continues_identically(name):
    """Save after two steps, load into a fresh optimizer, take one more step: same weights."""
    model, x, target = _problem()
    opt = _build(model, name, wd=0.1)
    for _ in range(2):
        _step(model, opt, x, target)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # as checkpoint.py loads it
    clone, _, _ = _problem()
    clone.load_state_dict(saved["model"])
    opt2 = _build(clone, name, wd=0.1)
    opt2.load_state_dict(saved["opt"])
    _step(model, opt, x, target)
    _step(clone, opt2, x, target)
    torch.testing.assert_close(clone.weight, model.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,module", [("adamw-8bit", "bitsandbytes"), ("adamw-4bit-ao", "torchao.optim")]
)
def test_missing_backend_raises_unavailable_with_install_hint(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    model, _, _ = _problem()
    with pytest.raises(UnavailableError) as err:
        _build(model, name)
    assert "pip install" in err.value.hint
