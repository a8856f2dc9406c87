"""Preference losses: DPO equals TRL's DPOTrainer (loss and gradients), ORPO and SimPO equal their
papers' formulas, the fused per-token log-probs equal the plain ones, and the reference without a
copy is right."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import DataConfig, PreferenceConfig
from onegpu.data import pairs
from onegpu.data.batches import Collator
from onegpu.objectives import preference
from onegpu.objectives.tokens import TokenLoss, with_target_positions

PAIRS = [
    {
        "prompt": "def add(a, b):\n",
        "chosen": "    return a + b\n",
        "rejected": "    print(a)\n    return None\n",
    },
    {
        "prompt": "class Point:\n",
        "chosen": "    def __init__(self, x, y):\n        self.x = x\n",
        "rejected": "    x y self\n",
    },
    {
        "prompt": "for i in range(10):\n",
        "chosen": "    print(i * i)\n",
        "rejected": "print range the fox\n",
    },
    {
        "prompt": "import os\n",
        "chosen": "print(os.path.join('a', 'b'))\n",
        "rejected": "The lazy dog.\n",
    },
]


def _pair_batch(tok, records=PAIRS, refs=None, packed=False):
    cfg = DataConfig(seq_len=128)
    examples = []
    for i, r in enumerate(records):
        p, c, j = pairs.encode_pair(
            r["prompt"], r["chosen"], r["rejected"], tok, cfg, f"record {i}"
        )
        ex = {"prompt_ids": p, "chosen_ids": c, "rejected_ids": j}
        if refs is not None:
            ex[pairs.REF_CHOSEN], ex[pairs.REF_REJECTED] = refs[0][i], refs[1][i]
        examples.append(ex)
    return with_target_positions(
        pairs.PairCollator(Collator(tok.pad_token_id, 8, 128, position_ids=packed))(examples)
    )


def _loss_fn(objective, chunk=0, reference=None, **pref):
    return preference.Preference(objective, PreferenceConfig(**pref), TokenLoss(chunk), reference)


# ------------------------------------------------------------------------------------ formulas
def test_dpo_loss_tends_to_log2_and_zero_gradient_as_beta_goes_to_zero():
    pi = torch.tensor([-3.0, -5.0, -2.0], requires_grad=True)
    pr = torch.tensor([-4.0, -1.0, -6.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-3.5, -4.0, -2.5]), torch.tensor([-3.0, -2.0, -5.0])
    loss, _, _ = preference.dpo_loss(pi, pr, ref_c, ref_r, beta=1e-6)
    loss.sum().backward()
    assert torch.allclose(loss, torch.full_like(loss, math.log(2)), atol=1e-5)
    assert pi.grad.abs().max() < 1e-5 and pr.grad.abs().max() < 1e-5


def test_reward_margin_is_positive_when_the_policy_moves_toward_chosen():
    ref_c, ref_r = torch.tensor([-4.0, -6.0]), torch.tensor([-5.0, -3.0])
    loss_fn = _loss_fn("dpo")
    # the policy raised each chosen response's log-prob and lowered each rejected one's
    loss, rc, rr = preference.dpo_loss(ref_c + 1.0, ref_r - 0.5, ref_c, ref_r, loss_fn.beta)
    assert (rc > 0).all() and (rr < 0).all() and (rc - rr > 0).all()
    assert (loss < math.log(2)).all()
    loss_fn.stats.add(
        torch.stack(
            [torch.tensor(2.0), (rc > rr).sum().float(), (rc - rr).sum(), rc.sum(), rr.sum()]
        )
    )
    loss_fn.end_cycle()
    stats = loss_fn.window_metrics()
    assert stats["reward_accuracy"] == 1.0 and stats["reward_margin"] == pytest.approx(0.15)
    # and the other way round: the margin's sign follows the preference
    _, rc, rr = preference.dpo_loss(ref_c - 1.0, ref_r + 0.5, ref_c, ref_r, loss_fn.beta)
    assert (rc - rr < 0).all()


def test_orpo_equals_the_papers_odds_ratio_formula():
    pi_c, pi_r = torch.tensor([-6.0, -2.0]), torch.tensor([-9.0, -1.5])
    len_c, len_r = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 3.0])
    lam = 0.25
    loss, rc, rr = preference.orpo_loss(pi_c, pi_r, len_c, len_r, lam)
    # Hong et al. 2024: P = exp(mean token log-prob), odds = P / (1 - P), L = L_SFT + lam * -log
    # sigmoid(log odds ratio)
    p_c, p_r = torch.exp(pi_c / len_c), torch.exp(pi_r / len_r)
    ratio = torch.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
    expected = -pi_c / len_c - lam * torch.log(torch.sigmoid(ratio))
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(rc, lam * pi_c / len_c) and torch.allclose(rr, lam * pi_r / len_r)


def test_simpo_equals_the_papers_formula():
    pi_c, pi_r = torch.tensor([-6.0, -2.0]), torch.tensor([-9.0, -1.5])
    len_c, len_r = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 3.0])
    beta, ratio = 2.0, 0.5
    loss, _, _ = preference.simpo_loss(pi_c, pi_r, len_c, len_r, beta, ratio)
    # Meng et al. 2024, eq. 6: -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)
    expected = -torch.log(torch.sigmoid(beta / len_c * pi_c - beta / len_r * pi_r - ratio * beta))
    assert torch.allclose(loss, expected, atol=1e-6)


# ------------------------------------------------------------------------------ log-probs per
# sequence
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "padding-free"])
def test_fused_sequence_logps_equal_the_plain_ones_with_gradients(tiny_tokenizer, packed):
    model = make_tiny_llama(tiny_tokenizer)
    batch = _pair_batch(tiny_tokenizer, packed=packed)
    grads = []
    for chunk in (0, 7):  # 7: several chunks, the last one short
        model.zero_grad()
        _, sums, lengths = preference.sequence_logps(model, batch, chunk)
        (
            sums * torch.arange(1.0, sums.numel() + 1)
        ).sum().backward()  # a different weight per sequence
        grads.append(
            (sums.detach(), lengths, {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    (a, la, ga), (b, lb, gb) = grads
    assert torch.allclose(a, b, atol=1e-5) and torch.equal(la, lb)
    for name in ga:
        assert torch.allclose(ga[name], gb[name], atol=1e-5), name


def test_padded_and_packed_batches_give_the_same_sequence_logps(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer)
    with torch.no_grad():
        padded = preference.sequence_logps(model, _pair_batch(tiny_tokenizer), 0)[1]
        packed = preference.sequence_logps(model, _pair_batch(tiny_tokenizer, packed=True), 0)[1]
    assert torch.allclose(padded, packed, atol=1e-4)


def test_pair_tokens_match_trl_tokenization(tiny_tokenizer, tmp_path):
    """The same prompt / chosen / rejected ids as TRL's DPOTrainer tokenizes (text records get an
    EOS)."""
    trl = pytest.importorskip("trl")
    ds = _trl_trainer(
        tiny_tokenizer, make_tiny_llama(tiny_tokenizer), trl, tmp=str(tmp_path)
    ).train_dataset
    for i, r in enumerate(PAIRS):
        ours = pairs.encode_pair(
            r["prompt"], r["chosen"], r["rejected"], tiny_tokenizer, DataConfig(), "x"
        )
        assert ours == (ds[i]["prompt_ids"], ds[i]["chosen_ids"], ds[i]["rejected_ids"])
        assert ours[1][-1] == tiny_tokenizer.eos_token_id


def _trl_trainer(tok, model, trl, beta=0.1, tmp="/tmp/onegpu-trl-test", ref_model=None):
    import datasets

    args = trl.DPOConfig(
        output_dir=tmp,
        beta=beta,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=len(PAIRS),
        max_length=128,
        dataset_num_proc=None,
        disable_dropout=True,
        precompute_ref_log_probs=False,
    )
    return trl.DPOTrainer(
        model=model,
        ref_model=ref_model if ref_model is not None else copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=tok,
    )


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_gradients_equal_trl_dpotrainer(tiny_tokenizer, beta, tmp_path):
    """Same tiny model, same pairs: TRL's DPOTrainer.compute_loss (its reference: a frozen copy) and
    ours (fused head, a copy as reference) give the same loss and the same gradient for every
    weight."""
    trl = pytest.importorskip("trl")
    torch.manual_seed(0)
    base = make_tiny_llama(tiny_tokenizer)
    reference = copy.deepcopy(base)
    with torch.no_grad():  # the policy moved away from the reference, so the loss is not log 2
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)

    trainer = _trl_trainer(
        tiny_tokenizer, theirs, trl, beta, str(tmp_path), ref_model=copy.deepcopy(reference)
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()

    import contextlib

    from onegpu.objectives.reference import CopyReference

    loss_fn = _loss_fn(
        "dpo", 16, CopyReference(reference, contextlib.nullcontext, TokenLoss(16)), beta=beta
    )
    ours.train()
    our_loss = loss_fn.loss(ours, _pair_batch(tiny_tokenizer)) / len(
        PAIRS
    )  # the step divides by the pairs
    our_loss.backward()
    assert abs(float(our_loss) - math.log(2)) > 1e-3
    assert float(our_loss) == pytest.approx(float(trl_loss), abs=1e-5)
    grads = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4), name


def test_adapters_off_reference_is_the_base_model(tiny_tokenizer):
    """With LoRA, the reference is the policy with its adapters disabled: at the start that is the
    policy itself (the loss is log 2, the margin 0), and after the adapters change it is still the
    base."""
    from peft import LoraConfig, get_peft_model

    from onegpu.objectives.reference import AdapterReference

    base = make_tiny_llama(tiny_tokenizer)
    with torch.no_grad():
        expected = preference.sequence_logps(base, _pair_batch(tiny_tokenizer))[1]
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules="all-linear"))
    loss_fn = _loss_fn("dpo", chunk=16, reference=AdapterReference(TokenLoss(16)))
    loss = loss_fn.loss(model, _pair_batch(tiny_tokenizer)) / len(PAIRS)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    ref = loss_fn.reference(model, _pair_batch(tiny_tokenizer))
    assert torch.allclose(ref, expected, atol=1e-5)
    assert float(loss_fn.loss(model, _pair_batch(tiny_tokenizer)) / len(PAIRS)) != pytest.approx(
        math.log(2), abs=1e-4
    )
