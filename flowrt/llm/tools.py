"""Tools for chat threads: ``@fr.tool`` turns a typed Python function into a tool the model may call.

```python
@fr.tool
def add(a: int, b: int = 0) -> int:
    \"\"\"Add two integers.

    Args:
        a: the first number
        b: the second number
    \"\"\"
    return a + b

c = llm.chat(system="You are a calculator.")
c.user("What is 2 + 3?")
reply = await c.assistant(tools=[add], tool_choice="required")   # reply.tool_calls: [ToolCall(...)]
await c.call_tools(reply)                                         # runs them, appends role "tool" messages
answer = await c.assistant(tool_choice="none")
```

The JSON schema of a tool's arguments comes from its signature (pydantic: types, defaults, ``Optional``,
``Annotated[..., Field(description=...)]``), its description from the docstring's first paragraph, and
per-parameter descriptions from a Google-style ``Args:`` section. Calling the tool object calls the function.
The wire format (``<tool_call>`` blocks), the constraints and the parser live in flowrt/llm/toolcalls.py.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from typing import Any, Callable, Iterable

import anyio

from ..worker import run_sync_abandonable
from .toolcalls import ToolCall, ToolSpec, format_call, template_supports_tools, tools_system_prompt

__all__ = ["Tool", "tool", "ToolTimeoutError", "AssistantReply", "as_tools", "run_tool_calls", "messages_for_template"]

TOOL_CHOICES = ("auto", "required", "none")


class Tool:
    """A callable tool: ``name``, ``description``, ``parameters`` (JSON schema), ``spec`` (ToolSpec),
    ``to_openai()``; calling it calls the function; ``await t.invoke(arguments)`` validates a dict of
    arguments and runs it (sync functions in a daemon thread that a cancelled caller abandons, as sync steps
    do, so a hung tool never holds up a step timeout or a cancelled run; ``timeout``: seconds a run may take
    before ``ToolTimeoutError``)."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 timeout: float | None = None) -> None:
        from pydantic import ConfigDict, create_model

        if not callable(fn):
            raise TypeError(f"@fr.tool needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or fn.__name__
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"tool {self.name!r}: timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = timeout
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.name):
            raise ValueError(f"tool name must be 1-64 characters of a-z, A-Z, 0-9, _, . or -, got {self.name!r}")
        doc = inspect.getdoc(fn) or ""
        summary, arg_docs = _parse_docstring(doc)
        self.description = description if description is not None else summary
        self.is_async = inspect.iscoroutinefunction(fn)
        sig = inspect.signature(fn)
        try:
            hints = _type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
            hints = {}
        fields: dict[str, Any] = {}
        self._var_kw = False
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL,):
                raise TypeError(f"tool {self.name!r}: *{p.name} is not supported (name every parameter)")
            if p.kind is p.VAR_KEYWORD:
                self._var_kw = True
                continue
            ann = hints.get(p.name, p.annotation)
            if ann is inspect.Parameter.empty:
                ann = Any
            default = ... if p.default is inspect.Parameter.empty else p.default
            desc = arg_docs.get(p.name)
            if desc:
                from pydantic import Field

                fields[p.name] = (ann, Field(default, description=desc))
            else:
                fields[p.name] = (ann, default)
        self._positional_only = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_ONLY]
        model_name = "".join(w[:1].upper() + w[1:] for w in re.split(r"[_.\-]+", self.name) if w) or "Args"
        try:
            self.arguments_model = create_model(
                model_name, __config__=ConfigDict(extra="allow" if self._var_kw else "forbid"), **fields)
            schema = self.arguments_model.model_json_schema()
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"tool {self.name!r}: cannot make a JSON schema of its parameters: {e}") from e
        self.parameters = _clean_schema(schema)
        functools.update_wrapper(self, fn)

    # the function itself
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # a tool defined in a class still binds
        return self if obj is None else functools.partial(self.fn, obj)

    def __repr__(self) -> str:
        return f"<fr.tool {self.name}{inspect.signature(self.fn)}>"

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def to_openai(self) -> dict:
        return self.spec.to_openai()

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments checked and converted by the signature's types (pydantic ValidationError if bad)."""
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
        m = self.arguments_model.model_validate(arguments)
        out = {k: getattr(m, k) for k in type(m).model_fields}
        if self._var_kw and m.model_extra:
            out.update(m.model_extra)
        return out

    async def invoke(self, arguments: dict[str, Any]) -> Any:
        """Validate ``arguments`` and run the tool (a sync function in an abandonable daemon thread), within
        its ``timeout`` (ToolTimeoutError naming the tool)."""
        kwargs = self.validate(arguments)
        args = [kwargs.pop(k) for k in self._positional_only]
        if self.timeout is None:
            return await self._run(args, kwargs)
        with anyio.move_on_after(self.timeout) as scope:
            return await self._run(args, kwargs)
        assert scope.cancelled_caught
        raise ToolTimeoutError(f"tool {self.name!r} timed out after {self.timeout:g}s", self.name)

    async def _run(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(*args, **kwargs)
        # Not anyio.to_thread: its worker threads are joined at exit, so a hung tool would outlive its caller.
        result = await run_sync_abandonable(functools.partial(self.fn, *args, **kwargs),
                                            name=f"flowrt tool {self.name}")
        if inspect.isawaitable(result):
            result = await result
        return result


class ToolTimeoutError(TimeoutError):
    """A tool ran past its ``@fr.tool(timeout=...)`` (a sync tool's thread is abandoned, still running)."""

    def __init__(self, message: str, tool: str) -> None:
        super().__init__(message)
        self.tool = tool


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout: float | None = None) -> Any:
    """Decorator: ``@fr.tool`` or ``@fr.tool(name=..., description=..., timeout=seconds)`` -> a ``Tool``."""
    if fn is None:
        return lambda f: Tool(f, name=name, description=description, timeout=timeout)
    return Tool(fn, name=name, description=description, timeout=timeout)


