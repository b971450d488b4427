"""The ``flowrt`` command line.

    flowrt run FILE.py [--input NAME=VALUE ...] [--model PATH] [--json] [--trace FILE] [--workflow NAME]
                       [--index DIR] [--ENGINE-OPTION VALUE ...]
    flowrt graph FILE.py [--format text|mermaid|dot]
    flowrt bench NAME [ARGS ...]          # runs bench/NAME.py (bench/ is in a source checkout only)
    flowrt serve ...                      # flowrt.server (when installed)
    flowrt index ...                      # flowrt.retrieval (when installed)

Exit status of ``run``: 0 when every step succeeded, 1 when a step failed (its dependents are skipped;
every other result is still printed), 2 for a bad command line, workflow file, input or model.

The engine options (``run`` and ``serve``) are generated from ``flowrt.engine.EngineArgs``: one
``--kebab-case`` option per field, documented where the field is (``flowrt run --help`` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser", "add_engine_arguments", "engine_kwargs_from_args", "parse_inputs"]

EXIT_OK, EXIT_STEP_FAILED, EXIT_USAGE = 0, 1, 2

ENGINE_GROUP_DESCRIPTION = ("the fields of flowrt.engine.EngineArgs (engine/API.md); an option left out keeps the "
                            "engine's default")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that adds the engine's options only when it is used (parsing or help).

    The options are generated from ``EngineArgs``, and importing it loads the engine (torch): ``flowrt
    graph`` or ``flowrt run`` on plain Python steps must not pay for that.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list[Callable[[], None]] = []

    def defer_engine_options(self, add: Callable[[], None]) -> None:
        self._deferred.append(add)

    def _materialize(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._materialize()
        return super().parse_known_args(args, namespace)

    def _parse_known_args(self, *args: Any, **kwargs: Any) -> Any:  # some Pythons skip parse_known_args
        self._materialize()
        return super()._parse_known_args(*args, **kwargs)

    def format_usage(self) -> str:
        self._materialize()
        return super().format_usage()

    def format_help(self) -> str:
        self._materialize()
        return super().format_help()


def _engine_fields() -> dict[str, Any]:
    """EngineArgs' fields (pydantic FieldInfo) but ``model`` (``--model``, handled apart)."""
    from .engine import EngineArgs

    return {n: f for n, f in EngineArgs.model_fields.items() if n != "model"}


_ENGINE_FIELD_NAMES: list[str] | None = None  # filled when the options are first added


def _engine_field_names() -> list[str]:
    global _ENGINE_FIELD_NAMES
    if _ENGINE_FIELD_NAMES is None:
        _ENGINE_FIELD_NAMES = list(_engine_fields())
    return _ENGINE_FIELD_NAMES


