"""Constrained decoding (constrain.py): the incremental JSON / JSON-schema machine against the json module and
hand-checked cases, and the sampler under a schema with synth:tiny's real vocabulary."""
from __future__ import annotations

import functools
import json
import random
import re

import pytest
import torch
from conftest import byte_verdict, random_json

import hybridmoe
from hybridmoe.constrain.json_machine import JsonMachine
from hybridmoe.constrain.json_schema import SchemaError, check_schema
from hybridmoe.constrain.tokens import THINK_END, TokenConstraint
from hybridmoe.generate import Sampler, SamplerSettings


def verdict(schema, text: str | bytes) -> str:
    return byte_verdict(JsonMachine(schema), text)


PET = {"anyOf": [                                  # a discriminated union, as Pydantic writes Union[Cat, Dog]
    {"type": "object", "additionalProperties": False, "required": ["kind", "meow"],
     "properties": {"kind": {"const": "cat"}, "meow": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["kind", "bark"],
     "properties": {"kind": {"const": "dog"}, "bark": {"type": "integer", "minimum": 0, "maximum": 9}}}]}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 2},
                         "ratio": {"type": ["number", "null"], "exclusiveMaximum": 1}}}


@pytest.mark.parametrize("schema, text, want", [
    (True, '{"a": [1, -2.5e+3, "x\\u00e9\\n", true, false, null], "b": {}}', "ok"),
    (True, '{\n  "a": 1,\n  "b": [\n    2\n  ]\n}\n', "ok"),                    # json.dumps(indent=2), newline
    (True, "12", "ok"), (True, "-0.5E-7", "ok"), (True, '"\u00e9t\u00e9"', "ok"), (True, "[]", "ok"),
    (True, '{"a": ', "prefix"), (True, "tr", "prefix"), (True, '"abc', "prefix"),
    (True, "01", "refused"), (True, "1.", "prefix"), (True, "{,}", "refused"), (True, "[1,]", "refused"),
    (True, '{"a" 1}', "refused"), (True, "nul1", "refused"), (True, '"a\x01"', "refused"),
    (True, '{"a": 1, "a": 2}', "refused"),                                        # a key twice
    (True, "{}  ", "refused"), (True, "{}\t", "refused"),                         # llama.cpp's whitespace
    (True, "{}\n" + " " * 20, "ok"), (True, "{}\n" + " " * 21, "refused"),
    (PERSON, '{"name": "Ann", "age": 41}', "ok"),
    (PERSON, '{"age": 41, "name": "Ann", "tags": ["b", 3], "ratio": null}', "ok"),
    (PERSON, '{"age": 41, "name": "Ann", "ratio": 0.5}', "ok"),
    (PERSON, '{"name": "Ann"}', "refused"),                                       # age is required
    (PERSON, '{"name": "Ann", "age": 41, "x": 1}', "refused"),                    # no other keys
    (PERSON, '{"nam', "prefix"), (PERSON, '{"nick', "refused"),
    (PERSON, '{"name": "", "age": 1}', "refused"),                                # minLength
    (PERSON, '{"name": "Annabelle", "age": 1}', "refused"),                       # maxLength
    (PERSON, '{"name": "A", "age": 151}', "refused"), (PERSON, '{"name": "A", "age": 1000', "refused"),
    (PERSON, '{"name": "A", "age": -1', "refused"), (PERSON, '{"name": "A", "age": 1.5}', "refused"),
    (PERSON, '{"name": "A", "age": 1, "tags": ["c"]}', "refused"),
    (PERSON, '{"name": "A", "age": 1, "tags": ["a", "b", "a"]}', "refused"),    # maxItems
    (PERSON, '{"name": "A", "age": 1, "ratio": 1}', "refused"),                  # exclusiveMaximum
    (PERSON, '{"name": "A", "age": 1, "ratio": "x"}', "refused"),
    (PERSON, "[1]", "refused"),
    ({"$defs": {"p": PERSON}, "type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1},
     '[{"name": "B", "age": 2}]', "ok"),
    ({"type": "array", "minItems": 1}, "[]", "refused"),
    ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, '"ab"', "ok"),
    ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, '"abc"', "refused"),
    ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, "7", "ok"),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"const": "x"}}, "required": ["b"]}], "additionalProperties": False},
     '{"b": "x", "a": 3}', "ok"),
    (PET, '{"kind": "cat", "meow": true}', "ok"), (PET, '{"kind": "dog", "bark": 3}', "ok"),
    (PET, '{"kind": "cat", "bark": 1}', "refused"), (PET, '{"kind": "d', "prefix"), (PET, '{"kind": "dog"}', "refused"),
    ({"anyOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 10}]}, "3", "ok"),
    ({"anyOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 10}]}, "7", "prefix"),
    ({"anyOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 10}]}, "12", "ok"),
    ({"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0.5}]}}},
     '{"v": 1}', "ok"),
    ({"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0.5}]}}},
     '{"v": 0.2}', "refused"),
    ({"type": "array", "items": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "maxLength": 3}]}},
     '["2024-01-01", "abc"]', "ok"),
    ({"type": "array", "items": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "maxLength": 3}]}},
     '["abcd"]', "refused"),
    ({"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, '[1, "a"]', "ok"),
    ({"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, '[1, "a", 2]', "refused"),
    ({"enum": [1, 12, "x"]}, "1", "ok"), ({"enum": [1, 12, "x"]}, "12", "ok"), ({"enum": [1, 12]}, "13", "refused"),
    ({"const": {"k": [1, 2]}}, '{"k": [1, 2]}', "ok"), ({"const": {"k": [1, 2]}}, '{"k":[1,2]}', "ok"),
    ({"type": "object", "additionalProperties": {"type": "boolean"}}, '{"x": true, "y": false}', "ok"),
    ({"type": "object", "additionalProperties": {"type": "boolean"}}, '{"x": 1}', "refused"),
    ({"type": "string", "format": "email", "description": "annotations are taken, not enforced"}, '"x"', "ok"),
    ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}, '"ABC-12"', "ok"),
    ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}, '"AB1', "refused"),
    ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}, '"ABC-"', "refused"),          # not yet a match
    ({"type": "string", "pattern": "^a$"}, '"a\\n"', "refused"),       # ECMA's $: the end, not before a "\n"
    ({"type": "string", "pattern": "^[$]+$"}, '"$$"', "ok"),
    ({"type": "string", "pattern": "abc"}, '"xxabcx"', "ok"), ({"type": "string", "pattern": "abc"}, '"xx"', "refused"),
    ({"type": "string", "pattern": "^caf\u00e9$"}, '"caf\u00e9"', "ok"),                 # é escaped, checked decoded
    ({"type": "string", "format": "date"}, '"2024-02-29"', "ok"),
    ({"type": "string", "format": "date"}, '"2024-13', "refused"),
    ({"type": "string", "format": "date-time"}, '"2024-02-29T12:30:00.5+02:00"', "ok"),
    ({"type": "string", "format": "date-time"}, '"2024-02-29T12:30:00"', "refused"),     # RFC 3339 needs a zone
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', "ok"),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3"', "refused"),
])
def test_documents(schema, text, want):
    assert verdict(schema, text) == want


