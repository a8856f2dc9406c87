"""torch.compile is really applied, keeps the loss and gradients, and bucketed lengths keep the
number of compilations bounded."""

from __future__ import annotations

import pytest
import torch

from helpers import is_compiled, make_tiny_llama
from onegpu.config import TechniquesConfig
from onegpu.data.batches import Collator
from onegpu.errors import ConfigError, UnavailableError
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.compile import apply_compile

COMPILED_FRAMES = []


@torch._dynamo.register_backend
def counting_eager(gm, example_inputs):
    """Counts every graph dynamo hands to a backend (one per compile or recompile)."""
    COMPILED_FRAMES.append(gm)
    return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    COMPILED_FRAMES.clear()
    yield
    torch._dynamo.reset()


def _padded_batch(tok, lengths, multiple):
    g = torch.Generator().manual_seed(3)
    examples = []
    for n in lengths:
        ids = torch.randint(0, len(tok), (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    return Collator(tok.pad_token_id, multiple=multiple)(examples)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("regional", [True, False])
def test_compiled_loss_and_gradients_equal_eager(tiny_tokenizer, regional):
    batch = _padded_batch(tiny_tokenizer, [20, 30], multiple=32)
    eager = _loss_and_grads(make_tiny_llama(tiny_tokenizer), batch)
    model = make_tiny_llama(tiny_tokenizer)
    tcfg = TechniquesConfig(
        compile="default", compile_backend="aot_eager", compile_regional=regional
    )
    apply_compile(model, tcfg, "cpu")
    assert is_compiled(model.model.layers[0]) == regional and is_compiled(model) == (not regional)
    compiled = _loss_and_grads(model, batch)
    assert torch.allclose(compiled[0], eager[0], rtol=1e-5)
    for name, g in eager[1].items():
        assert torch.allclose(compiled[1][name], g, rtol=1e-4, atol=1e-6), name


def _compiles_for(tok, lengths, multiple):
    model = make_tiny_llama(tok)
    apply_compile(
        model, TechniquesConfig(compile="default", compile_backend="counting_eager"), "cpu"
    )
    for n in lengths:
        loss_sum(model, _padded_batch(tok, [n, n - 3], multiple)).backward()
    return len(COMPILED_FRAMES)


def test_bucketed_lengths_do_not_recompile(tiny_tokenizer):
    lengths = [40, 50, 61, 45]  # all inside the 64-token bucket
    bucketed = _compiles_for(tiny_tokenizer, lengths, multiple=64)
    assert bucketed == 1  # one graph, shared by both decoder blocks, for every length in the bucket
    torch._dynamo.reset()
    COMPILED_FRAMES.clear()
    unbucketed = _compiles_for(tiny_tokenizer, lengths, multiple=1)
    assert unbucketed > bucketed  # every new length is a new shape


@pytest.mark.parametrize(
    "switches",
    [
        {"tiled_mlp": "auto"},
        {"tiled_mlp": "on"},
        {"tiled_mlp": "auto", "checkpointing": "full"},
        {"tiled_mlp": "on", "checkpointing": "full"},
        {"tiled_mlp": "on", "checkpointing": "full", "activation_offload": True, "lora": "on"},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_every_block_shares_one_graph_through_the_pipeline(tiny_tokenizer, switches):
    """Through prepare_model, with the tiled MLP (auto is the default), checkpointing, LoRA and
    activation offload, regional compile makes one graph for all blocks: nothing per block is
    guarded on (a per-block object would recompile each block and leave blocks past dynamo's
    recompile limit eager)."""
    from onegpu.config import LoraConfig
    from onegpu.techniques.prepare import prepare_model

    switches = dict(switches)
    lora = LoraConfig(enabled=switches.pop("lora", "off") == "on", r=4)
    tcfg = TechniquesConfig(
        compile="default",
        compile_backend="counting_eager",
        tiled_mlp_tile_tokens=16,
        lora=lora,
        **switches,
    )
    model = prepare_model(make_tiny_llama(tiny_tokenizer, num_hidden_layers=10), tcfg, "cpu")
    loss_sum(model.train(), _padded_batch(tiny_tokenizer, [60, 64], multiple=64)).backward()
    assert len(COMPILED_FRAMES) == 1


@pytest.mark.slow  # an inductor compile: 12-15 CPU s from a cold cache, near the fast tier's limit
def test_inductor_compiles_a_block(tiny_tokenizer):
    """The default backend (inductor) compiles the block's forward and its backward, in one graph,
    and the compiled block gives the eager loss."""
    from torch._dynamo.utils import counters

    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    batch = _padded_batch(tiny_tokenizer, [16], multiple=16)
    eager = _loss_and_grads(make_tiny_llama(tiny_tokenizer, num_hidden_layers=1), batch)
    apply_compile(model, TechniquesConfig(compile="default"), "cpu")
    counters.clear()
    compiled = _loss_and_grads(model, batch)
    assert counters["frames"]["ok"] >= 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    # inductor produced (or took from its cache) the forward graph and the backward graph
    inductor = counters["inductor"]
    assert inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"] == 2, dict(inductor)
    assert counters["aot_autograd"]["ok"] == 1
    assert torch.allclose(compiled[0], eager[0], rtol=1e-4)


def test_bad_compile_settings_are_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        apply_compile(model, TechniquesConfig(compile="default", compile_backend="nope"), "cpu")
    with pytest.raises(ConfigError, match="inductor mode"):
        apply_compile(
            model, TechniquesConfig(compile="max-autotune", compile_backend="eager"), "cpu"
        )
    with pytest.raises(UnavailableError, match="CUDA graphs"):
        apply_compile(model, TechniquesConfig(compile="reduce-overhead"), "cpu")
    assert apply_compile(
        model, TechniquesConfig(compile="off"), "cpu"
    ) is model and not is_compiled(model)


def _cfg(**techniques):
    from onegpu.config import from_dict

    steps = techniques.pop("max_steps", 200)
    return from_dict({"training": {"max_steps": steps}, "techniques": techniques})


def test_auto_compile_resolution(monkeypatch):
    import shutil

    from onegpu.techniques.compile import AUTO_MIN_STEPS, resolve_compile

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert _cfg().techniques.compile == "auto"
    assert resolve_compile(_cfg(), "cpu") == "default"
    assert (
        resolve_compile(_cfg(max_steps=AUTO_MIN_STEPS - 1), "cpu") == "off"
    )  # too short to repay it
    assert resolve_compile(_cfg(offload="zero2-cpu"), "cpu") == "off"
    assert resolve_compile(_cfg(lora={"enabled": True, "quantize_base": "nf4"}), "cuda") == "off"
    assert resolve_compile(_cfg(compile="off"), "cpu") == "off"
    assert (
        resolve_compile(_cfg(compile="max-autotune", max_steps=3), "cpu") == "max-autotune"
    )  # asked for
    assert resolve_compile(_cfg(), "mps") == "off"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert resolve_compile(_cfg(), "cpu") == "off"  # no C++ compiler
    # Unresolved auto (a caller that did not settle it) compiles nothing.
    model = torch.nn.Linear(2, 2)
    assert apply_compile(model, TechniquesConfig(), "cpu") is model and not is_compiled(model)


def test_default_run_compiles_blocks_and_evaluates_without_compiling(
    tmp_path, tiny_model_dir, text_file, monkeypatch
):
    """A default run long enough to repay compiling gets its decoder blocks compiled; evaluation
    runs them eagerly instead of compiling a no-grad variant."""
    import dataclasses
    import shutil

    from accelerate import Accelerator

    from onegpu import hardware
    from onegpu.config import from_dict
    from onegpu.data import batches
    from onegpu.objectives.tokens import with_target_positions
    from onegpu.techniques.prepare import resolved_techniques
    from onegpu.training import assemble
    from onegpu.training.data import build_data
    from onegpu.training.evaluate import evaluate

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    cfg = from_dict(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"path": str(text_file), "seq_len": 32},
            "training": {"micro_batch_size": 2, "eval_batches": 2},
            "output": {"dir": str(tmp_path)},
        }
    )
    tcfg = resolved_techniques(cfg, "cpu")
    assert tcfg.compile == "default" and cfg.techniques.compile == "auto"  # settled on a copy
    # The same path with the graph-counting backend, so the test needs no C++ build.
    cfg.techniques.compile, cfg.techniques.compile_backend = "default", "counting_eager"
    device, name = hardware.detect(), str(tiny_model_dir)
    data = build_data(cfg, name)
    parts = assemble.assemble(cfg, device, "fp32", name, tokenizer=data.tokenizer, optimizer=False)
    assert all(is_compiled(layer) for layer in parts.model.model.layers)
    batch = next(iter(batches.eval_batches(data.train_ds, 2, data.collator, 1)))
    parts.objective.loss(parts.model, with_target_positions(batch)).backward()
    trained = len(COMPILED_FRAMES)
    assert trained >= 1
    data = dataclasses.replace(data, val_ds=data.train_ds)
    run = assemble.Run(
        cfg,
        device,
        tmp_path / "run",
        name,
        "fp32",
        data,
        parts.model,
        parts.optimizer,
        parts.scheduler,
        parts.objective,
    )
    assert evaluate(run, Accelerator(cpu=True)) is not None
    assert len(COMPILED_FRAMES) == trained  # no compile for evaluation
