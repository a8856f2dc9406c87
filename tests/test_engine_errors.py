"""A request that fails in the engine fails alone: an error while its prompt is computed (or its
sampling set up, or its text made) ends that request with ``Update(finished=True,
finish_reason="error", error=...)``, gives back its row and blocks and forgets the prefix blocks
it was to fill; every other request, decoding or computing its prompt in the same forward, gets
the tokens it gets alone — through the HTTP server too, where the failed caller gets a 500."""

from __future__ import annotations

import copy

import pytest

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
MARK = 7  # a token that makes the injected forward fail


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


def alone(model, prompt, params=GREEDY) -> list[int]:
    return (
        Engine(model, None, EngineConfig(max_slots=1, max_len=64))
        .generate([prompt], params)[0]
        .token_ids
    )


def fail_forwards_with(model, fails) -> tuple:
    """A copy of ``model`` whose prompt forwards (more than one token a row) raise where ``fails(ids
    of the forward's rows)`` says so (a fault of one request's own prompt, as a bad input or an
    out-of-memory would be), and the row count of each prompt forward."""
    faulty, calls = copy.deepcopy(model), []

    def check(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # a prompt's piece; a decode step feeds one token a row
            rows = ids.tolist()
            calls.append(len(rows))
            if fails(rows):
                raise RuntimeError("injected fault")

    faulty.register_forward_pre_hook(check, with_kwargs=True)
    return faulty, calls


def released(engine: Engine) -> bool:
    """No row and no block held: what an engine with nothing to do gives back."""
    stats = engine.stats()
    return not engine.has_work() and stats.running == 0 and stats.kv_positions_used == 0


def drive(engine: Engine) -> dict:
    got: dict = {}
    while engine.has_work():
        for u in engine.step():
            got.setdefault(u.request_id, []).append(u)
    return got


def tokens(updates) -> list[int]:
    return [t for u in updates for t in u.token_ids]


def test_a_prompt_that_fails_ends_its_request_alone(llama):
    """One decoding neighbour and two prompts computed with it in one forward (same length): the
    marked one fails; the forward is run again a piece at a time, the others' tokens are theirs
    alone, and the failed request's row and blocks are free again."""
    faulty, calls = fail_forwards_with(llama, lambda rows: any(MARK in r for r in rows))
    engine = Engine(faulty, None, EngineConfig(max_slots=4, max_len=64, sync_every=4))
    early = engine.submit([20, 21, 22], GREEDY)
    first = engine.step()  # its prompt computed: it decodes from now on
    bad, good = [30, MARK, 31, 32], [40, 41, 42, 43]
    rid_bad, rid_good = engine.submit(bad, GREEDY), engine.submit(good, GREEDY)
    got = drive(engine)
    got[early] = first + got[early]
    assert calls == [1, 2, 1, 1]  # the neighbour's prompt; the pair, then each alone
    [failure] = got[rid_bad]
    assert failure.finished and failure.finish_reason == "error" and failure.token_ids == []
    assert "injected fault" in failure.error
    assert tokens(got[rid_good]) == alone(llama, good)
    assert tokens(got[early]) == alone(llama, [20, 21, 22])
    assert all(u.error is None for r in (early, rid_good) for u in got[r])
    assert released(engine)


def test_a_failed_prompt_is_not_found_in_the_cache_by_a_later_request(llama):
    """The blocks the failed forward was to fill were registered when it was planned: they are
    forgotten, so the same prompt, asked again, is computed (not read from garbage) and right."""
    once = iter([True])
    faulty, _ = fail_forwards_with(llama, lambda rows: next(once, False))
    engine = Engine(faulty, None, EngineConfig(max_slots=2, max_len=64, block_size=4))
    prompt = list(range(20, 33))  # three full blocks and one token
    failed = engine.generate([prompt], GREEDY)[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    again = engine.generate([prompt], GREEDY)[0]
    assert again.token_ids == alone(llama, prompt) and engine.stats().prefix_hits == 0


def test_a_request_whose_sampling_cannot_be_set_up_fails_alone(llama):
    """A request whose settings the rows refuse when it takes one (a logit_bias id past the
    model's vocabulary, which the server checks first and a library caller may not) fails
    alone: its row and blocks go back, the neighbour's answer is as alone."""
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64))
    a, b = [20, 21, 22], [40, 41, 42]
    vocab = llama.get_output_embeddings().weight.shape[0]
    broken = SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=((vocab + 5, 1.0),))
    got = engine.generate([a, b], [broken, GREEDY])
    assert got[0].finish_reason == "error" and got[0].token_ids == []
    assert got[1].token_ids == alone(llama, b)
    assert released(engine)


