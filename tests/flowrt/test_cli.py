"""The flowrt CLI: run (--json end to end on stories260K), graph, bench, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowrt.cli.commands import main
from support import ROOT

MODEL = str(ROOT / "tests" / "models" / "stories260K")
ENGINE = ["--model", MODEL, "--dtype", "float32", "--num-kv-blocks", "256"]


def write(tmp_path: Path, name: str, src: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(src))
    return str(p)


PLAIN = """
    import flowrt as fr

    wf = fr.Workflow("plain")

    @wf.step
    def words(text: str) -> list:
        print("this goes to stderr under --json")
        return text.split()

    @wf.step(map="words")
    def upper(words: str) -> str:
        return words.upper()

    @wf.step
    def count(words: list, times: int = 1) -> int:
        return len(words) * times

    @wf.step
    def broken(count: int, fail: bool = False) -> int:
        if fail:
            raise RuntimeError("asked to fail")
        return count

    @wf.step
    def after_broken(broken: int) -> int:
        return broken + 1
"""


def run_json(capsys, args):
    code = main(args)
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_run_json_plain_steps_and_input_parsing(tmp_path, capsys):
    f = write(tmp_path, "plain.py", PLAIN)
    code, d, err = run_json(capsys, ["run", f, "--input", "text=1 2 3", "--input", "times=2", "--json"])
    assert code == 0
    assert set(d) == {"outputs", "errors", "stats"}
    # `text` is annotated str: kept as a string even though "1 2 3" is not JSON; times parses as JSON
    assert d["outputs"] == {"words": ["1", "2", "3"], "upper": ["1", "2", "3"], "count": 6, "broken": 6,
                            "after_broken": 7}
    assert d["errors"] == {} and d["stats"]["steps_completed"] == 5
    assert "this goes to stderr" in err


def test_run_exit_code_and_errors_when_a_step_fails(tmp_path, capsys):
    f = write(tmp_path, "plain.py", PLAIN)
    code, d, _ = run_json(capsys, ["run", f, "-i", "text=a b", "-i", "fail=true", "--json"])
    assert code == 1
    assert d["errors"]["broken"] == "RuntimeError: asked to fail"
    assert d["errors"]["after_broken"].startswith("skipped")
    assert d["outputs"]["count"] == 2  # the other branches' results are kept
    # human output: results on stdout, errors (with traceback tail) and a summary on stderr
    code = main(["run", f, "-i", "text=a b", "-i", "fail=true", "--no-progress"])
    out = capsys.readouterr()
    assert code == 1 and "count" in out.out and "broken failed" in out.err and "asked to fail" in out.err
    assert "raise RuntimeError" in out.err and "steps done" in out.err


def test_run_usage_errors_exit_2(tmp_path, capsys):
    f = write(tmp_path, "plain.py", PLAIN)
    assert main(["run", f]) == 2
    assert "missing input(s) 'text'" in capsys.readouterr().err
    assert main(["run", f, "-i", "text=x", "-i", "nope=1"]) == 2
    assert "unknown input(s) 'nope'" in capsys.readouterr().err
    assert main(["run", f, "-i", "textx"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "not found" in capsys.readouterr().err
    two = write(tmp_path, "two.py", """
        import flowrt as fr
        a = fr.Workflow("first")
        b = fr.Workflow("second")
        @a.step
        def x() -> int: return 1
        @b.step
        def y() -> int: return 2
    """)
    assert main(["run", two]) == 2
    assert "several workflows" in capsys.readouterr().err
    code, d, _ = run_json(capsys, ["run", two, "--workflow", "second", "--json"])
    assert code == 0 and d["outputs"] == {"y": 2}
    assert main(["run", two, "--workflow", "third"]) == 2
    assert "no workflow named 'third'" in capsys.readouterr().err


def test_input_file_and_trace(tmp_path, capsys):
    f = write(tmp_path, "plain.py", PLAIN)
    (tmp_path / "in.txt").write_text("x y z w")
    trace = tmp_path / "trace.json"
    code, d, _ = run_json(capsys, ["run", f, "--input-file", f"text={tmp_path / 'in.txt'}", "--json",
                                   "--trace", str(trace)])
    assert code == 0 and d["outputs"]["count"] == 4
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"words", "count", "upper[3]"}


def test_graph_formats(tmp_path, capsys):
    f = write(tmp_path, "plain.py", PLAIN)
    assert main(["graph", f]) == 0
    out = capsys.readouterr().out
    assert "workflow plain" in out and "upper (map words; sync)  <- words" in out
    assert main(["graph", f, "--format", "mermaid"]) == 0
    assert "words --> upper" in capsys.readouterr().out
    assert main(["graph", f, "-f", "dot"]) == 0
    assert '"broken" -> "after_broken";' in capsys.readouterr().out
    bad = write(tmp_path, "bad.py", """
        import flowrt as fr
        wf = fr.Workflow("bad")
        @wf.step
        def a(b): return b
        @wf.step
        def b(a): return a
    """)
    assert main(["graph", bad]) == 2  # the error surfaces when the file is imported
    assert "cycle between steps: a -> b -> a" in capsys.readouterr().err
    broken = write(tmp_path, "broken.py", "import flowrt as fr\nraise ImportError('no such thing')\n")
    assert main(["run", broken]) == 2
    err = capsys.readouterr().err
    assert "cannot load" in err and "ImportError: no such thing" in err


def test_bench_unknown_name(capsys):
    assert main(["bench", "no_such_bench_xyz"]) == 2
    assert "no benchmark 'no_such_bench_xyz'" in capsys.readouterr().err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("run", "graph", "bench"):
        assert cmd in out
    assert main([]) == 2


@pytest.mark.slow
def test_run_json_end_to_end_on_stories260k(tmp_path):
    """The real command in a fresh process: the README's self-consistency example on the test model."""
    pytest.importorskip("flowrt.engine")
    trace = tmp_path / "sc.trace.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "flowrt.cli", "run", str(ROOT / "workflows" / "self_consistency.py"),
         "--input", "question=Tom has 3 apples and buys 5 more. How many apples does he have?",
         "--input", "samples=4", "--input", "max_tokens=8", "--json", "--trace", str(trace), *ENGINE],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert set(d) == {"outputs", "errors", "stats"} and d["errors"] == {}
    assert len(d["outputs"]["solve"]) == 4 and isinstance(d["outputs"]["vote"], str)
    st = d["stats"]
    assert st["run_llm_calls"] == 5  # one shared prefill + 4 samples
    assert st["kv_blocks_used"] == 0 and st["open_sequences"] == 0
    # the prompt was computed once: well under 4 copies of it
    prompt_len = st["run_prompt_tokens"] // 5
    assert st["run_tokens_computed"] < 2 * prompt_len
    assert json.loads(trace.read_text())["traceEvents"]
    # engine-wide and per-run counters are grouped apart (the flat keys stay, for compatibility)
    assert st["engine"]["kv_blocks_used"] == 0 and st["engine"]["generated_tokens"] == st["generated_tokens"]
    assert st["run"]["llm_calls"] == 5 and st["run"]["generated_tokens"] == st["run_generated_tokens"]
    assert st["run"]["steps_completed"] == 2
    assert st["engine"]["weights_bytes"] > 0 and st["engine"]["weights_formats"]["attn_qkv"] == "float32"
    assert "KV blocks x 16 tokens" in proc.stderr and "MiB" in proc.stderr  # the start-up line


