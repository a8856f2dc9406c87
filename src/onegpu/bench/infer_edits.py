"""`onegpu bench infer --workload edits`: batch 1, greedy, on held-out code-edit tasks
(data/edits.py). Per model: how much of each answer its greedy continuation copies (the copy rate:
the share of reference answer tokens it reproduces in place) and what a prompt-lookup proposer
would get accepted from that continuation (simulated: the earliest earlier match of the last 3, 2
or 1 tokens of prompt + generated text proposes up to 4 following tokens; the longest agreeing
prefix is accepted, and each verify step adds one token of its own). With ``--speculative ngram``
the engine with speculative decoding runs beside the same engine without, interleaved round by
round: tokens/s, the tokens each decode step made, and whether both made the same tokens.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from onegpu.bench import provenance
from onegpu.errors import ConfigError


def lookup(context: list[int], k: int = 4, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, the earliest earlier occurrence of the last n
    tokens of ``context`` that has a token after it; the up to ``k`` tokens that follow it."""
    end = len(context)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        tail = context[end - n :]
        for start in range(end - n):
            if context[start : start + n] == tail:
                return context[start + n : min(start + n + k, end)]
    return []


def simulate_lookup(prompt: list[int], generated: list[int], k: int = 4) -> list[int]:
    """Tokens accepted at each verify step if a prompt-lookup proposer drove the decode that made
    ``generated`` (greedy: the proposal is checked against the tokens the model makes). The first
    token comes from the prompt's forward; every step after accepts some and adds one."""
    accepted, i = [], 1
    while i < len(generated):
        proposal = lookup(prompt + generated[:i], k)
        a = 0
        while a < len(proposal) and i + a < len(generated) and proposal[a] == generated[i + a]:
            a += 1
        accepted.append(a)
        i += a + 1
    return accepted


def copy_rate(generated: list[int], reference: list[int]) -> float:
    """The share of reference tokens the generated sequence holds at the same position."""
    same = sum(g == r for g, r in zip(generated, reference, strict=False))
    return same / len(reference) if reference else 0.0


