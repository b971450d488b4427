"""Structured outputs and tool calls over HTTP: request fields into an engine constraint, and tool calls
back out of the generated text (whole, or as OpenAI-style streamed deltas).

Constraint sources (at most one per request): ``response_format`` (``json_object`` / ``json_schema``),
vLLM's ``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields, and ``tools`` with ``tool_choice`` "required" / a named function (the output is
one or more calls) or "auto" (free text, but a ``<tool_call>`` block the model starts is a valid call).
Each constraint remembers the request parameter it came from, so a bad one is a 400 naming it.

Compiling a constraint can take a while (a large schema): `precompile` runs it in a worker thread before
the request is submitted (the engine caches compiled constraints by spec, so the submission on the event
loop then costs a matcher copy).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from flowrt.llm import toolcalls as TC

from .errors import OpenAIError, bad_request


@dataclass
class Constraint:
    params: Any          # flowrt.engine.StructuredOutputsParams
    param: str           # the request parameter it came from (named in errors)


def _so(param: str, **kw) -> Constraint:
    from flowrt.engine import StructuredOutputsParams

    try:
        return Constraint(StructuredOutputsParams(**kw), param)
    except Exception as e:  # noqa: BLE001 - pydantic ValidationError: a malformed spec
        if hasattr(e, "errors"):
            err = e.errors(include_url=False)[0]
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = f"{loc}: {err['msg']}" if loc else err["msg"]
        else:
            msg = str(e)
        raise bad_request(f"{param}: {msg}", param=param) from None


def from_response_format(rf: dict[str, Any] | None) -> Constraint | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _so("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'.",
                              param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required.",
                              param="response_format.json_schema.schema")
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                              param="response_format.json_schema.schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be true or false.",
                              param="response_format.json_schema.strict")
        # strict false: the schema as JSON Schema reads it (objects may take keys they do not name)
        return _so("response_format.json_schema.schema", json=schema, strict=strict is not False)
    raise bad_request(f"response_format.type {kind!r} is not supported (text, json_object, json_schema).",
                      param="response_format.type")


def from_request(req: Any) -> Constraint | None:
    """The request's output constraint other than tools (None when unconstrained); 400 when several."""
    found: list[Constraint] = []
    c = from_response_format(req.response_format)
    if c is not None:
        found.append(c)
    if req.structured_outputs is not None:
        so = req.structured_outputs
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object.", param="structured_outputs")
        found.append(_so("structured_outputs", **so))
    for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                     ("guided_grammar", "grammar")):
        v = getattr(req, name)
        if v is not None:
            found.append(_so(name, **{kw: v}))
    if len(found) > 1:
        raise bad_request(f"Give at most one output constraint; got {', '.join(c.param for c in found)}.",
                          param=found[1].param)
    if not found:
        return None
    if req.bound_numbers is not None and found[0].params.kind in ("json", "json_object"):
        found[0].params = found[0].params.model_copy(update={"bound_numbers": req.bound_numbers})
    return found[0]


# ---- tools ----------------------------------------------------------------------------------------------


@dataclass
class Tools:
    specs: list[TC.ToolSpec]
    choice: str              # "none" | "auto" | "required" | a function name
    parallel: bool
    max_calls: int | None = None      # None: toolcalls.MAX_CALLS
    bound_numbers: bool = True

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> Constraint | None:
        try:
            if self.choice == "none":
                return None
            if self.choice == "auto":
                return Constraint(TC.auto_constraint(self.specs, self.max_calls, self.bound_numbers), "tools")
            return Constraint(TC.call_constraint(self.specs, self.choice, self.parallel, self.max_calls,
                                                 self.bound_numbers), "tools")
        except ValueError as e:
            raise bad_request(str(e), param="tool_choice") from None


