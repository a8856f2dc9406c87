"""Fused (chunked) cross-entropy: same loss and gradients as the plain loss, never the full logits,
no head recompute, lower peak memory; models whose logits it cannot reproduce are refused (or,
with loss=auto, trained with the plain loss)."""

from __future__ import annotations

import pytest
import torch

from helpers import count_targets, make_tiny_llama, peak_cpu_bytes, random_batch
from onegpu.config import Config, TechniquesConfig, from_dict, validate
from onegpu.errors import ConfigError, UnavailableError
from onegpu.objectives.sft import SFT, loss_sum
from onegpu.objectives.tokens import (
    IGNORE,
    TARGETS,
    TokenLoss,
    model_inputs,
    select_targets,
    with_target_positions,
)
from onegpu.techniques.fused_loss import auto_chunk


def _loss_and_grads(model, batch, chunk):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch, chunk_size=chunk)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_chunked_loss_equals_plain_loss_and_gradients(tiny_tokenizer, chunk):
    model = make_tiny_llama(tiny_tokenizer)
    batch = random_batch(len(tiny_tokenizer), length=48, seed=2, masked_prefix=5)
    plain, g_plain = _loss_and_grads(model, batch, 0)
    chunked, g_chunked = _loss_and_grads(model, batch, chunk)
    assert torch.allclose(plain, chunked, rtol=1e-5)
    assert g_plain.keys() == g_chunked.keys()
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_chunked[name], rtol=1e-4, atol=1e-6), name


def test_chunked_loss_keeps_the_forward_autocast(tiny_tokenizer):
    """Under bf16 autocast (as Accelerate runs the forward) the chunks' head matmul runs in bf16
    too."""
    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    batch = random_batch(len(tiny_tokenizer), seed=2, masked_prefix=5)
    head_dtypes = []
    model.lm_head.register_forward_hook(lambda m, i, o: head_dtypes.append(o.dtype))
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(
        model.forward
    )  # only the forward, like Accelerate
    plain = loss_sum(model, batch)
    chunked = loss_sum(model, batch, chunk_size=8)
    chunked.backward()  # the recomputed chunks run under the same autocast
    assert len(head_dtypes) > 4 and set(head_dtypes) == {torch.bfloat16}
    assert torch.allclose(plain, chunked, rtol=1e-2)


def test_softcapped_model_handled(tiny_tokenizer):
    """Gemma-2-style final logit soft-capping is reproduced, so the loss is still exact."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=len(tiny_tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=0.5,
            pad_token_id=tiny_tokenizer.pad_token_id,
        )
    )
    batch = random_batch(len(tiny_tokenizer), seed=2, masked_prefix=5)
    plain, _ = _loss_and_grads(model, batch, 0)
    chunked, _ = _loss_and_grads(model, batch, 5)
    assert torch.allclose(plain, chunked, rtol=1e-5)


def test_unknown_logit_transform_is_refused(tiny_tokenizer):
    model = _scaled_logits(
        make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    )  # post-processes its logits
    with pytest.raises(UnavailableError, match="techniques.loss=fused"):
        loss_sum(
            model,
            random_batch(len(tiny_tokenizer), length=8, seed=2, masked_prefix=5),
            chunk_size=4,
        )


def test_chunked_loss_lowers_peak_memory(tiny_tokenizer):
    """A large vocabulary makes the logits dominate, as in real LLMs (transformers#30860)."""
    vocab = 16384
    model = make_tiny_llama(tiny_tokenizer, vocab_size=vocab, num_hidden_layers=1)
    batch = random_batch(vocab, length=256, seed=2)
    peaks = {}
    for chunk in (0, 64):
        model.zero_grad(set_to_none=True)
        # the lambda runs inside this iteration, so it sees this iteration's chunk
        peaks[chunk] = peak_cpu_bytes(lambda: loss_sum(model, batch, chunk_size=chunk).backward())  # noqa: B023
    logits_bytes = 2 * 256 * vocab * 4  # one fp32 copy of the full logits
    assert peaks[0] > 2 * logits_bytes  # logits, their softmax and gradient coexist
    assert peaks[64] < peaks[0] - logits_bytes


def test_model_inputs_and_count_targets():
    ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4]])
    assert count_targets(labels) == 2
    plain = model_inputs(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    )
    assert (
        set(plain) == {"input_ids", "attention_mask", "use_cache"} and plain["use_cache"] is False
    )
    packed = model_inputs(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.tensor([[0, 1, 0, 1]]),
        }
    )
    assert "attention_mask" not in packed and "position_ids" in packed


