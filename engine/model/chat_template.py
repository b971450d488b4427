"""Chat templates rendered as transformers renders them (a sandboxed jinja2 environment with its globals, filters
and extension), without importing transformers: used by engine/model/tokenizer.py's ``apply_chat_template``."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

__all__ = ["render_chat_template"]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """Template data as plain JSON-like values: a sandboxed template must not reach methods of rich objects
    (pydantic models and dataclasses become dicts, anything unknown a "<TypeName>" placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(chat: Any) -> list[dict]:
    """Messages as plain dicts, keys whose value is None dropped (templates print "None" or fail on them),
    reasoning copied under the names templates read."""
    out = []
    for m in _plain(getattr(chat, "messages", chat)):
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tool_schemas(tools: list | None) -> list | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):  # a Python function: transformers derives the JSON schema from its docstring
            from transformers.utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
    return _plain(schemas)


def render_chat_template(template: str, chat: Any, tools: list | None = None, documents: list | None = None,
                         add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                         **kwargs: Any) -> str:
    """One conversation rendered through ``template``, as transformers renders it.

    ``continue_final_message`` (True or the name of the field to continue) ends the text right after the
    last message's content, so generation continues it.
    """
    messages = _messages(chat)
    final = None
    if continue_final_message:
        if not messages:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = messages[-1].get(field)
        if final is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [k for k in _REASONING_KEYS if messages[-1].get(k) == final] if field in _REASONING_KEYS else [field]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                             "chat_template")
        if isinstance(final, list):
            block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
            if block is None:
                raise ValueError("continue_final_message is set but we could not find any text to continue in "
                                 "the final message!")
            final = block["text"]
            block["text"] += _CONTINUE_TAG
        else:
            for f in fields:
                messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    text = _compiled(template).render(messages=messages, tools=_tool_schemas(tools), documents=_plain(documents),
                                      add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template!")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


@functools.lru_cache(maxsize=32)
def _compiled(template: str):
    return _environment().from_string(template)


@functools.lru_cache(maxsize=1)
def _environment():
    """A sandboxed Jinja environment set up as transformers sets up its own for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for masks): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore names (no way to CPython internals through it)."""

        def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick, so namespace(self=...) works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class DictFactory:
        """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=DictFactory(), namespace=Namespace)
    return env