def test_nesting_is_capped():
    m = JsonMachine(True)
    assert m.feed(b"[" * 64) and not m.accepts(b"[") and not m.accepts(b"{") and m.accepts(b"1")


def test_a_dead_end_is_refused_where_it_starts():
    # property names must be one of a few: no escapes that could not spell one; maxLength: only the quote
    assert verdict(PERSON, '{"n\\u') == "refused" and verdict(PERSON, '{"n\\') == "refused"
    assert verdict({"type": "string", "maxLength": 2}, '"ab\\') == "refused"
    assert verdict({"type": "string"}, b'"\xc3') == "prefix" and verdict({"type": "string"}, b'"\xc3"') == "refused"
    assert verdict({"type": "string"}, b'"\xff') == "refused"                    # not UTF-8


def _strict_loads(text: str) -> bool:
    def no_dups(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError("duplicate key")
        return dict(pairs)

    def no_constants(name):
        raise ValueError(name)
    try:
        json.loads(text, object_pairs_hook=no_dups, parse_constant=no_constants)
        return True
    except ValueError:
        return False


def test_any_json_agrees_with_the_json_module():
    """Schema true against json.loads (strict: no duplicate keys, no NaN): every json.dumps form of random
    values is taken, and single-character edits of them (not whitespace, which follows llama.cpp's rule) are
    complete exactly when json.loads accepts them."""
    rng = random.Random(0)
    for _ in range(300):
        v = random_json(rng)
        for text in (json.dumps(v), json.dumps(v, ensure_ascii=False, separators=(",", ":")),
                     json.dumps(v, ensure_ascii=False, indent=2)):
            assert verdict(True, text) == "ok", text
            for _ in range(4):
                i = rng.randrange(len(text) + 1)
                edit = text[:i] + rng.choice('{}[],:"\\0123456789.-+eEtrufalsn') + text[i + rng.randrange(2):]
                assert (verdict(True, edit) == "ok") == _strict_loads(edit), edit


@pytest.mark.parametrize("schema, msg", [
    ({"type": "string", "not": {"const": "a"}}, "'not'"),
    ({"type": "string", "pattern": "[a-"}, "is not a regular expression"),
    ({"type": "string", "pattern": 5}, "pattern must be a string"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"$ref": "https://example.com/s.json"}, "only references into the schema"),
    ({"type": "strin"}, "unknown type 'strin'"),
    ({"required": ["a"], "additionalProperties": False}, "requires properties it does not allow"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "loop"),
    ({"type": "array", "maxItems": -1}, "non-negative integer"),
    ([1], "not a schema"),
    ({"allOf": [{"properties": 5}]}, "'properties' must be an object"),
    ({"type": []}, "'type' is an empty list"), ({"type": [["x"]]}, "unknown type"),
    (functools.reduce(lambda d, _: {"items": d}, range(100), True), "nested more than 64 levels"),
    (functools.reduce(lambda d, _: {"allOf": [d]}, range(3000), True), "nested too deeply"),
])
def test_schemas_it_cannot_enforce_are_refused(schema, msg):
    with pytest.raises(SchemaError, match=msg):
        check_schema(schema)


