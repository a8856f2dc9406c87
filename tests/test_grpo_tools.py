"""GRPO's multi-turn rollouts with tools (grpo.tools): calls in the model's format run in a
subprocess, their results come back as tool messages, each turn goes on from the prefix cache,
only the policy's tokens are trained, and a failing tool is an error message, never a dead run."""

from __future__ import annotations

import copy
import json
import sys
import textwrap

import pytest
import torch

from families import tiny_family_model
from onegpu.config import Config, validate
from onegpu.config.grpo import GRPOConfig
from onegpu.errors import ConfigError
from onegpu.objectives import tools as tools_mod
from onegpu.objectives.multiturn import ToolUse, tool_rollouts
from onegpu.objectives.rollout import training_rows
from onegpu.objectives.tokens import IGNORE

TOOLS = textwrap.dedent(
    """
    import time

    def echo(text: str = "hi") -> str:
        '''Say the text back.

        Args:
            text: what to say
        '''
        return "echo:" + text

    def boom() -> str:
        '''Raise.'''
        raise ValueError("no such thing")

    def hang() -> str:
        '''Sleep past any time limit.'''
        time.sleep(60)
        return "late"

    def number() -> str:
        '''Return a number, not text.'''
        return 42

    def noisy() -> str:
        '''Print, then return text.'''
        print("chatter on stdout")
        return "quiet"
    """
)


