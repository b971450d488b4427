"""Rendering step results for people and for JSON, totally: one value that cannot be rendered (an int
past Python's 4,300-digit string limit, an object whose ``__str__`` raises, a string with lone
surrogates) becomes a marked placeholder that says why, so every other result of the run still shows."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["to_jsonable", "unrenderable", "safe_repr", "printable", "clip"]

_MAX_DEPTH = 50

CLIP_CHARS = 4000   # a traced LLM call's prompt or output text longer than this keeps its head and tail


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text``, or its first quarter and last three quarters of ``limit`` characters around a marker that says
    how many were left out (a prompt's start holds its system text, its end what the call added)."""
    if len(text) <= limit:
        return text
    head, tail = limit // 4, limit - limit // 4
    return f"{text[:head]}\n[... {len(text) - head - tail} characters left out ...]\n{text[-tail:]}"


def unrenderable(v: Any, error: BaseException | str) -> str:
    """The placeholder for a value that cannot be rendered: ``<unrenderable TYPE: REASON>``."""
    if isinstance(error, BaseException):
        try:
            reason = str(error) or type(error).__name__
        except Exception:  # noqa: BLE001 - rendering must never raise
            reason = type(error).__name__
    else:
        reason = error
    return f"<unrenderable {type(v).__name__}: {reason}>"


def safe_repr(v: Any) -> str:
    """``repr(v)``, or the placeholder when that raises."""
    try:
        return repr(v)
    except Exception as e:  # noqa: BLE001 - rendering must never raise
        return unrenderable(v, e)


def printable(s: str) -> str:
    """A string that encodes as UTF-8 (lone surrogates are escaped, not fatal when printed)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def to_jsonable(v: Any, _depth: int = 0) -> Any:
    """A JSON value for a step result (pydantic models, dataclasses, sets, arrays, ...; anything else
    becomes its ``str``). Never raises: what cannot be rendered becomes ``unrenderable(...)``."""
    try:
        return _convert(v, _depth)
    except Exception as e:  # noqa: BLE001 - rendering must never raise
        return unrenderable(v, e)


def _convert(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        return unrenderable(v, f"nested deeper than {_MAX_DEPTH} levels")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        int.__repr__(v)  # raises past sys.get_int_max_str_digits(), as json.dumps would
        return v
    if isinstance(v, str):
        return printable(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {_key(k): to_jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=safe_repr) if isinstance(v, (set, frozenset)) else v
        return [to_jsonable(x, depth + 1) for x in items]
    if hasattr(v, "model_dump") and callable(v.model_dump):
        try:
            return to_jsonable(v.model_dump(), depth + 1)
        except Exception:  # noqa: BLE001 - best effort, falls back to str()
            pass
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_jsonable({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, depth + 1)
    if hasattr(v, "tolist"):
        try:
            return to_jsonable(v.tolist(), depth + 1)
        except Exception:  # noqa: BLE001 - best effort, falls back to str()
            pass
    return printable(str(v))


def _key(k: Any) -> str:
    try:
        return printable(k if isinstance(k, str) else str(k))
    except Exception as e:  # noqa: BLE001 - rendering must never raise
        return unrenderable(k, e)
