"""Activation offload's CUDA path on the card: side-stream copies to page-locked host buffers, the
in-flight bound, the prefetch in backward, through training's own prepare_model and train_step
(card_step.step). Runs inside a card's process (test_cards.py).

The card has no data, so what is checked is the bookkeeping and the memory it implies, not the
overlap (cards.py, "streams and events"); equal values are the CPU tier's
(tests/test_activation_offload.py)."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import card_step
import cards
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from onegpu.config import LoraConfig, TechniquesConfig
from onegpu.techniques.activation_offload import MAX_IN_FLIGHT, attached

MIN_BYTES = 4096  # a block input of the tiny model (2 x 16 tokens x 64, 16-bit) and above

VARIANTS = {
    "plain": {},
    "checkpointing-full": {"checkpointing": "full"},
    "lora": {"lora": LoraConfig(enabled=True, r=4)},
}


class HostMemory(TorchDispatchMode):
    """Bytes of the live storages of fake host tensors made while entered (page-locked buffers:
    cards.py makes them fake host tensors)."""

    def __init__(self):
        super().__init__()
        self.live = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        out = func(*args, **(kwargs or {}))
        if isinstance(out, FakeTensor) and out.device.type == "cpu":
            self.live.setdefault(out.untyped_storage(), out.untyped_storage().nbytes())
        return out

    def allocated(self) -> int:
        return sum(self.live.values())


@dataclass
class Seen:
    """What one step showed from outside the technique."""

    start: int = 0  # card bytes when the model's forward began
    end: int = 0  # ... and when it ended
    host: int = 0  # fake host bytes alive at the end of the forward, made during it
    saved: list = field(default_factory=list)  # bytes of each distinct saved storage, in order
    grads: dict = field(default_factory=dict)  # parameter index -> (grad shape, grad dtype)


@contextlib.contextmanager
def watching(track_saves: bool):
    """Global module and optimizer hooks around one step: the card's bytes at the start and end of
    the outermost model forward (the first one: checkpointing's recompute in backward calls the
    layers again), the host bytes made in it, the gradients when the optimizer steps and, with
    ``track_saves``, each distinct non-weight storage of MIN_BYTES or more that autograd saves in
    that forward (what activation offload would take, in the order it would take it)."""
    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen, state = Seen(), {"depth": 0, "done": False}
    host = HostMemory()
    keys: set = set()

    def pack(t):
        st = t.untyped_storage()
        key = StorageWeakRef(st)
        if key not in keys and key not in state["weights"] and st.nbytes() >= MIN_BYTES:
            seen.saved.append(st.nbytes())
        keys.add(key)
        return t

    saves = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def pre(mod, args):
        if state["done"]:
            return
        if state["depth"] == 0:
            gc.collect()  # alive is reachable: nothing waits for the collector in either reading
            seen.start = cards.MEMORY.allocated()
            weights = (*mod.parameters(), *mod.buffers())
            state["weights"] = {StorageWeakRef(w.untyped_storage()) for w in weights}
            host.__enter__()
            if track_saves:
                saves.__enter__()
        state["depth"] += 1

    def post(mod, args, out):
        if state["done"]:
            return
        state["depth"] -= 1
        if state["depth"] == 0:
            if track_saves:
                saves.__exit__(None, None, None)
            host.__exit__(None, None, None)
            gc.collect()
            seen.end, seen.host = cards.MEMORY.allocated(), host.allocated()
            state["done"] = True

    def grads(optimizer, args, kwargs):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        seen.grads = {i: (p.grad.shape, p.grad.dtype) for i, p in enumerate(params)}

    handles = [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(post),
        register_optimizer_step_pre_hook(grads),
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _run(variant: str, offload: bool):
    tcfg = TechniquesConfig(
        activation_offload=offload, activation_offload_min_bytes=MIN_BYTES, **VARIANTS[variant]
    )
    with watching(track_saves=not offload) as seen:
        model, optimizer, _, _ = card_step.step(tcfg)
    return model, seen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_offload_step_moves_and_brings_back(card, variant):
    """The step with activation offload: every saved storage of MIN_BYTES or more went to host
    memory; the card's bytes at the end of the forward dropped by those bytes less the copies
    still in flight (at most MAX_IN_FLIGHT storages); the host holds them; the backward brought
    back every moved storage that had left the card, prefetching; the gradients are the plain
    run's."""
    if card.key not in card_step.EVERY_STEP:
        pytest.skip(f"the method steps run on {' and '.join(card_step.EVERY_STEP)}")
    _, plain = _run(variant, offload=False)
    model, off = _run(variant, offload=True)
    stats = attached(model).stats
    moved = plain.saved  # what the plain run saved, in order: what the offload must take
    in_flight = moved[-MAX_IN_FLIGHT:]
    assert len(moved) > MAX_IN_FLIGHT and stats.moved_storages == len(moved)
    assert stats.moved == sum(moved) and stats.in_flight == sum(in_flight)
    # the forward's growth of the card's bytes, with and without: the drop is what left the card
    drop = (plain.end - plain.start) - (off.end - off.start)
    assert drop == sum(moved) - sum(in_flight) > 0
    assert off.host == sum(moved) and plain.host == 0
    assert stats.fetched == len(moved) - len(in_flight) and stats.prefetched > 0
    assert off.grads == plain.grads and len(plain.grads) > 0


