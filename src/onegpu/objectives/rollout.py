"""GRPO's rollouts: the policy samples completions of its prompts in the training process, in the
training memory (no second engine), and they become training rows.

Sampling runs on the prepared model itself (LoRA: the adapted model; the live training weights,
no copy), under no_grad, in eval mode, through onegpu's decode engine (grpo.sampler=engine, the
default: a group's completions share their prompt's KV blocks through the engine's prefix cache —
the prompt is computed once, each completion only its last, partial block — all completions
decoded together, sampling on the device), transformers' ``generate`` or its continuous batching.
Compiled blocks run eagerly on the eager paths (a compiled block would recompile for every decode
shape). The KV cache lives only inside the call: it is freed when sampling returns, before any
forward of the loss.

A training row is prompt + completion, unpadded, then right-padded to the micro-batch's longest;
only completion tokens are targets (a truncated completion's none, with
grpo.mask_truncated_completions; in a multi-turn rollout, multiturn.py, only the policy's own).
The completion ends at its first EOS, which it keeps (as TRL).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from onegpu.objectives.tokens import IGNORE

# On a CPU, a small model samples on one thread: a decode step's ops are too small to split, and
# the threads' synchronisation costs more than they save, many times more on a shared machine
# (`benchmarks/grpo_rollouts.py`, in git history at 8841ae7, ran each path at 1 and 2 threads; its
# 2026-11-24 run found 2 threads slower for every path, by 1.05x to 16x, on a 2-core machine).
ONE_THREAD_PARAMS = 100_000_000


@dataclass
class KeptEngine:
    """A compiled run's rollout engine, kept across its rollouts (its step compiles once) by the
    objective that samples with it, and gone with it: ``engine`` holds the model, so a table keyed
    by the model would keep both alive for the process's life."""

    engine: object = None
    length: int = 0  # the positions it was asked to hold (past the context it holds less)


@dataclass
class Samples:
    """One cycle's completions, row-aligned with its prompts."""

    completion_ids: list[list[int]]
    truncated: list[bool]
    seconds: float  # wall time of sampling (the device synchronised)
    # the sampler's log-prob of each sampled token, under the model's own logits (before
    # temperature and filters: the engine's logprobs); None where the sampler gives none
    logps: Optional[list[list[float]]] = None
    # multi-turn rollouts (multiturn.py): completion_ids hold every token after the prompt, tool
    # messages included; per token, True where the policy wrote it (the only targets)
    model_mask: Optional[list[list[bool]]] = None
    conversations: Optional[list[list[dict]]] = None  # the chat messages after each prompt
    counts: Optional[dict] = None  # tool calls, errors by kind, turns, the prefix cache's hits

    def lengths(self) -> list[int]:
        """The policy's own tokens per row."""
        if self.model_mask is None:
            return [len(c) for c in self.completion_ids]
        return [sum(m) for m in self.model_mask]


def generation_model(model):
    """The module whose ``generate`` samples: inside a DDP or DeepSpeed wrapper, the model."""
    while not hasattr(model, "generate") and hasattr(model, "module"):
        model = model.module
    return model


