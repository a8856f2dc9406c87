"""The sampler-trainer mismatch GRPO logs: the decode engine's log-prob of each token it sampled
against the training forward's log-prob of the same token, in fp32 and in bf16, on two shapes.

    python benchmarks/sampler_mismatch.py                     # tiny and small, 5 rounds
    python benchmarks/sampler_mismatch.py --presets tiny --rounds 2 --out /tmp/mismatch

Per round (a seed each): the default GRPO job's prompts (starts of standard-library functions),
completions sampled at temperature 1 by the engine as GRPO samples them (objectives/rollout.py's
engine_rollouts, with the engine's own log-probs), then each prompt + completion through the
model's ordinary forward, the log-softmax of its logits at the completion's tokens. Figures: the
mean and max over tokens of |log p_train - log p_sampler| and the k3 estimate of KL(sampler ||
train), the figures GRPO logs as sampler_logp_diff_mean / _max and sampler_kl.

Precisions: fp32 (both sides fp32 weights and math) and bf16 (the engine on the model's weights
cast to bf16, the training forward under bf16 autocast over the fp32 weights, as a bf16 mixed run
trains). Both on this machine's CPU kernels: the simulated card (tests/simgpu) runs on fake tensors,
which hold shapes and no values, so it cannot give a numeric mismatch; a card's bf16 kernels differ
from the CPU's, and this script runs unchanged on one (not measured yet). The models are the
presets at their seeded random initialisation (no trained checkpoint is assumed): their
distributions are flat, so the figures are what the kernels' rounding does to a near-uniform one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def setup(preset: str, prompts: int, seed: int):
    """(model, tokenizer, prompt ids) of the default GRPO job's prompts on ``preset``."""
    import torch

    from onegpu import models
    from onegpu.config import from_dict
    from onegpu.data import records as records_io
    from onegpu.data.prompts import corpus_prompts
    from onegpu.training.data import build_tokenizer

    cfg = from_dict({"model": {"name": preset}, "training": {"objective": "grpo"}})
    train, _val, fingerprint = records_io.load_records(cfg.data, seed)
    tok = build_tokenizer(cfg, preset, train, "text", fingerprint)
    texts = corpus_prompts(train, cfg.data.text_field, seed, prompts)[cfg.data.prompt_field]
    ids = [tok(t, add_special_tokens=False)["input_ids"][-96:] for t in texts]
    torch.manual_seed(seed)
    model = models.load_model(preset, cfg.model, tok).eval()
    return model, tok, ids


def train_logps(model, prompt: list[int], completion: list[int], bf16: bool) -> list[float]:
    """The training forward's log-prob of each completion token (one row, no padding)."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def measure(model, tok, prompts, new: int, seed: int, bf16: bool) -> dict:
    import copy

    import torch

    from onegpu.config import GRPOConfig
    from onegpu.objectives.rollout import engine_rollouts

    gcfg = GRPOConfig(max_completion_length=new, temperature=1.0, top_k=0, top_p=1.0)
    sampler = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
    torch.manual_seed(seed)
    with torch.no_grad():
        rows, logps = engine_rollouts(sampler, prompts, gcfg, [tok.eos_token_id], with_logps=True)
    diffs, k3 = [], []
    for prompt, row, sampled in zip(prompts, rows, logps, strict=True):
        trained = train_logps(model, prompt, row, bf16)
        for lt, ls in zip(trained, sampled, strict=True):
            d = lt - ls
            diffs.append(abs(d))
            k3.append(math.expm1(d) - d)  # KL(sampler || train), k3, in float64
    return {
        "tokens": len(diffs),
        "logp_diff_mean": statistics.fmean(diffs),
        "logp_diff_max": max(diffs),
        "kl": statistics.fmean(k3),
    }


def run(presets: list[str], rounds: int, prompts: int, new: int) -> dict:
    import torch

    from onegpu.bench import provenance

    torch.set_num_threads(1)  # a shared machine: one thread each, like the training benches here
    header = provenance.begin()
    out: dict = {"rounds": rounds, "prompts": prompts, "max_new_tokens": new, "shapes": {}}
    for preset in presets:
        model, tok, ids = setup(preset, prompts, 0)
        params = sum(p.numel() for p in model.parameters())
        shape = out["shapes"][preset] = {"params": params, "fp32": [], "bf16": []}
        for r in range(rounds):  # interleaved: fp32 and bf16 of a round share its seed
            for precision in ("fp32", "bf16"):
                t0 = time.perf_counter()
                fig = measure(model, tok, ids, new, 1000 + r, precision == "bf16")
                fig["seconds"] = time.perf_counter() - t0
                shape[precision].append(fig)
                print(preset, precision, r, json.dumps(fig), flush=True)
    out["header"] = provenance.end(header)
    return out


def _median(xs):
    return statistics.median(xs)


def markdown(doc: dict) -> str:
    from onegpu.bench import provenance

    lines = [
        "# The sampler-trainer mismatch on CPU kernels: fp32 and bf16",
        "",
        provenance.markdown(doc["header"]),
        f"{doc['prompts']} prompts of the default GRPO job a round, {doc['max_new_tokens']} new "
        f"tokens at most each, sampled at temperature 1 by the decode engine; {doc['rounds']} "
        "rounds (a seed each), one torch thread; medians over rounds, range in brackets. "
        "|diff| = |log p_train - log p_sampler| per sampled token; KL = the k3 estimate of "
        "KL(sampler || train), as GRPO logs them (sampler_logp_diff_mean / _max, sampler_kl). "
        "Measured on a shared, loaded CPU (the load is above); the figures are numerics, not "
        "timings.",
        "",
        "| shape | params | precision | tokens a round | mean abs diff | max abs diff | KL |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset, shape in doc["shapes"].items():
        for precision in ("fp32", "bf16"):
            reps = shape[precision]

            def cell(key, fmt=".2e", reps=reps):
                xs = [r[key] for r in reps]
                return f"{_median(xs):{fmt}} [{min(xs):{fmt}}–{max(xs):{fmt}}]"

            lines.append(
                f"| {preset} | {shape['params'] / 1e6:.2f} M | {precision} | "
                f"{_median([r['tokens'] for r in reps]):.0f} | {cell('logp_diff_mean')} | "
                f"{cell('logp_diff_max')} | {cell('kl')} |"
            )
    lines += [
        "",
        "fp32: the engine's step and the training forward are the same math in different kernels "
        "(the engine's paged attention and cached decode against one full forward). bf16: the "
        "engine on the weights cast to bf16, the training forward under bf16 autocast over fp32 "
        "weights, both on this CPU's bf16 kernels. Not measured here: a card's bf16 kernels (the "
        "simulated card holds no values; no card was measured yet) and a trained model's "
        "sharper distributions (these are the presets at their seeded random initialisation).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sampler-mismatch-cpu")
    a = ap.parse_args(argv)
    doc = run([p.strip() for p in a.presets.split(",") if p.strip()], a.rounds, a.prompts, a.new)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{a.name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
