"""Gradient accumulation must not change the math: k uneven micro-batches == one big batch.

The loss is normalised by the number of target tokens in the whole accumulated batch
(transformers#34191, #37766), so tokens in short and long micro-batches weigh the same.
"""

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.data.batches import Collator
from onegpu.objectives.sft import SFT, loss_sum
from onegpu.training.step import train_step


class RecordingOptimizer:
    """Captures the gradients train_step produced instead of applying them."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {
            n: p.grad.detach().clone()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _examples(vocab: int, lengths, prompt_len=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        labels = [-100] * prompt_len + ids[
            prompt_len:
        ]  # masked prompt, as in prompt/completion data
        out.append({"input_ids": ids, "labels": labels})
    return out


def _grads(model, micro):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    opt = RecordingOptimizer(model)
    train_step(model, opt, micro, acc, max_grad_norm=0.0, objective=SFT())
    return opt.grads


def _gpt2(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_uneven_micro_batches_equal_one_big_batch(tiny_tokenizer, arch):
    model = make_tiny_llama(tiny_tokenizer) if arch == "llama" else _gpt2(tiny_tokenizer)
    model.eval()  # no dropout: the two runs must see identical math
    examples = _examples(len(tiny_tokenizer), lengths=[7, 30, 12, 21, 5, 40])
    collate = Collator(tiny_tokenizer.pad_token_id, multiple=8)
    micro = [
        collate(examples[0:1]),
        collate(examples[1:4]),
        collate(examples[4:6]),
    ]  # 1 + 3 + 2 rows
    big = [collate(examples)]
    g_acc, g_big = _grads(model, micro), _grads(model, big)
    assert g_acc.keys() == g_big.keys() and len(g_acc) > 0
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_per_micro_batch_mean_would_differ(tiny_tokenizer):
    """Guard the test itself: the naive per-micro-batch mean gives different gradients here."""
    model = make_tiny_llama(tiny_tokenizer)
    model.eval()
    examples = _examples(len(tiny_tokenizer), lengths=[6, 40])
    collate = Collator(tiny_tokenizer.pad_token_id, multiple=8)
    micro = [collate(examples[0:1]), collate(examples[1:2])]

    def naive(mb):
        n = int((mb["labels"][:, 1:] != -100).sum())
        return loss_sum(model, mb) / n / len(micro)

    model.zero_grad()
    for mb in micro:
        naive(mb).backward()
    g_naive = {n: p.grad.clone() for n, p in model.named_parameters()}
    g_big = _grads(model, [collate(examples)])
    diff = max((g_naive[n] - g_big[n]).abs().max().item() for n in g_big)
    assert diff > 1e-4
