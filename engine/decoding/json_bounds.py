"""What a JSON schema leaves open, closed before it becomes a grammar, so a small model cannot run away.

llguidance generates exactly what a schema allows, and a schema often allows more than its author meant:

* **extra keys** (`close_objects`): an object that names its ``properties`` but does not say
  ``additionalProperties`` gets ``additionalProperties: false``, so only the named properties are generated
  (JSON Schema would allow any others, and small models invent them). ``strict: false`` keeps the schema's
  own reading;
* **unbounded numbers** (`bound_integers`, `to_lark`): an integer without a bound is kept within the signed
  64-bit range (to 2**63 - 1024, the largest bound llguidance's range regex takes: at most 19 digits), and a
  ``number`` without bounds is at most 17 digits (integer and fraction together, so at most 17 significant
  digits) with an exponent of at most 3 digits. A model otherwise writes ``100000000000…`` until max_tokens.

Numbers need a grammar of their own (llguidance's JSON compiler has no digit limit, and ``minimum`` /
``maximum`` bound only a number's integer part): `to_lark` writes the schema as a Lark grammar in which each
unbounded ``number`` (and each "any JSON value": ``{}``, ``true``, an object without properties) is a bounded
rule, and every part without one is embedded as it is (``%json {...}``). Constructs it does not rewrite
(``allOf``, ``prefixItems``, ``patternProperties``, extra keys beside properties, ...) are embedded whole, with
llguidance's own number rules inside them; so is a ``number`` with ``minimum`` / ``maximum`` (its bounds kept).
"""

from __future__ import annotations

import json
from typing import Any

INT_BOUND = 2**63 - 1024  # |integer| cap: the largest bound under 2**63 that survives llguidance's f64 range
MAX_DIGITS = 17           # digits of a number (integer and fraction parts together)
MAX_EXP_DIGITS = 3
MAX_WHITESPACE = 24       # characters of whitespace between tokens when whitespace is not compact
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_WHITESPACE  # llguidance's whitespace_pattern then

_VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # {name: schema}


def _map_schemas(schema: Any, fn) -> Any:
    """`schema` with `fn` applied bottom-up to every subschema (values of const/enum/... left alone)."""
    if isinstance(schema, list):
        return [_map_schemas(x, fn) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _VALUES:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: _map_schemas(sub, fn) for name, sub in v.items()}
        else:
            out[k] = _map_schemas(v, fn)
    return fn(out)


def close_objects(schema: Any) -> Any:
    """Objects that name ``properties`` and say nothing of ``additionalProperties`` allow no other keys."""
    def close(node: dict) -> dict:
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node \
                and "unevaluatedProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = False
        return node
    return _map_schemas(schema, close)


def _types(node: dict) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []


def bound_integers(schema: Any) -> Any:
    """Integers without a lower or upper bound get one at ±INT_BOUND."""
    def bound(node: dict) -> dict:
        if "integer" in _types(node) and "enum" not in node and "const" not in node:
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -INT_BOUND
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = INT_BOUND
        return node
    return _map_schemas(schema, bound)


def number_regex() -> str:
    """A JSON number of at most MAX_DIGITS digits and a MAX_EXP_DIGITS-digit exponent (no leading zeros)."""
    alts = [r"0(?:\.[0-9]{1,%d})?" % (MAX_DIGITS - 1)]
    for k in range(1, MAX_DIGITS + 1):
        frac = r"(?:\.[0-9]{1,%d})?" % (MAX_DIGITS - k) if k < MAX_DIGITS else ""
        alts.append(r"[1-9]" + (r"[0-9]{%d}" % (k - 1) if k > 1 else "") + frac)
    return r"-?(?:%s)(?:[eE][+-]?[0-9]{1,%d})?" % ("|".join(alts), MAX_EXP_DIGITS)


def _is_open_number(node: dict) -> bool:
    """A number schema (alone or among other types) without bounds."""
    return ("number" in _types(node) and "enum" not in node and "const" not in node
            and not any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                             "multipleOf")))


def _is_any(node: Any) -> bool:
    return node is True or (isinstance(node, dict) and not any(k for k in node if k not in (
        "title", "description", "$comment", "default", "examples", "$schema", "$id", "$defs", "definitions")))


def needs_lark(schema: Any) -> bool:
    """Whether the schema holds an unbounded number or an any-value (so `to_lark` must bound it)."""
    found = []

    def visit(node: dict) -> dict:
        if _is_open_number(node) or _is_any(node) or _is_open_object(node):
            found.append(node)
        return node
    if _is_any(schema):
        return True
    _map_schemas(schema, visit)
    return bool(found)


def _refs(schema: Any) -> set[str]:
    """Every "$ref" string within `schema`."""
    out: set[str] = set()

    def visit(node: dict) -> dict:
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"])
        return node
    _map_schemas(schema, visit)
    return out


