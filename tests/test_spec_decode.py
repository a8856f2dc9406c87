"""Speculative decoding (prompt lookup) changes no token: greedy answers with ``speculative
"ngram"`` equal the engine's without it for every family, with a LoRA adapter and mixed
adapter/base rows, under a grammar, beside plain rows and prompts being computed, with
penalties and logit_bias, and where a stop string, EOS or max_tokens ends a request inside an
accepted run; sampled answers equal too (the same seed draws the same tokens: the acceptance
rule keeps the target's own draws, sampling.speculative_accept). Each test asserts from the
engine's counters that rows were proposed for and that proposals were accepted, so speculation
was active. Rejected positions give their blocks back and no rejected token is ever hashed into
the prefix cache.

These tests were seen to fail against a broken rule: with ``speculative_accept`` returning one
token too many (``match.cumprod(-1).sum(-1) + 1``, capped at k), the family (llama, gpt2: the
two run), adapter, mixed-batch, grammar and sampled equality tests failed;
tests/test_spec_sampling.py's chi-square tests failed too. The rule was then restored."""

from __future__ import annotations

import pytest
import torch

from families import FAMILIES, tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

# prompts that repeat themselves, so that prompt lookup finds matches (a random model's greedy
# answers repeat too)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "x = [1, 2, 3, 1, 2, 3, 1, 2",
    "the cat sat on the mat. the cat sat on",
]
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)
# always propose (no pause), so that every family verifies many positions
SPEC = dict(speculative="ngram", num_speculative_tokens=4, spec_min_accepted=0.0)


def _ids(tok, prompts=PROMPTS):
    return [tok(p)["input_ids"] for p in prompts]


def _run(model, tok, prompts, params, adapters=None, tokenizer=None, **cfg):
    config = EngineConfig(**{"max_slots": len(prompts), "max_len": 160, **cfg})
    engine = Engine(model, tokenizer, config)
    got = engine.generate(prompts, params, adapters)
    stats = engine.stats()
    assert stats.kv_positions_used == 0 and stats.running == 0  # every block went back
    return got, stats


def _same(model, tok, prompts, params, adapters=None, tokenizer=None, **cfg):
    """Plain and speculative results of the same requests; asserts speculation was active."""
    plain, _ = _run(model, tok, prompts, params, adapters, tokenizer, **cfg)
    spec, stats = _run(model, tok, prompts, params, adapters, tokenizer, **{**cfg, **SPEC})
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0, stats
    assert sum(stats.spec_accepted_per_position) == stats.spec_accepted
    return plain, spec


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_without_speculation_for_every_family(family, tiny_tokenizer):
    model = tiny_family_model(family, tiny_tokenizer).eval()
    plain, spec = _same(model, tiny_tokenizer, _ids(tiny_tokenizer), GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain], family
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]


