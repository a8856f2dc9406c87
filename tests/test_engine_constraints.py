"""Structured output in the decode engine: a random tiny model, which never writes JSON by itself,
answers every one of a set of fuzzed JSON schemas with JSON that validates, a regex with a match
and a choice with one of the choices, greedy and sampled; a request its limit cuts short ends
with "length"; rows without a grammar get, bit for bit, the tokens they get alone; the compiled
step gives the eager tokens; a grammar that refuses a token, or does not compile, fails its
request alone; a request preempted and computed again keeps its place in its grammar."""

from __future__ import annotations

import json
import random
import re

import pytest

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import Constraint, SamplingParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "The quick brown", "x = [1, 2"]
LIMIT = 160  # tokens: more than the longest answer the schemas below allow, char by char
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ["yes", "no", 'say "maybe"']


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


def engine(model, tokenizer, grammars=None, **kw) -> Engine:
    config = EngineConfig(**{"max_slots": 4, "max_len": 256, **kw})
    return Engine(model, tokenizer, config, grammars=grammars)


def field_schema(rng: random.Random, depth: int) -> dict:
    """A bounded field: every answer has a bounded length, so a complete one fits in LIMIT."""
    kinds = ["string", "integer", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "x y", 3, None, True], rng.randint(1, 3))}
    if kind == "array":
        items = field_schema(rng, depth + 1)
        return {"type": "array", "items": items, "maxItems": rng.randint(1, 3)}
    return object_schema(rng, depth + 1)


def object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "n", "ok", "sub"], rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: field_schema(rng, depth) for n in names},
        "required": [n for n in names if rng.random() < 0.8],
        "additionalProperties": False,
    }


def as_json(schema: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


def test_every_answer_to_fuzzed_json_schemas_validates(llama, tiny_tokenizer, ids):
    """16 seeded schemas (objects with required string/integer/boolean/enum/array fields and
    nested objects), greedy and sampled, 4 requests at a time: each answer is complete JSON that
    its schema accepts. Unconstrained, the same model writes no JSON at all."""
    rng = random.Random(0)
    schemas = [object_schema(rng) for _ in range(16)]
    params = [
        SamplingParams(
            max_new_tokens=LIMIT,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            constraint=as_json(s),
        )
        for i, s in enumerate(schemas)
    ]
    prompts = [ids[i % len(ids)] for i in range(len(schemas))]
    got = engine(llama, tiny_tokenizer).generate(prompts, params)
    for schema, res in zip(schemas, got, strict=True):
        assert res.finish_reason == "stop", (schema, res.text)
        jsonschema.validate(json.loads(res.text), schema)
    free = engine(llama, tiny_tokenizer).generate(prompts[:2], SamplingParams(max_new_tokens=40))
    for res in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(res.text)


def test_any_json_object_a_regex_and_a_choice(llama, tiny_tokenizer, ids):
    """Any JSON object (an unbounded grammar: two seeded draws that end within LIMIT tokens, long
    ones); a regex and a choice, greedy and sampled."""
    anything = Constraint("json_schema", "")
    bounded = [Constraint("regex", REGEX), Constraint("choice", json.dumps(CHOICES))]
    params = [
        SamplingParams(max_new_tokens=LIMIT, temperature=1.0, seed=s, constraint=anything)
        for s in (2, 3)
    ]
    params += [
        SamplingParams(max_new_tokens=LIMIT, temperature=t, seed=s, constraint=c)
        for c in bounded
        for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))
    ]
    prompts = [ids[1], ids[3]] + [ids[0]] * (len(params) - 2)
    got = engine(llama, tiny_tokenizer).generate(prompts, params)
    for p, res in zip(params, got, strict=True):
        assert res.finish_reason == "stop", res.text
        if p.constraint is anything:
            assert isinstance(json.loads(res.text), dict) and len(res.token_ids) > 50
        elif p.constraint.kind == "regex":
            assert re.fullmatch(REGEX, res.text), res.text
        else:
            assert res.text in CHOICES


def test_an_answer_its_limit_cuts_short_ends_with_length(llama, tiny_tokenizer, ids):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}}
    schema["required"] = ["s"]
    [res] = engine(llama, tiny_tokenizer).generate(
        [ids[0]], SamplingParams(max_new_tokens=8, constraint=as_json(schema))
    )
    assert res.finish_reason == "length" and len(res.token_ids) == 8
    assert res.text.startswith('{"s": "')


@pytest.mark.parametrize("sample", [False, True])
def test_rows_without_a_grammar_get_their_solo_tokens_beside_constrained_ones(
    llama, tiny_tokenizer, ids, sample
):
    """Two constrained and two free rows in one batch (one token a step while the grammars run,
    several between read-backs after): the free rows' tokens are theirs alone, bit for bit."""
    free = [
        SamplingParams(max_new_tokens=24, temperature=1.0 if sample else 0.0, seed=s)
        for s in (5, 6)
    ]
    alone = [
        engine(llama, tiny_tokenizer, max_slots=1, sync_every=4).generate([p], f)[0].token_ids
        for p, f in zip(ids[2:], free, strict=True)
    ]
    schema = object_schema(random.Random(1))
    guided = [
        SamplingParams(max_new_tokens=LIMIT, constraint=as_json(schema)),
        SamplingParams(max_new_tokens=LIMIT, constraint=Constraint("regex", REGEX)),
    ]
    mixed = engine(llama, tiny_tokenizer, sync_every=4).generate(ids, guided + free)
    assert [r.token_ids for r in mixed[2:]] == alone
    jsonschema.validate(json.loads(mixed[0].text), schema)
    assert re.fullmatch(REGEX, mixed[1].text)


