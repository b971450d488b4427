"""The engine's command-line options, built from ``EngineArgs``' fields (as vLLM's ``EngineArgs.add_cli_args``).

One ``--kebab-case`` option per field: its help is the field's ``description`` plus its type, bounds and
default; booleans get ``--x/--no-x``; a value is validated by ``EngineArgs`` itself, so a bad one is a
usage error naming the option. Options left out are ``None`` and not passed on (the engine's defaults apply).
Front ends (``flowrt run``, ``flowrt serve``) add ``--model`` and these to their parsers.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from typing import Any, Callable

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from .config import EngineArgs

__all__ = ["add_cli_args", "engine_field_names", "engine_kwargs_from_args", "option_help"]


def _fields() -> dict[str, FieldInfo]:
    """EngineArgs' fields but ``model`` (``--model``, which front ends add themselves)."""
    return {n: f for n, f in EngineArgs.model_fields.items() if n != "model"}


def engine_field_names() -> list[str]:
    return list(_fields())


def _unwrap_optional(ann: Any) -> Any:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _bound(field: FieldInfo, name: str) -> Any:
    return next((getattr(m, name) for m in field.metadata if getattr(m, name, None) is not None), None)


def option_help(field: FieldInfo) -> tuple[str, str | None]:
    """(help, metavar) of one field: its description, then its type, bounds and default."""
    ann = _unwrap_optional(field.annotation)
    kind = ""
    metavar: str | None
    if typing.get_origin(ann) is typing.Literal:
        metavar = "{" + ",".join(str(c) for c in typing.get_args(ann)) + "}"
    elif isinstance(ann, type) and issubclass(ann, enum.Enum):
        metavar = "{" + ",".join(str(m.value) for m in ann) + "}"
    else:
        metavar = {int: "N", float: "X", str: "TEXT"}.get(ann)
        kind = getattr(ann, "__name__", str(ann))
        lo, hi = _bound(field, "ge"), _bound(field, "le")
        if lo is not None and hi is not None:
            kind += f" in {lo}..{hi}"
        elif lo is not None:
            kind += f" >= {lo}"
        elif hi is not None:
            kind += f" <= {hi}"
    shown = field.default.value if isinstance(field.default, enum.Enum) else field.default
    default = "default: the engine's choice" if field.default is None else f"default {shown}"
    details = f"{kind}; {default}" if kind else default
    help_ = f"{field.description} ({details})" if field.description else details
    return help_.replace("%", "%%"), metavar


def _value(name: str) -> Callable[[str], Any]:
    """argparse ``type=``: the value as EngineArgs validates it (a bad one is a usage error naming the option)."""

    def convert(raw: str) -> Any:
        try:
            value = getattr(EngineArgs.model_validate({name: raw}), name)
            return raw if value is None else value  # an explicit off (--speculative-config off) stays given
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{raw!r}: {e.errors()[0]['msg']}") from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def add_cli_args(group: argparse._ActionsContainer) -> None:
    """One option per EngineArgs field (but ``model``) on an argparse parser or argument group."""
    fields = _fields()
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        help_, metavar = option_help(field)
        if _unwrap_optional(field.annotation) is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            group.add_argument(flag, dest=name, type=_value(name), default=None, metavar=metavar, help=help_)
    if "enable_prefix_caching" in fields:  # the historical spelling
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                           help=argparse.SUPPRESS)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` keywords given on the command line (options left out are not included)."""
    return {n: getattr(args, n) for n in engine_field_names() if getattr(args, n, None) is not None}