class AssistantReply(str):
    """An assistant turn that may call tools: the ``str`` is the generated text; ``content`` is it without
    the ``<tool_call>`` blocks; ``tool_calls`` the parsed calls (``name``, ``arguments`` dict, ``id``)."""

    content: str
    tool_calls: list[ToolCall]

    def __new__(cls, text: str, content: str | None = None, tool_calls: Iterable[ToolCall] = ()) -> "AssistantReply":
        obj = super().__new__(cls, text)
        obj.content = text if content is None else content
        obj.tool_calls = list(tool_calls)
        return obj

    def __reduce__(self) -> Any:
        return (AssistantReply, (str(self), self.content, self.tool_calls))


def as_tools(tools: Iterable[Any]) -> list[Any]:
    """Tools as given to ``assistant(tools=...)``: Tool objects, plain functions (made tools), ToolSpecs or
    OpenAI tool dicts (described to the model but not runnable by ``call_tools``)."""
    out = []
    for t in tools:
        if isinstance(t, (Tool, ToolSpec)):
            out.append(t)
        elif isinstance(t, dict):
            out.append(ToolSpec.from_openai(t))
        elif callable(t):
            out.append(Tool(t))
        else:
            raise TypeError(f"a tool must be an @fr.tool function, a ToolSpec or an OpenAI tool dict, got {t!r}")
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"two tools share the name {sorted(dup)[0]!r}")
    return out


def specs(tools: Iterable[Any]) -> list[ToolSpec]:
    return [t.spec if isinstance(t, Tool) else t for t in tools]


def assistant_message(reply: AssistantReply) -> dict[str, Any]:
    """The chat message recording an assistant turn (OpenAI shape; arguments kept as a dict, as chat
    templates expect)."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content if reply.tool_calls else str(reply)}
    if reply.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in reply.tool_calls]
    return msg


def messages_for_template(messages: list[dict[str, Any]], tools: list[Any] | None,
                          template: str | None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools=) for ``apply_chat_template``. A template that renders ``tools`` gets them as they
    are; for one that does not (SmolLM2's, the plain ChatML fallback) the tools are described in the system
    message (Hermes style) and assistant tool calls are written into the content as ``<tool_call>`` blocks."""
    has_calls = any(m.get("tool_calls") for m in messages)
    if not tools and not has_calls:
        return messages, None
    openai_tools = [s.to_openai() for s in specs(tools)] if tools else None
    if template_supports_tools(template):
        return messages, openai_tools
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m)
            calls = "\n".join(format_call(c["function"]["name"], _args(c["function"]["arguments"]))
                              for c in m.pop("tool_calls"))
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
        out.append(m)
    if tools:
        desc = tools_system_prompt(specs(tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + desc}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out, None


def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


async def run_tool_calls(calls: list[ToolCall], tools: list[Any]) -> list[str]:
    """Run ``calls`` concurrently; each result (or the error it raised, or why its arguments are invalid)
    as the text of its tool message."""
    from ..aio import gather

    by_name = {t.name: t for t in tools}

    async def one(call: ToolCall) -> str:
        t = by_name.get(call.name)
        if t is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(by_name) or 'none'})"
        if not isinstance(t, Tool):
            return f"error: tool {call.name!r} has no Python function to run"
        try:
            t.validate(call.arguments)
        except Exception as e:  # noqa: BLE001 - reported to the model
            return f"error: invalid arguments for {call.name}: {_validation_text(e)}"
        try:
            result = await t.invoke(call.arguments)
        except ToolTimeoutError as e:
            return f"error: {e}"
        except Exception as e:  # noqa: BLE001 - reported to the model
            return f"error: {call.name} raised {type(e).__name__}: {e}"
        return _result_text(result)

    return await gather(*(one(c) for c in calls))


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        from pydantic import BaseModel

        if isinstance(result, BaseModel):
            return result.model_dump_json()
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def _validation_text(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())) or 'arguments'}: {err.get('msg')}"
                             for err in errors())
        except Exception:  # noqa: BLE001
            pass
    return str(e)


# ---------------------------------------------------------------------------------------------- helpers
def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(fn, include_extras=True)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {parameter: description} from a Google-style ``Args:`` section)."""
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1) if doc.strip() else [""]
    summary = " ".join(line.strip() for line in paragraphs[0].splitlines()).strip()
    if re.match(r"^(Args|Arguments|Parameters|Returns|Raises):", summary):
        summary = ""
    args: dict[str, str] = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)+)", doc, re.MULTILINE)
    if m:
        current = None
        for line in m.group(2).splitlines():
            if not line.strip():
                continue
            hit = re.match(r"^\s{1,8}(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if hit and (current is None or len(line) - len(line.lstrip()) <= _indent_of(m.group(2))):
                current = hit.group(1).lstrip("*")
                args[current] = hit.group(2).strip()
            elif current is not None:
                args[current] = (args[current] + " " + line.strip()).strip()
    return summary, args


def _indent_of(block: str) -> int:
    for line in block.splitlines():
        if line.strip():
            return len(line) - len(line.lstrip())
    return 0


def _clean_schema(schema: Any) -> Any:
    """The pydantic schema without its ``title`` keys (noise for the model); ``$defs`` kept."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "title" and isinstance(v, str):
                continue
            if k == "properties" and isinstance(v, dict):
                out[k] = {pk: _clean_schema(pv) for pk, pv in v.items()}
            else:
                out[k] = _clean_schema(v)
        return out
    if isinstance(schema, list):
        return [_clean_schema(x) for x in schema]
    return schema