def tools_of(req: Any) -> Tools | None:
    """The request's tools and tool_choice (None without tools); 400 for a malformed one."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires tools.", param="tool_choice")
        return None
    specs = []
    for i, t in enumerate(req.tools):
        try:
            specs.append(TC.ToolSpec.from_openai(t))
        except ValueError as e:
            raise bad_request(f"tools[{i}]: {e}", param=f"tools[{i}]") from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names.", param="tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}.', param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not one of the tools.", param="tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice {choice!r} is not one of none, auto, required.", param="tool_choice")
    parallel = True if req.parallel_tool_calls is None else bool(req.parallel_tool_calls)
    return Tools(specs, choice, parallel, req.max_tool_calls, req.bound_numbers is not False)


def resolve(req: Any) -> tuple[Constraint | None, Tools | None]:
    """(the constraint to submit, the tools to parse calls for)."""
    c = from_request(req)
    tools = tools_of(req) if hasattr(req, "tools") else None
    if tools is not None:
        if c is not None:
            if tools.choice not in ("none", "auto"):
                raise bad_request(f"{c.param} cannot be combined with tool_choice {tools.choice!r}.",
                                  param="tool_choice")
            return c, tools  # auto + a response format: the format constrains, calls are still parsed
        return tools.constraint(), tools
    return c, None


def _manager(engine: Any) -> Any:
    inner = getattr(engine, "engine", None)
    return getattr(inner, "structured", None)


async def precompile(engine: Any, c: Constraint | None) -> None:
    """Compiles `c` in a worker thread (filling the engine's cache); a bad constraint is a 400 naming its
    parameter."""
    if c is None:
        return
    mgr = _manager(engine)
    if mgr is None:
        return  # the engine compiles it at submission
    try:
        await asyncio.to_thread(mgr.compile, c.params)
    except ValueError as e:
        msg = re.sub(r"^structured_outputs\.\w+", c.param, str(e))
        raise OpenAIError(msg, 400, param=c.param, code="invalid_structured_output") from None


# ---- tool calls out --------------------------------------------------------------------------------------


def message(text: str, finish_reason: str | None, tools: Tools | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason ("tool_calls" when it made calls)."""
    if tools is None or not tools.parse:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = TC.parse_tool_calls(text)  # no call markup in content, even of a cut-off call
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    msg = {"role": "assistant", "content": content or None, "tool_calls": [_openai(c) for c in calls]}
    return msg, ("tool_calls" if finish_reason == "stop" else finish_reason)


def _openai(c: TC.ToolCall) -> dict[str, Any]:
    d = c.to_openai()
    if c.raw_arguments is not None:  # as written: what a stream of the same text sends
        d["function"]["arguments"] = c.raw_arguments
    return d


_HEAD = TC.CALL_HEAD


def _args_end(s: str) -> int:
    """How much of `s` (what follows ``"arguments": `` so far, the call not yet complete) is surely
    arguments: without a partial closing tag, whitespace and the call object's own closing brace at its end."""
    for k in range(min(len(s), len(TC.CLOSE)), 0, -1):
        if TC.CLOSE.startswith(s[-k:]):
            s = s[:-k]
            break
    s = s.rstrip()
    if s.endswith("}"):
        s = s[:-1].rstrip()
    return len(s)


@dataclass
class ToolStream:
    """One choice's streamed text split into content deltas and OpenAI tool-call deltas: the call's id,
    type and name first (with empty arguments), then its arguments text in pieces. Text that might be the
    start of a ``<tool_call>`` is held back; whitespace-only content (between blocks) is dropped."""
    buf: str = ""            # text not yet resolved
    in_call: bool = False
    name_sent: bool = False
    args_sent: int = 0       # characters of the current call's arguments already sent
    index: int = -1          # of the current call
    calls: int = 0
    pending_ws: str = ""
    made_calls: bool = False
    _ids: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        content = ""
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                i = self.buf.find(TC.OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buf, TC.OPEN)
                    content += self._content(self.buf[:len(self.buf) - keep], final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return content, deltas
                content += self._content(self.buf[:i], False)
                self.pending_ws = ""
                self.buf = self.buf[i:]  # from the open tag on
                self.in_call, self.name_sent, self.args_sent = True, False, 0
                continue
            block = TC.read_block(self.buf, 0, final)  # None while the call is still coming
            if block is None:
                body = self.buf[TC.skip_ws(self.buf, len(TC.OPEN)):]
            else:
                body = self.buf[block.body_start:block.body_end]
            m = _HEAD.match(body)
            if m and not self.name_sent:
                self.index, self.calls = self.calls, self.calls + 1
                cid = TC.new_call_id()
                self._ids.append(cid)
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = m.group(1)
                deltas.append({"index": self.index, "id": cid, "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.name_sent, self.made_calls = True, True
            if self.name_sent:
                rest = body[m.end():] if m else ""
                if block is None:
                    end = _args_end(rest)
                elif block.complete:  # exactly its arguments as written
                    raw = TC.raw_arguments(body)
                    end = len(raw) if raw is not None else len(rest)
                else:
                    end = self.args_sent  # cut off (or not JSON): nothing more of it is sure
                if end > self.args_sent:
                    deltas.append({"index": self.index, "function": {"arguments": rest[self.args_sent:end]}})
                    self.args_sent = end
            if block is None:
                return content, deltas
            self.buf = self.buf[block.end:]
            self.in_call = False

    def _content(self, s: str, final: bool) -> str:
        if not s:
            return ""
        s = self.pending_ws + s
        if not self.made_calls and final:
            self.pending_ws = ""
            return s  # no calls: the text as generated
        stripped = s.rstrip()
        self.pending_ws = "" if final else s[len(stripped):]
        return stripped


def _partial_suffix(s: str, tag: str) -> int:
    for k in range(min(len(s), len(tag) - 1), 0, -1):
        if tag.startswith(s[-k:]):
            return k
    return 0
