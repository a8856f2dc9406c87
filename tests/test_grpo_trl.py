"""GRPO's loss and every weight's gradient equal TRL's GRPOTrainer._compute_loss (trl 1.16) on the
same model, completions, advantages, rollout and reference log-probs: each loss type, with and
without the KL term, on and off policy (num_iterations > 1, the ratio clipped), through the plain
and the fused output head, accumulated over two micro-batches as each side accumulates."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import GRPOConfig
from onegpu.objectives import grpo_loss, rollout
from onegpu.objectives.grpo import ADV, GRPO, OLD, REF, SAMPLED
from onegpu.objectives.reference import CopyReference
from onegpu.objectives.tokens import TokenLoss, with_target_positions

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in range(10):\n"]
GROUP = 2  # completions per prompt: 3 prompts x 2 = 6 rows, in 2 micro-batches of 3 rows, so the
MICRO, ACCUM = 3, 2  # middle group straddles the micro-batches
MAX_LEN = 12
LENGTHS = [5, 12, 3, 9, 12, 7]  # completion lengths: some end in EOS, two are cut at MAX_LEN
REWARDS = [1.0, 0.0, 0.5, 2.0, 0.0, 0.25]
TEMPERATURE = 0.7  # not 1: both sides must divide the logits by the sampling temperature
BETA = 0.04
KL_SETUPS = [
    pytest.param(0.0, False, id="no-kl"),
    # TRL's KL term as DeepSeekMath's k3 estimator (use_bias_correction_kl=False)
    pytest.param(BETA, False, id="kl"),
    # TRL 1.16's default: the k3 term times the importance ratio (DeepSeek-V3.2's unbiased KL)
    pytest.param(BETA, True, id="kl-times-ratio"),
]


def _rows(tok):
    """(prompt ids, completion ids) per row: each prompt GROUP times, completions of fixed lengths
    drawn from a fixed generator, those shorter than MAX_LEN ending in EOS."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids, completions = [], []
    for i, n in enumerate(LENGTHS):
        prompt_ids.append(tok(PROMPTS[i // GROUP], add_special_tokens=False)["input_ids"])
        ids = torch.randint(3, len(tok), (n,), generator=gen).tolist()
        if n < MAX_LEN:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    assert len({len(p) for p in prompt_ids}) > 1  # left padding matters on TRL's side
    return prompt_ids, completions


def _trl_batch(tok, prompt_ids, completions):
    """TRL's generation batch: [prompt left-padded | completion right-padded], as its
    _generate_and_score_completions builds it, before _prepare_inputs splits it by rows."""
    pad = tok.pad_token_id
    p_ids, p_mask = rollout.left_padded(prompt_ids, pad, "cpu")
    width = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), width), pad, dtype=torch.long)
    c_mask = torch.zeros_like(c_ids)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    return {
        "prompt_ids": p_ids,
        "prompt_mask": p_mask,
        "completion_ids": c_ids,
        "completion_mask": c_mask,
        "num_items_in_batch": c_mask.sum(),
    }


def _trl_logps(trainer, model, batch):
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            batch["completion_ids"].size(1),
        )[0]