def _random_schema(rng: random.Random, depth=0):
    """Schema-like values, well-formed or not (untrusted input)."""
    if depth > 3 or rng.random() < 0.2:
        return rng.choice([True, False, {}, 1, "x", None, [], {"type": rng.choice(["string", "integer", "nope"])}])
    keys = ["type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
            "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "minimum",
            "maximum", "exclusiveMinimum", "exclusiveMaximum", "$defs", "title", "pattern"]
    out = {}
    for k in rng.sample(keys, rng.randrange(1, 4)):
        out[k] = rng.choice([
            lambda: _random_schema(rng, depth + 1), lambda: random_json(rng, 2),
            lambda: [_random_schema(rng, depth + 1) for _ in range(rng.randrange(3))],
            lambda: {f"p{i}": _random_schema(rng, depth + 1) for i in range(rng.randrange(3))},
            lambda: rng.choice(["object", "array", "string", "number", ["null", "integer"], "#/$defs/a", "#"]),
            lambda: rng.randrange(-2, 4)])()
    return out


def test_any_schema_is_enforced_or_refused_cleanly():
    """Random schema-like input never raises anything but SchemaError, and a machine built from a schema
    that passed takes random JSON texts without raising."""
    rng = random.Random(1)
    taken = 0
    for _ in range(1500):
        schema = _random_schema(rng)
        try:
            m = JsonMachine(schema)
        except SchemaError:
            continue
        taken += 1
        for _ in range(3):
            text = json.dumps(random_json(rng), ensure_ascii=False).encode()
            c = m.clone()
            for i in range(len(text)):
                if not c.feed(text[i:i + 1]):
                    break
            c.can_end()
    assert taken > 100


@pytest.fixture(scope="module")
def tok():
    return hybridmoe.load("synth:tiny").tokenizer


def _constrained(tok, schema, logits_fn, settings, trigger=None, n=400):
    c = TokenConstraint(JsonMachine(schema), tok, tok.eos_ids, trigger)
    s = Sampler(settings, c)
    ids = []
    for _ in range(n):
        t = s(logits_fn())
        if t in tok.eos_ids:
            return ids, True
        s.accept(t)
        ids.append(t)
    return ids, False


TICKET = {"type": "object", "additionalProperties": False, "required": ["code", "day", "id"],
          "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                         "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}}}


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_sampling_under_a_schema_writes_matching_json(tok, temperature):
    """Random logits (the model wants anything) over synth:tiny's real byte-level vocabulary: whatever is
    sampled, the reply ends with an end-of-generation token and is JSON the schema accepts."""
    g = torch.Generator().manual_seed(int(temperature * 10))
    for seed in range(3):
        for schema in (PERSON, TICKET, PET):
            ids, ended = _constrained(tok, schema, lambda: torch.randn(tok.n_vocab, generator=g) * 3,
                                      SamplerSettings(temperature=temperature, seed=seed))
            text = tok.decode(ids)
            assert ended and verdict(schema, text) == "ok", text
            v = json.loads(text)
            if schema is PERSON:
                assert set(v) <= set(PERSON["properties"]) and 0 <= v["age"] <= 150 and 1 <= len(v["name"]) <= 8
            elif schema is PET:
                assert v in ({"kind": "cat", "meow": v.get("meow")}, {"kind": "dog", "bark": v.get("bark")})
                assert isinstance(v.get("meow", v.get("bark")), (bool, int))
            else:
                assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", v["code"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", v["day"])
                assert len(v["id"]) == 36


def test_free_until_the_trigger(tok):
    """With a trigger (the end of a thinking block) tokens before it are free; the constraint starts after."""
    script = tok.encode("<think>hmm, {not json</think>", add_special=False)
    it = iter(script)

    def logits():                                       # the script first, then the model wants anything
        t = next(it, None)
        v = torch.randn(tok.n_vocab) * 3
        if t is not None:
            v[t] = 100.0
        return v
    ids, ended = _constrained(tok, PERSON, logits, SamplerSettings(temperature=0), trigger=THINK_END)
    text = tok.decode(ids)
    assert ids[:len(script)] == script and ended
    assert verdict(PERSON, text[text.index("</think>") + len("</think>"):]) == "ok"
