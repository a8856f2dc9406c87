"""Activation offload keeps the math and moves the saved tensors it should, and only those."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import make_tiny_llama, saved_tensor_bytes
from onegpu.config import LoraConfig, TechniquesConfig
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.activation_offload import ActivationOffload
from onegpu.techniques.checkpointing import apply_checkpointing
from onegpu.techniques.prepare import prepare_model

LAYERS, HIDDEN = 3, 64


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    ids = torch.randint(0, len(tiny_tokenizer), (2, 96), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _model(tok, checkpointing="off", **config):
    model = make_tiny_llama(tok, num_hidden_layers=LAYERS, **config)
    return apply_checkpointing(model, TechniquesConfig(checkpointing=checkpointing), "cpu")


def _step(model, batch, chunk=0):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch, chunk)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_same(a, b):
    assert torch.allclose(a[0], b[0], rtol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name, g in a[1].items():
        assert torch.allclose(g, b[1][name], rtol=1e-5, atol=1e-7), name


def _assert_close_to_rounding(a, b):
    """Equal but for the order of float sums (two compilations may differ in it): the loss to
    1e-6 and each gradient's largest difference within 1e-5 of its largest value."""
    assert torch.allclose(a[0], b[0], rtol=1e-6)
    assert a[1].keys() == b[1].keys()
    for name, g in a[1].items():
        assert (g - b[1][name]).abs().max() <= 1e-5 * b[1][name].abs().max(), name


@contextlib.contextmanager
def _in_forward(model, pack):
    """Saved-tensor hooks (``pack``, identity unpack) active during the model's forward only."""
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    h1 = model.register_forward_pre_hook(lambda *a: hooks.__enter__())
    h2 = model.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    try:
        yield
    finally:
        h1.remove(), h2.remove()


def _saved_storages(model, batch) -> list[int]:
    """Bytes of each distinct non-weight storage autograd saves in the model's forward."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict = {}  # address -> (weak ref, bytes); an address freed and reused is a new storage
    sizes: list = []

    def pack(t):
        st = t.untyped_storage()
        known = seen.get(st.data_ptr())
        if st.data_ptr() not in weights and (known is None or known[0].expired()):
            seen[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            sizes.append(st.nbytes())
        return t

    with _in_forward(model, pack):
        loss_sum(model.train(), batch).backward()
    return sizes


@pytest.mark.parametrize("checkpointing", ["off", "full"])
@pytest.mark.parametrize("chunk", [0, 32])
def test_same_loss_and_gradients(tiny_tokenizer, batch, checkpointing, chunk):
    plain = _step(_model(tiny_tokenizer, checkpointing), batch, chunk)
    model = _model(tiny_tokenizer, checkpointing)
    offload = ActivationOffload(model, min_bytes=0).attach()
    first = _step(model, batch, chunk)
    _assert_same(first, plain)
    assert offload.stats.moved > 0
    _assert_same(
        _step(model, batch, chunk), plain
    )  # a second step: nothing left over from the first


def test_moved_and_kept_bytes_as_predicted(tiny_tokenizer, batch):
    """Each distinct saved storage of at least min_bytes moves, the rest stays: the device bytes
    alive at the end of the forward drop by exactly the predicted amount."""
    sizes = _saved_storages(_model(tiny_tokenizer), batch)
    threshold = sorted(sizes)[len(sizes) // 2]  # about half the storages on each side
    model = _model(tiny_tokenizer)
    offload = ActivationOffload(model, min_bytes=threshold).attach()
    loss_sum(model.train(), batch).backward()
    assert offload.stats.moved == sum(n for n in sizes if n >= threshold) > 0
    assert offload.stats.kept == sum(n for n in sizes if n < threshold) > 0
    # the largest saved activations, (batch x seq x intermediate) fp32, are among the moved
    assert max(sizes) >= batch["input_ids"].numel() * 128 * 4


def test_with_checkpointing_the_block_inputs_move(tiny_tokenizer, batch):
    """Checkpointed blocks save only their inputs, and those are what moves."""
    block_input = batch["input_ids"].numel() * HIDDEN * 4  # (batch x seq x hidden) fp32
    plain = ActivationOffload(m := _model(tiny_tokenizer), min_bytes=block_input).attach()
    loss_sum(m.train(), batch).backward()
    ckpt = ActivationOffload(m := _model(tiny_tokenizer, "full"), min_bytes=block_input).attach()
    loss_sum(m.train(), batch).backward()
    assert LAYERS * block_input <= ckpt.stats.moved < plain.stats.moved / 3


def test_lora_same_gradients_adapters_only(tiny_tokenizer, batch):
    tcfg = TechniquesConfig(lora=LoraConfig(enabled=True, r=4))
    plain = _step(prepare_model(make_tiny_llama(tiny_tokenizer), tcfg, "cpu"), batch)
    tcfg.activation_offload, tcfg.activation_offload_min_bytes = True, 0
    offloaded = _step(prepare_model(make_tiny_llama(tiny_tokenizer), tcfg, "cpu"), batch)
    _assert_same(offloaded, plain)
    assert all("lora_" in name for name in offloaded[1])


def _saves(fn) -> list:
    """(shape, dtype) of each tensor autograd saves while ``fn`` runs, outside inner hooks."""
    saves = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saves.append((t.shape, t.dtype)) or t, lambda t: t
    ):
        fn()
    return saves


def test_pipeline_switch_takes_the_saved_tensors(tiny_tokenizer, batch):
    """Through prepare_model, every tensor saved in the model's forward goes to the offload hooks:
    an outer tracker sees exactly what the loss saves outside it, and no hook is left active."""
    plain = make_tiny_llama(tiny_tokenizer)
    off = prepare_model(
        make_tiny_llama(tiny_tokenizer),
        TechniquesConfig(activation_offload=True, activation_offload_min_bytes=0),
        "cpu",
    )
    everything = _saves(lambda: loss_sum(plain.train(), batch, 32))
    with _in_forward(plain, lambda t: t):  # the model's own saves hidden from the tracker
        outside = _saves(lambda: loss_sum(plain.train(), batch, 32))
    assert _saves(lambda: loss_sum(off.train(), batch, 32)) == outside
    assert len(outside) < len(everything) / 2
    x = torch.ones(4, requires_grad=True)
    assert (
        _saves(lambda: off(input_ids=batch["input_ids"]) and (x * x).sum())
        == [(x.shape, x.dtype)] * 2
    )


def test_hooks_left_when_forward_raises_and_off_without_grad(tiny_tokenizer, batch):
    model = _model(tiny_tokenizer)
    offload = ActivationOffload(model, min_bytes=0).attach()
    with pytest.raises(IndexError):
        model(input_ids=torch.full((1, 4), 10_000))  # past the vocabulary
    x = torch.ones(4, requires_grad=True)
    assert saved_tensor_bytes(model, lambda: (x * x).sum()) > 0  # the tracker's hooks, not ours
    after_raise = offload.stats
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert offload.stats is after_raise  # no forward was entered: nothing is saved without grad


def test_fake_tensors_move_what_real_ones_move(tiny_tokenizer, batch):
    """A FakeTensor (torch's shape propagation, the simulated-GPU tier's card) stands for a plain
    tensor but has no data address: the storages a forward on fake tensors moves are those the
    same forward on real tensors moves, found by the storage's identity, not its address."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    threshold = batch["input_ids"].numel() * HIDDEN * 4  # a block input and larger
    # eager attention: transformers counts fake tensors as tracing and then always builds the
    # causal mask, which SDPA on real tensors does without (a different graph)
    real = ActivationOffload(
        _model(tiny_tokenizer, attn_implementation="eager"), min_bytes=threshold
    ).attach()
    loss_sum(real.model.train(), batch).backward()
    with torch.device("meta"):
        model = _model(tiny_tokenizer, attn_implementation="eager")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu").tie_weights()
        fake = ActivationOffload(model, min_bytes=threshold).attach()
        loss_sum(model.train(), batch).backward()
    assert isinstance(next(model.parameters()), FakeTensor) and real.stats.moved > 0
    assert fake.stats == real.stats


