"""Responses API items and fields in the chat shapes the rest of the server speaks, and back.

Input items (messages with content parts, ``function_call``, ``function_call_output``) become chat messages
(an assistant turn's calls attached to it as ``tool_calls``, a call's output a ``role: "tool"`` message), so
the chat template, the tool-call constraints and the structured-output engine are the chat endpoint's own.
A finished reply becomes output items (a ``message`` with ``output_text``, one ``function_call`` per call),
and those become chat messages again when a later response continues the conversation.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .errors import bad_request

_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """A message's (or a call output's) content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts.", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise bad_request(f"{where}[{j}]: content parts of type {kind!r} are not supported; only text "
                              f"({', '.join(_TEXT_PARTS[:2])}).", param=f"{where}[{j}]")
    return "".join(out)


def _field(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key} is required (a string).", param=f"{where}.{key}")
    return v


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; a 400 naming `input[i]` for an item it cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}.",
                                  param=f"{where}.role")
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", where), _field(item, "name", where)
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise bad_request(f"{where}.arguments must be a JSON string.", param=f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            names[call_id] = name
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the calls of the turn it belongs to
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            tool = {"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{where}.output")}
            if call_id in names:
                tool["name"] = names[call_id]
            msgs.append(tool)
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                              f"function_call_output).", param=f"{where}.type")
    return msgs


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: type, name, parameters) as chat tools; built-in tools are a 400."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: only function tools (built-in tools "
                              f"such as web_search run on OpenAI's servers).", param=f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.',
                      param="tool_choice")


def response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat endpoint's `response_format`."""
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return dict(fmt)  # json_object, or a type the structured-output code names in its 400


def rename_param(text: str) -> str:
    """Chat parameter names in an error (from the shared chat code) as this request names them."""
    for old, new in (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
                     ("max_completion_tokens", "max_output_tokens"), ("messages", "input")):
        text = text.replace(old, new)
    return text


# ---- out --------------------------------------------------------------------------------------------


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat message (structured.message) as output items: its text, then its calls."""
    items = []
    if message.get("content"):
        items.append(message_item(message["content"]))
    for c in message.get("tool_calls") or []:
        items.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def items_as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the assistant's chat turn (what the next response's template renders)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def tools_echo(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's function tools as the response object shows them."""
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools or []]


def nbytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