@torch.no_grad()
def sample(
    model,
    prompt_ids: list[list[int]],
    gcfg,
    tokenizer,
    device,
    rows: int,
    compiled: bool = False,
    max_prompt: int = 0,
    kept: Optional[KeptEngine] = None,
) -> Samples:
    """Sample one completion per prompt row, ``rows`` prompts per call, with grpo.sampler's path:
    the decode engine, transformers' ``generate`` or its continuous batching. ``compiled``: the run
    compiles, and so does the engine's decode step (kept across calls, so it compiles once);
    ``max_prompt``: the longest prompt the run can draw (data.seq_len), which sizes that engine's
    cache once; ``kept``: where that engine is kept between calls."""
    from transformers import GenerationConfig

    eos = _eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = GenerationConfig(
        do_sample=True,
        temperature=gcfg.temperature,
        top_p=gcfg.top_p,
        top_k=gcfg.top_k,
        max_new_tokens=gcfg.max_completion_length,
        pad_token_id=pad,
        eos_token_id=eos,
        use_cache=True,
    )
    gen = generation_model(model)
    was_training = gen.training
    gen.eval()
    t0 = time.perf_counter()
    completions: list[list[int]] = []
    logps: Optional[list[list[float]]] = [] if gcfg.sampler == "engine" else None
    threads = torch.get_num_threads()
    if device.type == "cpu" and sum(p.numel() for p in gen.parameters()) < ONE_THREAD_PARAMS:
        torch.set_num_threads(1)
    try:
        compiled = compiled and gcfg.sampler == "engine"
        with torch.compiler.set_stance("default" if compiled else "force_eager"):
            for start in range(0, len(prompt_ids), rows):
                chunk = prompt_ids[start : start + rows]
                ids, lps = _sample_chunk(
                    gen, chunk, config, gcfg, pad, device, compiled, max_prompt, kept
                )
                completions += ids
                if logps is not None:
                    logps += lps
    finally:
        gen.train(was_training)
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.synchronize()
    cut = [_until_eos(c, set(eos)) for c in completions]
    kept_logps = (
        None if logps is None else [lp[: len(c)] for lp, (c, _) in zip(logps, cut, strict=True)]
    )
    return Samples([c for c, _ in cut], [t for _, t in cut], time.perf_counter() - t0, kept_logps)


def _sample_chunk(gen, chunk, config, gcfg, pad: int, device, compiled, max_prompt, kept):
    """(completions, the sampler's per-token log-probs or None) of a chunk of prompts."""
    if gcfg.sampler == "engine":
        return engine_rollouts(
            gen, chunk, gcfg, config.eos_token_id, compiled, max_prompt, kept, with_logps=True
        )
    if gcfg.sampler == "continuous":
        return continuous(gen, chunk, config, gcfg.max_completion_length), None
    ids, mask = left_padded(chunk, pad, device)
    out = gen.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, ids.size(1) :].tolist(), None


def engine_config(gcfg, rows: int, length: int, eos: list[int], compiled: bool):
    """The rollouts' engine: ``rows`` rows of ``length`` positions, the step compiled or not,
    the rows of the device policy but grpo.policy_off's."""
    from onegpu.infer.engine import EngineConfig
    from onegpu.infer.policy import parse_off

    # nothing streams: read back every 32 steps (a finished row idles at most that long)
    return EngineConfig(
        max_slots=rows,
        max_len=length,
        compile="on" if compiled else "off",
        eos_ids=eos,
        sync_every=32,
        fixed_shape=compiled,  # one compiled step, not one per (rows, length) bucket
        policy_off=parse_off(gcfg.policy_off, "--grpo.policy_off"),
    )