def _call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "mytools.py").write_text(TOOLS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mytools"
    sys.modules.pop("mytools", None)


@pytest.fixture
def call_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with each test call as one token of its own, so a model that writes
    one token writes a whole call."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens([_call(n) for n in ("echo", "boom", "hang", "number", "noisy", "nope")])
    return tok


def _always(tok, text: str):
    """A tiny model that greedily writes the token ``text`` whatever it reads: its blocks add
    nothing to the residual stream, every embedding's first component is 1 and the head reads
    only that component, for that token alone."""
    model = tiny_family_model("llama", tok, tie_word_embeddings=False).eval()
    target = tok.convert_tokens_to_ids(text)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[target, 0] = 10.0
    return model, target


def _use(tok, names, module, timeout=10.0):
    refs = [f"{module}:{n}" for n in names]
    runner = tools_mod.ToolRunner(tools_mod.resolve(refs), timeout)
    return ToolUse(runner, "hermes", tok)


def _prompts(tok, n=2):
    msgs = [
        [{"role": "user", "content": f"question number {i}: " + "tell me more " * (3 + 2 * i)}]
        for i in range(n)
    ]
    ids = [
        tok(
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for m in msgs
    ]
    return msgs, ids


def _gcfg(**kw):
    kw = {"max_completion_length": 16, "temperature": 0.0, "max_turns": 3, **kw}
    return GRPOConfig(tools=["calculator"], **kw)


def test_each_call_runs_and_its_result_is_a_tool_message(call_tokenizer, tool_module):
    """The model calls echo every turn: turns 1 and 2 run it (the answer comes back as a tool
    message the rewards see and the model reads), the last turn's call has no turn left to read
    it and is not run."""
    tok = call_tokenizer
    model, call = _always(tok, _call("echo"))
    msgs, ids = _prompts(tok)
    use = _use(tok, ["echo"], tool_module)
    out = tool_rollouts(model, ids, msgs, _gcfg(), [call, tok.eos_token_id], use)
    assert use.runner.counts["tool_calls"] == 4 and out.counts["tool_calls"] == 4
    for conv, row in zip(out.conversations, out.completion_ids, strict=True):
        assert [m["role"] for m in conv] == ["assistant", "tool"] * 2 + ["assistant"]
        assert all(m["content"] == "echo:hi" for m in conv if m["role"] == "tool")
        assert conv[0]["tool_calls"][0]["function"]["name"] == "echo"
        assert conv[0]["content"] == ""  # the call is not content
        text = tok.decode(row)
        assert text.count("echo:hi") == 2 and text.count(_call("echo")) == 3
    assert out.counts["turns"] == 6 and not any(out.truncated)
    use.runner.close()


def test_only_the_policys_tokens_are_targets(call_tokenizer, tool_module):
    """Token by token: every label after the prompt is the policy's own sampled token (its call)
    or IGNORE where a tool message's (and the template's) tokens are; the sampler's log-probs
    are one per target."""
    tok = call_tokenizer
    model, call = _always(tok, _call("echo"))
    msgs, ids = _prompts(tok)
    use = _use(tok, ["echo"], tool_module)
    out = tool_rollouts(model, ids, msgs, _gcfg(), [call, tok.eos_token_id], use)
    batch = training_rows(ids, out, tok.pad_token_id, mask_truncated=False)
    for i, (p, c, m) in enumerate(zip(ids, out.completion_ids, out.model_mask, strict=True)):
        labels = batch["labels"][i].tolist()
        assert labels[: len(p)] == [IGNORE] * len(p)
        for k, (token, own) in enumerate(zip(c, m, strict=True)):
            assert labels[len(p) + k] == (token if own else IGNORE)
            assert own == (token == call)  # the policy wrote exactly the calls
        assert batch["input_ids"][i, len(p) : len(p) + len(c)].tolist() == c
        tool_text = tok.decode([t for t, own in zip(c, m, strict=True) if not own])
        assert tool_text.count("echo:hi") == 2
        assert len(out.logps[i]) == sum(m) == 3
        assert labels[len(p) + len(c) :] == [IGNORE] * (len(labels) - len(p) - len(c))
    use.runner.close()


def _computed(model):
    seen = []
    model.register_forward_pre_hook(
        lambda mod, a, kw: (
            seen.append(kw["input_ids"].numel()) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    return seen


@pytest.mark.parametrize("caching", [True, False])
def test_later_turns_go_on_from_the_prefix_cache(call_tokenizer, tool_module, caching):
    """Each turn submits the whole conversation; with the prefix cache the engine finds every
    full block the earlier turns filled (its stats count them as hits), and computes only the
    rest. Off, it recomputes each conversation whole, the same tokens coming out."""
    tok = call_tokenizer
    model, call = _always(tok, _call("echo"))
    seen = _computed(model)
    msgs, ids = _prompts(tok)
    use = _use(tok, ["echo"], tool_module)
    gcfg = _gcfg(max_turns=3)
    out = tool_rollouts(model, ids, msgs, gcfg, [call, tok.eos_token_id], use, caching)
    hits = 0
    submitted = 0
    for p, m in zip(ids, out.model_mask, strict=True):
        ends = [k + 1 for k, own in enumerate(m) if own]  # after each of its turns' token
        starts = [0] + [k for k in range(1, len(m)) if m[k] and not m[k - 1]]
        for turn in range(1, len(starts)):
            before = len(p) + ends[turn - 1]  # the last turn's sequence (its KV but the last)
            now = len(p) + starts[turn]  # the sequence submitted this turn
            hits += min((before - 1) // 16, (now - 1) // 16) * 16
        submitted += sum(len(p) + s for s in starts)
    assert out.counts["prefix_hits"] == (hits if caching else 0)
    assert hits >= 2 * 16  # the test would mean nothing without full blocks to find
    assert sum(seen) == submitted - out.counts["prefix_hits"]


@pytest.mark.parametrize(
    "name, kind, says",
    [
        ("boom", "raised", "raised ValueError: no such thing"),
        ("hang", "timeout", "time limit"),
        ("number", "non_text", "returned int, not text"),
        ("nope", "unknown_tool", "no tool named 'nope'"),
    ],
)
def test_a_failing_tool_is_an_error_message_counted(call_tokenizer, tool_module, name, kind, says):
    """A tool that raises, hangs past grpo.tool_timeout or returns no text (or a call to no
    tool) becomes an error message the model reads, counted by kind; the rollout goes on."""
    tok = call_tokenizer
    model, call = _always(tok, _call(name))
    msgs, ids = _prompts(tok, 1)
    known = ["echo"] if name == "nope" else [name]
    use = _use(tok, known, tool_module, timeout=1.0)
    gcfg = _gcfg(max_turns=2, max_completion_length=64)  # room for the whole message
    out = tool_rollouts(model, ids, msgs, gcfg, [call, tok.eos_token_id], use)
    (conv,) = out.conversations
    assert [m["role"] for m in conv] == ["assistant", "tool", "assistant"]
    assert conv[1]["content"].startswith("error: ") and says in conv[1]["content"]
    assert out.counts[f"tool_errors/{kind}"] == 1
    if name == "hang":  # the killed worker is started again for the next call
        assert use.runner.call("hang", "{}")[1] == "timeout"
    use.runner.close()


def test_a_tools_prints_do_not_reach_the_replies(tool_module):
    runner = tools_mod.ToolRunner(tools_mod.resolve([f"{tool_module}:noisy"]), 10)
    assert runner.call("noisy", "{}") == ("quiet", None)
    assert runner.call("noisy", "[1]")[1] == "bad_arguments"
    runner.close()


def test_the_calculator_tool_and_its_reward():
    from onegpu.objectives.rewards import calculator_answer

    runner = tools_mod.ToolRunner(tools_mod.resolve(["calculator"]), 10)
    assert runner.call("calculator", json.dumps({"expression": "1234+4321"})) == ("5555", None)
    text, kind = runner.call("calculator", json.dumps({"expression": "2**99"}))
    assert kind == "raised" and text.startswith("error:")
    runner.close()
    reward = calculator_answer(GRPOConfig())
    said = {"role": "assistant", "content": "", "tool_calls": [{}]}
    convs = [
        [said, {"role": "tool", "content": "5555"}, {"role": "assistant", "content": "5555"}],
        [said, {"role": "tool", "content": "5555"}],  # the tool's result is not an answer
        [{"role": "assistant", "content": "5500"}],
    ]
    assert reward(completions=convs, answer=["5555"] * 3) == [1.0, 0.0, 0.0]


def _cfg(**grpo):
    cfg = Config()
    cfg.training.objective = "grpo"
    cfg.training.micro_batch_size = 8
    for k, v in grpo.items():
        setattr(cfg.grpo, k, v)
    return cfg


@pytest.mark.parametrize(
    "grpo, says",
    [
        ({"max_turns": 4}, "grpo.max_turns is set, but grpo.tools is empty"),
        ({"tools": ["calculator"], "max_turns": 1}, "grpo.max_turns must be >= 2"),
        ({"tools": ["nomodule"]}, "'nomodule' is neither a built-in tool"),
        ({"tools": ["calculator"], "tool_timeout": 0}, "grpo.tool_timeout must be > 0"),
        ({"tools": ["calculator"], "sampler": "generate"}, "grpo.tools needs grpo.sampler"),
    ],
)
def test_tool_settings_are_checked(grpo, says):
    with pytest.raises(ConfigError, match=says):
        validate(_cfg(**grpo))


def test_a_tool_that_does_not_import_is_refused_before_any_load():
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_x:f'"):
        tools_mod.resolve(["no_such_module_x:f"])


def _chain(tok, chain: list[int]):
    """A tiny model that greedily writes chain[k + 1] after chain[k] whatever came before: each
    position's hidden state is its token's embedding (the blocks add nothing), a code the head
    maps to the next token of the chain."""
    model = tiny_family_model("llama", tok, tie_word_embeddings=False)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (here, after) in enumerate(zip(chain, chain[1:], strict=False)):
            code = torch.zeros(hidden)
            code[k] = 1.0
            model.model.embed_tokens.weight[here] = code
            model.lm_head.weight[after] = 20.0 * code
    return model


def test_a_grpo_run_with_tools_trains_and_logs_the_calls(
    tmp_path, call_tokenizer, tool_module, one_thread
):
    """A whole run: the policy calls echo, then ends its turn, every turn; the run trains on the
    conversations and logs the calls, the turns and the prefix cache's hits."""
    import onegpu
    from helpers import make_cfg

    tok = call_tokenizer
    start = tok.convert_tokens_to_ids("<|assistant|>")
    model = _chain(tok, [start, tok.convert_tokens_to_ids(_call("echo")), tok.eos_token_id])
    model_dir = tmp_path / "policy"
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    data = tmp_path / "prompts.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(8):
            prompt = [{"role": "user", "content": f"question {i}: " + "more " * (8 + i)}]
            f.write(json.dumps({"prompt": prompt}) + "\n")
    cfg = make_cfg(tmp_path, model_dir, "tools", max_steps=2, save_every=0, eval_every=0)
    cfg["data"].update(path=str(data), seq_len=64)
    cfg["training"].update(objective="grpo", micro_batch_size=4, grad_accum=1)
    cfg["grpo"] = {
        "group_size": 4,
        "max_completion_length": 16,
        "rewards": ["length"],
        "tools": [f"{tool_module}:echo"],
        "max_turns": 3,
        "tool_parser": "hermes",
    }
    result = onegpu.train(cfg)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r.get("split") == "train" and "loss" in r][-1]
    assert train["tool_calls"] > 0 and train["turns"] > 1
    assert train["prefix_hit_ratio"] > 0 and "tool_errors/raised" not in train
    # the policy's own tokens of a rollout: its call and its EOS, a turn (tool messages aside)
    assert train["completion_length"] <= 2 * 3
