"""The GGUF's check in llama.cpp: its tokenizer against `tokenizers` on a test set (a mismatch is
reported, never hidden), then unquantized types (f16, bf16, f32): greedy tokens equal to the
engine's; quantized types: teacher-forced top-1 agreement over the engine's continuations and the
perplexity ratio on held-out text, each against its type's threshold."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onegpu.export.check import CheckReport, Reference, check_greedy
from onegpu.export.compare import perplexity, top1_agreement
from onegpu.export.config import UNQUANTIZED
from onegpu.export.gguf import run_child
from onegpu.export.pretokenizer import TEST_SET

# Held-out text for the perplexity ratio (not a prompt of the check)
HELD_OUT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i * i)\n"
    "The quick brown fox jumps over the lazy dog.\n"
)
# Lowest top-1 agreement and highest perplexity ratio each quantized type passes with, set from
# trained models (benchmarks/results/export-gguf-agreement-trained.md: short default-job runs at
# hidden 128 and 256 agreed 0.988-1.0, ratios 0.998-1.001). The margin below them grows with the
# type's rounding: it covers the 256 positions' sampling error (about 0.006) and deeper, wider
# models than those two accumulating more rounding, while a quantization that lost the model's
# function (agreement near 1/vocabulary, as a transposed tensor gives) fails. q8_0 and q6_k at
# 0.85 also pass the default job's shape untrained (0.875 over the tests' 128 positions): its
# first export may come before much training. An untrained model's flat logits flip under
# rounding far more at lower bits (random weights: down to 0.08 for q4_k_m,
# export-gguf-agreement.md), and its check then fails.
THRESHOLDS = {
    "q8_0": (0.85, 1.03),
    "q6_k": (0.85, 1.04),
    "q5_k_m": (0.82, 1.06),
    "q4_k_m": (0.80, 1.10),
}
RUNTIME = "llama.cpp (llama-cpp-python)"


def check_gguf(ref: Reference, gguf: Path, quant: str, fmt: str = "gguf") -> CheckReport:
    tok = ref.tokenizer
    held = tok(HELD_OUT)["input_ids"]
    forced = [ids + want for ids, want in zip(ref.ids, ref.tokens, strict=True)] + [held]
    n_ctx = max(map(len, forced)) + 8
    unquantized = quant in UNQUANTIZED
    got = run_child(
        {
            "op": "eval",
            "model": str(gguf),
            "n_ctx": n_ctx,
            "greedy": [[ids, len(w)] for ids, w in zip(ref.ids, ref.tokens, strict=True)]
            if unquantized
            else [],
            "forced": forced,
            "tokenize": list(TEST_SET) + ref.prompts,
        }
    )
    texts = list(TEST_SET) + ref.prompts
    mismatches = _tokenizer_mismatches(tok, texts, got)
    if unquantized:
        dtype = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[quant]
        results = iter(range(len(ref.ids)))

        def greedy(_ids, _n):
            i = next(results)
            return [int(t) for t in got[f"greedy_tokens_{i}"]], got[f"greedy_rows_{i}"]

        report = check_greedy(ref, greedy, dtype, f"{fmt} {quant}", RUNTIME)
    else:
        report = _quantized(ref, quant, got, held, fmt)
    report.metrics["tokenizer"] = {
        "texts": len(texts),
        "identical": len(texts) - len(mismatches),
        "mismatches": mismatches,
    }
    if mismatches:
        report.passed = False
        first = mismatches[0]
        report.summary += (
            f"; TOKENIZER MISMATCH on {len(mismatches)}/{len(texts)} texts, first "
            f"{first['text'][:40]!r} at token {first['at']}"
        )
    meta = json_loads(got["metadata"])
    report.metrics["gguf"] = {k: meta.get(k) for k in GGUF_KEYS}
    return report


GGUF_KEYS = (
    "tokenizer.ggml.model",  # the vocabulary's kind: gpt2 (byte-level BPE), llama (SentencePiece)
    "tokenizer.ggml.pre",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.chat_template",
    "general.file_type",
)


def json_loads(arr) -> dict:
    import json

    return json.loads(str(arr))


def _quantized(ref: Reference, quant: str, got: dict, held: list[int], fmt: str) -> CheckReport:
    from onegpu.export.runtimes import forced_rows

    src_rows, exp_rows = [], []
    for i, (ids, want) in enumerate(zip(ref.ids, ref.tokens, strict=True)):
        src_rows.append(forced_rows(ref.model, ids, list(want)))
        exp_rows.append(got[f"forced_{i}"][len(ids) - 1 : len(ids) - 1 + len(want)])
    agree = top1_agreement(np.concatenate(src_rows), np.concatenate(exp_rows))
    last = len(ref.ids)
    ppl_src = perplexity(forced_rows(ref.model, held[:1], held[1:]), held[1:])
    ppl_exp = perplexity(got[f"forced_{last}"][: len(held) - 1], held[1:])
    ratio = ppl_exp / ppl_src
    need_agree, max_ratio = THRESHOLDS[quant]
    passed = agree >= need_agree and ratio <= max_ratio
    positions = sum(len(w) for w in ref.tokens)
    summary = (
        f"check {fmt} {quant} in {RUNTIME}: top-1 agreement {agree:.3f} over {positions} "
        f"teacher-forced tokens (needs >= {need_agree}), perplexity ratio {ratio:.4f} on "
        f"held-out text (needs <= {max_ratio})" + ("" if passed else "; FAILED")
    )
    return CheckReport(
        f"{fmt} {quant}",
        RUNTIME,
        ref.description,
        passed,
        summary,
        metrics={
            "top1_agreement": agree,
            "positions": positions,
            "perplexity_source": ppl_src,
            "perplexity_export": ppl_exp,
            "perplexity_ratio": ratio,
            "thresholds": {"top1_agreement_min": need_agree, "perplexity_ratio_max": max_ratio},
        },
        prompts=ref.prompt_source,
    )


def _tokenizer_mismatches(tok, texts: list[str], got: dict) -> list[dict]:
    out = []
    for i, text in enumerate(texts):
        want = tok(text)["input_ids"]
        have = [int(t) for t in got[f"tokens_{i}"]]
        if want != have:
            at = next(
                (j for j, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
                min(len(want), len(have)),
            )
            out.append(
                {
                    "text": text,
                    "at": at,
                    "tokenizers": want[at : at + 5],
                    "llama.cpp": have[at : at + 5],
                }
            )
    return out