# ------------------------------------------------------------------ full size, against the planner
FULL = "Llama-3.2-1B"  # all 16 layers, the published shape (fullsize.SHAPES)
FULL_BATCH, FULL_SEQ = 2, 4096
FULL_CARD = "H100"  # memory does not depend on the card: one card runs it


class NoCausalMask:
    """While entered, transformers' SDPA mask is None, as on a card for a batch without padding
    (``sdpa_mask`` skips it, SDPA runs ``is_causal``): under fake tensors transformers counts as
    tracing and would build the (batch x seq x seq) mask (cards.py). Only for unpadded batches."""

    def __enter__(self):
        from transformers.masking_utils import AttentionMaskInterface

        self.plain = AttentionMaskInterface._global_mapping["sdpa"]
        AttentionMaskInterface.register("sdpa", lambda *args, **kwargs: None)
        return self

    def __exit__(self, *exc):
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register("sdpa", self.plain)


def card_peak(setup) -> dict:
    """One optimizer step of ``setup`` (a fullsize.Setup) on the card, after a warm one (optimizer
    state exists, gradients were freed): torch.cuda.max_memory_allocated over it, bytes, and what
    ran. Built as training builds it, with fullsize's parts (fullsize.build does the same on fake
    host tensors): prepare_model for "cuda", then fake "cuda" weights."""
    import time

    from accelerate.state import AcceleratorState
    from fullsize import CardAttention, meta_model, train_parts

    from onegpu.config import Config
    from onegpu.hardware import detect
    from onegpu.techniques.prepare import prepare_model
    from onegpu.training.step import train_step

    config, c = setup.config(), setup.candidate
    cfg = c.apply(Config())
    model = prepare_model(meta_model(config, c), cfg.techniques, "cuda")
    ids = torch.randint(0, config.vocab_size, (c.training.micro_batch_size, setup.seq))
    micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    t0 = time.perf_counter()
    gc.collect()  # an earlier step's model, still in a reference cycle, is not this step's
    with cards.fake_cuda(), NoCausalMask(), CardAttention() as route:
        before = torch.cuda.memory_allocated()  # what other checks in this process left alive
        cards.on_card(model).train()
        # on the card already, so Accelerate places nothing: see cards.py, "placement"
        model, optimizer, loss_fn, accelerator, _ = train_parts(model, config, cfg, detect())
        args = (accelerator, cfg.training.max_grad_norm, loss_fn)
        train_step(model, optimizer, micro, *args)
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optimizer, micro, *args)
        peak = torch.cuda.max_memory_allocated() - before
    offload = attached(model)
    out = {
        "peak": peak,
        "seconds": time.perf_counter() - t0,
        "flash_calls": route.flash,
        "other_sdpa_calls": route.other,
        "moved": offload.stats.moved if offload else 0,
    }
    del model, optimizer, accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
    return out