def _field_comments() -> dict[str, str]:
    """The ``# comment`` of each EngineArgs field in engine/config.py (trailing the field, else the comment
    lines right above it): the help of a field that has no ``Field(description=...)``."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        from .engine import EngineArgs

        src = textwrap.dedent(inspect.getsource(EngineArgs))
        lines = src.splitlines()
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
        cls = ast.parse(src).body[0]
        out = {}
        for node in getattr(cls, "body", []):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                text = comments.get(node.end_lineno or node.lineno)
                if not text:  # a block of comment-only lines right above the field
                    above, n = [], node.lineno - 1
                    while n in comments and lines[n - 1].lstrip().startswith("#"):
                        above.insert(0, comments[n])
                        n -= 1
                    text = " ".join(above)
                if text:
                    out[node.target.id] = text
        return out
    except Exception:  # source unavailable (zipped install, ...): help without the comments
        return {}


def _unwrap_optional(ann: Any) -> Any:
    import types
    import typing

    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _engine_option_help(name: str, field: Any, comment: str | None) -> tuple[str, str | None]:
    """(help, metavar) of one EngineArgs field."""
    import typing

    ann = _unwrap_optional(field.annotation)
    kind = ""
    if typing.get_origin(ann) is typing.Literal:
        metavar = "{" + ",".join(str(c) for c in typing.get_args(ann)) + "}"
    else:
        metavar = {int: "N", float: "X", str: "TEXT"}.get(ann)
        kind = getattr(ann, "__name__", str(ann))
        lo = next((getattr(m, "ge", None) for m in field.metadata if getattr(m, "ge", None) is not None), None)
        hi = next((getattr(m, "le", None) for m in field.metadata if getattr(m, "le", None) is not None), None)
        if lo is not None and hi is not None:
            kind += f" in {lo}..{hi}"
        elif lo is not None:
            kind += f" >= {lo}"
        elif hi is not None:
            kind += f" <= {hi}"
    default = "default: the engine's choice" if field.default is None else f"default {field.default}"
    details = f"{kind}; {default}" if kind else default
    lead = field.description or comment
    help_ = f"{lead} ({details})" if lead else details
    return help_.replace("%", "%%"), metavar


def _engine_value(name: str) -> Callable[[str], Any]:
    """argparse ``type=``: the value as EngineArgs validates it (a bad one is a usage error naming the option)."""

    def convert(raw: str) -> Any:
        from pydantic import ValidationError

        from .engine import EngineArgs

        try:
            return getattr(EngineArgs(**{name: raw}), name)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{raw!r}: {e.errors()[0]['msg']}") from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def _add_engine_options(g: Any) -> None:
    global _ENGINE_FIELD_NAMES
    fields = _engine_fields()
    _ENGINE_FIELD_NAMES = list(fields)
    comments = _field_comments()
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        help_, metavar = _engine_option_help(name, field, comments.get(name))
        if _unwrap_optional(field.annotation) is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            g.add_argument(flag, dest=name, type=_engine_value(name), default=None, metavar=metavar, help=help_)
    if "enable_prefix_caching" in fields:  # the historical spelling
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                       help=argparse.SUPPRESS)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--model`` and one ``--kebab-case`` option per ``EngineArgs`` field (shared by ``flowrt run`` and
    ``flowrt serve``; read back with ``engine_kwargs_from_args``). On a parser of this CLI the engine
    options are generated when the parser is first used, so building the CLI does not load the engine."""
    g = p.add_argument_group("engine", ENGINE_GROUP_DESCRIPTION)
    g.add_argument("--model", metavar="PATH", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    defer = getattr(p, "defer_engine_options", None)  # duck-typed: `python -m flowrt.cli` has two _Parser classes
    if defer is not None:
        defer(lambda: _add_engine_options(g))
    else:
        _add_engine_options(g)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` keywords given on the command line (options left out are not included)."""
    return {n: getattr(args, n) for n in _engine_field_names() if getattr(args, n, None) is not None}


# ---------------------------------------------------------------------------------------------- inputs
class UsageError(Exception):
    pass


def _is_str_annotation(ann: Any) -> bool:
    return ann is str or ann == "str"


def _fits(wf: Any, name: str, value: Any) -> bool:
    from .inputs import coerce_input
    from .workflow import WorkflowError

    try:
        coerce_input(wf, name, value)
    except WorkflowError:
        return False
    return True


def parse_inputs(pairs: Sequence[str], files: Sequence[str], wf: Any) -> dict[str, Any]:
    """``NAME=VALUE`` pairs: the value is a string for inputs annotated ``str``, otherwise JSON when it
    parses as JSON (numbers, lists, objects, true/false/null) and the raw string when not (or when only
    the string fits the input's type). Types are checked later, by ``Workflow.check_inputs``.
    ``--input-file NAME=PATH`` reads the value from a file (always a string)."""
    specs = wf.inputs
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--input expects NAME=VALUE, got {pair!r}")
        name, value = pair.split("=", 1)
        name = name.strip()
        ann = specs[name].annotation if name in specs else None
        if _is_str_annotation(ann):
            out[name] = value
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            out[name] = value
            continue
        # JSON unless only the raw text fits the step's type (e.g. `--input name=123` for `name: str | None`)
        out[name] = value if not _fits(wf, name, parsed) and _fits(wf, name, value) else parsed
    for pair in files:
        if "=" not in pair:
            raise UsageError(f"--input-file expects NAME=PATH, got {pair!r}")
        name, path = pair.split("=", 1)
        try:
            out[name.strip()] = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--input-file {name}: cannot read {path}: {e.strerror or e}") from None
    return out


# ---------------------------------------------------------------------------------------------- run
def _print_result_human(result: Any, show_tb: bool) -> None:
    from rich.console import Console
    from rich.pretty import Pretty
    from rich.text import Text

    from .render import printable, unrenderable

    out = Console(soft_wrap=True, highlight=False)
    err = Console(stderr=True, highlight=False)
    sinks = set(result.sinks)
    for name, value in result.outputs.items():
        label = Text(name, style="bold") + Text(" (result):" if name in sinks else ":")
        try:  # step results are shown as text, never parsed as rich markup
            out.print(label, Text(printable(value)) if isinstance(value, str) else Pretty(value))
        except Exception as e:
            out.print(label, Text(unrenderable(value, e)))
    for name, e in result.errors.items():
        style = "magenta" if e.kind == "skipped" else "bold red"
        message = e.message.removeprefix(f"{e.kind}: ")  # "x skipped: depends on ...", not "skipped: skipped:"
        err.print(Text(f"{name} {e.kind}", style=style) + Text(f": {printable(message)}"), highlight=False)
        if e.traceback and e.kind != "skipped":
            tb = e.traceback.rstrip().splitlines()
            shown = tb if show_tb else tb[-6:]
            if not show_tb and len(tb) > 6:
                err.print("  ... (--traceback shows all)", style="dim")
            for line in shown:
                err.print("  " + printable(line), style="dim", markup=False, highlight=False)


class _LoadFailed(Exception):
    pass


class _EngineFailed(Exception):
    """The model (--model and the engine options) could not be loaded."""


class _StderrHandler(logging.Handler):
    """Log lines to whatever ``sys.stderr`` is when they are emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _show_engine_log() -> None:
    """Show the engine's INFO lines (its start-up line reports the KV cache size) on stderr, once."""
    log = logging.getLogger("flowrt.engine")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        log.addHandler(_StderrHandler())
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _load(args: argparse.Namespace, cmd: str) -> Any:
    """The workflow of args.file; errors raised by the user's module get its traceback and exit 2."""
    from .loader import format_load_error, load_workflow
    from .workflow import WorkflowError

    try:
        return load_workflow(args.file, args.workflow)
    except (WorkflowError, FileNotFoundError):
        raise
    except Exception as e:
        print(f"flowrt {cmd}: error: cannot load {args.file}:", file=sys.stderr)
        print(format_load_error(e, args.file), file=sys.stderr)
        raise _LoadFailed() from e


def cmd_run(args: argparse.Namespace) -> int:
    import anyio

    from .executor import RunObserver
    from .runtime import Runtime
    from .trace import Tracer
    from .workflow import WorkflowError

    try:
        wf = _load(args, "run")
        inputs = parse_inputs(args.input or [], args.input_file or [], wf)
        wf.validate()
        inputs = wf.check_inputs(inputs)   # typed and converted before anything (the model) loads
    except (UsageError, WorkflowError, FileNotFoundError) as e:
        print(f"flowrt run: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _LoadFailed:
        return EXIT_USAGE

    runtime = Runtime(args.model, index=args.index, **engine_kwargs_from_args(args))
    observer = RunObserver(wf)
    tracer = Tracer(stats_fn=runtime.stats)
    use_progress = (not args.no_progress) and sys.stderr.isatty()

    async def go() -> Any:
        async with runtime:
            if "llm" in wf.resources:  # a model that cannot load is a usage error, not a skipped step
                _show_engine_log()   # the engine's start-up line: model, dtype, KV blocks and MiB
                try:
                    await runtime.model()
                except Exception as e:
                    raise _EngineFailed(f"cannot start the engine: {e}") from e
            if use_progress:
                from .progress import ProgressDisplay

                with ProgressDisplay(observer, runtime.stats):
                    return await runtime.execute(wf, inputs, tracer=tracer, observer=observer)
            return await runtime.execute(wf, inputs, tracer=tracer, observer=observer)

    # With --json nothing but the JSON may reach stdout: steps that print write to stderr instead.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with redirect:
            result = anyio.run(go)
    except (WorkflowError, _EngineFailed) as e:
        print(f"flowrt run: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flowrt run: interrupted", file=sys.stderr)
        return 130
    if args.trace:
        try:
            tracer.save(args.trace)
        except OSError as e:
            print(f"flowrt run: cannot write trace {args.trace}: {e}", file=sys.stderr)
    if args.json:
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()
    else:
        _print_result_human(result, args.traceback)
        from .progress import summary_line

        print(summary_line(result), file=sys.stderr)
        if args.trace:
            print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_STEP_FAILED


def cmd_graph(args: argparse.Namespace) -> int:
    from .workflow import WorkflowError

    try:
        wf = _load(args, "graph")
        wf.validate()
    except (WorkflowError, FileNotFoundError) as e:
        print(f"flowrt graph: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except _LoadFailed:
        return EXIT_USAGE
    print(wf.render(args.format))
    return EXIT_OK


def _checkout_root() -> Path:
    """The folder above the flowrt package: a source checkout's root (an installed wheel's site-packages)."""
    return Path(__file__).resolve().parent.parent


def _bench_dirs() -> list[Path]:
    """Where benchmarks are looked for: ./bench, and the bench/ folder of the source checkout flowrt runs
    from. bench/ is not part of the installed package, so an installed flowrt usually has neither."""
    dirs = [Path.cwd() / "bench"]
    root = _checkout_root()
    if (root / "pyproject.toml").is_file():  # a checkout (or an editable install), not site-packages
        dirs.append(root / "bench")
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def cmd_bench(args: argparse.Namespace) -> int:
    name = args.name
    if name.endswith(".py"):
        candidates = [Path(name)]
    else:
        dirs = [d for d in _bench_dirs() if d.is_dir()]
        if not dirs:
            print("flowrt bench: no bench/ folder: the benchmarks live in flowrt's source checkout and are not "
                  "installed with the package; run `flowrt bench` from a checkout of flowrt (or from a folder "
                  "holding bench/), or pass a benchmark file: `flowrt bench path/to/NAME.py`", file=sys.stderr)
            return EXIT_USAGE
        candidates = [d / f"{name}.py" for d in dirs]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        known = sorted({p.stem for d in _bench_dirs() if d.is_dir() for p in d.glob("*.py")
                        if not p.name.startswith("_")})
        print(f"flowrt bench: no benchmark {name!r} (looked in {', '.join(str(d) for d in _bench_dirs())}); "
              f"available: {', '.join(known) or 'none'}", file=sys.stderr)
        return EXIT_USAGE
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args.bench_args]
    sys.path.insert(0, str(path.resolve().parent))  # as `python bench/NAME.py` would: its helper modules import
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- parser
def _register_external(sub: Any, module: str) -> None:
    """``serve`` / ``index`` come from other packages; skipped quietly when they are not importable."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    add = getattr(mod, "add_parser", None)
    if add is not None:
        add(sub)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="flowrt", description="Run multi-step LLM workflows on an in-process "
                                     "engine with copy-on-write KV sharing.")
    parser.add_argument("--version", action="version", version=f"flowrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("run", help="run a workflow file", description="Run the workflow defined in FILE.")
    p.add_argument("file", metavar="FILE.py")
    p.add_argument("--input", "-i", action="append", metavar="NAME=VALUE",
                   help="a workflow input (repeatable); VALUE is JSON unless the input is annotated str")
    p.add_argument("--input-file", action="append", metavar="NAME=PATH", help="an input read from a file")
    p.add_argument("--workflow", "-w", metavar="NAME", help="which workflow, when FILE defines several")
    p.add_argument("--json", action="store_true",
                   help='print {"outputs": ..., "errors": ..., "stats": ...} as JSON and nothing else on stdout')
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (Perfetto / chrome://tracing)")
    p.add_argument("--index", metavar="DIR", help="retrieval index directory, injected as `retriever`")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("--traceback", action="store_true", help="print full tracebacks of failed steps")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_run)

    g = sub.add_parser("graph", help="print a workflow's DAG", description="Print the DAG of FILE's workflow.")
    g.add_argument("file", metavar="FILE.py")
    g.add_argument("--format", "-f", choices=["text", "mermaid", "dot"], default="text")
    g.add_argument("--workflow", "-w", metavar="NAME")
    g.set_defaults(func=cmd_graph)

    b = sub.add_parser("bench", help="run a benchmark from bench/",
                       description="Run bench/NAME.py from a source checkout of flowrt (bench/ is not installed "
                                   "with the package), or a benchmark file NAME.py.")
    b.add_argument("name", metavar="NAME")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
    b.set_defaults(func=cmd_bench)

    _register_external(sub, "flowrt.server.cli")
    _register_external(sub, "flowrt.retrieval.cli")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    code = args.func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
