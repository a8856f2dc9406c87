"""JSON schemas as OpenAI and vLLM treat them: a pydantic model's schema (an Enum, a nested model
and a list, all through ``$defs``) compiles whole in every forced-call form and its sampled calls
parse as the model, as does one with anyOf, a pattern, a format and an array's bounds; objects
that leave ``additionalProperties`` out are closed (and open again with ``--json_schema_strict
false``); every tool's schema is checked when the request arrives, whatever its tool_choice, a
fault named by tool and path."""

from __future__ import annotations

import datetime
import enum
import json
from typing import Annotated, Optional

import pytest
from pydantic import BaseModel, Field

from onegpu.infer.requests import Constraint
from onegpu.serve.json_schemas import SchemaFault, check_schema, closed, rebased
from onegpu.serve.messages import Tool
from serve_fakes import LiveApp, make_service
from test_serve_api import chat, error_of, post
from test_serve_tools import HERMES_TEMPLATE, WEATHER


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Place(BaseModel):
    city: str
    country: str


class Forecast(BaseModel):
    unit: Unit
    place: Place
    days: list[int]


def forecast_tool(name: str = "forecast") -> Tool:
    params = Forecast.model_json_schema()
    assert "$defs" in params  # pydantic writes the Enum and the nested model there
    return Tool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": params}}
    )


def test_closed_closes_listed_objects_everywhere_and_leaves_data_and_free_maps_alone():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "e": {"enum": [{"properties": {"x": 1}}], "default": {"properties": {}}},
            "l": {"type": "array", "items": {"properties": {"c": {"type": "string"}}}},
        },
        "$defs": {"D": {"anyOf": [{"properties": {"d": {}}}, {"type": "null"}]}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["l"]["items"]["additionalProperties"] is False
    assert out["$defs"]["D"]["anyOf"][0]["additionalProperties"] is False
    assert props["free"] == {"type": "object"}  # a free mapping stays free
    assert props["open"]["additionalProperties"] is True  # what the schema says wins
    assert props["e"] == schema["properties"]["e"]  # enum values and defaults are data
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_rebased_refs_point_below_their_new_place():
    moved = rebased({"$ref": "#/$defs/A", "$defs": {"A": {"items": {"$ref": "#"}}}}, "/$defs/t")
    assert moved["$ref"] == "#/$defs/t/$defs/A"
    assert moved["$defs"]["A"]["items"]["$ref"] == "#/$defs/t"


@pytest.mark.parametrize(
    "schema, path",
    [
        ({"type": "object", "properties": {"unit": {"type": "kelvin"}}}, "properties.unit.type"),
        ({"properties": {"n": {"$ref": "#/$defs/Nope"}}}, "properties.n.$ref"),
        ({"properties": {"s": {"type": "string", "pattern": "(["}}}, "properties.s.pattern"),
        ({"type": "array", "minItems": -1}, "minItems"),
    ],
)
def test_check_schema_names_the_path_of_the_fault(schema, path):
    pytest.importorskip("jsonschema")
    with pytest.raises(SchemaFault) as fault:
        check_schema(schema)
    assert fault.value.path == path
    check_schema(Forecast.model_json_schema())  # pydantic's own: no fault


# ------------------------------------------------------------------------ grammars (llguidance)
@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    pytest.importorskip("llguidance")
    from onegpu.infer.constraints import Grammars

    return Grammars(tiny_tokenizer)


def _read(fmt, name, text):
    from onegpu.serve.tools import reader

    r = reader(fmt, name)
    content, calls = r.feed(text)
    rest, more = r.finish()
    return content + rest, calls + more


@pytest.mark.parametrize("fmt", ["hermes", "llama3", None])
@pytest.mark.parametrize("named", [True, False])
def test_a_pydantic_schema_with_defs_compiles_in_every_forced_form_and_parses_as_the_model(
    grammars, tiny_tokenizer, fmt, named
):
    """Nested under a wrapper, pydantic's '#/$defs/...' references pointed nowhere (llguidance:
    "Pointer '/$defs/Unit' does not exist"): they are rebased, and random allowed tokens make a
    call whose arguments validate as the pydantic model."""
    from onegpu.serve.tools import forced_call
    from test_constraints import sample

    tools = [forecast_tool(), Tool.model_validate(WEATHER)]
    name = "forecast" if named else None
    constraint = forced_call(fmt, tools, name, strict=True, parallel=False)
    grammars.check(constraint)
    for seed in range(3):
        text, ended = sample(grammars, tiny_tokenizer, constraint, seed)
        assert ended, text
        content, calls = _read(fmt or "json", name if fmt is None else None, text)
        assert content == "" and len(calls) == 1, text
        if calls[0].name == "forecast":
            Forecast.model_validate_json(calls[0].arguments)
        else:
            assert calls[0].name == "weather" and not named


def _mask_allows(grammars, tokenizer, constraint: Constraint, prefix: str, piece: str) -> bool:
    """Whether, after ``prefix``, the grammar allows the token(s) that start ``piece``."""
    from onegpu.infer.constraints import allocate_bitmask
    from onegpu.infer.logit_rules import unpack_bitmask

    matcher = grammars.matcher(constraint)
    for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
        assert matcher.accept(t), prefix
    bitmask = allocate_bitmask(1, len(tokenizer))
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, len(tokenizer))[0]
    starts = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).startswith(piece)]
    return bool(allowed[starts].any())