def test_full_size_peak_with_offload_as_planned(card):
    """Llama-3.2-1B (16 layers), bf16 weights, checkpointing full, batch 2 x 4096: the card's
    peak (torch.cuda.max_memory_allocated) within ±5% of the planner's estimate on a GPU, with
    activation offload and without; offload lowers both, and the planner promises no more saving
    than the card shows."""
    if card.key != FULL_CARD:
        pytest.skip(f"memory does not depend on the card: the full-size rows run on {FULL_CARD}")
    from fullsize import SHAPES, TOLERANCE, Setup, predicted

    from onegpu.plan.candidate import setup

    rows = {}
    for offload in (False, True):
        c = setup(
            FULL_BATCH, 1, precision="bf16-pure", checkpointing="full", activation_offload=offload
        )
        s = Setup(FULL, c, FULL_SEQ)
        rows[offload] = (card_peak(s), predicted(s))
    layers = SHAPES[FULL]().num_hidden_layers
    for offload, (tracked, planned) in rows.items():
        assert tracked["flash_calls"] >= 2 * 2 * layers and tracked["other_sdpa_calls"] == 0
        assert (tracked["moved"] > 0) == offload
        ratio = planned["peak"] / tracked["peak"]
        assert ratio == pytest.approx(1.0, abs=TOLERANCE), (
            f"offload={offload}: planned {planned['peak'] / 2**30:.3f} GiB, card "
            f"{tracked['peak'] / 2**30:.3f} GiB; planned parts {planned['parts']}"
        )
    saved = rows[False][0]["peak"] - rows[True][0]["peak"]
    planned_saving = rows[False][1]["peak"] - rows[True][1]["peak"]
    assert 0 < planned_saving <= saved


def test_forward_without_backward_releases_its_copies(card):
    """A forward whose graph is dropped before any backward (an evaluation with gradients on)
    leaves only its copies in flight on the card beyond what the plain model leaves, and the next
    forward releases them first."""
    if card.key not in card_step.EVERY_STEP:
        pytest.skip(f"the method steps run on {' and '.join(card_step.EVERY_STEP)}")
    from onegpu.techniques.prepare import prepare_model

    held = {}
    for offload in (False, True):
        tcfg = TechniquesConfig(activation_offload=offload, activation_offload_min_bytes=MIN_BYTES)
        model = prepare_model(card_step._model(), tcfg, "cuda")
        with cards.fake_cuda():
            cards.on_card(model).train()
            batch = {k: v.to("cuda") for k, v in card_step._batch().items()}
            gc.collect()
            before, held[offload] = torch.cuda.memory_allocated(), []
            for _ in range(2):
                model(**batch)  # the output, and with it the graph, is dropped at once
                gc.collect()
                held[offload].append(torch.cuda.memory_allocated() - before)
    in_flight = attached(model).stats.in_flight
    assert in_flight > 0 and held[True] == [held[False][0] + in_flight] * 2
    assert held[False][0] == held[False][1]


class _Skip(torch.nn.Module):
    """A chain of layers whose first output also feeds the loss directly (a skip connection): the
    backward needs that early storage at once, before its turn in reverse forward order."""

    def __init__(self, width: int = 256, depth: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        first = h = torch.relu(self.layers[0](x))
        for layer in self.layers[1:]:
            h = torch.relu(layer(h))
        return h.sum() + (first * first).sum()


def test_a_storage_needed_out_of_order_is_fetched_on_demand(card):
    """The skip connection's storage is neither in flight nor prefetched when the backward asks
    for it: it is copied back on demand, and every moved storage comes back exactly once."""
    if card.key not in card_step.EVERY_STEP:
        pytest.skip(f"the method steps run on {' and '.join(card_step.EVERY_STEP)}")
    from onegpu.techniques.activation_offload import PREFETCH, apply_activation_offload

    tcfg = TechniquesConfig(activation_offload=True, activation_offload_min_bytes=MIN_BYTES)
    model = apply_activation_offload(_Skip(), tcfg, "cuda")
    with cards.fake_cuda():
        model.to_empty(device="cuda")
        model(torch.zeros(64, 256).to("cuda")).backward()
    stats = attached(model).stats
    assert stats.moved_storages > MAX_IN_FLIGHT + PREFETCH
    # every storage not left on the device comes back once; the skip's was not fetched ahead
    assert stats.fetched == stats.moved_storages - MAX_IN_FLIGHT
    assert stats.fetched - stats.prefetched == 1  # the skip's, asked for first
