"""KTO: the loss and gradients equal TRL's KTOTrainer (mixed, all-desirable and all-undesirable
batches, unequal weights), the same tokens and mismatched completions as TRL's, the KL estimate
is the mismatched sequences' (no gradient), and the adapters-off and precomputed references give
the reference's log-probs."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import DataConfig, PreferenceConfig
from onegpu.data import unpaired
from onegpu.data.batches import Collator
from onegpu.objectives import kto, reference
from onegpu.objectives.tokens import TokenLoss, with_target_positions

RECORDS = [
    {"prompt": "def add(a, b):\n", "completion": "    return a + b\n", "label": True},
    {"prompt": "class Point:\n", "completion": "    x y self\n", "label": False},
    {"prompt": "for i in range(10):\n", "completion": "    print(i * i)\n", "label": True},
    {"prompt": "import os\n", "completion": "The lazy dog.\n", "label": False},
    {"prompt": "while True:\n", "completion": "    break\n", "label": True},
]


def _dataset(tok, records):
    import datasets

    cols = {k: [r[k] for r in records] for k in ("prompt", "completion", "label")}
    out = unpaired.tokenize_batch(
        cols, list(range(len(records))), tok, DataConfig(seq_len=128), "t"
    )
    ds = datasets.Dataset.from_dict(
        {k: out[k] for k in ("prompt_ids", "completion_ids", unpaired.LABEL)}
    )
    return unpaired.with_mismatched(ds)


def _batch(tok, records=RECORDS, refs=None, packed=False):
    ds = _dataset(tok, records)
    examples = [ds[i] for i in range(len(ds))]
    if refs is not None:
        for ex, a, b in zip(examples, refs[0], refs[1], strict=True):
            ex[unpaired.REF_COMPLETION], ex[unpaired.REF_KL] = float(a), float(b)
    collator = unpaired.UnpairedCollator(
        Collator(tok.pad_token_id, 8, 128, position_ids=packed), 128
    )
    return with_target_positions(collator(examples))


def _trl_trainer(tok, model, ref_model, records, tmp, **kw):
    import datasets
    import trl

    args = trl.KTOConfig(
        output_dir=tmp,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=len(records),
        max_length=128,
        dataset_num_proc=None,
        disable_dropout=True,
        **kw,
    )
    return trl.KTOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok,
    )


def _moved(tok, swap: bool = False):
    """(policy, reference), one the other moved at random: rewards are not 0. On these records
    the mismatched sequences' mean log-ratio is negative (z0 clamped to 0) one way, positive
    ``swap``ped."""
    torch.manual_seed(0)
    base = make_tiny_llama(tok)
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return (ref, base) if swap else (base, ref)


@pytest.mark.parametrize(
    "labels, beta, weights, swap",
    [
        ((True, False, True, False, True), 0.1, (1.0, 1.0), False),  # z0 clamped at 0
        ((True, False, True, False, True), 0.5, (1.33, 0.7), True),  # z0 > 0
        ((True,) * 5, 0.1, (1.0, 1.0), True),  # all desirable: no undesirable loss at all
        ((False,) * 5, 0.3, (1.0, 2.0), True),
    ],
)
def test_kto_loss_and_gradients_equal_trl_ktotrainer(
    tiny_tokenizer, tmp_path, labels, beta, weights, swap
):
    """Same tiny model (moved off its reference), same records: TRL's KTOTrainer.compute_loss and
    ours (fused head, a frozen copy as reference) give the same loss, the same KL estimate and the
    same gradient of every weight."""
    pytest.importorskip("trl")
    records = [{**r, "label": lab} for r, lab in zip(RECORDS, labels, strict=True)]
    base, ref = _moved(tiny_tokenizer, swap)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    trainer = _trl_trainer(
        tiny_tokenizer,
        theirs,
        copy.deepcopy(ref),
        records,
        str(tmp_path),
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
    )
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()

    pref = PreferenceConfig(beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1])
    tokens = TokenLoss(16)
    loss_fn = kto.KTO(pref, tokens, reference.CopyReference(ref, contextlib.nullcontext, tokens))
    ours.train()
    batch = _batch(tiny_tokenizer, records)
    our_loss = loss_fn.loss(ours, batch) / loss_fn.count(batch)  # the step divides by examples
    our_loss.backward()
    assert abs(float(our_loss.detach()) - 0.5 * weights[0 if labels[0] else 1]) > 1e-4
    assert float(our_loss) == pytest.approx(float(trl_loss), abs=1e-6)
    grads = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4), name
    kl = loss_fn.window_metrics() or {}
    loss_fn.end_cycle()
    metrics = loss_fn.window_metrics()
    assert not kl and metrics["kl"] == pytest.approx(trainer._metrics["train"]["kl"][-1], abs=1e-5)
    assert (metrics["kl"] > 1e-3) == swap


def test_tokens_and_mismatched_completions_match_trl(tiny_tokenizer, tmp_path):
    """The prompt / completion ids (text completions end in EOS) and each example's mismatched
    completion are TRL's."""
    pytest.importorskip("trl")
    model = make_tiny_llama(tiny_tokenizer)
    trainer = _trl_trainer(tiny_tokenizer, model, copy.deepcopy(model), RECORDS, str(tmp_path))
    ds = trainer.train_dataset
    ours = _dataset(tiny_tokenizer, RECORDS)
    for i in range(len(RECORDS)):
        for key, theirs in (
            ("completion_ids", "completion_ids"),
            (unpaired.KL_IDS, "KL_completion_ids"),
        ):
            assert ours[i][key] == ds[i][theirs], (i, key)
        assert ours[i]["prompt_ids"] == ds[i]["prompt_ids"]
        assert ours[i]["label"] == ds[i]["label"]
    assert ours[0]["completion_ids"][-1] == tiny_tokenizer.eos_token_id