def encode_tasks(tokenizer, tasks) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference answer ids + EOS) of each task, tokenized as training does
    (data.batches: the prompt with special tokens, the completion without, then EOS)."""
    return [
        (
            tokenizer(t.prompt, add_special_tokens=True)["input_ids"],
            tokenizer(t.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        )
        for t in tasks
    ]


def copying(tokens: list[list[int]], encoded) -> dict:
    """Copy rate and simulated prompt-lookup acceptance of greedy answers ``tokens``."""

    def per_step(answers):  # (mean accepted per verify step, tokens per decode step)
        flat = [
            a for (p, _), g in zip(encoded, answers, strict=True) for a in simulate_lookup(p, g)
        ]
        made = sum(len(g) - 1 for g in answers)
        return (statistics.mean(flat) if flat else 0.0), made / max(len(flat), 1)

    (accepted, per), (_, ceiling) = per_step(tokens), per_step([r for _, r in encoded])
    return {
        "copy_rate": statistics.mean(
            copy_rate(g, r) for (_, r), g in zip(encoded, tokens, strict=True)
        ),
        "sim_accepted_per_step": accepted,
        "sim_tokens_per_step": per,
        "sim_tokens_per_step_reference": ceiling,  # a model that answers exactly the reference
        "answer_tokens": statistics.mean(len(r) for _, r in encoded),
        "prompt_tokens": statistics.mean(len(p) for p, _ in encoded),
    }


def make_engine(model, encoded, speculative: str | None, k: int):
    """A batch-1 engine sized to the longest task, with EngineConfig's ``speculative`` (None:
    without)."""
    from onegpu.infer.engine import Engine, EngineConfig

    longest = max(len(p) + len(r) + 16 for p, r in encoded)
    config = EngineConfig(
        max_slots=1,
        max_len=longest,
        compile="off",
        speculative=speculative,
        num_speculative_tokens=k,
    )
    return Engine(model, None, config)


def run_tasks(engine, encoded) -> tuple[dict, list[list[int]]]:
    """Each task alone, greedy, up to EOS (at most its answer's length + 8): the seconds, the
    tokens, the decode steps they took."""
    from onegpu.infer.requests import SamplingParams

    out, seconds, steps0 = [], 0.0, engine.stats().decode_steps
    for prompt, ref in encoded:
        t0 = time.perf_counter()
        result = engine.generate([prompt], SamplingParams(max_new_tokens=len(ref) + 8))[0]
        seconds += time.perf_counter() - t0
        out.append(result.token_ids)
    made = sum(len(t) for t in out)
    steps = engine.stats().decode_steps - steps0
    run = {"seconds": seconds, "tokens": made, "tps": made / seconds, "decode_steps": steps}
    run["tokens_per_step"] = (made - len(out)) / max(steps, 1)  # first tokens: the prompts'
    return {**run, "load1": os.getloadavg()[0]}, out


def run_edits(cfg, model_dir: str) -> dict:
    """The edit workload on ``model_dir``: copying, then the arms timed in interleaved rounds."""
    from onegpu.data.edits import edit_tasks
    from onegpu.infer import InferConfig, load

    lm = load(InferConfig(model=model_dir, device=cfg.device, dtype=cfg.dtype))
    from onegpu.infer.engine_config import context_of

    encoded = encode_tasks(lm.tokenizer, edit_tasks("heldout", cfg.tasks, cfg.seed))
    # a task longer than the model's context (with another tokenizer than the recipe's) is left out
    fits = [e for e in encoded if len(e[0]) + len(e[1]) + 16 <= context_of(lm.model)]
    if not fits:
        raise ConfigError(
            f"--workload edits: none of the {len(encoded)} tasks fits {model_dir}'s context.",
            hint="a model with a longer context, or the recipe's tokenizer (examples/copy/)",
        )
    if len(fits) < len(encoded):
        print(
            f"edits: {len(encoded) - len(fits)} of {len(encoded)} tasks over the context, left out"
        )
    encoded = fits
    arms = {"engine": make_engine(lm.model, encoded, None, cfg.num_speculative_tokens)}
    if cfg.speculative:
        arms[f"engine+{cfg.speculative}"] = make_engine(
            lm.model, encoded, cfg.speculative, cfg.num_speculative_tokens
        )
    tokens = {name: run_tasks(engine, encoded)[1] for name, engine in arms.items()}  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(cfg.repeats):
        for name, engine in arms.items():
            runs[name].append(run_tasks(engine, encoded)[0])
    rows = []
    for name, rs in runs.items():
        tps = [r["tps"] for r in rs]
        rows.append(
            {
                "arm": name,
                "tps": statistics.median(tps),
                "tps_range": [min(tps), max(tps)],
                "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rs),
                "same_tokens": tokens[name] == tokens["engine"],
                "load1_range": [min(r["load1"] for r in rs), max(r["load1"] for r in rs)],
            }
        )
    return {
        "model": model_dir,
        "tasks": cfg.tasks,
        "rounds": cfg.repeats,
        "copying": copying(tokens["engine"], encoded),
        "rows": rows,
    }


def edits_markdown(result: dict) -> str:
    c, base = result["copying"], result["rows"][0]["tps"]
    lines = [
        f"# onegpu bench infer --workload edits: {Path(result['model']).name}",
        "",
        provenance.markdown(result),
        f"{result['tasks']} held-out edit tasks (prompt {c['prompt_tokens']:.0f} tokens, answer "
        f"{c['answer_tokens']:.0f} on average), batch 1, greedy, {result['rounds']} interleaved "
        "rounds after a warm-up. Copy rate: **{:.3f}**; simulated prompt lookup (k=4): "
        "{:.2f} tokens accepted per step, {:.2f} tokens per decode step ({:.2f} for a model that "
        "answered exactly the reference).".format(
            c["copy_rate"],
            c["sim_accepted_per_step"],
            c["sim_tokens_per_step"],
            c["sim_tokens_per_step_reference"],
        ),
        "",
        "| arm | tokens/s median (range) | x engine | tokens per decode step | same tokens | "
        "load 1-min |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lo, hi = r["tps_range"]
        lines.append(
            f"| {r['arm']} | {r['tps']:.1f} ({lo:.1f}–{hi:.1f}) | {r['tps'] / base:.2f}x | "
            f"{r['tokens_per_step']:.2f} | {'yes' if r['same_tokens'] else 'no'} | "
            f"{r['load1_range'][0]:.1f}–{r['load1_range'][1]:.1f} |"
        )
    return "\n".join(lines) + "\n"