def test_a_graph_dropped_before_backward_frees_what_stayed(tiny_tokenizer, batch):
    """What stays on the device (below min_bytes) is saved detached: an output its own node saves
    (RMSNorm's rsqrt) must not keep that node, and so itself, alive once the graph is dropped
    unused."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    made.append(StorageWeakRef(t.untyped_storage()))
            return out

    model = _model(tiny_tokenizer)
    offload = ActivationOffload(model, min_bytes=1 << 40).attach()  # every saved tensor stays
    held = (*model.parameters(), *model.buffers(), *batch.values())  # alive anyway
    anyway = {StorageWeakRef(t.untyped_storage()) for t in held}
    made: list = []
    with Outputs():
        model(**batch)  # gradients on, the graph dropped with the output
    gc.collect()
    assert offload.stats.kept > 0 and offload.stats.moved == 0
    assert [r for r in made if r not in anyway and not r.expired()] == []


@pytest.mark.slow  # inductor compiles the blocks: 17-33 CPU s from a cold cache
@pytest.mark.parametrize("checkpointing", ["off", "full"])
def test_compiled_blocks_same_loss_and_gradients_and_their_saves_move(
    tiny_tokenizer, batch, checkpointing
):
    """Compile and offload together, as prepare_model stacks them (torchtune's ladder runs both):
    a compiled block's saved tensors are saved when its compiled autograd node runs, through the
    offload hooks, so they move; loss and gradients equal the compiled run without offload."""
    from onegpu.techniques.activation_offload import attached

    def build(offload: bool):
        torch.manual_seed(0)
        tcfg = TechniquesConfig(
            compile="default",
            checkpointing=checkpointing,
            activation_offload=offload,
            activation_offload_min_bytes=0,
        )
        return prepare_model(make_tiny_llama(tiny_tokenizer, num_hidden_layers=LAYERS), tcfg, "cpu")

    compiled = _step(build(False), batch)
    model = build(True)
    _assert_close_to_rounding(_step(model, batch), compiled)
    # Compiled code chooses its own saves (elementwise results recomputed, AOTAutograd's own
    # checkpoint), so what moves differs from the eager blocks' saves: the compiled ones ran.
    # Each block's input, (batch x seq x hidden) fp32, is among them and moves.
    stats = attached(model).stats
    eager = ActivationOffload(_model(tiny_tokenizer, checkpointing), min_bytes=0).attach()
    _step(eager.model, batch)
    assert stats.moved != eager.stats.moved
    assert stats.moved >= LAYERS * batch["input_ids"].numel() * HIDDEN * 4
    assert stats.moved_storages >= LAYERS
    _assert_close_to_rounding(_step(model, batch), compiled)
