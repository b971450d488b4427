"""The ``flowrt`` command line.

    flowrt run FILE.py [--input NAME=VALUE ...] [--model PATH] [--json] [--trace FILE] [--workflow NAME]
                       [--index DIR] [--ENGINE-OPTION VALUE ...]
    flowrt run FILE.py --checkpoint runs.db [--stream]   # saved after every step; prints the run id
    flowrt resume RUN_ID --checkpoint runs.db [--answer VALUE]
    flowrt runs list|show [RUN_ID] --checkpoint runs.db
    flowrt runs gc --checkpoint runs.db [--dry-run]   # the KV blocks kept, and pruning them
    flowrt graph FILE.py [--format text|mermaid|dot]
    flowrt bench NAME [ARGS ...]          # runs bench/NAME.py (bench/ is in a source checkout only)
    flowrt serve ...                      # flowrt.server (when installed)
    flowrt index ...                      # flowrt.retrieval (when installed)

Exit status of ``run``: 0 when every step succeeded, 1 when a step failed (its dependents are skipped;
every other result is still printed), 2 for a bad command line, workflow file, input, model or checkpoint
database (and for ``resume``, a run that another process holds: it is named), 3 when a step called
``fr.interrupt`` (the payload is printed; ``flowrt resume`` continues). ``flowrt runs`` only reads: it opens
the database read-only and never creates one.

The engine options (``run`` and ``serve``) are generated from ``flowrt.engine.EngineArgs``: one
``--kebab-case`` option per field, its help the field's description (``flowrt.engine.cli_args``;
``flowrt run --help`` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ..runner.options import add_engine_arguments, engine_kwargs_from_args, replica_kwargs_from_args
from ..checkpoint.kv_budget import add_kv_budget
from .kv_gc import cmd_gc

__all__ = ["main", "build_parser", "add_engine_arguments", "engine_kwargs_from_args", "parse_inputs"]

EXIT_OK, EXIT_STEP_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 3

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


# ---------------------------------------------------------------------------------------------- inputs
class UsageError(Exception):
    pass


def _is_str_annotation(ann: Any) -> bool:
    return ann is str or ann == "str"


def _fits(wf: Any, name: str, value: Any) -> bool:
    from ..graph.inputs import coerce_input
    from ..graph.workflow import WorkflowError

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

    from ..render import printable, unrenderable

    out = Console(soft_wrap=True, highlight=False)
    err = Console(stderr=True, highlight=False)
    sinks = set(result.sinks)
    for name, value in result.outputs.items():
        label = Text(name, style="bold") + Text(" (result):" if name in sinks else ":")
        try:  # step results are shown as text, never parsed as rich markup
            out.print(label, Text(printable(value)) if isinstance(value, str) else Pretty(value))
        except Exception as e:  # noqa: BLE001 - any value's rendering error is shown, not fatal
            out.print(label, Text(unrenderable(value, e)))
    for name, failure in result.errors.items():
        style = "magenta" if failure.kind == "skipped" else "bold red"
        # "x skipped: depends on ...", not "skipped: skipped:"
        message = failure.message.removeprefix(f"{failure.kind}: ")
        err.print(Text(f"{name} {failure.kind}", style=style) + Text(f": {printable(message)}"), highlight=False)
        if failure.traceback and failure.kind != "skipped":
            tb = failure.traceback.rstrip().splitlines()
            shown = tb if show_tb else tb[-6:]
            if not show_tb and len(tb) > 6:
                err.print("  ... (--traceback shows all)", style="dim")
            for line in shown:
                err.print("  " + printable(line), style="dim", markup=False, highlight=False)
    for name, skip in getattr(result, "skipped", {}).items():  # routes not chosen: not failures
        err.print(Text(f"{name} skipped", style="dim") + Text(f": {printable(skip.message)}", style="dim"))


class _LoadFailed(Exception):
    pass


class _EngineFailed(Exception):
    """The model (--model and the engine options) could not be loaded."""


class _Terminated(Exception):
    """SIGTERM stopped the run (flowrt.cli.signals)."""


class _StderrHandler(logging.Handler):
    """Log lines to whatever ``sys.stderr`` is when they are emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging handler contract: handleError
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
    from ..graph.loader import format_load_error, load_workflow
    from ..graph.workflow import WorkflowError

    try:
        return load_workflow(args.file, args.workflow)
    except (WorkflowError, FileNotFoundError):
        raise
    except Exception as e:
        print(f"flowrt {cmd}: error: cannot load {args.file}:", file=sys.stderr)
        print(format_load_error(e, args.file), file=sys.stderr)
        raise _LoadFailed() from e


