"""Preference tuning on a CUDA GPU (skipped without one): the fused per-token log-probs under bf16
autocast match the plain ones and never hold the (tokens x vocab) logits, and a short DPO + LoRA run
trains."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.objectives import preference
from onegpu.objectives.tokens import with_target_positions

pytestmark = pytest.mark.gpu


def _pair_batch(tok, pairs=8, length=512, vocab=None):
    g = torch.Generator().manual_seed(0)
    vocab = vocab or len(tok)
    ids = torch.randint(5, vocab, (2 * pairs, length), generator=g)
    labels = ids.clone()
    labels[:, : length // 4] = -100  # the prompt
    batch = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "sequence_ids": torch.arange(2 * pairs).unsqueeze(1).expand(-1, length).contiguous(),
        "pair_index": torch.arange(pairs),
    }
    return {k: v.cuda() for k, v in with_target_positions(batch).items()}


def test_fused_logps_match_plain_under_bf16_and_use_less_memory(tiny_tokenizer):
    vocab = 32768  # big enough that the full logits dominate
    model = make_tiny_llama(tiny_tokenizer, vocab_size=vocab).cuda()
    batch = _pair_batch(tiny_tokenizer, vocab=vocab)
    peaks, sums = {}, {}
    for chunk in (0, 1024):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, s, _ = preference.sequence_logps(model, batch, chunk)
        s.sum().backward()
        torch.cuda.synchronize()
        peaks[chunk], sums[chunk] = torch.cuda.max_memory_allocated() - base, s.detach().float()
    assert torch.allclose(sums[0], sums[1024], rtol=2e-2, atol=0.5)
    logits_bytes = batch["input_ids"].numel() * vocab * 4
    assert (
        peaks[1024] < peaks[0] - logits_bytes // 2
    )  # the fp32 logits (and their gradient) never existed


def test_dpo_with_lora_trains_on_the_gpu(tmp_path, tiny_model_dir):
    import json

    from onegpu import train
    from onegpu.report import read_metrics

    data = tmp_path / "pairs.jsonl"
    rows = [
        {
            "prompt": f"def f{i}(x):\n",
            "chosen": f"    return x + {i}\n",
            "rejected": f"x {i} return +\n",
        }
        for i in range(64)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"path": str(data), "seq_len": 64},
            "training": {
                "objective": "dpo",
                "micro_batch_size": 8,
                "max_steps": 20,
                "lr": 3e-3,
                "log_every": 5,
                "eval_every": 0,
                "warmup_steps": 0,
            },
            "techniques": {"lora": {"enabled": True, "r": 8}, "precision": "bf16"},
            "output": {"dir": str(tmp_path / "runs"), "report_to": "none"},
        }
    )
    recs = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["split"] == "train"]
    assert (
        recs[-1]["reward_margin"] > recs[0]["reward_margin"] and recs[-1]["reward_accuracy"] >= 0.75
    )