def test_the_kl_estimate_is_the_mismatched_sequences_and_carries_no_gradient(tiny_tokenizer):
    """z0 is the mean log-ratio of the mismatched sequences (changing them changes the loss; it is
    clamped at 0), and the gradient is that of the loss with z0 held fixed."""
    base, ref = _moved(tiny_tokenizer)
    tokens = TokenLoss(0)
    batch = _batch(tiny_tokenizer)
    from onegpu.objectives.preference import sequence_logps

    with torch.no_grad():
        pi_kl = sequence_logps(base, unpaired.mismatched(batch), tokens)[1]
        ref_kl = sequence_logps(ref, unpaired.mismatched(batch), tokens)[1]
        ref_main = sequence_logps(ref, batch, tokens)[1]
    z0 = kto.kl_estimate(pi_kl, ref_kl)
    assert float(z0) == pytest.approx(max(float((pi_kl - ref_kl).mean()), 0.0))
    pi = sequence_logps(base, batch, tokens)[1]
    expected, _ = kto.kto_loss(pi, ref_main, z0, batch[unpaired.LABEL], 0.1, 1.0, 1.0)
    loss_fn = kto.KTO(
        PreferenceConfig(), tokens, reference.CopyReference(ref, contextlib.nullcontext, tokens)
    )
    assert float(loss_fn.loss(base, batch)) == pytest.approx(float(expected.sum()), abs=1e-6)
    # other mismatched completions: another estimate, another loss
    other = dict(batch)
    for k in [k for k in batch if k.startswith(unpaired.KL)]:
        other[k] = (
            batch[k[len(unpaired.KL) :]] if k != unpaired.KL + unpaired.EXAMPLE_INDEX else batch[k]
        )
    other[unpaired.KL + "target_positions"] = batch["target_positions"]
    assert float(loss_fn.loss(base, other)) != pytest.approx(float(expected.sum()), abs=1e-5)


def test_adapters_off_and_precomputed_references_are_the_base_models(tiny_tokenizer):
    """With LoRA the reference is the policy with its adapters off (at the start: every reward 0,
    KL 0, each loss 1 - sigmoid(0) = 0.5); precomputed reference log-probs carried in the batch
    (examples', then mismatched sequences') give the loss a frozen copy gives."""
    from peft import LoraConfig, get_peft_model

    base, ref = _moved(tiny_tokenizer)
    lora = get_peft_model(copy.deepcopy(ref), LoraConfig(r=4, target_modules="all-linear"))
    tokens = TokenLoss(16)
    loss_fn = kto.KTO(PreferenceConfig(), tokens, reference.AdapterReference(tokens))
    batch = _batch(tiny_tokenizer)
    assert float(loss_fn.loss(lora, batch)) / 5 == pytest.approx(0.5, abs=1e-6)

    with torch.no_grad():
        sums = reference.batch_logps(ref, batch, tokens)
    pre = _batch(tiny_tokenizer, refs=(sums[:5], sums[5:]))
    copied = kto.KTO(
        PreferenceConfig(), tokens, reference.CopyReference(ref, contextlib.nullcontext, tokens)
    )
    precomputed = kto.KTO(PreferenceConfig(), tokens, None)
    assert precomputed.needs_reference == "precomputed"
    assert float(precomputed.loss(base, pre)) == pytest.approx(
        float(copied.loss(base, batch)), abs=1e-6
    )


def test_padded_and_packed_batches_give_the_same_loss(tiny_tokenizer):
    base, ref = _moved(tiny_tokenizer)
    tokens = TokenLoss(0)
    loss_fn = kto.KTO(
        PreferenceConfig(), tokens, reference.CopyReference(ref, contextlib.nullcontext, tokens)
    )
    padded = loss_fn.loss(base, _batch(tiny_tokenizer))
    packed = loss_fn.loss(base, _batch(tiny_tokenizer, packed=True))
    assert float(padded) == pytest.approx(float(packed), abs=1e-4)


def test_bad_labels_name_the_record(tiny_tokenizer):
    from onegpu.errors import DataError

    cols = {"prompt": ["a"], "completion": ["b"], "label": ["yes"]}
    with pytest.raises(DataError, match="record 0.*'label' must be true"):
        unpaired.tokenize_batch(cols, [0], tiny_tokenizer, DataConfig(), "train")