def _load_valid(args: argparse.Namespace, cmd: str) -> Any:
    """The validated workflow of args.file, or None after printing why (flowrt resume / graph: exit 2)."""
    from ..graph.workflow import WorkflowError

    try:
        wf = _load(args, cmd)
        wf.validate()
        return wf
    except (WorkflowError, FileNotFoundError) as e:
        print(f"flowrt {cmd}: error: {e}", file=sys.stderr)
    except _LoadFailed:
        pass
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from ..graph.workflow import WorkflowError

    if args.stream and args.json:
        print("flowrt run: error: --stream prints text as it is generated; it cannot go with --json", file=sys.stderr)
        return EXIT_USAGE
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
    runtime = _make_runtime(args, "run", args.model, engine_kwargs_from_args(args), args.index)
    if runtime is None:
        return EXIT_USAGE
    return _run_cli(args, "run", wf, runtime, lambda **kw: runtime.execute(wf, inputs, file=os.path.abspath(args.file),
                                                                          **kw))


def _make_runtime(args: argparse.Namespace, cmd: str, model: Any, engine_kwargs: dict[str, Any],
                  index: str | None) -> Any:
    from ..runner.runtime import Runtime

    try:
        return Runtime(model, index=index, checkpoint=getattr(args, "checkpoint", None),
                       checkpoint_kv=getattr(args, "checkpoint_kv", False),
                       cache=not getattr(args, "no_cache", False),
                       checkpoint_kv_max_bytes=getattr(args, "checkpoint_kv_max_bytes", None),
                       **replica_kwargs_from_args(args), **engine_kwargs)
    except Exception as e:  # a checkpoint database that cannot be used: corrupt, newer format, ...
        from ..checkpoint import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"flowrt {cmd}: error: {e}", file=sys.stderr)
            return None
        raise


def _shown(checkpoint: str | None) -> str:
    """How ``--checkpoint`` is printed: a URL without its password (flowrt.checkpoint.redact)."""
    from ..checkpoint.redact import redact_url

    return redact_url(checkpoint)


class _CliEvents:
    """``flowrt run`` / ``resume`` as an event listener: the run id at the start (stderr), and with
    ``--stream`` every thread's text as it is generated (stdout; a ``[step #thread.fork]`` header when the
    source changes) and the step events (stderr)."""

    def __init__(self, cmd: str, checkpoint: str | None, stream: bool) -> None:
        self.cmd, self.checkpoint, self.stream = cmd, checkpoint, stream
        self._source: tuple | None = None

    def __call__(self, ev: Any) -> None:
        kind = ev.type
        if kind == "run_started" and ev.run_id:
            how = " (forked)" if self.cmd == "runs fork" else " (resumed)" if ev.resumed else ""
            print(f"flowrt {self.cmd}: run {ev.run_id}{how}; checkpoints in "
                  f"{_shown(self.checkpoint)}", file=sys.stderr, flush=True)
        if not self.stream:
            return
        if kind == "token":
            src = (ev.step, ev.thread_id, ev.fork_index)
            if src != self._source:
                self._source = src
                sys.stdout.write(f"\n[{ev.step} #{ev.thread_id}.{ev.fork_index}] ")
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif kind in ("step_started", "step_finished", "step_failed", "routed", "interrupted"):
            if self._source is not None:
                sys.stdout.write("\n")
                sys.stdout.flush()
                self._source = None
            detail = {"step_started": "started", "step_finished": "finished",
                      "step_failed": f"failed: {getattr(ev, 'message', '')}",
                      "routed": f"routed to {', '.join(getattr(ev, 'targets', []))}",
                      "interrupted": "interrupted"}[kind]
            print(f"-- {ev.step} {detail}", file=sys.stderr, flush=True)


