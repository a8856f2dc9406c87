"""Tiled MLP keeps the math, and the MLP's (tokens x intermediate) tensors are never kept whole."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import LoraConfig, TechniquesConfig
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.prepare import prepare_model
from onegpu.techniques.tiled_mlp import TiledMLP, apply_tiled_mlp, untile

SEQ, INTER = 96, 128  # the tiny model: hidden 64, intermediate 128


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    ids = torch.randint(
        0, len(tiny_tokenizer), (2, SEQ), generator=torch.Generator().manual_seed(5)
    )
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _tiled(tok, mode="on", tile=32, min_seq=8192, **tech):
    tcfg = TechniquesConfig(
        tiled_mlp=mode, tiled_mlp_tile_tokens=tile, tiled_mlp_min_seq=min_seq, **tech
    )
    return prepare_model(make_tiny_llama(tok), tcfg, "cpu")


def _step(model, batch):
    model.train()
    loss = loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_same(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name, g in a[1].items():
        assert torch.allclose(g, b[1][name], rtol=1e-4, atol=1e-6), name


def test_same_loss_and_gradients(tiny_tokenizer, batch):
    plain = _step(make_tiny_llama(tiny_tokenizer), batch)
    _assert_same(_step(_tiled(tiny_tokenizer), batch), plain)
    _assert_same(_step(_tiled(tiny_tokenizer, tile=0), batch), plain)  # tile = hidden size
    _assert_same(_step(_tiled(tiny_tokenizer, checkpointing="full"), batch), plain)


def test_same_gradients_with_lora(tiny_tokenizer, batch):
    lora = LoraConfig(enabled=True, r=4)
    plain = _step(
        prepare_model(make_tiny_llama(tiny_tokenizer), TechniquesConfig(lora=lora), "cpu"), batch
    )
    tiled = _step(_tiled(tiny_tokenizer, lora=lora), batch)
    _assert_same(tiled, plain)
    assert any("mlp.down_proj.lora_" in name for name in tiled[1])


def test_evaluation_output_unchanged(tiny_tokenizer, batch):
    with torch.no_grad():
        plain = make_tiny_llama(tiny_tokenizer).eval()(input_ids=batch["input_ids"]).logits
        tiled = _tiled(tiny_tokenizer).eval()(input_ids=batch["input_ids"]).logits
    assert torch.allclose(tiled, plain, rtol=1e-5, atol=1e-6)


def _saves(model, batch) -> list:
    """(shape, dtype) of each tensor autograd keeps for backward in one training forward (what a
    checkpointed region saves through its own hooks is not kept: it is recomputed)."""
    saves = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saves.append((t.shape, t.dtype)) or t, lambda t: t
    ):
        loss_sum(model.train(), batch, 32)
    return saves


def test_intermediates_not_kept_and_auto_threshold(tiny_tokenizer, batch):
    """Tiled, none of the (tokens x intermediate) tensors of the MLPs is kept for backward (plain:
    four a layer: gate and up projections, activation, product); auto tiles only sequences of at
    least tiled_mlp_min_seq tokens; untile restores the model's own MLP."""

    def intermediates(saves):
        return [
            shape
            for shape, _ in saves
            if shape[-1:] == (INTER,) and shape.numel() == 2 * SEQ * INTER
        ]

    plain = _saves(make_tiny_llama(tiny_tokenizer), batch)
    assert len(intermediates(plain)) == 4 * 2  # 2 layers
    assert intermediates(_saves(_tiled(tiny_tokenizer), batch)) == []
    assert intermediates(_saves(_tiled(tiny_tokenizer, "auto", min_seq=SEQ), batch)) == []
    assert _saves(_tiled(tiny_tokenizer, "auto", min_seq=SEQ + 1), batch) == plain
    model = _tiled(tiny_tokenizer)
    untile(model)
    assert _saves(model, batch) == plain


def test_one_block_peak_drops_as_predicted(tiny_tokenizer):
    """One decoder layer at 2,048 tokens, measured with PyTorch's memory tracker: at the end of
    the forward the layer keeps 4 x tokens x intermediate fp32 fewer bytes, and the step's peak
    drops by at least that (the MLP backward's full-length temporaries go too)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, inter = 2048, 256
    predicted = 4 * tokens * inter * 4

    def measure(mode):
        model = make_tiny_llama(
            tiny_tokenizer,
            num_hidden_layers=1,
            intermediate_size=inter,
            max_position_embeddings=tokens,
        )
        apply_tiled_mlp(model, TechniquesConfig(tiled_mlp=mode, tiled_mlp_tile_tokens=256))
        layer = model.model.layers[0]
        x = torch.randn(1, tokens, 64, requires_grad=True)
        pos = torch.arange(tokens)[None]
        rope = tuple(t.detach() for t in model.model.rotary_emb(x, pos))
        tracker = MemTracker()
        tracker.track_external(layer, x)
        with tracker:
            out = layer(x, position_embeddings=rope, attention_mask=None, position_ids=pos)
            after_forward = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
            out.sum().backward()
        return after_forward, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    (fwd_plain, peak_plain), (fwd_tiled, peak_tiled) = measure("off"), measure("on")
    assert fwd_plain - fwd_tiled == pytest.approx(predicted, rel=0.02)
    assert peak_plain - peak_tiled >= predicted


def test_moe_blocks_left_whole_with_a_log_line(tiny_tokenizer, caplog):
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=len(tiny_tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    with caplog.at_level(logging.INFO, logger="onegpu.techniques.tiled_mlp"):
        apply_tiled_mlp(model, TechniquesConfig(tiled_mlp="on"))
    assert not any(isinstance(layer.mlp, TiledMLP) for layer in model.model.layers)
    assert "2 decoder layers left whole (is a Mixture-of-Experts block)" in caplog.text


def test_prepared_twice_tiles_once_and_keys_unchanged(tiny_tokenizer):
    model = _tiled(tiny_tokenizer)
    keys = set(make_tiny_llama(tiny_tokenizer).state_dict())
    apply_tiled_mlp(model, TechniquesConfig(tiled_mlp="on"))
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = model.model.layers[0].mlp
    assert type(mlp).__mro__[:3] == (type(mlp), TiledMLP, LlamaMLP)  # one level of tiling
    assert set(model.state_dict()) == keys


def test_start_up_line_says_whether_tiles_are_used_at_the_runs_sequence_length(
    tmp_path, tiny_model_dir, tiny_tokenizer, caplog
):
    """A run at data.seq_len=32 under tiled_mlp=auto (tiles from 8,192 tokens) cuts no tile: its
    start-up line says so instead of announcing tiles; at or above the threshold it says they are
    used."""
    import onegpu
    from helpers import make_cfg

    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=0, eval_every=0)
    with caplog.at_level(logging.INFO, logger="onegpu.techniques.tiled_mlp"):
        onegpu.train(cfg)
    assert "tiled MLP: no tiles at this sequence length" in caplog.text
    assert "sequences of up to 32 tokens" in caplog.text and "run their MLP whole" in caplog.text
    assert "in tiles of" not in caplog.text
    caplog.clear()
    tcfg = TechniquesConfig(tiled_mlp="auto", tiled_mlp_min_seq=32)
    with caplog.at_level(logging.INFO, logger="onegpu.techniques.tiled_mlp"):
        apply_tiled_mlp(make_tiny_llama(tiny_tokenizer), tcfg, seq_len=64)
    assert "tiles used at this sequence length" in caplog.text
    assert "tiles of hidden-size tokens on sequences of 32 to 64 tokens" in caplog.text
