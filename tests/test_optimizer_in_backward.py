"""Optimizer step in backward: the same weights as a normal step, gradients that never coexist,
clear refusals of what it cannot do, and an exact resume."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from helpers import assert_same_weights, make_tiny_llama
from onegpu.config import Config, TechniquesConfig, TrainingConfig, from_dict, validate
from onegpu.data.batches import Collator
from onegpu.errors import ConfigError
from onegpu.techniques.optimizer_in_backward import OptimizerInBackward, steps_in_backward
from onegpu.techniques.optimizers import build_optimizer, state_bytes
from onegpu.training.step import train_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


def _batches(tokenizer, n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    collate = Collator(tokenizer.pad_token_id, 8, 64)
    out = []
    for _ in range(n):
        rows = [torch.randint(5, len(tokenizer), (int(k),), generator=g).tolist() for k in (20, 31)]
        out.append(collate([{"input_ids": r, "labels": r} for r in rows]))
    return out


def _train(tokenizer, in_backward: bool, optimizer: str, steps: int = 3):
    model = make_tiny_llama(tokenizer)
    opt = build_optimizer(
        model,
        TechniquesConfig(optimizer=optimizer, optimizer_in_backward=in_backward),
        TrainingConfig(lr=1e-2, max_grad_norm=0.0),
    )
    accelerator = Accelerator(cpu=True)
    for batch in _batches(tokenizer, steps):
        train_step(model, opt, [batch], accelerator, max_grad_norm=0.0)
    return model, opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_same_weights_as_a_normal_step(tiny_tokenizer, optimizer):
    plain, _ = _train(tiny_tokenizer, False, optimizer)
    inside, opt = _train(tiny_tokenizer, True, optimizer)
    assert isinstance(opt, OptimizerInBackward) and steps_in_backward(opt)
    for (name, a), (_, b) in zip(plain.named_parameters(), inside.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            make_tiny_llama(tiny_tokenizer).parameters(), inside.parameters(), strict=True
        )
    )  # it did train


def test_full_gradients_never_coexist(tiny_tokenizer):
    """At every gradient's completion at most one gradient is alive (a normal step holds them
    all)."""

    def max_alive(in_backward: bool) -> tuple[int, int]:
        model = make_tiny_llama(tiny_tokenizer)
        params = [p for p in model.parameters() if p.requires_grad]
        seen = []
        # Registered before the optimizer's hooks, so it runs first and sees its own gradient.
        for p in params:
            p.register_post_accumulate_grad_hook(
                lambda _: seen.append(sum(q.grad is not None for q in params))
            )
        opt = build_optimizer(
            model,
            TechniquesConfig(optimizer="adamw", optimizer_in_backward=in_backward),
            TrainingConfig(max_grad_norm=0.0),
        )
        train_step(
            model, opt, _batches(tiny_tokenizer, 1), Accelerator(cpu=True), max_grad_norm=0.0
        )
        return max(seen), len(params)

    alive, n = max_alive(True)
    assert alive == 1
    alive_plain, _ = max_alive(False)
    assert alive_plain == n  # the last gradient of a normal backward finds all others still there


def test_state_round_trips_and_is_counted(tiny_tokenizer):
    """The facade's state is every inner optimizer's, each parameter once: the bytes counted are
    those of a normal AdamW's state after the same steps (two fp32 moments and a step a weight)."""
    _, opt = _train(tiny_tokenizer, True, "adamw", steps=2)
    _, plain = _train(tiny_tokenizer, False, "adamw", steps=2)
    assert len(opt.state) == len(opt.inner) == len(plain.state)
    assert state_bytes(opt) == state_bytes(plain)
    weights = sum(p.numel() for p in plain.state)
    assert state_bytes(plain) == 2 * 4 * weights + 4 * len(plain.state)
    model2 = make_tiny_llama(tiny_tokenizer)
    opt2 = build_optimizer(
        model2, TechniquesConfig(optimizer_in_backward=True), TrainingConfig(max_grad_norm=0.0)
    )
    opt2.load_state_dict(opt.state_dict())
    for a, b in zip(opt.inner, opt2.inner, strict=True):
        sa, sb = next(iter(a.state.values())), next(iter(b.state.values()))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        opt2.load_state_dict(torch.optim.SGD(model2.parameters(), lr=1.0).state_dict())


def test_scheduler_reaches_every_inner_optimizer(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer)
    opt = build_optimizer(
        model, TechniquesConfig(optimizer_in_backward=True), TrainingConfig(lr=1e-2)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    sched.step()
    assert {g["lr"] for inner in opt.inner for g in inner.param_groups} == {5e-3}


def test_a_non_finite_loss_never_reaches_the_weights(tiny_tokenizer):
    from onegpu.training.recovery import NanGuard

    model = make_tiny_llama(tiny_tokenizer)
    opt = build_optimizer(
        model, TechniquesConfig(optimizer_in_backward=True), TrainingConfig(max_grad_norm=0.0)
    )
    before = [p.detach().clone() for p in model.parameters()]
    guard = NanGuard(5)
    from onegpu.objectives.sft import SFT

    class NaN(SFT):  # a loss that is not a number
        def loss(self, m, b):
            return torch.tensor(float("nan"), requires_grad=True)

    train_step(
        model,
        opt,
        _batches(tiny_tokenizer, 1),
        Accelerator(cpu=True),
        0.0,
        objective=NaN(),
        guard=guard,
        step=1,
    )
    assert guard.last_bad and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    "training, techniques, match",
    [
        ({"grad_accum": 2, "max_grad_norm": 0.0}, {}, "grad_accum=2"),
        ({}, {}, "max_grad_norm=1.0"),
        ({"max_grad_norm": 0.0}, {"precision": "fp16"}, "precision=fp16"),
        ({"max_grad_norm": 0.0}, {"offload": "zero2-cpu"}, "offload=zero2-cpu"),
    ],
)
def test_what_it_cannot_do_is_refused_clearly(training, techniques, match):
    raw = {"training": training, "techniques": {"optimizer_in_backward": True, **techniques}}
    with pytest.raises(ConfigError, match=match) as err:
        validate(from_dict(raw))
    assert err.value.hint and "optimizer_in_backward" in str(err.value)
    validate(Config())  # the default is untouched


def test_trains_and_resumes_exactly(tmp_path, tiny_model_dir):
    from helpers import straight_then_resumed

    expected, got, a, b = straight_then_resumed(
        tmp_path, tiny_model_dir, {"optimizer_in_backward": True}, grad_accum=1, max_grad_norm=0.0
    )
    assert got == expected
    assert_same_weights(a, b)
    train_losses = [r[2] for r in got if r[0] == "train"]
    assert train_losses[-1] < train_losses[0]
