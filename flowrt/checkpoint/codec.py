"""Step results as JSON for checkpoints, exactly or not at all.

``encode(v)`` is ``{"json": ...}`` when the value comes back equal from ``decode`` (JSON values, tuples,
and threads, which are stored as their token ids and text), else ``{"placeholder": "<unrenderable ...>" or
its rendering, "type": ...}``: a marked placeholder, whose step runs again on resume instead of handing its
successors a string where they expect an object.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..render import to_jsonable

__all__ = ["encode", "decode", "encode_thread", "NotRestorable"]

TAG = "__flowrt__"
_MAX_DEPTH = 60


class NotRestorable(Exception):
    """An encoded value that cannot be decoded here (a placeholder, or a thread with no model)."""


class _NotJSON(Exception):
    pass


def encode_thread(t: Any) -> dict[str, Any]:
    from ..llm.thread import ChatThread

    d: dict[str, Any] = {TAG: "thread", "token_ids": list(t.token_ids), "text": t.text}
    if isinstance(t, ChatThread):
        d.update(chat=True, messages=t.messages, chat_template=t.chat_template)
    return d


def _enc(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _NotJSON("nested too deep")
    if v is None or isinstance(v, (bool, str)):
        if isinstance(v, str):
            v.encode("utf-8")  # lone surrogates cannot be stored
        return v
    if isinstance(v, int):
        int.__repr__(v)
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _NotJSON("not a finite float")
        return v
    if isinstance(v, list) and type(v) is list:
        return [_enc(x, depth + 1) for x in v]
    if isinstance(v, tuple) and type(v) is tuple:
        return {TAG: "tuple", "items": [_enc(x, depth + 1) for x in v]}
    if type(v) is dict:
        if not all(isinstance(k, str) for k in v) or TAG in v:
            raise _NotJSON("dict keys must be str")
        return {k: _enc(x, depth + 1) for k, x in v.items()}
    from ..llm.thread import Thread

    if isinstance(v, Thread):
        if v.closed:
            raise _NotJSON("a closed thread")
        return encode_thread(v)
    raise _NotJSON(type(v).__name__)


def encode(v: Any) -> dict[str, Any]:
    try:
        enc = _enc(v, 0)
        json.dumps(enc, allow_nan=False)
        return {"json": enc}
    except Exception as e:  # noqa: BLE001 - anything unencodable becomes a placeholder
        shown = to_jsonable(v)
        return {"placeholder": shown if isinstance(shown, str) else json.dumps(shown, default=str)[:2000],
                "type": type(v).__name__, "reason": str(e) or type(e).__name__}


def _dec(v: Any, model: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x, model) for x in v]
    if isinstance(v, dict):
        tag = v.get(TAG)
        if tag == "tuple":
            return tuple(_dec(x, model) for x in v["items"])
        if tag == "thread":
            if model is None:
                raise NotRestorable("a thread, and the run has no model")
            from ..llm.thread import ChatThread, Thread

            if v.get("chat"):
                return ChatThread.from_tokens(model, v["token_ids"], v["text"], messages=v.get("messages", []),
                                              chat_template=v.get("chat_template"))
            return Thread.from_tokens(model, v["token_ids"], v["text"])
        return {k: _dec(x, model) for k, x in v.items()}
    return v


def decode(enc: dict[str, Any], model: Any = None) -> Any:
    """The value ``encode`` stored; ``NotRestorable`` for a placeholder (or a thread without a model)."""
    if "json" not in enc:
        raise NotRestorable(f"stored as a placeholder ({enc.get('type')}: {enc.get('reason')})")
    return _dec(enc["json"], model)