class Booking(BaseModel):
    """The rest of the list a schema compiles whole with: anyOf (an Optional), a string pattern,
    a string format, an array's minItems/maxItems (of an Enum, through $defs)."""

    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    day: datetime.date
    note: Optional[Annotated[str, Field(max_length=8)]] = None
    units: Annotated[list[Unit], Field(min_length=1, max_length=2)]
    place: Place


def test_anyof_pattern_format_and_array_bounds_compile_and_every_answer_validates(
    grammars, tiny_tokenizer
):
    """As response_format and as a forced call's arguments: random allowed tokens end in JSON
    that validates against the schema (formats checked) and parses as the pydantic model."""
    jsonschema = pytest.importorskip("jsonschema")
    from onegpu.serve.prepare import request_constraint
    from onegpu.serve.schemas import ChatRequest
    from onegpu.serve.tools import forced_call
    from test_constraints import sample

    schema = Booking.model_json_schema()
    assert {"anyOf", "pattern", "format", "minItems", "maxItems"} <= set(
        json.dumps(schema).split('"')
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "booking", "schema": schema}}
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "book", "parameters": schema}}
    )
    constraints = [
        request_constraint(ChatRequest.model_validate(chat(response_format=fmt)), True),
        forced_call(None, [tool], "book", strict=True, parallel=False),
    ]
    check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for constraint in constraints:
        grammars.check(constraint)
        for seed in range(3):
            text, ended = sample(grammars, tiny_tokenizer, constraint, seed)
            assert ended, text
            check.validate(json.loads(text))
            Booking.model_validate_json(text)


@pytest.mark.parametrize("strict", [True, False])
def test_a_schema_without_additional_properties_allows_no_other_key_unless_strict_is_off(
    grammars, tiny_tokenizer, strict
):
    """After ``{"sky": "x"`` a closed object may only end: no ``,`` to start an invented key.
    With --json_schema_strict false the schema's own default (other keys allowed) holds."""
    from onegpu.serve.prepare import request_constraint
    from onegpu.serve.schemas import ChatRequest

    sky = {"type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": sky}}
    for body in ({"response_format": fmt}, {"guided_json": sky}):
        req = ChatRequest.model_validate(chat(**body))
        constraint = request_constraint(req, strict)
        assert _mask_allows(grammars, tiny_tokenizer, constraint, '{"sky": "x"', ",") is not strict
        assert _mask_allows(grammars, tiny_tokenizer, constraint, '{"sky": "x"', "}")


def test_grammar_kinds_lark_gbnf_and_structured_outputs_compile(grammars, tiny_tokenizer):
    from test_constraints import sample

    for grammar in ('start: "yes" | "no" | "ok" NUM\nNUM: /[0-9]{2}/', 'root ::= "yes" | "no"'):
        for seed in range(3):
            text, ended = sample(grammars, tiny_tokenizer, Constraint("grammar", grammar), seed)
            assert ended and (text in ("yes", "no") or (text[:2] == "ok" and text[2:].isdigit()))
    from onegpu.infer.constraints import ConstraintError

    with pytest.raises(ConstraintError, match="unknown name"):
        grammars.check(Constraint("grammar", "start: nothing_here"))


# ------------------------------------------------------------------------ on arrival (HTTP)
@pytest.fixture(scope="module")
def live(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = HERMES_TEMPLATE
    service, engine = make_service(tok, lambda p, s: "It is sunny.", tool_format="hermes")
    try:
        from onegpu.infer.constraints import Grammars

        service.check_constraint = Grammars(tok).check
    except Exception:  # noqa: BLE001 - without llguidance the metaschema check still runs
        pass
    app = LiveApp(service)
    app.engine = engine
    yield app
    app.stop()


def _tool(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_every_tool_schema_is_checked_on_arrival_whatever_the_tool_choice(live, choice):
    """Before, a malformed schema under tool_choice auto was accepted (only a forced call
    compiled it)."""
    pytest.importorskip("jsonschema")
    bad = _tool("convert", {"type": "object", "properties": {"unit": {"type": "kelvin"}}})
    extra = {} if choice is None else {"tool_choice": choice}
    sent = len(live.engine.seen)
    err = error_of(post(live, "/v1/chat/completions", chat(tools=[WEATHER, bad], **extra)), 400)
    assert err["code"] == "invalid_tool_schema"
    assert err["param"] == "tools.1.function.parameters.properties.unit.type"
    assert "'convert'" in err["message"] and "properties.unit.type" in err["message"]
    dangling = _tool("find", {"properties": {"n": {"$ref": "#/$defs/Nope"}}})
    err = error_of(post(live, "/v1/chat/completions", chat(tools=[dangling], **extra)), 400)
    assert err["param"] == "tools.0.function.parameters.properties.n.$ref"
    assert "'find'" in err["message"] and "#/$defs/Nope" in err["message"]
    assert len(live.engine.seen) == sent  # refused before any engine work
    good = post(live, "/v1/chat/completions", chat(tools=[WEATHER, forecast_tool().model_dump()]))
    assert good.status_code == 200, good.text