def test_fused_loss_never_builds_the_full_logits_and_recomputes_nothing(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer)
    batch = random_batch(len(tiny_tokenizer), length=48, seed=2, masked_prefix=5)
    rows, phase = [], {"now": "forward"}
    model.lm_head.register_forward_hook(
        lambda m, i, o: rows.append((phase["now"], o.shape[:-1].numel()))
    )
    loss = loss_sum(model, batch, chunk_size=16)
    phase["now"] = "backward"
    loss.backward()
    targets = 2 * (48 - 5)  # per row: labels 5..47 are targets
    assert [r for p, r in rows if p == "backward"] == []  # gradients were taken in the forward
    head_rows = [r for _, r in rows]
    assert max(head_rows) <= 16  # one chunk (or the last position) at a time, never 2 x 48 rows
    # every target once, plus the model's own last position, plus the once-per-model check of it
    assert sum(head_rows) == targets + 2 + 2


def test_frozen_head_gets_no_gradient_and_the_rest_matches(tiny_tokenizer):
    """As under LoRA: the head is frozen, only the hidden states need a gradient."""
    model = make_tiny_llama(tiny_tokenizer, tie_word_embeddings=False)
    model.lm_head.weight.requires_grad_(False)
    batch = random_batch(len(tiny_tokenizer), length=48, seed=2, masked_prefix=5)
    plain, g_plain = _loss_and_grads(model, batch, 0)
    fused, g_fused = _loss_and_grads(model, batch, 13)
    assert model.lm_head.weight.grad is None and "lm_head.weight" not in g_fused
    assert torch.allclose(plain, fused, rtol=1e-5) and g_plain.keys() == g_fused.keys()
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_fused[name], rtol=1e-4, atol=1e-6), name


def test_bf16_weights_get_bf16_gradients_close_to_plain(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer).to(torch.bfloat16)
    batch = random_batch(len(tiny_tokenizer), length=32, seed=2, masked_prefix=5)
    plain, g_plain = _loss_and_grads(model, batch, 0)
    fused, g_fused = _loss_and_grads(model, batch, 8)
    assert torch.allclose(plain.float(), fused.float(), rtol=1e-2)
    for name, g in g_plain.items():
        assert g_fused[name].dtype == torch.bfloat16
        assert (g_fused[name].float() - g.float()).norm() <= 0.05 * g.float().norm() + 1e-6, name


def test_fused_loss_without_grad_equals_plain(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer).eval()
    batch = random_batch(len(tiny_tokenizer), length=48, seed=2, masked_prefix=5)
    with torch.no_grad():
        assert torch.allclose(
            loss_sum(model, batch), loss_sum(model, batch, chunk_size=9), rtol=1e-5
        )


def _scaled_logits(model):
    original = model.forward

    def scaled_forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    model.forward = scaled_forward
    return model


def test_auto_falls_back_to_the_plain_loss_where_fused_cannot_serve(tiny_tokenizer, caplog):
    import logging

    model = _scaled_logits(make_tiny_llama(tiny_tokenizer, num_hidden_layers=1))
    batch = random_batch(len(tiny_tokenizer), length=8, seed=2, masked_prefix=5)
    auto = SFT(TokenLoss(4, fallback=True))
    with caplog.at_level(logging.INFO, logger="onegpu"):
        loss = auto.loss(model, batch)
    assert not auto.tokens.fused and "using the plain loss" in caplog.text
    assert torch.allclose(loss, loss_sum(model, batch))  # the model's own (scaled) logits
    with pytest.raises(UnavailableError, match="techniques.loss=plain"):
        SFT(TokenLoss(4, fallback=False)).loss(model, batch)


