"""What a JSON schema leaves unbounded is bounded before it becomes a grammar (issue 27, items 8 and 9):
integers within the signed 64-bit range, numbers of at most 17 digits and a 3-digit exponent, whitespace
bounded, and only the properties a schema names unless it allows others. Checked on the compiled matcher
(stories260K's tokenizer): which texts the grammar accepts."""

import json

import pytest
from support import STORIES

from flowrt.engine import StructuredOutputsParams
from flowrt.engine.decoding.structured_output import StructuredOutputManager


@pytest.fixture(scope="module")
def mgr():
    from flowrt.engine.model.tokenizer import load_tokenizer

    return StructuredOutputManager(load_tokenizer(STORIES), vocab_size=512, eos_ids=(2,))


def accepts(mgr, text: str, **so) -> bool:
    m = mgr.compile(StructuredOutputsParams(**so))
    for t in mgr.ll_tokenizer.tokenize_str(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


POPULATION = {"type": "object", "properties": {"population": {"type": "integer", "minimum": 0}},
              "required": ["population"]}
XY = {"type": "object", "properties": {"xy": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                              "maxItems": 2}}, "required": ["xy"]}


def test_integers_stay_in_the_64_bit_range(mgr):
    ok = lambda n: accepts(mgr, json.dumps({"population": n}), json=POPULATION)  # noqa: E731
    assert ok(1234567890123456789) and ok(0) and ok(2**63 - 1024)  # 19 digits
    assert not ok(10**24) and not ok(2**63)  # 25 digits; past the range
    assert accepts(mgr, "-1234567890123456789", json={"type": "integer"})
    assert not accepts(mgr, "1" * 25, json={"type": "integer"})
    # the option lifts it
    assert accepts(mgr, json.dumps({"population": 10**24}), json=POPULATION, bound_numbers=False)


@pytest.mark.parametrize("text, ok", [
    ("1", True), ("-0.5", True), ("1.2345678901234567", True), ("12345678901234567", True),
    ("1.5e300", True), ("1e-999", True), ("0.0000000000000001", True),
    ("1.23456789012345678", False), ("123456789012345678", False),  # 18 digits
    ("-5.1000000000000000000", False), ("1e1000", False), ("01", False),
])
def test_numbers_have_at_most_17_digits_and_a_3_digit_exponent(mgr, text, ok):
    assert accepts(mgr, text, json={"type": "number"}) is ok
    assert accepts(mgr, f'{{"xy": [{text}, 2]}}', json=XY) is ok
    assert accepts(mgr, text, json={"type": ["number", "null"]}) is ok


def test_bound_numbers_false_lifts_the_number_bounds(mgr):
    assert accepts(mgr, '{"xy": [-5.1000000000000000000, 1]}', json=XY, bound_numbers=False)


def test_any_json_is_bounded_too(mgr):
    """json_object mode, `{}` and open objects: the values inside are generic JSON with bounded numbers."""
    assert accepts(mgr, '{"a": {"b": [1, 2.5, "x", null, true]}}', json_object=True)
    assert not accepts(mgr, '{"a": ' + "1" * 30 + "}", json_object=True)
    assert not accepts(mgr, "[1]", json_object=True)
    assert accepts(mgr, '{"k": [1, {"z": false}]}', json={"type": "object", "properties": {"k": {}}})
    assert not accepts(mgr, '{"k": ' + "9" * 20 + "}", json={"type": "object", "properties": {"k": {}}})


def test_whitespace_is_bounded(mgr):
    assert not accepts(mgr, '{"xy": [1,  2]}', json=XY)  # compact by default
    assert accepts(mgr, '{ "xy" : [1 ,\n  2] }', json=XY, disable_any_whitespace=False)
    assert not accepts(mgr, '{"xy": [1,' + " " * 40 + "2]}", json=XY, disable_any_whitespace=False)
    person = {"type": "object", "properties": {"name": {"type": "string"}}}
    assert accepts(mgr, '{\n  "name": "x"\n}', json=person, disable_any_whitespace=False)
    assert not accepts(mgr, '{' + "\n" * 40 + '"name": "x"}', json=person, disable_any_whitespace=False)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "score": {"type": "number"}}, "required": ["name"]}


@pytest.mark.parametrize("schema", [PERSON, {**PERSON, "properties": {"name": {"type": "string"},
                                                                      "age": {"type": "integer"}}}])
def test_only_named_properties_unless_the_schema_allows_others(mgr, schema):
    assert accepts(mgr, '{"name": "a", "age": 12}', json=schema)
    assert accepts(mgr, '{"name": "a"}', json=schema)
    assert not accepts(mgr, '{"name": "a", "age": 12, "choice": "x"}', json=schema)
    assert not accepts(mgr, '{"age": 12}', json=schema)  # name is required
    # explicitly allowed, or strict=False (JSON Schema's own reading): other keys may follow
    assert accepts(mgr, '{"name": "a", "choice": "x"}', json={**schema, "additionalProperties": True})
    assert accepts(mgr, '{"name": "a", "choice": "x"}', json={**schema, "additionalProperties": {"type": "string"}})
    assert accepts(mgr, '{"name": "a", "choice": "x"}', json=schema, strict=False)


def test_recursive_definitions(mgr):
    node = {"$defs": {"P": {"type": "object", "properties": {
        "x": {"type": "number"}, "next": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]}},
        "required": ["x", "next"]}}, "$ref": "#/$defs/P"}
    assert accepts(mgr, '{"x": 1, "next": {"x": 2.5, "next": null}}', json=node)
    assert not accepts(mgr, '{"x": 1, "next": {"x": ' + "1" * 20 + ', "next": null}}', json=node)
    assert not accepts(mgr, '{"x": 1, "next": null, "y": 2}', json=node)


def test_optional_properties_keep_their_order_and_commas(mgr):
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "string"},
                                               "c": {"type": "boolean"}}, "required": ["b"]}
    for text in ('{"b": "x"}', '{"a": 1, "b": "x"}', '{"b": "x", "c": true}', '{"a": 1, "b": "x", "c": false}'):
        assert accepts(mgr, text, json=schema), text
    for text in ('{}', '{"a": 1}', '{"c": true, "b": "x"}', '{"a": 1,, "b": "x"}', '{"b": "x",}'):
        assert not accepts(mgr, text, json=schema), text
    all_optional = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    for text in ('{}', '{"a": 1}', '{"b": 2}', '{"a": 1, "b": 2}'):
        assert accepts(mgr, text, json=all_optional), text
