"""logit_bias and min_tokens in the decode engine, on the device with the other sampling tensors:
greedy tokens equal a reference loop that adds the bias to the model's own logits (a full forward
per token), over several decode steps between read-backs; a bias of +100 holds a sampled row
too; a row without one in the same batch gets its tokens as alone; min_tokens holds EOS back
until that many tokens are out, then lets it end the request."""

from __future__ import annotations

import pytest
import torch

from families import tiny_family_model
from onegpu.errors import ConfigError
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

NEW = 12


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer):
    return tiny_tokenizer("def add(a, b):")["input_ids"]


def reference(model, prompt: list[int], bias: dict[int, float]) -> list[int]:
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    return out


def engine(model, sync_every: int = 1) -> Engine:
    return Engine(model, None, EngineConfig(max_slots=2, max_len=64, sync_every=sync_every))


@pytest.fixture(scope="module")
def expected(llama, prompt):
    """(the plain greedy answer, a bias, the reference loop's answer under it)."""
    plain = reference(llama, prompt, {})
    # push the model's own first choices down and two others up: the answer must change
    bias = {plain[0]: -100.0, plain[1]: -30.0, 7: 6.5, 11: 4.0}
    return plain, bias, reference(llama, prompt, bias)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_greedy_biased_tokens_equal_the_reference_loop(llama, prompt, expected, sync_every):
    plain, bias, biased = expected
    params = SamplingParams(NEW, ignore_eos=True, logit_bias=tuple(sorted(bias.items())))
    unbiased = SamplingParams(NEW, ignore_eos=True)
    got = engine(llama, sync_every).generate([prompt, prompt], [params, unbiased])
    assert got[0].token_ids == biased and biased != plain
    assert got[1].token_ids == plain  # the row beside it is not touched


def test_a_full_bias_holds_a_sampled_row(llama, prompt):
    params = SamplingParams(
        NEW, temperature=1.0, seed=3, ignore_eos=True, logit_bias=((42, 100.0),)
    )
    assert engine(llama, 4).generate([prompt], params)[0].token_ids == [42] * NEW


def test_min_tokens_holds_eos_back_until_then(llama, prompt, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    to_eos = ((eos, 100.0),)  # the model would end at once
    early = engine(llama).generate([prompt], SamplingParams(NEW, logit_bias=to_eos))[0]
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    for sync_every in (1, 4):
        params = SamplingParams(NEW, logit_bias=to_eos, min_tokens=5)
        held = engine(llama, sync_every).generate([prompt], params)[0]
        assert held.token_ids[-1] == eos and len(held.token_ids) == 6, held.token_ids
        assert eos not in held.token_ids[:5] and held.finish_reason == "stop"


def test_bad_bias_settings_are_refused_by_name(llama, prompt):
    with pytest.raises(ConfigError, match="logit_bias"):
        SamplingParams(NEW, logit_bias=((3, 101.0),)).check()
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(4, min_tokens=5).check()
    eng = engine(llama)
    [res] = eng.generate([prompt], SamplingParams(NEW, logit_bias=((10**6, 1.0),)))
    assert res.finish_reason == "error"  # that request alone: the engine goes on
    assert eng.generate([prompt], SamplingParams(2, ignore_eos=True))[0].finish_reason == "length"
