"""GRPO's multi-turn rollouts with tools (grpo.tools, grpo.max_turns): the policy answers, each
tool call it writes runs (tools.ToolRunner), its result is appended as a ``tool`` message and the
policy goes on, until a turn without a call, grpo.max_turns turns or the room left.

Every turn submits each conversation so far, whole, to one decode engine: its prefix cache holds
the blocks every earlier turn filled (a finished sequence's full blocks stay findable), so a turn
computes only the tool message and the last, partial block before it. The tokens the policy is
trained on are the tokens it sampled, and the tool messages' tokens are the chat template's
rendering of just the appended messages (the template rendered before and after them, the
difference tokenized), never a re-tokenization of the whole conversation, whose merges could
differ. Only the policy's own tokens are targets (``Samples.model_mask``); the rewards see the
whole conversation as chat messages (the assistant's with their ``tool_calls``, the tools').
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from onegpu.errors import ConfigError, DataError


@dataclass
class ToolUse:
    """What a run's rollouts call tools with: the runner, the call format, the run's tokenizer
    and the tools' JSON schemas (the chat template's ``tools``, in every rendering)."""

    runner: object  # tools.ToolRunner
    fmt: str  # the call format: hermes or llama3 (serve/tools.py reads it)
    tokenizer: object
    schemas: list = field(default_factory=list)

    @classmethod
    def for_run(cls, gcfg, tokenizer) -> ToolUse:
        from onegpu.objectives import tools
        from onegpu.serve.tools import parser_for

        fmt = parser_for(getattr(tokenizer, "chat_template", None), gcfg.tool_parser)
        if fmt is None:
            raise ConfigError(
                "grpo.tools: the model's chat template shows no tool-call format to read the "
                "model's calls in.",
                hint="set grpo.tool_parser hermes (<tool_call>{...}</tool_call>) or llama3",
            )
        resolved = tools.resolve(gcfg.tools)
        runner = tools.ToolRunner(resolved, gcfg.tool_timeout)
        return cls(runner, fmt, tokenizer, [t.schema for t in resolved])


@torch.no_grad()
def sample(model, prompt_ids, messages, gcfg, tokenizer, device, rows: int, use: ToolUse):
    """rollout.sample's counterpart with tools: one conversation per prompt row, ``rows`` rows per
    engine, eager, in eval mode (on a CPU, a small model on one thread, as rollout.sample)."""
    from onegpu.objectives.rollout import ONE_THREAD_PARAMS, _eos_ids, generation_model

    gen = generation_model(model)
    eos = _eos_ids(tokenizer, model)
    was_training, threads = gen.training, torch.get_num_threads()
    gen.eval()
    if device.type == "cpu" and sum(p.numel() for p in gen.parameters()) < ONE_THREAD_PARAMS:
        torch.set_num_threads(1)
    try:
        with torch.compiler.set_stance("force_eager"):
            parts = [
                tool_rollouts(gen, prompt_ids[s : s + rows], messages[s : s + rows], gcfg, eos, use)
                for s in range(0, len(prompt_ids), rows)
            ]
    finally:
        gen.train(was_training)
        torch.set_num_threads(threads)
    return _joined(parts)


def _joined(parts: list):
    from onegpu.objectives.rollout import Samples

    counts: Counter = Counter()
    for p in parts:
        counts.update(p.counts)
    return Samples(
        [c for p in parts for c in p.completion_ids],
        [t for p in parts for t in p.truncated],
        sum(p.seconds for p in parts),
        [lp for p in parts for lp in p.logps],
        [m for p in parts for m in p.model_mask],
        [c for p in parts for c in p.conversations],
        dict(counts),
    )


@dataclass
class _Row:
    prompt: list[int]
    raw: list[dict]  # the conversation as rendered: the assistant's messages as the text it wrote
    messages: list[dict]  # the conversation for the rewards (after the prompt)
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[bool] = field(default_factory=list)  # True: the policy's own token
    logps: list[float] = field(default_factory=list)  # the sampler's, of the policy's tokens
    done: bool = False
    truncated: bool = False


@torch.no_grad()
def tool_rollouts(
    gen,
    prompt_ids: list[list[int]],
    prompts: list,
    gcfg,
    eos: list[int],
    use: ToolUse,
    prefix_caching: bool = True,
):
    """One conversation per prompt row, as rollout.Samples (``prefix_caching`` off: every turn
    computes its whole conversation again; the benchmark's other arm)."""
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.policy import parse_off
    from onegpu.infer.requests import SamplingParams
    from onegpu.objectives.rollout import Samples

    t0 = time.perf_counter()
    new, turns = gcfg.max_completion_length, gcfg.max_turns
    rows = [
        _Row(list(p), _messages(m, i), [])
        for i, (p, m) in enumerate(zip(prompt_ids, prompts, strict=True))
    ]
    overhead = len(_tool_turn(use, [*rows[0].raw, _said("")], [_result("x", "")], ""))
    longest = max(map(len, prompt_ids))
    length = longest + turns * new + (turns - 1) * (new + overhead)
    engine = Engine(
        gen,
        None,
        EngineConfig(
            max_slots=len(rows),
            max_len=-(-length // 64) * 64,
            compile="off",
            eos_ids=eos,
            sync_every=32,
            prefix_caching=prefix_caching,
            policy_off=parse_off(gcfg.policy_off, "--grpo.policy_off"),
        ),
    )
    stop, counted = set(eos), Counter(use.runner.counts)
    base = int(torch.randint(0, 2**62, (1,)).item())
    for turn in range(turns):
        submitted = {}
        for i, row in enumerate(rows):
            room = engine.max_len - len(row.prompt) - len(row.ids)
            if not row.done and room < 1:  # the conversation fills the engine's context
                row.done = row.truncated = True
            if row.done:
                continue
            params = SamplingParams(
                min(new, room),
                gcfg.temperature,
                gcfg.top_k,
                gcfg.top_p,
                seed=base + turn * len(rows) + i,
                logprobs=0,
            )
            submitted[engine.submit(row.prompt + row.ids, params)] = i
        if not submitted:
            break
        tokens = {r: [] for r in submitted}
        logps = {r: [] for r in submitted}
        while engine.has_work():
            for u in engine.step():
                tokens[u.request_id] += u.token_ids
                logps[u.request_id] += [lp.logprob for lp in u.logprobs or ()]
        for rid, i in submitted.items():
            _turn(rows[i], tokens[rid], logps[rid], stop, use, new, last=turn == turns - 1)
    stats = engine.stats()
    counts = Counter(use.runner.counts)
    counts.subtract(counted)
    counts["turns"] = sum(sum(m["role"] == "assistant" for m in r.messages) for r in rows)
    counts["prefix_queries"], counts["prefix_hits"] = stats.prefix_queries, stats.prefix_hits
    if next(gen.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return Samples(
        [r.ids for r in rows],
        [r.truncated for r in rows],
        time.perf_counter() - t0,
        [r.logps for r in rows],
        model_mask=[r.mask for r in rows],
        conversations=[r.messages for r in rows],
        counts=dict(counts),
    )


def _turn(row: _Row, sampled, logps, stop: set, use: ToolUse, new: int, last: bool) -> None:
    """The row after one turn: the policy's tokens (to its first EOS), then, when it called tools
    and has a turn left, their results as tool messages."""
    from onegpu.serve.tools import reader

    cut = next((k + 1 for k, t in enumerate(sampled) if t in stop), None)
    own = sampled[:cut] if cut is not None else sampled
    row.ids += own
    row.mask += [True] * len(own)
    row.logps += logps[: len(own)]
    tok = use.tokenizer
    text = tok.decode(own, skip_special_tokens=True)
    calls_reader = reader(use.fmt)
    content, calls = calls_reader.feed(text)
    rest, more = calls_reader.finish()
    calls += more
    said = {"role": "assistant", "content": content + rest}
    if calls:
        said["tool_calls"] = [c.openai() for c in calls]
    row.messages.append(said)
    row.raw.append(_said(text))
    if cut is None:  # cut at the turn's length: the conversation cannot go on
        row.done = row.truncated = True
        return
    if not calls or last:
        row.done = True
        return
    results = []
    for call in calls:
        text_out, _ = use.runner.call(call.name, call.arguments)
        ids = tok(text_out, add_special_tokens=False)["input_ids"]
        if len(ids) > new:  # a result is cut to a turn's length
            text_out = tok.decode(ids[:new])
        results.append(_result(call.name, text_out, call.id))
    added = _tool_turn(use, row.raw, results, text, tok.decode(own[-1:]))
    row.raw += results
    row.messages += results
    row.ids += added
    row.mask += [False] * len(added)


def _tool_turn(use: ToolUse, raw: list[dict], results: list[dict], said: str, ended: str = ""):
    """The tokens that follow the policy's last turn ``said`` (which ended with the token whose
    text is ``ended``) to append ``results`` and open its next turn: the template's text after
    ``said`` past that token (e.g. the newline after <|im_end|>), and the text the results and the
    generation prompt add (both renderings with the tools, as the prompt's)."""
    tok, tools = use.tokenizer, use.schemas or None
    before = tok.apply_chat_template(raw, tools=tools, tokenize=False)
    after = tok.apply_chat_template(
        [*raw, *results], tools=tools, tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise DataError(
            "grpo.tools: the chat template renders the conversation differently once a tool "
            "message follows it, so the tool's turn cannot be appended to the sampled tokens.",
            hint="use a chat template that renders a conversation turn by turn (as most do)",
        )
    at = before.rfind(said) if said else -1
    tail = before[at + len(said) :] if at >= 0 else ""
    if ended and tail.startswith(ended):  # that token is the policy's, already in the row
        tail = tail[len(ended) :]
    return tok(tail + after[len(before) :], add_special_tokens=False)["input_ids"]


def _messages(prompt, i: int) -> list[dict]:
    if not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
        raise DataError(
            f"grpo.tools: prompt {i} is {type(prompt).__name__}, not chat messages: a tool's "
            "result is a message of the conversation.",
            hint="give the prompts as lists of {role, content} messages",
        )
    return [dict(m) for m in prompt]


def _said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _result(name: str, text: str, call_id: Optional[str] = None) -> dict:
    return {"role": "tool", "name": name, "tool_call_id": call_id or "call_0", "content": text}