def _trainer(trl, tok, model, tmp_path, loss_type, beta, iterations, kl_ratio, level="token"):
    import datasets

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        num_generations=GROUP,
        num_iterations=iterations,
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=kl_ratio,
        importance_sampling_level=level,
        temperature=TEMPERATURE,
        max_completion_length=MAX_LEN,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=tok,
    )
    # what Trainer's loop sets before each accumulation window
    trainer.current_gradient_accumulation_steps = ACCUM
    return trainer


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain", "fused"])
@pytest.mark.parametrize("iterations", [1, 2], ids=["on-policy", "clipped"])
@pytest.mark.parametrize("beta, kl_ratio", KL_SETUPS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_loss_and_gradients_equal_trl_grpotrainer(
    tiny_tokenizer, tmp_path, loss_type, beta, kl_ratio, iterations, chunk
):
    _compare(tiny_tokenizer, tmp_path, loss_type, beta, kl_ratio, iterations, chunk)


@pytest.mark.parametrize("iterations", [1, 2], ids=["on-policy", "clipped"])
@pytest.mark.parametrize("beta, kl_ratio", [KL_SETUPS[0], KL_SETUPS[2]])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_sequence_ratios_equal_trl_grpotrainer(
    tiny_tokenizer, tmp_path, loss_type, beta, kl_ratio, iterations
):
    """GSPO (grpo.importance_sampling_level sequence, TRL's importance_sampling_level): one ratio
    per completion, the exp of its mean log-ratio; the same loss and gradients as TRL's. (On policy
    without the KL term the two levels give the same gradient, an identity; the clipped and the
    KL cases are where a token-level ratio fails this test.)"""
    _compare(tiny_tokenizer, tmp_path, loss_type, beta, kl_ratio, iterations, 5, "sequence")


CAP = 1.5  # the sampler correction's cap: some of the test's ratios are above it


@pytest.mark.parametrize("iterations", [1, 2], ids=["on-policy", "clipped"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_sampler_correction_equals_trl_vllm_importance_sampling(
    tiny_tokenizer, tmp_path, mode, level, iterations
):
    """grpo.sampler_correction tis / mis at each level (TRL's vllm_importance_sampling_mode
    token_truncate / token_mask / sequence_truncate / sequence_mask): the sampler's log-probs some
    way off the policy's at sampling; TRL's ratio as its _generate_and_score_completions computes
    it over the padded batch, fed to its _compute_loss; the same loss and gradients as ours."""
    _compare(tiny_tokenizer, tmp_path, "dapo", BETA, True, iterations, 5, correction=(mode, level))


def _trl_sampler_ratio(at_sampling, sampled, mask, mode, level):
    """TRL 1.16's importance_sampling_ratio (grpo_trainer.py, _generate_and_score_completions)."""
    diff = torch.nan_to_num((at_sampling - sampled) * mask, nan=0.0)
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode == "tis":
        return torch.clamp(ratio, min=None, max=CAP)
    return ratio.masked_fill((ratio < -math.inf) | (ratio > CAP), value=0.0)


def _compare(
    tiny_tokenizer,
    tmp_path,
    loss_type,
    beta,
    kl_ratio,
    iterations,
    chunk,
    level="token",
    correction=None,
):
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    # TRL loads its reference from the policy's name_or_path: the starting weights, saved here
    make_tiny_llama(tok).save_pretrained(str(tmp_path / "start"))
    start = AutoModelForCausalLM.from_pretrained(str(tmp_path / "start"))
    base = copy.deepcopy(start)
    with torch.no_grad():  # the policy moved away from the reference: the KL term is not 0
        torch.manual_seed(3)
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    trainer = _trainer(trl, tok, theirs, tmp_path, loss_type, beta, iterations, kl_ratio, level)
    assert (trainer.ref_model is not None) == bool(beta)

    prompt_ids, completions = _rows(tok)
    adv = grpo_loss.advantages(torch.tensor(REWARDS), GROUP, "group")
    gen = _trl_batch(tok, prompt_ids, completions)
    gen["advantages"] = adv
    mask = gen["completion_mask"].bool()
    if iterations > 1:  # the rollout's log-probs, some way off the current ones: ratios clip
        noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * 0.4
        gen["old_per_token_logps"] = _trl_logps(trainer, trainer.model, gen) + noise
        ratio = torch.exp(-noise[mask])
        a = adv.unsqueeze(1).expand_as(mask)[mask]
        assert (((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))).sum() >= 3
    if beta:
        gen["ref_per_token_logps"] = _trl_logps(trainer, trainer.ref_model, gen)
    sampled = None
    if correction is not None:  # the sampler's log-probs, off the policy's at sampling
        at_sampling = gen.get("old_per_token_logps")
        if at_sampling is None:
            at_sampling = _trl_logps(trainer, trainer.model, gen)
        off = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * 0.3
        sampled = (at_sampling - off).masked_fill(~mask, 0.0)
        ratio = _trl_sampler_ratio(at_sampling, sampled, mask, *correction)
        clipped = ratio > CAP - 1e-6 if correction[0] == "tis" else ratio == 0
        assert 0 < int(clipped.sum()) < ratio.numel()  # the cap binds for some, not all
        gen["importance_sampling_ratio"] = ratio
        # TRL applies the ratio when its rollouts come from vLLM: the flags that say so
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True

    # TRL: the generation batch split by rows (its _prepare_inputs), one _compute_loss each
    theirs.train()
    trl_loss = 0.0
    for s in range(0, len(LENGTHS), MICRO):
        part = {k: v if v.dim() == 0 else v[s : s + MICRO] for k, v in gen.items()}
        loss = trainer._compute_loss(trainer.model, part)
        loss.backward()
        trl_loss += float(loss)

    # ours: training rows as rollout.training_rows makes them; the step's normalisation
    g = GRPOConfig(
        group_size=GROUP,
        max_completion_length=MAX_LEN,
        temperature=TEMPERATURE,
        loss_type=loss_type,
        beta=beta,
        num_iterations=iterations,
        kl_ratio=kl_ratio,
        importance_sampling_level=level,
        sampler_correction="off" if correction is None else correction[0],
        sampler_correction_level="sequence" if correction is None else correction[1],
        sampler_correction_max=CAP,
    )
    tokens = TokenLoss(chunk)
    reference = None
    if beta:
        reference = CopyReference(copy.deepcopy(start), contextlib.nullcontext, tokens)
    objective = GRPO(g, tokens, [], tok, "prompt", reference)
    micro = []
    for s in range(0, len(LENGTHS), MICRO):
        rows = slice(s, s + MICRO)
        samples = rollout.Samples(
            completions[rows], [len(c) == MAX_LEN for c in completions[rows]], 0.0
        )
        mb = rollout.training_rows(prompt_ids[rows], samples, tok.pad_token_id, False)
        mb[ADV] = adv[rows]
        mb = with_target_positions(mb)
        if iterations > 1:
            mb[OLD] = gen["old_per_token_logps"][rows][mask[rows]]
        if sampled is not None:
            mb[SAMPLED] = sampled[rows][mask[rows]]
        if beta:
            mb[REF] = reference.token_logps(ours, mb, TEMPERATURE)
        micro.append(mb)
    if beta:  # our reference, at the sampling temperature, is TRL's
        torch.testing.assert_close(
            torch.cat([mb[REF] for mb in micro]),
            gen["ref_per_token_logps"][mask],
            rtol=1e-5,
            atol=1e-5,
        )
    ours.train()
    n = sum(objective.count(mb) for mb in micro)
    our_loss = 0.0
    for mb in micro:
        loss = objective.loss(ours, mb) / n
        loss.backward()
        our_loss += float(loss)

    assert our_loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    theirs_p = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        t = theirs_p[name].grad
        assert t is not None and t.abs().max() > 0, name
        rel = float((p.grad - t).norm() / t.norm())
        assert rel < 2e-5, f"{name}: gradient off by {rel:.1e} (relative)"
        torch.testing.assert_close(p.grad, t, rtol=1e-4, atol=1e-6 * float(t.abs().max()))
