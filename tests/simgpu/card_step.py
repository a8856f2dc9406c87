"""The training step on the card's fake "cuda" tensors, through training's own prepare_model,
make_accelerator, LossFn and train_step (not a copy). Runs inside a card's process."""

from __future__ import annotations

import cards
import pytest
import torch

from onegpu.config import Config, TechniquesConfig
from onegpu.hardware import detect

VOCAB = 256
# The method steps do not branch on which Ampere+ card runs them: the H100 (bf16) and the T4 (fp16)
# run them all; the RTX 4090 and A100 run the precision=auto step (the tier stays a few minutes).
EVERY_STEP = ("H100", "T4")


def _every_step(card) -> None:
    if card.key not in EVERY_STEP:
        pytest.skip(f"the method steps run on {' and '.join(EVERY_STEP)}")


def _model(moe: bool = False):
    """A tiny Llama (or Mixtral) built on the meta device, as a loaded model would be shaped."""
    import transformers

    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    config = (
        transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw)
        if moe
        else transformers.LlamaConfig(tie_word_embeddings=True, **kw)
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _batch(pad: int = 0) -> dict:
    ids = torch.randint(0, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if pad:
        mask[:, -pad:], labels[:, -pad:] = 0, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step(
    tcfg: TechniquesConfig,
    micro: int = 1,
    moe: bool = False,
    value: float = cards.VALUE,
    watch=None,
):
    """Prepare a tiny model as training does, then run one train_step on the card; returns
    (model, optimizer, accelerator, loss). ``watch(model)``, if given, is called with the prepared
    model just before the step (to hook it)."""
    from onegpu.objectives import make_objective
    from onegpu.techniques.optimizers import build_optimizer
    from onegpu.techniques.precision import resolve_precision, weights_dtype
    from onegpu.techniques.prepare import prepare_model
    from onegpu.training.assemble import make_accelerator
    from onegpu.training.step import train_step

    cfg = Config(techniques=tcfg)
    cfg.techniques.compile = "off"
    device = detect()
    precision = resolve_precision(cfg.techniques, device)
    model = _model(moe).to(weights_dtype(precision))
    model = prepare_model(model, cfg.techniques, device.type)
    with cards.fake_cuda(), cards.fake_value(value):
        cards.on_card(model).train()
        optimizer = build_optimizer(model, cfg.techniques, cfg.training)
        accelerator = make_accelerator(cfg, device, precision)
        accelerator.device_placement = False  # on the card already: see cards.py, "placement"
        model, optimizer = accelerator.prepare(model, optimizer)
        loss_fn = make_objective(cfg, VOCAB, device.is_gpu)
        if watch is not None:
            watch(model)
        loss, tokens = train_step(
            model,
            optimizer,
            [_batch() for _ in range(micro)],
            accelerator,
            1.0,
            loss_fn,
        )
    assert tokens == 32 * micro and loss.device.type == "cuda"
    return model, optimizer, accelerator, loss


def _stepped(optimizer) -> bool:
    inner = getattr(optimizer, "optimizer", optimizer)
    return any(s for s in inner.state.values())


def test_autocast_step_on_the_card(card):
    """precision=auto: the step's matmuls run in bf16 (fp16 with a GradScaler on the T4) under
    autocast; weights stay fp32."""
    computed = []

    def watch(model):  # an MLP projection of the first block: the dtype its matmul computes in
        up = model.model.layers[0].mlp.up_proj
        up.register_forward_hook(lambda m, args, out: computed.append(out.dtype))

    model, opt, acc, _ = step(TechniquesConfig(), watch=watch)
    assert acc.device.type == "cuda" and acc.mixed_precision == ("bf16" if card.bf16 else "fp16")
    assert (acc.scaler is not None) == (not card.bf16)  # loss scaling only for fp16
    assert computed == [torch.bfloat16 if card.bf16 else torch.float16]
    w = next(model.parameters())
    assert w.device.type == "cuda" and w.dtype == torch.float32
    assert _stepped(opt)
    from onegpu.report import device_memory_gb

    assert device_memory_gb(acc.device) > 0  # the run's peak, read from the card's counters


def test_fp16_scaler_skips_an_inf_step(card):
    """fp16: the GradScaler finds inf gradients (the harness answers inf) and skips the update.
    (foreach AdamW: the fused kernel would skip inside itself, where no value can be seen.)"""
    _every_step(card)
    tcfg = TechniquesConfig(precision="fp16", optimizer="adamw-foreach")
    _, opt, acc, _ = step(tcfg, value=float("inf"))
    assert acc.scaler is not None and opt.step_was_skipped and not _stepped(opt)
    _, opt, acc, _ = step(tcfg)
    assert not opt.step_was_skipped and _stepped(opt)


@pytest.mark.parametrize("mode", ["full", "every-n", "offload"])
def test_checkpointing_modes(card, mode):
    _every_step(card)
    from onegpu.techniques.checkpointing import checkpointed_layers

    model, opt, _, _ = step(TechniquesConfig(checkpointing=mode, precision="fp32"), micro=2)
    assert len(checkpointed_layers(model)) == (1 if mode == "every-n" else 2) and _stepped(opt)


def test_lora_step(card):
    _every_step(card)
    tcfg = TechniquesConfig()
    tcfg.lora.enabled = True
    model, opt, _, _ = step(tcfg)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained) and _stepped(opt)


def test_fused_loss_step(card):
    _every_step(card)
    _, opt, _, _ = step(TechniquesConfig(loss="fused", loss_chunk_size=8))
    assert _stepped(opt)


def test_optimizer_in_backward_step(card):
    _every_step(card)
    _, opt, _, _ = step(TechniquesConfig(optimizer_in_backward=True, precision="fp32"))
    inner = opt.optimizer
    assert type(inner).__name__ == "OptimizerInBackward"
    assert all(o.state for o in inner.inner)  # every parameter's optimizer stepped inside backward


def test_nan_guard_verdict_on_the_card(card):
    """The NaN guard reads one bool from the card: a finite value passes, inf is a bad step."""
    from onegpu.training.recovery import NanGuard

    _, _, _, loss = step(TechniquesConfig(precision="fp32"))
    guard = NanGuard(max_bad_steps=3)
    with cards.fake_cuda():
        norm = torch.zeros((), device="cuda")
        assert loss.is_cuda and not guard.is_bad(loss, norm)
        with cards.fake_value(float("inf")):
            assert guard.is_bad(loss, norm)
