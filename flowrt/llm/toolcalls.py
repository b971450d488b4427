"""Tool calls in the Hermes / Qwen2.5 / SmolLM2 format, shared by the server and the thread API.

A model calls a tool by writing a block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several blocks, separated by a newline, for parallel calls). This module holds the tool description
(`ToolSpec`, OpenAI's ``{"type": "function", "function": {...}}`` shape), a parsed call (`ToolCall`), the
constraints that make the engine emit valid calls (llguidance Lark grammars with the tools' JSON schemas
embedded through ``%json``), and the parser that gets the calls back out of generated text.

- `call_constraint(tools, choice)`: the output is one call (or, with `parallel`, one or more calls) and
  nothing else; `choice` is "required" (any tool) or one tool's name. Arguments are valid for the schema.
- `auto_constraint(tools)`: free text, and wherever the model starts a ``<tool_call>`` block, the block
  is constrained (a lazy free-text lexeme that ends at the trigger, then a constrained call; any number of
  calls, then free text). The text outside blocks is unconstrained.
- `parse_tool_calls(text)`: (content without the call blocks, calls). Never raises. Each call's JSON is
  decoded structurally from its open tag on (a string argument may contain ``</tool_call>``); no block
  markup stays in the content, also of a block that is not a call or was cut off by max_tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, overload

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8  # calls in one response unless the caller says otherwise (max_tool_calls): a response ends
# Compact JSON inside the blocks (", " and ": " separators, no free whitespace): small models otherwise pad.
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolSpec:
    """A function the model may call: `parameters` is the JSON schema of its arguments (an object)."""
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # OpenAI's function.strict: False lets objects take keys their schema omits

    def to_openai(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}

    @classmethod
    def from_openai(cls, d: dict) -> "ToolSpec":
        """From ``{"type": "function", "function": {"name", "description", "parameters"}}`` (or the bare
        function dict). ValueError for a malformed tool."""
        if not isinstance(d, dict):
            raise ValueError(f"a tool must be an object, got {type(d).__name__}")
        if d.get("type", "function") != "function":
            raise ValueError(f"only tools of type 'function' are supported, got {d.get('type')!r}")
        fn = d.get("function", d)
        if not isinstance(fn, dict):
            raise ValueError("tool.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tool function name must be 1-64 characters of a-z, A-Z, 0-9, _, . or -, got {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ValueError(f"tool {name!r}: description must be a string")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"tool {name!r}: strict must be true or false")
        return cls(name=name, description=desc, parameters=params, strict=strict)


@dataclass
class ToolCall:
    """One call the model made: `arguments` parsed (a dict)."""
    id: str
    name: str
    arguments: dict
    raw_arguments: str | None = field(default=None, repr=False, compare=False)  # the arguments as written

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def to_text(self) -> str:
        """The call as the model writes it (for re-rendering an assistant turn)."""
        return format_call(self.name, self.arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def format_call(name: str, arguments: dict) -> str:
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{CLOSE}'


def _specs(tools: Iterable[Any]) -> list[ToolSpec]:
    out = [t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in tools]
    if not out:
        raise ValueError("tools must not be empty")
    return out


def _args_schema(spec: ToolSpec, bound_numbers: bool = True) -> dict:
    """The arguments' schema as generated: objects take only the keys they name (unless the tool says
    ``strict: false``) and numbers are bounded (engine/decoding/json_bounds.py), as for response_format schemas."""
    from flowrt.engine.decoding import json_bounds

    s = dict(spec.parameters) if spec.parameters else {}
    if not s or ("type" not in s and not any(k in s for k in ("anyOf", "oneOf", "allOf", "$ref", "enum", "const"))):
        s.setdefault("type", "object")
    if spec.strict is not False:
        s = json_bounds.close_objects(s)
    if bound_numbers:
        s = json_bounds.bound_integers(s)
    return s


def _args_rule(spec: ToolSpec, i: int, bound_numbers: bool) -> tuple[str, str]:
    """(the Lark expression for one tool's arguments, rules it needs)."""
    from flowrt.engine.decoding import json_bounds

    s = _args_schema(spec, bound_numbers)
    if bound_numbers and json_bounds.needs_lark(s):
        return json_bounds.to_lark(s, compact=True, prefix=f"args{i}")
    return f"%json {json.dumps({**s, 'x-guidance': dict(_JSON_OPTS)})}", ""


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lark string literal


def _call_rules(specs: list[ToolSpec], bound_numbers: bool = True) -> str:
    """Rules `call` (one JSON call object for any of `specs`) and `block` (it wrapped in the tags)."""
    lines = ["block: " + _lark_str(OPEN + "\n") + " call " + _lark_str("\n" + CLOSE),
             "call: " + " | ".join(f"call_{i}" for i in range(len(specs)))]
    extra = ""
    for i, spec in enumerate(specs):
        head = '{"name": ' + json.dumps(spec.name) + ', "arguments": '
        args, rules = _args_rule(spec, i, bound_numbers)
        lines.append(f"call_{i}: {_lark_str(head)} {args} " + _lark_str("}"))
        extra += rules
    return "\n".join(lines) + "\n" + extra


def _max_calls(max_calls: int | None) -> int:
    n = MAX_CALLS if max_calls is None else max_calls
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_tool_calls must be a positive integer, got {max_calls!r}")
    return n


def call_constraint(tools: list, choice: str = "required", parallel: bool = True, max_calls: int | None = None,
                    bound_numbers: bool = True):
    """A StructuredOutputsParams making the output exactly one call block (parallel: one to `max_calls`
    (default MAX_CALLS), newline separated, so the response ends) of any tool ("required") or of the tool
    named `choice`. ValueError for an unknown name."""
    from flowrt.engine import StructuredOutputsParams

    specs = _specs(tools)
    if choice != "required":
        specs = [s for s in specs if s.name == choice]
        if not specs:
            raise ValueError(f"tool_choice names {choice!r}, which is not one of the tools")
    n = _max_calls(max_calls) if parallel else 1
    start = "start: block" + (f' ("\\n" block){{0,{n - 1}}}' if n > 1 else "")
    grammar = "%llguidance {}\n" + start + "\n" + _call_rules(specs, bound_numbers)
    return StructuredOutputsParams(grammar=grammar)


def auto_constraint(tools: list, max_calls: int | None = None, bound_numbers: bool = True):
    """tool_choice "auto": free text; once the model writes ``<tool_call>``, the block that follows is a
    valid call of one of the tools (then free text again; up to `max_calls` blocks). Built on llguidance's
    lazy lexemes (the free text ends at the first ``<tool_call>``), as its own StructTag helper does."""
    from flowrt.engine import StructuredOutputsParams

    specs = _specs(tools)
    n = _max_calls(max_calls)
    grammar = ("%llguidance {}\n"
               f"start: (trigger tail){{0,{n}}} TEXT\n"
               f"trigger[lazy]: TEXT {_lark_str(OPEN)}\n"
               f"tail: {_lark_str(chr(10))} call {_lark_str(chr(10) + CLOSE)}\n"
               "TEXT: /(.|\\n)*/\n" + _call_rules(specs, bound_numbers))
    return StructuredOutputsParams(grammar=grammar)


CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def raw_arguments(body: str) -> str | None:
    """The arguments text of a call body ``{"name": ..., "arguments": ARGS}`` exactly as written (None when
    the body does not have that shape)."""
    m = CALL_HEAD.match(body)
    if m is None:
        return None
    s = body[m.end():].rstrip()
    if not s.endswith("}"):
        return None
    return s[:-1].rstrip()


_DECODER = json.JSONDecoder()


@dataclass
class Block:
    """One ``<tool_call>`` block found in text: ``text[start:end]`` is the whole block (tags included),
    ``text[body_start:body_end]`` its JSON, and `call` the call it makes (None: not a call, or cut off)."""
    start: int
    end: int
    body_start: int
    body_end: int
    call: ToolCall | None
    complete: bool  # the JSON is whole (a cut-off block is not)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@overload
def read_block(text: str, start: int, final: Literal[True] = ...) -> Block: ...
@overload
def read_block(text: str, start: int, final: bool) -> Block | None: ...


def read_block(text: str, start: int, final: bool = True) -> Block | None:
    """The block whose open tag starts at `start`. Its JSON is decoded structurally from the tag on (a
    string value may hold ``</tool_call>``); the closing tag after it (or a prefix of it at the very end) is
    part of the block. A body cut off mid-JSON runs to the end of the text; one that is not JSON, to the next
    closing tag. With `final` False (text still streaming in), None while the block might still grow."""
    k = skip_ws(text, start + len(OPEN))
    try:
        _, e = _DECODER.raw_decode(text, k)
    except json.JSONDecodeError as err:
        c = -1 if _cut_off(text, err) else text.find(CLOSE, k)
        if c < 0:
            return Block(start, len(text), k, len(text), None, False) if final else None
        return Block(start, c + len(CLOSE), k, c, None, False)
    except (ValueError, RecursionError):
        return Block(start, len(text), k, len(text), None, False) if final else None
    m = skip_ws(text, e)
    rest = text[m:]
    if rest.startswith(CLOSE):
        end = m + len(CLOSE)
    elif CLOSE.startswith(rest):  # nothing, or a cut-off closing tag, follows
        if not final:
            return None
        end = len(text)
    else:
        end = e
    call = _as_call(text[k:e])
    if call is None and end == e:  # JSON that is not a call: the block runs to its closing tag
        c = text.find(CLOSE, e)
        end = len(text) if c < 0 else c + len(CLOSE)
    return Block(start, end, k, e, call, True)


def _cut_off(text: str, err: json.JSONDecodeError) -> bool:
    """Whether the JSON failed only because the text ends (so more text could complete it), not because
    it is malformed: an unterminated string, or nothing but the start of a literal after the error."""
    if err.msg.startswith("Unterminated string"):
        return True
    tail = text[err.pos:].rstrip()
    return tail == "-" or any(w.startswith(tail) for w in ("true", "false", "null"))


def _as_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    raw = raw_arguments(body)
    try:
        if raw is not None and json.loads(raw) != args:
            raw = None
    except ValueError:
        raw = None
    return ToolCall(new_call_id(), obj["name"], args, raw)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls): the calls of every well-formed block, and the text without any block (stripped).
    No ``<tool_call>`` markup stays in the content: a block that is not a call, or one cut off (by
    max_tokens), is dropped. Text without blocks comes back as it is. Never raises."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    try:
        while (i := text.find(OPEN, pos)) >= 0:
            b = read_block(text, i)
            kept.append(text[pos:i])
            pos = b.end
            if b.call is not None:
                calls.append(b.call)
        kept.append(text[pos:])
    except Exception:  # noqa: BLE001 - never raise on model output
        return text, []
    if pos == 0:
        return text, []
    return "".join(kept).strip(), calls


def render_tools_for_template(tools: Iterable[Any]) -> list[dict]:
    """The tools as `tokenizer.apply_chat_template(..., tools=...)` takes them: OpenAI-style function dicts
    (``{"type": "function", "function": {"name", "description", "parameters"}}``). Accepts ToolSpecs or
    OpenAI tool dicts."""
    return [s.to_openai() for s in _specs(tools)]


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders the `tools` it is given (else the caller must describe them)."""
    return template is not None and re.search(r"\btools\b", template) is not None


def tools_system_prompt(tools: Iterable[Any]) -> str:
    """A Hermes-style description of the tools, for templates that ignore `tools=` (SmolLM2's own)."""
    defs = "\n".join(json.dumps(t, ensure_ascii=False) for t in render_tools_for_template(tools))
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + defs +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")
