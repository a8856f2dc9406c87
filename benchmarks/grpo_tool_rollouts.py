"""GRPO's multi-turn tool rollouts (objectives/multiturn.py) with the engine's prefix cache on and
off: rollout tokens/s (the policy's own tokens over the sampling's wall time) at 3 turns,
interleaved rounds, median and range.

    python benchmarks/grpo_tool_rollouts.py [--rounds 5] [--turns 3] [--out results/NAME]
    python benchmarks/grpo_tool_rollouts.py --curve RUN_DIR --out results/NAME

``--curve``: instead, the reward curve of a finished run of the built-in calculator job (`onegpu
train --training.objective grpo --grpo.tools '[calculator]'`), read from its metrics.jsonl.

The workload is an agent's: 2 prompts x a group of 4 conversations, each prompt a 512-token system
prompt (the standard library's source, as a tool schema and instructions would be) and a short
question; each turn 16 tokens of the policy's, the last of them a call to ``lookup``, whose
32-token passage comes back as a tool message (the last turn's call is not run: no turn is left to
read it). The policy has the tiny preset's shape (4 layers, hidden 128, vocabulary 4,096, fp32),
every forward computing as that model does, with weights set so that greedy decoding writes this
turn whatever it reads: its blocks' output projections are zero, so each position's hidden state
is its token's embedding, and the embeddings and head make a chain of 16 tokens from the
generation prompt to the call and EOS. Its turns are then the same length in both arms, and the
two arms differ only in what the engine computes: with the cache, each turn only the tool
message and the last, partial block before it (and a group's prompt once); without it, every
turn each conversation whole. Each arm's prompt tokens computed are counted at the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from onegpu.bench import provenance  # noqa: E402

CALL = '<tool_call>{"name": "lookup", "arguments": {"query": "the answer"}}</tool_call>'
TURN, SYSTEM, PASSAGE, GROUP, PROMPTS = 16, 512, 32, 4, 2


def lookup(query: str = "") -> str:
    """The benchmark's tool: a fixed passage of about PASSAGE tokens.

    Args:
        query: what to look up
    """
    return ("A passage that answers " + query + ". ") * 5


def corpus() -> list[str]:
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(lib.glob("[a-f]*.py"))]


def build(texts: list[str]):
    """The tokenizer (byte-level BPE of the tiny preset's size, with the call as one token) and
    the policy: the tiny preset's shape, writing TURN tokens from the generation prompt to the
    call, then EOS."""
    from onegpu import models
    from onegpu.data.tokenizer import train_tokenizer

    tok = train_tokenizer(texts, 4096, "bench-grpo-tools")
    tok.add_tokens([CALL])
    torch.manual_seed(0)
    config = models.preset_config("tiny", tok, tie_word_embeddings=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    start = tok.convert_tokens_to_ids("<|assistant|>")
    call = tok.convert_tokens_to_ids(CALL)
    fillers = list(range(300, 300 + TURN - 2))  # ordinary BPE tokens
    chain = [start, *fillers, call, tok.eos_token_id]  # each token's successor
    hidden = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (here, after) in enumerate(zip(chain, chain[1:], strict=False)):
            code = torch.zeros(hidden)
            code[k % hidden] = 1.0
            model.model.embed_tokens.weight[here] = code
            model.lm_head.weight[after] = 20.0 * code
    return tok, model


def prompts(tok, texts: list[str]):
    messages, ids = [], []
    for i in range(PROMPTS):
        source = tok(texts[i], add_special_tokens=False)["input_ids"][:SYSTEM]
        m = [
            {"role": "system", "content": tok.decode(source)},
            {"role": "user", "content": f"Question {i}: what does it say?"},
        ]
        text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for _ in range(GROUP):
            messages.append(m)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])
    return messages, ids


def one_arm(model, tok, messages, ids, turns: int, caching: bool, use) -> dict:
    from onegpu.config.grpo import GRPOConfig
    from onegpu.objectives.multiturn import tool_rollouts

    computed = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: (
            computed.append(kw["input_ids"].numel()) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    gcfg = GRPOConfig(
        tools=["lookup"], max_turns=turns, max_completion_length=PASSAGE + 16, temperature=0.0
    )
    try:
        out = tool_rollouts(model, ids, messages, gcfg, [tok.eos_token_id], use, caching)
    finally:
        hook.remove()
    tokens = sum(out.lengths())
    return {
        "tokens": tokens,
        "seconds": out.seconds,
        "tokens_per_s": tokens / out.seconds,
        "prompt_tokens_computed": sum(computed),
        "prefix_hits": out.counts["prefix_hits"],
        "tool_calls": out.counts["tool_calls"],
        "turns": out.counts["turns"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None, help="results path without suffix (.md and .json)")
    ap.add_argument("--curve", default=None, help="a calculator job's run folder")
    args = ap.parse_args()
    if args.curve:
        return curve(Path(args.curve), args)
    from onegpu.objectives import tools
    from onegpu.objectives.multiturn import ToolUse

    torch.set_num_threads(1)  # as GRPO's rollouts of a small model on a CPU (rollout.py)
    header = provenance.begin()
    texts = corpus()
    tok, model = build(texts)
    messages, ids = prompts(tok, texts)
    runner = tools.ToolRunner(tools.resolve([f"{Path(__file__).stem}:lookup"]), 30)
    use = ToolUse(runner, "hermes", tok)
    one_arm(model, tok, messages[:2], ids[:2], args.turns, True, use)  # warm: the tool's worker
    rounds = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)  # alternate which goes first
        arms = {}
        for caching in order:
            arms["on" if caching else "off"] = one_arm(
                model, tok, messages, ids, args.turns, caching, use
            )
        rounds.append(arms)
        ratio = arms["on"]["tokens_per_s"] / arms["off"]["tokens_per_s"]
        print(
            f"round {r}: on {arms['on']['tokens_per_s']:.0f} tok/s, off "
            f"{arms['off']['tokens_per_s']:.0f} tok/s, {ratio:.2f}x",
            flush=True,
        )
    runner.close()
    header = provenance.end(header)
    report(header, rounds, args)


def curve(run: Path, args) -> None:
    """The reward curve of a calculator job's run: training and validation rewards, tool calls
    and errors, turns, as logged."""
    header = provenance.end(provenance.begin())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train" and "reward" in r]
    val = [r for r in records if r.get("split") == "val" and "reward" in r]
    keys = ("reward", "tool_calls", "turns", "completion_length", "prefix_hit_ratio")
    lines = [
        "# GRPO with tools: the built-in calculator job's reward curve",
        "",
        provenance.markdown(header),
        f"The run: `{run}` (its config.yaml and metrics.jsonl; the header's load is the load when "
        "this page was written, not the run's). Training rows: the mean over the steps since the "
        "previous row (tool_calls: their count); validation: held-out questions, 8 conversations "
        "each.",
        "",
        "| split | step | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for split, rows in (("train", train), ("val", val)):
        for r in rows:
            cells = [
                f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys
            ]
            lines.append(f"| {split} | {r.get('step')} | " + " | ".join(cells) + " |")
    errors = sorted({k for r in train for k in r if k.startswith("tool_errors/")})
    if errors:
        totals = {k: sum(r.get(k, 0) for r in train) for k in errors}
        lines += [
            "",
            "Tool errors over the run: " + ", ".join(f"{k} {v:g}" for k, v in totals.items()),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = HERE / args.out
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        data = {"header": header, "run": str(run), "train": train, "val": val}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}–{max(values):,.2f})"


def report(header: dict, rounds: list[dict], args) -> None:
    ratios = [a["on"]["tokens_per_s"] / a["off"]["tokens_per_s"] for a in rounds]
    lines = [
        f"# GRPO tool rollouts: the prefix cache on and off, {args.turns} turns",
        "",
        provenance.markdown(header),
        f"{PROMPTS} prompts x {GROUP} conversations, a {SYSTEM}-token system prompt, {TURN}-token "
        f"turns each ending in a call, a {PASSAGE}-token-ish tool result; {args.rounds} "
        "interleaved rounds (the arm that goes first alternates), one thread. Rollout tokens/s: "
        "the policy's own tokens over the wall time of the rollout (tools, template rendering "
        "and sampling included). Median (range). Measured on a machine shared with other jobs "
        "(the load above): both arms ran under it, interleaved.",
        "",
        "| arm | rollout tokens/s | seconds | prompt tokens computed | prefix hits | tool calls |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ("on", "off"):
        vals = [a[arm] for a in rounds]
        lines.append(
            f"| prefix cache {arm} | {_summary([v['tokens_per_s'] for v in vals])} | "
            f"{_summary([v['seconds'] for v in vals])} | {vals[0]['prompt_tokens_computed']:,} | "
            f"{vals[0]['prefix_hits']:,} | {vals[0]['tool_calls']} |"
        )
    lines += ["", f"on / off, paired by round: **{_summary(ratios)}x**.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = HERE / args.out
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        data = {"header": header, "rounds": rounds, "ratios": ratios}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
