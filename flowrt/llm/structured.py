"""Constrained generation for threads: ``t.gen(json=Model | schema, regex=..., choice=[...], grammar=...)``.

``split_constraint(sampling)`` takes these keywords out of a call's sampling keywords and returns a
``Constraint``: what the engine is sent (``structured_outputs=``, a ``StructuredOutputsParams``) and how the
finished text becomes the call's value:

* ``json=<pydantic model class>`` -> a validated instance; ``json=<type>`` (``list[Record]``, ``int``, a
  TypedDict, ...) -> the value validated by a pydantic ``TypeAdapter``; ``json=<dict schema or JSON string>``
  -> the parsed JSON value;
* ``regex=``, ``choice=``, ``grammar=`` -> the text.

A generation cut short by ``max_tokens`` (finish_reason "length") raises ``IncompleteOutputError`` instead of
returning an unfinished prefix; a bad constraint raises ValueError naming the keyword.
"""

from __future__ import annotations

import json as _json
import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from pydantic import BaseModel, TypeAdapter

__all__ = ["Constraint", "IncompleteOutputError", "split_constraint", "KEYWORDS"]

KEYWORDS = ("json", "regex", "choice", "grammar")
DEFAULT_MAX_TOKENS = 256  # a constrained call without max_tokens gets this (the engine's default is 16)


class IncompleteOutputError(ValueError):
    """A constrained generation ended (finish_reason "length") before its output was complete."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text


class Constraint:
    """One call's constraint: ``keyword`` (json/regex/choice/grammar), ``params`` (StructuredOutputsParams)
    and ``parse(text)`` (the call's return value)."""

    def __init__(self, keyword: str, value: Any) -> None:
        from ..engine import StructuredOutputsParams

        self.keyword, self.value = keyword, value
        self._adapter: TypeAdapter[Any] | None = None
        self._model: type[BaseModel] | None = None
        spec: dict | list | str
        try:
            if keyword == "json":
                spec = self._json_schema(value)
            elif keyword == "choice":
                spec = list(value) if not isinstance(value, str) else value
            else:
                if not isinstance(value, str):
                    raise TypeError(f"expected a str, got {type(value).__name__}")
                spec = value
            self.params = StructuredOutputsParams(**{keyword: spec})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{keyword}=: {_short(e)}") from e

    def _json_schema(self, value: Any) -> dict | str:
        if isinstance(value, (dict, str)):
            if isinstance(value, str):
                try:
                    _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"a schema given as a string must be JSON: {e}") from None
            return value
        from pydantic import BaseModel, TypeAdapter

        if isinstance(value, type) and issubclass(value, BaseModel):
            self._model = value
            return value.model_json_schema()
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(value)
            self._adapter = adapter
            return adapter.json_schema()
        except Exception as e:  # noqa: BLE001 - PydanticSchemaGenerationError, PydanticUserError, ...
            raise ValueError(f"cannot make a JSON schema of {value!r} (give a pydantic model class, a type, "
                             f"or a JSON schema dict): {e}") from None

    def sampling(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The call's sampling keywords with the constraint added (and a default max_tokens)."""
        if "sampling_params" in sampling:
            sp = sampling["sampling_params"]
            if getattr(sp, "structured_outputs", None) is not None:
                raise ValueError(f"{self.keyword}= and sampling_params.structured_outputs both given")
            return {"sampling_params": sp.model_copy(update={"structured_outputs": self.params})}
        if sampling.get("structured_outputs") is not None:
            raise ValueError(f"{self.keyword}= and structured_outputs= both given: pass one")
        out = {**sampling, "structured_outputs": self.params}
        out.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        return out

    @contextmanager
    def translating(self, what: str = "gen") -> Iterator[None]:
        """Engine errors about the constraint (raised at submission) re-raised naming the keyword."""
        try:
            yield
        except ValueError as e:
            if isinstance(e, IncompleteOutputError) or "structured_outputs" not in str(e):
                raise
            raise ValueError(f"{what}({self.keyword}=...): invalid constraint: {_short(e)}") from e

    def check(self, out: Any, what: str = "gen", max_tokens: int | None = None) -> str:
        """The finished text of ``out`` (a RequestOutput); IncompleteOutputError if it was cut short."""
        co = out.outputs[0]
        if co.finish_reason == "length":
            mt = f"max_tokens={max_tokens}" if max_tokens is not None else "max_tokens"
            tail = co.text if len(co.text) <= 80 else "..." + co.text[-77:]
            raise IncompleteOutputError(
                f"{what}({self.keyword}=...): the output was cut off at {mt} (finish_reason 'length') before "
                f"it was complete; raise max_tokens (or bound the schema). Partial output: {tail!r}", co.text)
        return co.text

    def parse(self, text: str) -> Any:
        if self.keyword != "json":
            return text
        if self._model is not None:
            return self._model.model_validate_json(text)
        if self._adapter is not None:
            return self._adapter.validate_json(text)
        return _json.loads(text)

    def result(self, out: Any, what: str = "gen", max_tokens: int | None = None) -> Any:
        return self.parse(self.check(out, what, max_tokens))


def split_constraint(sampling: dict[str, Any]) -> tuple[Constraint | None, dict[str, Any]]:
    """(the constraint of ``json=`` / ``regex=`` / ``choice=`` / ``grammar=``, or None; the other keywords)."""
    given = [k for k in KEYWORDS if sampling.get(k) is not None]
    if not given:
        return None, {k: v for k, v in sampling.items() if k not in KEYWORDS}
    if len(given) > 1:
        raise ValueError(f"give one of json=, regex=, choice=, grammar= (got {', '.join(given)})")
    rest = {k: v for k, v in sampling.items() if k not in KEYWORDS}
    return Constraint(given[0], sampling[given[0]]), rest


def _short(e: BaseException) -> str:
    s = str(e)
    s = re.sub(r"\s+", " ", s)
    return s if len(s) <= 500 else s[:497] + "..."