def engine_rollouts(
    gen,
    chunk: list[list[int]],
    gcfg,
    eos: list[int],
    compiled: bool = False,
    max_prompt: int = 0,
    kept: Optional[KeptEngine] = None,
    with_logps: bool = False,
):
    """The chunk's completions from one decode engine, a row per completion (``with_logps``: and
    each sampled token's log-prob, the engine's logprobs under the model's own logits, the
    sampler's side of the sampler-trainer mismatch). Seeds come from
    torch's generator, so the run's seed (and a resume, which restores it) fixes the rollouts.
    Eager, the engine lives for the call, its cache sized to the chunk's longest prompt +
    max_completion_length. Compiled, it is kept in ``kept`` (its cache too: a compiled step is
    bound to its tensors), its cache sized once to ``max_prompt`` (the longest prompt the run can
    draw) + max_completion_length, so its one step compiles once in the run, not again at the
    first longer prompt; rebuilt only for more rows or a prompt past ``max_prompt``. The weights
    change between rollouts: a kept engine forgets its cached prefixes at each call."""
    from onegpu.infer.engine import Engine
    from onegpu.infer.requests import SamplingParams

    new = gcfg.max_completion_length
    longest = max(map(len, chunk))
    if compiled:
        longest = max(longest, max_prompt)
    length = -(-(longest + new) // 64) * 64  # whole 64s: the step's shapes vectorise evenly
    kept = kept if compiled and kept is not None else KeptEngine()
    engine = kept.engine if kept.length >= length else None
    if engine is None or engine.max_slots < len(chunk):
        engine = Engine(gen, None, engine_config(gcfg, len(chunk), length, eos, compiled))
        # keyed by the length asked for: past the model's context the engine holds less, and
        # comparing with what it holds would rebuild it at every call
        kept.engine, kept.length = engine, length
    engine.reset_prefix_cache()
    base = int(torch.randint(0, 2**62, (1,)).item())
    params = [
        SamplingParams(new, gcfg.temperature, gcfg.top_k, gcfg.top_p, seed=base + i, logprobs=0)
        for i in range(len(chunk))
    ]
    # Engine.generate keeps no logprobs: its loop, keeping them
    ids = [engine.submit(p, s, None) for p, s in zip(chunk, params, strict=True)]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    logps: dict[int, list[float]] = {i: [] for i in ids}
    while engine.has_work():
        for u in engine.step():
            tokens[u.request_id] += u.token_ids
            logps[u.request_id] += [lp.logprob for lp in u.logprobs or ()]
    completions = [tokens[i] for i in ids]
    return (completions, [logps[i] for i in ids]) if with_logps else completions


def continuous(gen, chunk: list[list[int]], config, new_tokens: int) -> list[list[int]]:
    """transformers' continuous batching over the chunk's prompts, its paged KV cache sized for
    them (left to itself it would size the cache from free memory: most of the card, or of the
    host's RAM), results in the prompts' order."""
    from transformers import ContinuousBatchingConfig

    page = 256
    pages = -(-(max(map(len, chunk)) + new_tokens) // page) + 1  # a spare page per row
    prompt_tokens = sum(map(len, chunk))
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=len(chunk) * pages,
        max_batch_tokens=max(page, min(8192, prompt_tokens)),
    )
    out = gen.generate_batch(chunk, generation_config=config, continuous_batching_config=cb)
    results = list(out.values())
    failed = [r.error for r in results if r.error]
    if len(results) != len(chunk) or failed:
        raise RuntimeError(
            "grpo.sampler=continuous: "
            + (failed[0] if failed else f"{len(results)} of {len(chunk)} completions came back")
        )
    return [list(r.generated_tokens) for r in results]


def _eos_ids(tokenizer, model) -> list[int]:
    """The tokenizer's EOS first, then any other the model's generation config stops at."""
    ids = generation_model(model).generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.insert(0, tokenizer.eos_token_id)
    if not ids:
        raise ValueError("GRPO needs an end-of-sequence token: the tokenizer has none")
    return ids


def _until_eos(row: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, tok in enumerate(row):
        if tok in eos:
            return row[: i + 1], False
    return row, True


def left_padded(rows: list[list[int]], pad: int, device):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def training_rows(
    prompt_ids: list[list[int]], samples: Samples, pad: int, mask_truncated: bool, multiple: int = 1
) -> dict:
    """The rows as one right-padded batch (input_ids, attention_mask, labels) on the host; width
    padded to a multiple of ``multiple`` (data.pad_to_multiple)."""
    seqs = [p + c for p, c in zip(prompt_ids, samples.completion_ids, strict=True)]
    width = max(len(s) for s in seqs)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, (p, c, cut) in enumerate(
        zip(prompt_ids, samples.completion_ids, samples.truncated, strict=True)
    ):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        mask[i, :n] = 1
        if not (mask_truncated and cut):
            target = torch.tensor(c, dtype=torch.long)
            if samples.model_mask is not None:  # a tool's tokens are not the policy's
                target[~torch.tensor(samples.model_mask[i], dtype=torch.bool)] = IGNORE
            labels[i, len(p) : n] = target
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