def test_a_constrained_request_is_read_back_after_every_token(llama, tiny_tokenizer, ids):
    """While a grammar runs the batch steps once between read-backs (its free neighbour too);
    after it, sync_every steps again."""
    e = engine(llama, tiny_tokenizer, sync_every=8)
    guided = e.submit(
        ids[0], SamplingParams(max_new_tokens=LIMIT, constraint=Constraint("regex", REGEX))
    )
    free = e.submit(ids[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    ended = False
    while not ended:
        for u in e.step():
            assert len(u.token_ids) <= 1
            ended = ended or (u.request_id == guided and u.finished)
    assert [len(u.token_ids) for u in e.step() if u.request_id == free] == [8]


def test_the_compiled_step_masks_as_the_eager_one(llama, tiny_tokenizer, ids):
    """aot_eager traces the graph inductor would compile, without its C++ build time."""
    params = [
        SamplingParams(max_new_tokens=LIMIT, constraint=as_json(object_schema(random.Random(3)))),
        SamplingParams(
            max_new_tokens=LIMIT, temperature=1.0, seed=4, constraint=Constraint("regex", REGEX)
        ),
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=20),
    ]
    want = [r.token_ids for r in engine(llama, tiny_tokenizer).generate(ids, params)]
    compiled = engine(llama, tiny_tokenizer, compile="on", compile_backend="aot_eager")
    assert [r.token_ids for r in compiled.generate(ids, params)] == want
    assert any(needs.constraints for _, _, needs in compiled.stats().compiled_shapes)


@pytest.mark.slow  # an inductor compile of the masked step (and the unmasked one): ~20 CPU s
def test_an_inductor_compiled_step_masks_as_the_eager_one(llama, tiny_tokenizer, ids):
    """The step as a GPU server compiles it: the bitmask unpacked and applied inside the graph."""
    params = [
        SamplingParams(max_new_tokens=LIMIT, constraint=Constraint("regex", REGEX)),
        SamplingParams(
            max_new_tokens=LIMIT, temperature=1.0, seed=4, constraint=Constraint("regex", REGEX)
        ),
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=20),
    ]
    want = [r.token_ids for r in engine(llama, tiny_tokenizer).generate(ids, params)]
    compiled = engine(llama, tiny_tokenizer, compile="on", fixed_shape=True)
    assert [r.token_ids for r in compiled.generate(ids, params)] == want
    assert any(needs.constraints for _, _, needs in compiled.stats().compiled_shapes)


class Refusing:
    """A grammar that allows every token and refuses its request's ``at``-th one."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row].fill_(-1)

    def accept(self, token: int) -> bool:
        self.seen += 1
        return self.seen < self.at

    def terminated(self) -> bool:
        return False

    def rollback(self, tokens: int) -> None:
        self.seen -= tokens


class RefusingGrammars:
    def matcher(self, constraint: Constraint):
        return Refusing(int(constraint.value))


def test_a_grammar_that_refuses_a_token_or_does_not_compile_fails_its_request_alone(
    llama, tiny_tokenizer, ids
):
    e = engine(llama, tiny_tokenizer)
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [engine(llama, tiny_tokenizer).generate([p], plain)[0].token_ids for p in ids[1:3]]
    bad = e.submit(ids[0], SamplingParams(max_new_tokens=12, constraint=Constraint("regex", "(")))
    rid = [e.submit(p, plain) for p in ids[1:3]]
    got: dict = {}
    while e.has_work():
        for u in e.step():
            got.setdefault(u.request_id, []).append(u)
    [failure] = got[bad]
    assert failure.finish_reason == "error" and "does not compile" in failure.error
    assert [[t for u in got[r] for t in u.token_ids] for r in rid] == alone
    e = engine(llama, tiny_tokenizer, grammars=RefusingGrammars())  # the compiler a caller gives
    refused = e.submit(
        ids[0], SamplingParams(max_new_tokens=12, constraint=Constraint("regex", "4"))
    )
    rid = [e.submit(p, plain) for p in ids[1:3]]
    got = {}
    while e.has_work():
        for u in e.step():
            got.setdefault(u.request_id, []).append(u)
    assert [u.finish_reason for u in got[refused]][-1] == "error"
    assert sum(len(u.token_ids) for u in got[refused]) == 3  # the 4th token was refused
    assert "does not allow the sampled token" in got[refused][-1].error
    assert [[t for u in got[r] for t in u.token_ids] for r in rid] == alone
    stats = e.stats()
    assert e.free_slots() == 4 and stats.running == stats.waiting == 0
    assert stats.kv_positions_used == 0


def test_a_preempted_request_keeps_its_place_in_its_grammar(llama, tiny_tokenizer, ids):
    """A pool far too small preempts; a constrained request computed again from its prompt and
    output goes on from where its grammar was: every answer still validates."""
    rng = random.Random(7)
    schemas = [object_schema(rng) for _ in range(4)]
    params = [SamplingParams(max_new_tokens=110, constraint=as_json(s)) for s in schemas]
    tight = engine(llama, tiny_tokenizer, max_len=128, num_blocks=9)  # 8 blocks of 16 to share
    got = tight.generate(ids, params)
    assert tight.stats().preemptions > 0
    for schema, res in zip(schemas, got, strict=True):
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), schema)