class RefusesToken:
    """A tokenizer that cannot make the text of one token (a vocabulary entry its decoder
    refuses): its ``decode`` raises for any ids that hold ``token``. Only what the engine asks
    of a tokenizer without a fast backend (so its text is made by ``decode``)."""

    def __init__(self, tokenizer, token: int):
        self.tokenizer, self.token = tokenizer, token
        self.eos_token_id = tokenizer.eos_token_id

    def decode(self, ids, **kwargs) -> str:
        if self.token in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, f"token {self.token} refused")
        return self.tokenizer.decode(ids, **kwargs)


def test_a_request_whose_text_cannot_be_made_fails_alone(llama, tiny_tokenizer):
    """An error in one request's own bookkeeping after its tokens came back (its detokenizer
    here, refusing a token the request decodes after its first) ends it alone; the neighbour
    decoding in the same steps goes on."""
    a, b = [20, 21, 22], [40, 41, 42]
    want_a, want_b = alone(llama, a), alone(llama, b)
    # a token of a's answer past its first that b's answer never holds: a's steps fail there
    refused = next(t for t in want_a[1:] if t not in want_b and t != want_a[0])
    tokenizer = RefusesToken(tiny_tokenizer, refused)
    engine = Engine(llama, tokenizer, EngineConfig(max_slots=2, max_len=64, sync_every=2))
    rid_a, rid_b = engine.submit(a, GREEDY), engine.submit(b, GREEDY)
    got = drive(engine)
    assert got[rid_a][-1].finish_reason == "error" and "refused" in got[rid_a][-1].error
    sent = tokens(got[rid_a])  # a's own tokens, its first at least, none from the refused on
    assert sent and sent == want_a[: len(sent)] and len(sent) <= want_a.index(refused)
    assert got[rid_b][-1].finish_reason == "length" and tokens(got[rid_b]) == want_b
    assert released(engine)


def test_a_request_reading_a_failed_prompts_blocks_in_the_same_step_fails_with_it(llama):
    """Two requests with one prefix arrive together: the second is admitted in the same step,
    reading the blocks the first computes. The first's forward fails: the second cannot be
    answered from those blocks and fails too; an unrelated third goes on, and the second,
    asked again, is computed afresh and right."""
    faulty, _ = fail_forwards_with(llama, lambda rows: any(r[-1] == MARK for r in rows))
    engine = Engine(faulty, None, EngineConfig(max_slots=3, max_len=64, block_size=4))
    prefix = list(range(20, 28))  # two full blocks
    first, second, third = prefix + [MARK], prefix + [50, 51], [60, 61, 62]
    got = engine.generate([first, second, third], GREEDY)
    assert [r.finish_reason for r in got] == ["error", "error", "length"]
    assert engine.stats().prefix_hits == 8  # the second did find the first's blocks
    assert got[2].token_ids == alone(llama, third)
    assert engine.generate([second], GREEDY)[0].token_ids == alone(llama, second)
    assert released(engine)


def test_through_the_server_the_failed_request_gets_a_500_and_the_others_their_answers(
    llama, tiny_tokenizer
):
    """The decode engine behind the HTTP server (in-process): the caller whose prompt fails gets
    OpenAI's error with the engine's reason, the callers sharing its steps their answers."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from onegpu.serve.adapters import ServedModels
    from onegpu.serve.app import Service
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler
    from serve_fakes import LiveApp

    faulty, _ = fail_forwards_with(llama, lambda rows: any(MARK in r for r in rows))
    engine = Engine(faulty, tiny_tokenizer, EngineConfig(max_slots=4, max_len=64, sync_every=2))
    metrics = Metrics()
    service = Service(
        Scheduler(engine, 8, metrics), tiny_tokenizer, ServedModels("tiny"), metrics, 64
    )
    prompts = [[30, MARK, 31, 32], [40, 41, 42, 43], [50, 51, 52, 53]]
    live = LiveApp(service)
    try:

        def ask(prompt):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, prompts))
    finally:
        live.stop()
    assert (
        replies[0].status_code == 500 and "injected fault" in replies[0].json()["error"]["message"]
    )
    reference = Engine(llama, tiny_tokenizer, EngineConfig(max_slots=1, max_len=64))
    for prompt, reply in zip(prompts[1:], replies[1:], strict=True):
        assert reply.status_code == 200, reply.text
        want = reference.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert reply.json()["choices"][0]["text"] == want[0].text