def _run_cli(args: argparse.Namespace, cmd: str, wf: Any, runtime: Any, start: Callable[..., Any],
             loads: Sequence[str] | None = None) -> int:
    """Run ``start`` on ``runtime`` and print the result. ``loads``: the resources the run loads before its
    steps (default: every one the workflow uses; a resume: only those its remaining steps need)."""
    import anyio

    from ..checkpoint import CheckpointError
    from ..events import EventSink
    from ..runner.executor import RunObserver
    from ..runner.trace import Tracer
    from ..graph.workflow import WorkflowError

    observer = RunObserver(wf)
    tracer = Tracer(stats_fn=runtime.stats)
    use_progress = (not args.no_progress) and (not getattr(args, "stream", False)) and sys.stderr.isatty()
    listener = _CliEvents(cmd, getattr(args, "checkpoint", None), getattr(args, "stream", False))
    sink = EventSink(listener, tokens=listener.stream)

    async def go() -> Any:
        from .signals import cancel_on_sigterm

        async with runtime:
            if "llm" in wf.resources:
                _show_engine_log()   # the engine's start-up line: model, dtype, KV blocks and MiB
            if "llm" in (wf.resources if loads is None else loads):  # a model that cannot load: a usage error
                try:
                    await runtime.model()
                except Exception as e:
                    raise _EngineFailed(f"cannot start the engine: {e}") from e
            with anyio.CancelScope() as stop, cancel_on_sigterm(stop):
                if use_progress:
                    from .progress import ProgressDisplay

                    with ProgressDisplay(observer, runtime.stats):
                        return await start(tracer=tracer, observer=observer, events=sink)
                return await start(tracer=tracer, observer=observer, events=sink)
            raise _Terminated   # the run was stopped (with --checkpoint-kv it saved a checkpoint with its KV)

    # With --json nothing but the JSON may reach stdout: steps that print write to stderr instead.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with redirect:
            result = anyio.run(go)
    except (WorkflowError, _EngineFailed, CheckpointError) as e:
        print(f"flowrt {cmd}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"flowrt {cmd}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        hint = "; flowrt resume continues it from its last checkpoint" if getattr(args, "checkpoint", None) else ""
        print(f"flowrt {cmd}: terminated{hint}", file=sys.stderr)
        return 128 + signal.SIGTERM
    if listener.stream and listener._source is not None:
        sys.stdout.write("\n")
    if args.trace:
        try:
            tracer.save(args.trace)
        except OSError as e:
            print(f"flowrt {cmd}: cannot write trace {args.trace}: {e}", file=sys.stderr)
    if args.json:
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()
    else:
        _print_result_human(result, args.traceback)
        from .progress import summary_line

        print(summary_line(result), file=sys.stderr)
        if args.trace:
            print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    if result.interrupted:
        it = result.interrupt or {}
        if not args.json:
            from ..render import to_jsonable

            shown = {i["step"]: i.get("payload") for i in result.interrupts} if len(result.interrupts) > 1 \
                else it.get("payload")
            print(json.dumps(to_jsonable(shown), ensure_ascii=False, indent=2))
        steps = [i["step"] for i in result.interrupts] if len(result.interrupts) > 1 else []
        if steps:
            print(f"flowrt {cmd}: run {result.run_id} is waiting for {len(steps)} answers (steps "
                  f"{', '.join(map(repr, steps))}); continue it with: flowrt resume {result.run_id} --checkpoint "
                  f"{_shown(args.checkpoint)} " + " ".join(f"--answer '{s}=...'" for s in steps), file=sys.stderr)
        else:
            print(f"flowrt {cmd}: run {result.run_id} is waiting for an answer (step {it.get('step')!r}); continue "
                  f"it with: flowrt resume {result.run_id} --checkpoint {_shown(args.checkpoint)} --answer '...'",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_STEP_FAILED


def _add_checkpoint_kv(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-kv", nargs="?", const=True, default=False, metavar="DIR",
                   help="save the KV blocks of live threads with every checkpoint (in DIR; default: beside the "
                        "SQLite database, DB.kv), so that a resume in a fresh process does not compute them again")
    add_kv_budget(p)


def _parse_answers(raws: list[str], state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``--answer VALUE`` (the run's one pending interrupt) or ``--answer STEP=VALUE`` for each of several
    (STEP a pending interrupt's step; anything else with a '=' is a plain value)."""
    from ..checkpoint.run import NO_ANSWER

    pending = [p["step"] for p in (state.get("interrupts") or ([state["interrupt"]] if state.get("interrupt") else []))]
    answer, answers = NO_ANSWER, {}
    for raw in raws:
        step, sep, value = raw.partition("=")
        if sep and step in pending:
            answers[step] = _parse_answer(value)
        elif answer is NO_ANSWER:
            answer = _parse_answer(raw)
        else:
            raise UsageError(f"--answer VALUE given twice; a run waiting at several steps takes --answer STEP=VALUE "
                             f"for each (it waits at: {', '.join(pending) or 'none'})")
    if answer is not NO_ANSWER and answers:
        raise UsageError("give either one --answer VALUE or --answer STEP=VALUE for each step, not both")
    return answer, answers


def _parse_answer(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _stored_run(args: argparse.Namespace, cmd: str, *, with_state: bool) -> Any:
    """The run ``args.run_id`` of ``--checkpoint`` (never a new database), or None after printing why."""
    from ..checkpoint import CheckpointError, open_store

    try:
        store = open_store(args.checkpoint, create=False)
        assert store is not None  # --checkpoint is required
        try:
            return store.get_run(args.run_id, with_state=with_state)
        finally:
            store.close()
    except CheckpointError as e:
        print(f"flowrt {cmd}: error: {e}", file=sys.stderr)
        return None


def _stored_run_setup(args: argparse.Namespace, cmd: str, record: Any) -> tuple[Any, Any] | None:
    """A stored run's workflow (``--file``, else the file it recorded) and a runtime with its model and engine
    options (the command line's on top), for ``resume`` and ``runs fork``; None after printing why."""
    file = args.file or record.file
    if not file:
        print(f"flowrt {cmd}: error: run {record.run_id} recorded no workflow file; pass --file", file=sys.stderr)
        return None
    args.file, args.workflow = file, record.workflow
    wf = _load_valid(args, cmd)
    if wf is None:
        return None
    meta = record.meta or {}
    engine_kwargs = {**(meta.get("engine") or {}), **engine_kwargs_from_args(args)}
    model = args.model if args.model is not None else meta.get("model")
    runtime = _make_runtime(args, cmd, model, engine_kwargs, args.index or meta.get("index"))
    return None if runtime is None else (wf, runtime)


def cmd_resume(args: argparse.Namespace) -> int:
    from ..checkpoint.lease import live_holder

    record = _stored_run(args, "resume", with_state=True)
    if record is None:
        return EXIT_USAGE
    try:
        answer, answers = _parse_answers(args.answer or [], record.state or {})
    except UsageError as e:
        print(f"flowrt resume: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if record.status == "done":
        print(f"flowrt resume: run {record.run_id} already finished; `flowrt runs show {record.run_id} --checkpoint "
              f"{_shown(args.checkpoint)}` shows its results", file=sys.stderr)
        return EXIT_USAGE
    holder = live_holder(record)
    if holder is not None:   # before loading anything; the claim when the run starts is what decides
        print(f"flowrt resume: error: run {record.run_id} is held by {holder}, which is running it (a run or a "
              f"resume that came first)", file=sys.stderr)
        return EXIT_USAGE
    setup = _stored_run_setup(args, "resume", record)
    if setup is None:
        return EXIT_USAGE
    wf, runtime = setup
    from ..checkpoint.needs import resources_to_continue

    return _run_cli(args, "resume", wf, runtime,
                    lambda **kw: runtime.resume(args.run_id, answer=answer, answers=answers, workflow=wf, **kw),
                    loads=resources_to_continue(wf, record.state))


def cmd_runs(args: argparse.Namespace) -> int:
    import datetime

    from ..checkpoint import CheckpointError, open_store
    from ..checkpoint.lease import live_holder

    def when(t: float) -> str:
        return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")

    if args.action == "fork":
        return cmd_fork(args)
    if args.action == "gc":
        return cmd_gc(args)
    try:
        store = open_store(args.checkpoint, readonly=True)   # reading: never creates or changes the file
        assert store is not None  # --checkpoint is required
        if args.action == "list":
            runs = store.list_runs(args.limit)
            if args.json:
                print(json.dumps([{"run_id": r.run_id, "workflow": r.workflow, "status": r.status, "file": r.file,
                                   "created": r.created, "updated": r.updated, "checkpoints": r.checkpoints,
                                   "holder": live_holder(r)} for r in runs], indent=2))
                return EXIT_OK
            if not runs:
                print(f"no runs in {_shown(args.checkpoint)}", file=sys.stderr)
            for r in runs:
                held = live_holder(r)
                print(f"{r.run_id}  {r.status:<11}  {r.workflow:<20}  {when(r.created)}  {r.checkpoints} checkpoints"
                      f"  {r.file or ''}{f'  held by {held}' if held else ''}")
            return EXIT_OK
        if not args.run_id:
            print(f"flowrt runs {args.action}: error: which run? `flowrt runs {args.action} RUN_ID --checkpoint DB`",
                  file=sys.stderr)
            return EXIT_USAGE
        if args.action == "history":
            return _print_history(store.history(args.run_id), args.json, when)
        r = store.get_run(args.run_id)
        hist = store.history(args.run_id)
    except CheckpointError as e:
        print(f"flowrt runs: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    state = r.state or {}
    outputs = {k: (v["json"] if "json" in v else v.get("placeholder")) for k, v in state.get("outputs", {}).items()}
    info = {"run_id": r.run_id, "workflow": r.workflow, "file": r.file, "status": r.status, "inputs": r.inputs,
            "created": when(r.created), "updated": when(r.updated), "outputs": outputs,
            "errors": {k: e["message"] for k, e in state.get("errors", {}).items()},
            "skipped": state.get("not_routed", {}), "routes": state.get("routes", []),
            "interrupt": r.interrupt, "holder": live_holder(r),
            "steps": [{k: h[k] for k in ("seq", "step", "visit", "status")} for h in hist]}
    print(json.dumps(info, indent=2, ensure_ascii=False, default=str))
    return EXIT_OK


def _summary(value: Any, width: int = 60) -> str:
    """A stored result on one line, cut to ``width`` characters."""
    if isinstance(value, dict) and ("json" in value or "placeholder" in value):
        value = value["json"] if "json" in value else value["placeholder"]
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _print_history(hist: list[dict[str, Any]], as_json: bool, when: Callable[[float], str]) -> int:
    """``flowrt runs history``: a run's checkpoints, oldest first (fork at any step shown)."""
    if as_json:
        print(json.dumps(hist, indent=2, ensure_ascii=False, default=str))
        return EXIT_OK
    from .table import text_table

    rows = [(str(h["seq"]), when(h["created"]), h["step"] or "(run)", h["status"] or "",
             _summary(h["result"]) if h["result"] is not None else "") for h in hist]
    for line in text_table(rows, right=frozenset({0})):
        print(line)
    return EXIT_OK


def cmd_fork(args: argparse.Namespace) -> int:
    """``flowrt runs fork RUN_ID --at STEP [--input name=value ...]``: a new run from before STEP."""
    if not args.run_id or not args.at:
        print("flowrt runs fork: error: which run and step? `flowrt runs fork RUN_ID --at STEP --checkpoint DB`",
              file=sys.stderr)
        return EXIT_USAGE
    record = _stored_run(args, "runs fork", with_state=False)
    setup = None if record is None else _stored_run_setup(args, "runs fork", record)
    if setup is None:
        return EXIT_USAGE
    wf, runtime = setup
    try:
        inputs = parse_inputs(args.input or [], args.input_file or [], wf)
    except UsageError as e:
        print(f"flowrt runs fork: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    forked: list[Any] = []

    async def start(**kw: Any) -> Any:
        forked.append(await runtime.fork(args.run_id, at=args.at, workflow=wf, **kw, **inputs))
        return forked[-1]

    code = _run_cli(args, "runs fork", wf, runtime, start)
    if forked and not args.json:
        print(forked[-1].run_id)   # the new run's id, alone on the last line (for scripts)
    return code


def cmd_graph(args: argparse.Namespace) -> int:

    wf = _load_valid(args, "graph")
    if wf is None:
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


def _add_stored_run_options(g: Any, prefix: str = "") -> None:
    """The options of the commands that run a stored run again (``resume``, ``runs fork``)."""
    g.add_argument("--file", metavar="FILE.py", help=f"{prefix}the workflow file (default: the one the run recorded)")
    g.add_argument("--stream", action="store_true", help=f"{prefix}print generated text live")
    g.add_argument("--trace", metavar="FILE", help=f"{prefix}write a Chrome trace")
    g.add_argument("--index", metavar="DIR", help=f"{prefix}retrieval index directory (default: the run's)")
    g.add_argument("--no-progress", action="store_true", help=f"{prefix}no live progress display")
    g.add_argument("--traceback", action="store_true", help=f"{prefix}print full tracebacks of failed steps")
    _add_no_cache(g, prefix)


def _add_no_cache(g: Any, prefix: str = "") -> None:
    g.add_argument("--no-cache", action="store_true", help=f"{prefix}run every step: fr.Cache steps neither take "
                   f"results kept in the checkpoint store nor keep theirs")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

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
    p.add_argument("--checkpoint", metavar="DB", help="save the run after every step to this SQLite database "
                   "(created if missing) or postgresql:// URL; prints the run id; `flowrt resume RUN_ID "
                   "--checkpoint DB` continues it")
    p.add_argument("--stream", action="store_true", help="print generated text live as the steps produce it")
    _add_no_cache(p)
    _add_checkpoint_kv(p)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_run)

    rs = sub.add_parser("resume", help="continue a checkpointed run (after a crash or an interrupt)",
                        description="Continue run RUN_ID from its last checkpoint: finished steps are not run "
                                    "again; an interrupted step runs again from its start, its fr.interrupt() "
                                    "call returning --answer.")
    rs.add_argument("run_id", metavar="RUN_ID")
    rs.add_argument("--checkpoint", metavar="DB", required=True, help="the run's checkpoint database")
    rs.add_argument("--answer", metavar="[STEP=]VALUE", action="append",
                    help="the answer to the run's interrupt (JSON, else a string); STEP=VALUE answers the interrupt "
                         "of that step, for a run waiting at several (parallel branches); repeat for each")
    _add_checkpoint_kv(rs)
    rs.add_argument("--json", action="store_true", help="print the result as JSON and nothing else on stdout")
    _add_stored_run_options(rs)
    add_engine_arguments(rs)
    rs.set_defaults(func=cmd_resume, workflow=None)

    ru = sub.add_parser("runs", help="list, show or fork checkpointed runs",
                        description="`flowrt runs list --checkpoint DB` lists runs, newest first; `flowrt runs show "
                                    "RUN_ID --checkpoint DB` prints one run's state and step history as JSON; "
                                    "`flowrt runs history RUN_ID` lists its checkpoints (step, time, result); "
                                    "`flowrt runs fork RUN_ID --at STEP [--input NAME=VALUE ...]` starts a new run "
                                    "from the state just before STEP with those inputs changed (STEP and the steps "
                                    "downstream of it run again, none upstream) and prints its run id; "
                                    "`flowrt runs gc [--dry-run]` shows the KV blocks kept (--checkpoint-kv) and "
                                    "the runs referring to them, and prunes the others (and to the budget).")
    ru.add_argument("action", choices=["list", "show", "history", "fork", "gc"])
    ru.add_argument("run_id", nargs="?", metavar="RUN_ID")
    ru.add_argument("--checkpoint", metavar="DB", required=True)
    ru.add_argument("--limit", type=int, default=50, help="list at most this many runs")
    ru.add_argument("--json", action="store_true", help="list as JSON (fork: print the result as JSON)")
    _add_checkpoint_kv(ru)
    ru.add_argument("--dry-run", action="store_true", help="gc: show what would be pruned, delete nothing")
    ru.add_argument("--grace", type=float, default=600.0, metavar="SECONDS",
                    help="gc: spare unreferenced blocks younger than this (a save in flight; default 600)")
    fk = ru.add_argument_group("fork")
    fk.add_argument("--at", metavar="STEP", help="fork: the step to run again (with everything downstream)")
    fk.add_argument("--input", "-i", action="append", metavar="NAME=VALUE", help="fork: an input to change")
    fk.add_argument("--input-file", action="append", metavar="NAME=PATH", help="fork: an input read from a file")
    _add_stored_run_options(fk, "fork: ")
    add_engine_arguments(ru)
    ru.set_defaults(func=cmd_runs, workflow=None)

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
    _register_external(sub, "flowrt.ui.cli")
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