def _lora(tiny_tokenizer):
    peft = pytest.importorskip("peft")
    base = tiny_family_model("llama", tiny_tokenizer)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a trained adapter, not the identity PEFT starts from
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def test_greedy_tokens_equal_with_a_lora_adapter_and_mixed_adapter_and_base_rows(tiny_tokenizer):
    model = _lora(tiny_tokenizer)
    ids = _ids(tiny_tokenizer)
    plain, spec = _same(model, tiny_tokenizer, ids, GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    names = ["default", "__base__", "default"]
    plain, spec = _same(model, tiny_tokenizer, ids, GREEDY, names)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    with model.disable_adapter():  # the base row really ran on the base model
        base, _ = _run(model, tiny_tokenizer, ids[1:2], GREEDY)
    assert spec[1].token_ids == base[0].token_ids


def test_beside_plain_rows_and_prompts_being_computed(tiny_tokenizer):
    """More requests than rows (admissions while others decode, prompts in pieces beside the
    verification) and a request that asks for logprobs (it decodes plainly)."""
    model = tiny_family_model("qwen2", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer) * 2
    params = [GREEDY] * 5 + [SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=2)]
    plain, spec = _same(model, tiny_tokenizer, ids, params, max_slots=3, chunk=8, token_budget=24)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_with_penalties_and_logit_bias(tiny_tokenizer):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    params = [
        SamplingParams(max_new_tokens=32, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=32, ignore_eos=True, frequency_penalty=0.4),
        SamplingParams(
            max_new_tokens=32,
            ignore_eos=True,
            presence_penalty=0.3,
            logit_bias=((ids[2][-1], 3.0), (5, -2.0)),
        ),
    ]
    plain, spec = _same(model, tiny_tokenizer, ids, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_sampled_tokens_equal_without_speculation(tiny_tokenizer):
    """The same seed draws the same tokens: the speculative sampler's output is the target's
    (its distribution is tests/test_spec_sampling.py's). The rows of a run share their top-p: a
    batch with a top-p row draws every row's token from the sorted distribution (the same law,
    another token for the same noise), so a mixed batch's draws depend on which rows share a
    step, with or without speculation."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer) * 2
    for top_p in (1.0, 0.9):
        # low temperatures: a random model's draws then repeat, so proposals are accepted
        params = [
            SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=t, top_p=top_p, seed=s)
            for s, t in enumerate([0.3, 0.5, 0.2] * 2)
        ]
        plain, spec = _same(model, tiny_tokenizer, ids, params, max_slots=6, ngram_min=1)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_max_tokens_and_eos_end_inside_an_accepted_run(tiny_tokenizer):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    plain, _ = _run(model, tiny_tokenizer, ids, GREEDY)
    for n in (11, 14, 19):  # budgets that end in the middle of runs of k + 1
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        a, b = _same(model, tiny_tokenizer, ids, params, ngram_min=1)
        assert (
            [r.token_ids for r in b] == [r.token_ids for r in a] == [r.token_ids[:n] for r in plain]
        )
        assert {r.finish_reason for r in b} == {"length"}
    # an end token: the one an answer makes first latest, so each request ends at its first
    # occurrence after runs were accepted
    toks = plain[1].token_ids
    eos = max(set(toks), key=toks.index)
    ending = SamplingParams(max_new_tokens=32)
    a, b = _same(model, tiny_tokenizer, ids, ending, eos_ids=[eos], ngram_min=1)
    assert [r.token_ids for r in b] == [r.token_ids for r in a]
    assert b[1].token_ids == toks[: toks.index(eos) + 1]
    assert b[1].finish_reason == "stop"


def test_a_stop_string_inside_an_accepted_run(tiny_tokenizer):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    plain, _ = _run(model, tiny_tokenizer, ids, GREEDY, tokenizer=tiny_tokenizer)
    stop = plain[1].text[len(plain[1].text) // 2 :][:3]  # text a late part of the answer holds
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, stop=(stop,))
    a, b = _same(model, tiny_tokenizer, ids, params, tokenizer=tiny_tokenizer)
    assert [(r.text, r.finish_reason) for r in b] == [(r.text, r.finish_reason) for r in a]
    assert b[1].finish_reason == "stop" and stop not in b[1].text


def test_rejected_tokens_are_never_hashed_into_the_prefix_cache(tiny_tokenizer):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    config = EngineConfig(max_slots=3, max_len=160, block_size=4, **SPEC)
    engine = Engine(model, None, config)
    got = engine.generate(ids, GREEDY)
    stats = engine.stats()
    assert stats.spec_proposed > stats.spec_accepted > 0  # some were rejected
    pool = engine.pool
    # every hash the pool holds names a prefix of a request's accepted tokens
    allowed = set()
    for prompt, res in zip(ids, got, strict=True):
        tokens = prompt + res.token_ids
        allowed.update(pool.chain(tokens, None, len(tokens) // pool.block_size))
    held = {b.hash for b in pool._blocks if b.hash is not None}
    assert held and held <= allowed
    # a request with one answer's prompt and output finds its blocks in the cache
    again = engine.generate([ids[0] + got[0].token_ids[:20]], GREEDY)
    assert engine.stats().prefix_hits > 0
    assert again[0].token_ids[:8] == got[0].token_ids[20:28]


def test_greedy_tokens_equal_under_a_grammar_beside_a_plain_row(tiny_tokenizer):
    pytest.importorskip("llguidance")
    from onegpu.infer.requests import Constraint

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    # a grammar whose answers repeat: proposals from earlier words are allowed and accepted
    words = Constraint("regex", r"(cat|sat|mat|on|the)( (cat|sat|mat|on|the)){4,40}\.")
    guided = SamplingParams(max_new_tokens=48, constraint=words)
    params = [guided, GREEDY, guided]
    plain, spec = _same(model, tiny_tokenizer, ids, params, tokenizer=tiny_tokenizer, ngram_min=1)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