def _is_open_object(node: dict) -> bool:
    """An object with no properties, pattern or extra-key schema: any object."""
    return (_types(node) == ["object"] and not node.get("properties") and "patternProperties" not in node
            and node.get("additionalProperties", True) is True and "enum" not in node and "const" not in node
            and not any(k in node for k in ("required", "minProperties", "maxProperties", "propertyNames",
                                             "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")))


class _Lark:
    """Writes one schema as Lark rules (see the module docstring)."""

    def __init__(self, root: Any, compact: bool, prefix: str) -> None:
        self.root = root
        self.compact = compact
        self.prefix = prefix
        self.defs = {k: v for k, v in ((k, root.get(k)) for k in ("$defs", "definitions"))
                     if isinstance(v, dict)} if isinstance(root, dict) else {}
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}
        self.bounded_refs = self._refs_needing_lark()
        self.n = 0
        self.opts = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} if compact
                     else {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE})

    def _refs_needing_lark(self) -> set[str]:
        """The "#/$defs/NAME" refs whose definitions hold (directly or through other refs) what `to_lark`
        bounds; "#" (the root) among them when the root does."""
        targets = {f"#/{key}/{name}": sub for key, defs in self.defs.items() for name, sub in defs.items()}
        targets["#"] = {k: v for k, v in self.root.items() if k not in ("$defs", "definitions")} \
            if isinstance(self.root, dict) else self.root
        need = {ref for ref, sub in targets.items() if needs_lark(sub)}
        while True:
            more = {ref for ref, sub in targets.items() if ref not in need and _refs(sub) & need}
            if not more:
                return need
            need |= more

    def needs(self, node: Any) -> bool:
        return needs_lark(node) or bool(_refs(node) & self.bounded_refs)

    def new_rule(self, body: str) -> str:
        name = f"{self.prefix}_{self.n}"
        self.n += 1
        self.rules[name] = body
        return name

    # separators ---------------------------------------------------------------------------------------
    def tok(self, s: str) -> str:
        """A punctuation token: compact ("," written ", "), or with bounded whitespace around it."""
        if self.compact:
            return json.dumps({",": ", ", ":": ": "}.get(s, s))
        return f"{self.prefix}_ws? {json.dumps(s)} {self.prefix}_ws?"

    # schemas ------------------------------------------------------------------------------------------
    def embed(self, node: Any) -> str:
        """The node as llguidance compiles it (with the root's definitions, for its $refs)."""
        if isinstance(node, dict):
            if '"$ref"' in json.dumps(node):
                node = {**{k: v for k, v in self.defs.items() if k not in node}, **node}
            node = {**node, "x-guidance": self.opts}
        return "%json " + json.dumps(node)

    def value(self, node: Any) -> str:
        if _is_any(node):
            return self.any_value()
        if not isinstance(node, dict) or not self.needs(node):
            return self.embed(node)
        if "$ref" in node and len([k for k in node if k not in ("description", "title", "$defs", "definitions",
                                                                 "$schema", "$id", "$comment")]) == 1:
            return self.ref(node["$ref"]) or self.embed(node)
        if set(node) & {"allOf", "not", "if", "oneOf", "$ref", "enum", "const"}:
            return self.embed(node)
        types = _types(node) or (["object"] if "properties" in node else ["array"] if "items" in node else [])
        if len(types) > 1:
            return self.new_rule(" | ".join(self.value({**node, "type": t}) for t in types))
        if _is_open_number(node):
            return self.number()
        if _is_open_object(node):
            return self.any_object()
        if "anyOf" in node:
            rest = {k: v for k, v in node.items() if k not in ("anyOf", "description", "title")}
            if rest or not isinstance(node["anyOf"], list) or not node["anyOf"]:
                return self.embed(node)
            return self.new_rule(" | ".join(self.value(s) for s in node["anyOf"]))
        if types == ["object"]:
            return self.object(node)
        if types == ["array"]:
            return self.array(node)
        return self.embed(node)

    def ref(self, ref: str) -> str | None:
        if ref == "#":
            return self.refs.setdefault("#", f"{self.prefix}_root")
        for key in ("$defs", "definitions"):
            head = f"#/{key}/"
            if ref.startswith(head) and ref[len(head):] in self.defs.get(key, {}):
                if ref not in self.refs:
                    name = self.refs[ref] = f"{self.prefix}_def{len(self.refs)}"
                    self.rules[name] = "<pending>"
                    self.rules[name] = self.value(self.defs[key][ref[len(head):]])
                return self.refs[ref]
        return None

    def number(self) -> str:
        name = f"{self.prefix}_number"
        self.rules[name] = f"/{number_regex()}/"
        return name

    def string(self) -> str:
        return self.embed({"type": "string"})

    def any_value(self) -> str:
        name = f"{self.prefix}_value"
        if name not in self.rules:
            self.rules[name] = "<pending>"
            self.rules[name] = " | ".join([self.any_object(), self.any_array(), self.string(), self.number(),
                                           '"true"', '"false"', '"null"'])
        return name

    def any_object(self) -> str:
        name = f"{self.prefix}_object"
        if name not in self.rules:
            self.rules[name] = "<pending>"
            pair = f"{self.string()} {self.tok(':')} {self.any_value()}"
            self.rules[name] = f'{self.tok("{")} ({pair} ({self.tok(",")} {pair})*)? {self.tok("}")}'
        return name

    def any_array(self) -> str:
        name = f"{self.prefix}_array"
        if name not in self.rules:
            self.rules[name] = "<pending>"
            v = self.any_value()
            self.rules[name] = f'{self.tok("[")} ({v} ({self.tok(",")} {v})*)? {self.tok("]")}'
        return name

    def object(self, node: dict) -> str:
        props = node.get("properties") or {}
        if node.get("additionalProperties", True) is not False or "patternProperties" in node \
                or any(k in node for k in ("minProperties", "maxProperties", "propertyNames", "dependentRequired",
                                           "unevaluatedProperties")) or not isinstance(props, dict):
            return self.embed(node)
        required = set(node.get("required") or [])
        if not required <= set(props):
            return self.embed(node)  # llguidance explains what is wrong
        keys = list(props)
        kv = [f"{json.dumps(json.dumps(k))} {self.tok(':')} {self.value(props[k])}" for k in keys]
        n = len(keys)
        can_empty = [all(k not in required for k in keys[i:]) for i in range(n + 1)]
        first: dict[int, str] = {}
        rest: dict[int, str] = {}

        def rest_ref(i: int) -> str:  # what may follow once something was written: "" / R_i / R_i?
            if i == n:
                return ""
            return rest[i] + ("?" if can_empty[i] else "")

        for i in range(n - 1, -1, -1):  # R_i: ", kv" items from i on, at least one
            alts = [f"{self.tok(',')} {kv[i]} {rest_ref(i + 1)}"]
            if keys[i] not in required and i + 1 < n:
                alts.append(rest[i + 1])
            rest[i] = self.new_rule(" | ".join(alts))
        for i in range(n - 1, -1, -1):  # S_i: the first item from i on, then the rest
            alts = [f"{kv[i]} {rest_ref(i + 1)}"]
            if keys[i] not in required and i + 1 < n:
                alts.append(first[i + 1])
            first[i] = self.new_rule(" | ".join(alts))
        if n == 0:
            return self.new_rule(f'{self.tok("{")} {self.tok("}")}')
        body = first[0] + ("?" if can_empty[0] else "")
        return self.new_rule(f'{self.tok("{")} {body} {self.tok("}")}')

    def array(self, node: dict) -> str:
        if any(k in node for k in ("prefixItems", "contains", "uniqueItems", "unevaluatedItems")) \
                or isinstance(node.get("items"), list):
            return self.embed(node)
        lo, hi = node.get("minItems", 0), node.get("maxItems")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)) or lo < 0 \
                or (hi is not None and hi < lo):
            return self.embed(node)
        item = self.value(node.get("items", True))
        sep = self.tok(",")
        if hi == 0:
            return self.new_rule(f'{self.tok("[")} {self.tok("]")}')
        more = f"({sep} {item})" + ("*" if hi is None and lo <= 1 else
                                    f"{{{max(lo - 1, 0)},}}" if hi is None else f"{{{max(lo - 1, 0)},{hi - 1}}}")
        items = f"{item} {more}"
        if lo == 0:
            items = f"({items})?"
        return self.new_rule(f'{self.tok("[")} {items} {self.tok("]")}')


def to_lark(schema: Any, compact: bool = True, prefix: str = "j") -> tuple[str, str]:
    """(the rule matching one value of `schema`, the Lark rules it needs), rule names starting with `prefix`
    (so several schemas can share one grammar)."""
    w = _Lark(schema, compact, prefix)
    start = w.value(schema)
    if "#" in w.refs:
        w.rules[w.refs["#"]] = start
    if not compact:
        w.rules[f"{prefix}_ws"] = r"/[\x20\x0A\x0D\x09]{1,%d}/" % MAX_WHITESPACE
    lines = [f"{name}: {body}" for name, body in w.rules.items()]
    return start, "\n".join(lines) + "\n"


def lark_grammar(schema: Any, compact: bool = True) -> str:
    """A whole Lark grammar (llguidance's dialect) for one value of `schema`."""
    start, rules = to_lark(schema, compact)
    return "%llguidance {}\nstart: " + start + "\n" + rules