def test_progress_display_renders():
    from io import StringIO

    from rich.console import Console

    import flowrt as fr
    from flowrt.cli.progress import ProgressDisplay

    wf = fr.Workflow("shown")

    @wf.step
    def a(x):
        return x

    @wf.step
    def b(a):
        return a

    ob = fr.RunObserver(wf)
    ob.on_status("a", "running")
    ob.items["a"] = (1, 3)
    buf = StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    stats = {"generated_tokens": 10, "num_kv_blocks": 100, "kv_blocks_used": 25, "prefix_cache_query_tokens": 50,
             "prefix_cache_hit_tokens": 25}
    disp = ProgressDisplay(ob, lambda: stats, console=console)
    with disp:
        pass
    console.print(disp.render())
    text = buf.getvalue()
    assert "shown: 0 done, 1 running, 1 pending" in text and "1/3 items" in text
    assert "KV: 25/100 blocks (25%)" in text and "prefix-cache hits: 50%" in text


ODD = """
    import flowrt as fr

    wf = fr.Workflow("odd")

    class NoStr:
        def __str__(self):
            raise RuntimeError("no str for you")

        def __repr__(self):
            raise RuntimeError("no repr either")

    @wf.step
    def big() -> int:
        return 10 ** 5000

    @wf.step
    def nostr() -> object:
        return NoStr()

    @wf.step
    def markup() -> str:
        return "[/oops] not markup"

    @wf.step
    def lone() -> str:
        return "half \\ud800 pair"

    @wf.step
    def fine() -> str:
        return "still here"
"""


