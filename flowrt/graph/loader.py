"""Loading workflows from Python files (``flowrt run FILE.py``, ``flowrt graph``, the server)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from .workflow import Workflow, WorkflowError

__all__ = ["load_module", "find_workflows", "load_workflow", "loaded_workflow", "format_load_error"]


def load_module(path: str | Path) -> ModuleType:
    """Import a Python file as a module (its directory is importable while it loads, so it can import its
    neighbours)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"workflow file not found: {path}")
    if p.suffix != ".py":
        raise WorkflowError(f"workflow file must be a .py file: {path}")
    resolved = p.resolve()
    name = f"flowrt_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise WorkflowError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(resolved.parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if added:
            try:
                sys.path.remove(parent)
            except ValueError:
                pass
    return module


def find_workflows(module: ModuleType) -> dict[str, Workflow]:
    """The module's top-level workflows, by variable name (each also reachable by ``Workflow.name``)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, Workflow) and not k.startswith("_")}


def load_workflow(path: str | Path, name: str | None = None) -> Workflow:
    """The workflow defined in ``path``: the only one (not counting those that are subgraphs of another),
    or the one whose variable or workflow name is ``name``."""
    found = find_workflows(load_module(path))
    if not found:
        raise WorkflowError(f"{path} defines no flowrt Workflow at top level")
    if name is not None:
        for var, wf in found.items():
            if name in (var, wf.name):
                return wf
        raise WorkflowError(f"{path} has no workflow named {name!r}; it defines: "
                            + ", ".join(f"{v} ({w.name!r})" for v, w in found.items()))
    unique = list({id(w): w for w in found.values()}.values())
    subs = {id(s.sub) for w in unique for s in w.steps.values() if s.sub is not None}
    unique = [w for w in unique if id(w) not in subs] or unique
    if len(unique) > 1:
        raise WorkflowError(f"{path} defines several workflows ({', '.join(found)}); choose one with "
                            f"--workflow NAME")
    return unique[0]


def loaded_workflow(path: str | Path, name: str) -> Workflow | None:
    """The workflow named ``name`` (variable or ``Workflow.name``) of ``path`` when that file is already
    imported (``sys.modules``: the running script's ``__main__``, a module, or one ``load_module`` loaded),
    by identity; None when it is not. Importing a script again would run its top level a second time."""
    target = Path(path).resolve()
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if not isinstance(f, str) or Path(f).name != target.name:
            continue
        try:
            if Path(f).resolve() != target:
                continue
        except OSError:
            continue
        for var, wf in find_workflows(module).items():
            if name in (var, wf.name):
                return wf
    return None


def format_load_error(e: BaseException, path: str | Path) -> str:
    """The error of a workflow file that failed to import, as the user needs it: a SyntaxError as its
    file, line and caret only; anything else as a traceback that starts at the user's file (flowrt's
    and importlib's frames above it say nothing about the user's code)."""
    if isinstance(e, SyntaxError):
        return "".join(traceback.format_exception_only(type(e), e)).rstrip()
    user = str(Path(path).resolve())
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != user:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb or e.__traceback__)).rstrip()
