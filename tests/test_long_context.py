"""A long-context training step builds nothing quadratic in the sequence length: no attention
mask, no score matrix, no full logits; rotary tables and position ids stay (tokens x small)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from onegpu.config import TechniquesConfig
from onegpu.data.batches import Collator
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.prepare import prepare_model


class Largest(TorchDispatchMode):
    """Records the largest tensor any operation produces (bytes, shape, op)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.largest[0]:
                self.largest = (t.numel() * t.element_size(), tuple(t.shape), str(func))
        return out


def _model(tokens, hidden=32, inter=64, heads=2, **tech):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=1,
            max_position_embeddings=tokens,
            attn_implementation="sdpa",
        )
    )
    return prepare_model(model, TechniquesConfig(**tech), "cpu")


def _packed(tokens, docs=1):
    """A padding-free row of ``docs`` documents, cut so the row gets a padded tail."""
    g = torch.Generator().manual_seed(0)
    size = (tokens - 5) // docs
    examples = [
        {"input_ids": (ids := torch.randint(3, 256, (size,), generator=g).tolist()), "labels": ids}
        for _ in range(docs)
    ]
    return Collator(0, multiple=64, position_ids=True)(examples)


def test_packed_single_document_row_builds_no_mask():
    """The padded tail of a padding-free row continues the last document: one document stays one,
    and sdpa runs causal without a (tokens x tokens) mask (two documents still need one)."""
    tokens = 4096
    batch = _packed(tokens)
    assert batch["input_ids"].shape == (1, tokens)
    assert batch["position_ids"][0].tolist() == list(range(tokens))
    model = _model(tokens)
    with torch.no_grad(), Largest() as one:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert one.largest[0] == tokens * 256 * 4, one.largest  # the fp32 logits (tokens x vocab)
    with torch.no_grad(), Largest() as two:
        two_docs = _packed(tokens, docs=2)
        model(
            input_ids=two_docs["input_ids"], position_ids=two_docs["position_ids"], use_cache=False
        )
    assert two.largest[0] >= tokens * tokens  # the block-diagonal mask: what flash varlen avoids


def test_padded_tail_changes_no_loss():
    batch = _packed(1000)
    n = int(batch["attention_mask"].sum())
    model = _model(1024)
    trimmed = {
        "input_ids": batch["input_ids"][:, :n],
        "labels": batch["labels"][:, :n],
        "position_ids": batch["position_ids"][:, :n],
    }
    assert batch["input_ids"].shape[1] > n
    assert torch.allclose(loss_sum(model, batch), loss_sum(model, trimmed), rtol=1e-6)


@pytest.mark.slow
def test_64k_forward_builds_nothing_quadratic():
    """A 65,536-token padding-free row from the collator: the rotary tables, the position ids and
    the attention of the whole forward stay below (tokens x intermediate) elements, where a mask
    would be (tokens x tokens): 4 Gi elements. (sdpa on CPU: its flash kernel, as on a GPU.)"""
    tokens = 65536
    batch = _packed(tokens)
    model = _model(tokens, hidden=16, inter=32, heads=1)
    with torch.no_grad(), Largest() as forward:
        model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=1,
        )
    assert forward.largest[0] <= tokens * 32 * 4, (
        forward.largest
    )  # 32 = the intermediate size, fp32


@pytest.mark.slow
def test_long_training_step_is_linear_in_tokens():
    """Forward and backward of an 8,192-token packed row with the fused loss, tiled MLP and
    activation offload: the largest tensor of the step is (tokens x hidden)-sized; the full
    logits would be (tokens x vocab), a mask (tokens x tokens), the MLP (tokens x intermediate)."""
    tokens = 8192
    batch = _packed(tokens)
    model = _model(tokens, hidden=32, inter=128, tiled_mlp="on", activation_offload=True).train()
    with Largest() as step:
        loss_sum(model, batch, chunk_size=256).backward()
    assert step.largest[0] <= tokens * 32 * 4, step.largest  # 32 = the hidden size, fp32