def test_loss_setting_resolution():
    tc = TechniquesConfig
    assert (
        TokenLoss.for_run(tc(), vocab=4096, on_gpu=False, sharded=False).chunk_size
        == auto_chunk(4096, False)
        == 512
    )
    assert TokenLoss.for_run(tc(loss_chunk_size=100), 4096, False, False).chunk_size == 100
    assert not TokenLoss.for_run(tc(loss="plain"), 4096, False, False).fused
    assert not TokenLoss.for_run(tc(), 4096, True, sharded=True).fused  # FSDP2 / ZeRO-3: plain
    with pytest.raises(ConfigError, match="shards them"):
        TokenLoss.for_run(tc(loss="fused"), 4096, True, sharded=True)
    with pytest.raises(ConfigError, match="techniques.loss=plain"):
        validate(from_dict({"techniques": {"loss": "plain", "loss_chunk_size": 64}}))
    assert auto_chunk(128256, on_gpu=True) == 256 and auto_chunk(128256, on_gpu=False) == 32
    assert Config().techniques.loss == "auto"


def test_default_training_uses_the_fused_loss(tmp_path, tiny_model_dir, text_file):
    """A default run's steps compute the fused loss: the model's forward returns logits of the
    last position only (the plain loss has it return every position's), the output head sees one
    auto-sized chunk of rows at a time, and the objective is still fused when the run ends
    (loss=auto falls back to plain at the first step where fused cannot serve)."""
    from onegpu import train
    from onegpu.training.state import Callback

    class Seen(Callback):
        def __init__(self):
            self.positions, self.rows = [], []

        def on_train_begin(self, run, state):
            def positions(module, args, out):
                if module.training:
                    self.positions.append(out.logits.shape[1])

            def rows(module, args, out):
                if module.training:
                    self.rows.append(out.shape[:-1].numel())

            run.model.register_forward_hook(positions)
            run.model.lm_head.register_forward_hook(rows)
            self.vocab = len(run.tokenizer)

        def on_train_end(self, run, state):
            self.fused, self.chunk = run.objective.tokens.fused, run.objective.tokens.chunk_size

    seen = Seen()
    cfg = {
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
        "training": {"micro_batch_size": 4, "max_steps": 2, "eval_every": 0, "eval_batches": 1},
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }
    assert train(cfg, callbacks=[seen]).state.step == 2
    assert seen.fused and seen.chunk == auto_chunk(seen.vocab, False)
    assert seen.positions == [1, 1]  # one forward a step, no (tokens x vocab) logits
    assert seen.rows and max(seen.rows) <= seen.chunk


def test_target_positions_from_the_host_select_the_same_rows(tiny_tokenizer):
    """The loop computes the target rows on the host (no device sync); they are the rows a
    boolean mask would pick, and the loss and gradients do not change."""
    batch = random_batch(len(tiny_tokenizer), n=3, length=20, seed=2, masked_prefix=4)
    batch["labels"][1, 10:] = IGNORE  # a padded row
    hidden = torch.randn(3, 20, 8)
    h, y = select_targets(hidden, batch["labels"], with_target_positions(batch)[TARGETS])
    keep = batch["labels"][:, 1:] != IGNORE
    assert torch.equal(h, hidden[:, :-1][keep]) and torch.equal(y, batch["labels"][:, 1:][keep])
    assert y.numel() == count_targets(batch["labels"])
    model = make_tiny_llama(tiny_tokenizer)
    without, g_without = _loss_and_grads(model, batch, 7)
    with_pos, g_with = _loss_and_grads(model, with_target_positions(batch), 7)
    assert torch.equal(without, with_pos)
    assert all(torch.equal(g_without[n], g_with[n]) for n in g_without)
