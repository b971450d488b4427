"""JSON schemas of varied shape for the structured-output tests and bench (bounded so a near-random model
finishes them within a modest max_tokens)."""

STR = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS: list[dict] = [
    obj({"name": STR}),
    obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"n": {"type": "null"}, "b": {"type": "boolean"}}),
    obj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    obj({"v": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj({"user": obj({"id": INT, "name": STR})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"pts": {"type": "array", "items": obj({"x": INT, "y": INT}), "minItems": 1, "maxItems": 2}}),
    obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]}}),
    obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": INT}),
                             obj({"kind": {"const": "square"}, "side": INT})]}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"uid": {"type": "string", "format": "uuid"}}),
    obj({"name": STR, "nick": STR}, required=["name"]),
    obj({"a": INT, "b": {"type": "boolean"}, "c": STR}, required=["b"]),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"const": {"const": "fixed"}, "n": INT}),
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "maxItems": 3},
    {"type": "string", "maxLength": 10},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "boolean"},
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                                  "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "minItems": 0, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9},
                                               "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"flag": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 5}}, required=["count"]),
    obj({"name": {"type": "string", "minLength": 2, "maxLength": 5},
         "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    obj({"val": {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"enum": ["x", "y"]}]}}),
    obj({"meta": {"type": "object", "properties": {"k": STR}, "additionalProperties": False}}, required=[]),
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}}, "required": ["p"], "additionalProperties": False,
     "$defs": {"pt": obj({"x": INT, "y": INT})}},
]