def test_unrenderable_results_do_not_lose_the_others(tmp_path, capsys):
    f = write(tmp_path, "odd.py", ODD)
    code, d, _ = run_json(capsys, ["run", f, "--json"])
    assert code == 0 and d["outputs"]["fine"] == "still here"
    assert d["outputs"]["big"].startswith("<unrenderable int: Exceeds the limit (4300 digits)")
    assert d["outputs"]["nostr"] == "<unrenderable NoStr: no str for you>"
    assert d["outputs"]["lone"] == "half \\ud800 pair"
    code = main(["run", f, "--no-progress"])  # the human display too
    out = capsys.readouterr().out
    assert code == 0 and "fine (result): still here" in out and "[/oops] not markup" in out
    assert "Exceeds the limit" in out and "half \\ud800 pair" in out


LLM_STEP = """
    import flowrt as fr

    wf = fr.Workflow("agent")

    @wf.step
    async def agent(question: str, llm: fr.Model, max_turns: int = 3) -> str:
        return question * max_turns
"""


def test_typed_input_is_checked_before_the_model_loads(tmp_path, capsys):
    f = write(tmp_path, "agent.py", LLM_STEP)
    # the model path is bad too: the input error must come first, before anything loads
    assert main(["run", f, "-i", "question=q", "-i", "max_turns=abc", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "input 'max_turns' must be int (step 'agent'), got 'abc'" in err and "engine" not in err


def test_bad_model_is_one_usage_error(tmp_path, capsys):
    f = write(tmp_path, "agent.py", LLM_STEP)
    assert main(["run", f, "-i", "question=q", "--model", str(tmp_path / "nope"), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "skipped" not in out.err
    assert "flowrt run: error: cannot start the engine: model path does not exist" in out.err
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((Path(MODEL) / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert main(["run", f, "-i", "question=q", "--model", str(pickled), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot start the engine" in err and "pickle" in err and "skipped" not in err


def test_syntax_error_shows_only_the_users_file(tmp_path, capsys):
    f = write(tmp_path, "syn.py", "import flowrt as fr\nwf = fr.Workflow('x')\ndef oops(:\n    pass\n")
    assert main(["run", f]) == 2
    err = capsys.readouterr().err
    assert f'File "{Path(f).resolve()}", line 3' in err and "SyntaxError" in err
    assert "flowrt" not in err.replace(f"flowrt run: error: cannot load {f}", "") and "importlib" not in err
    (tmp_path / "helper_mod.py").write_text("raise KeyError('inner')\n")
    f2 = write(tmp_path, "imp.py", "import flowrt as fr\nimport helper_mod\n")
    assert main(["graph", f2]) == 2
    err = capsys.readouterr().err
    assert "helper_mod.py" in err and "KeyError: 'inner'" in err
    assert "loader.py" not in err and "importlib" not in err


# ---------------------------------------------------------------------------------------------- engine options
def _subparser(parser, name):
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    return sub.choices[name]


def _sample_flag_values():
    """One command-line value per EngineArgs field (but model), and what EngineArgs makes of it."""
    import enum
    import typing

    from flowrt.engine.cli_args import _unwrap_optional
    from flowrt.engine import EngineArgs

    argv, expected = [], {}
    for name, field in EngineArgs.model_fields.items():
        if name == "model":
            continue
        flag, ann = "--" + name.replace("_", "-"), _unwrap_optional(field.annotation)
        if ann is bool:
            argv.append("--no-" + flag[2:] if field.default else flag)
            expected[name] = not field.default
        elif typing.get_origin(ann) is typing.Literal:
            value = next(c for c in typing.get_args(ann) if c != field.default)
            argv += [flag, str(value)]
            expected[name] = value
        elif isinstance(ann, type) and issubclass(ann, enum.Enum):  # quantization
            member = next(m for m in ann if m != field.default)
            argv += [flag, member.value]
            expected[name] = member
        elif ann is int:
            argv += [flag, "3"]
            expected[name] = 3
        elif ann is dict:  # JSON on the command line (speculative_config)
            argv += [flag, '{"method": "ngram"}']
            expected[name] = getattr(EngineArgs(**{name: {"method": "ngram"}}), name)
        else:
            argv += [flag, "x"]
            expected[name] = "x"
    return argv, expected


def test_every_engine_args_field_has_a_flag():
    from flowrt.cli.commands import build_parser
    from flowrt.engine import EngineArgs

    parser = build_parser()
    for cmd in ("run", "serve"):
        try:
            p = _subparser(parser, cmd)
        except KeyError:  # serve is registered only when flowrt.server is importable
            continue
        p.format_help()  # the options are generated on first use
        flags = {s for a in p._actions for s in a.option_strings}
        for name in EngineArgs.model_fields:
            assert "--" + name.replace("_", "-") in flags, (cmd, name)
        helps = [a.help for a in p._actions if any(s.startswith("--kv-cache-memory") for s in a.option_strings)]
        assert helps and "bytes" in helps[0]  # help comes from the engine's own field documentation


def test_engine_flags_parse_to_engine_kwargs():
    from flowrt.cli.commands import build_parser, engine_kwargs_from_args

    argv, expected = _sample_flag_values()
    args = build_parser().parse_args(["run", "wf.py", "--model", "m", *argv])
    assert args.model == "m"
    assert engine_kwargs_from_args(args) == expected
    args = build_parser().parse_args(["run", "wf.py"])
    assert engine_kwargs_from_args(args) == {}  # nothing given: the engine's own defaults apply
    args = build_parser().parse_args(["run", "wf.py", "--no-prefix-caching", "--dtype", "bf16"])
    assert engine_kwargs_from_args(args) == {"enable_prefix_caching": False, "dtype": "bfloat16"}


def test_bad_engine_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "wf.py", "--block-size", "0"])
    assert e.value.code == 2
    assert "--block-size" in capsys.readouterr().err


def test_building_the_cli_does_not_load_the_engine():
    code = ("import sys; from flowrt.cli.commands import main; "
            "assert main(['graph', sys.argv[1]]) == 0; "
            "assert 'flowrt.engine' not in sys.modules and 'torch' not in sys.modules, 'engine loaded'")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "workflows" / "self_consistency.py")],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr


ENGINE_PROBE = """
    import flowrt as fr

    wf = fr.Workflow("probe")

    @wf.step
    def engine_stats(llm: fr.Model) -> dict:
        s = llm.stats()
        return {"block_size": s["block_size"], "num_kv_blocks": s["num_kv_blocks"]}
"""


def test_engine_flag_values_reach_the_engine(tmp_path, capsys, monkeypatch):
    import flowrt.engine

    seen = {}
    real = flowrt.engine.AsyncLLM

    class Recording(real):
        def __init__(self, model=None, **kwargs):
            seen.update(kwargs, model=model)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(flowrt.engine, "AsyncLLM", Recording)
    f = write(tmp_path, "probe.py", ENGINE_PROBE)
    code, d, _ = run_json(capsys, ["run", f, "--json", "--model", MODEL, "--dtype", "float32", "--block-size", "8",
                                   "--num-kv-blocks", "48", "--kv-cache-dtype", "float32",
                                   "--no-enable-prefix-caching"])
    assert code == 0, d
    assert d["outputs"]["engine_stats"] == {"block_size": 8, "num_kv_blocks": 48}
    assert seen == {"model": MODEL, "dtype": "float32", "block_size": 8, "num_kv_blocks": 48,
                    "kv_cache_dtype": "float32", "enable_prefix_caching": False}


# ---------------------------------------------------------------------------------------------- bench
def test_bench_without_a_bench_folder_says_so(tmp_path, capsys, monkeypatch):
    import flowrt.cli.commands

    site = tmp_path / "site-packages"  # an installed wheel: no pyproject.toml, no bench/ next to flowrt
    site.mkdir()
    monkeypatch.setattr(flowrt.cli.commands, "_checkout_root", lambda: site)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "throughput"]) == 2
    err = capsys.readouterr().err
    assert "no bench/ folder" in err and "not installed with the package" in err and "checkout" in err


def test_bench_runs_from_a_checkout(tmp_path, capsys, monkeypatch):
    import flowrt.cli.commands

    checkout = tmp_path / "checkout"
    (checkout / "bench").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'flowrt'\n")
    (checkout / "bench" / "helper_for_bench.py").write_text("VALUE = 42\n")
    (checkout / "bench" / "hello.py").write_text(textwrap.dedent("""
        import sys
        from helper_for_bench import VALUE   # a helper module next to it, as `python bench/hello.py` allows

        print("hello", VALUE, sys.argv[1:])
        sys.exit(3 if "--fail" in sys.argv else 0)
    """))
    monkeypatch.setattr(flowrt.cli.commands, "_checkout_root", lambda: checkout)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path_before = list(sys.path)
    assert main(["bench", "hello", "--n", "2"]) == 0
    assert "hello 42 ['--n', '2']" in capsys.readouterr().out
    assert main(["bench", "hello", "--fail"]) == 3
    assert sys.path == path_before
    sys.modules.pop("helper_for_bench", None)
