"""The engine's command-line options come from flowrt.engine.cli_args (built from EngineArgs' field
descriptions, not from source comments); `flowrt run`, `flowrt resume` and `flowrt serve` offer the same
flags as before the builder moved, and the server does not import the CLI (flowrt.cli)."""

import argparse
import subprocess
import sys

import pytest

# the engine and replica flags of `flowrt run` / `resume` / `serve` before the builder moved into engine/, plus
# the EngineArgs fields added since
ENGINE_FLAGS = {
    "--model", "--tokenizer", "--dtype", "--kv-cache-dtype", "--block-size", "--max-num-seqs",
    "--max-num-batched-tokens", "--kv-cache-memory", "--num-kv-blocks", "--max-model-len", "--attention-backend",
    "--device", "--seed", "--enable-prefix-caching", "--no-enable-prefix-caching", "--num-threads",
    "--scheduling-policy", "--max-wait-steps", "--enable-forced-tokens", "--no-enable-forced-tokens",
    "--enforce-eager", "--no-enforce-eager", "--no-prefix-caching", "--replicas", "--ray-address", "--routing",
    "--speculative-config",  # added since (issue 25), through EngineArgs' field like every other flag
    "--adaptive-threads", "--no-adaptive-threads",  # added since (issue 26: the CPU thread governor)
    "--quantization",  # added since (issue 33: weights kept quantized)
}


def _flags(parser: argparse.ArgumentParser, group_titles=("engine", "replicas")) -> set[str]:
    parser.format_help()  # adds the deferred engine options
    return {o for g in parser._action_groups if g.title in group_titles for a in g._group_actions
            for o in a.option_strings}


def test_front_ends_offer_the_same_engine_flags_as_before():
    from flowrt.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in ("run", "resume", "serve"):
        assert _flags(sub.choices[cmd]) == ENGINE_FLAGS, cmd


def test_help_comes_from_the_field_descriptions():
    from flowrt.engine import EngineArgs
    from flowrt.engine.cli_args import add_cli_args, engine_kwargs_from_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    helps = {a.dest: a.help for a in p._actions if a.help != argparse.SUPPRESS}
    assert helps["max_wait_steps"] == "program policy: no request waits more steps than this (int >= 1; default 256)"
    for name, field in EngineArgs.model_fields.items():
        if field.description:
            assert helps[name].startswith(field.description.replace("%", "%%")), name
    args = p.parse_args(["--max-wait-steps", "7", "--no-enforce-eager"])
    assert engine_kwargs_from_args(args) == {"max_wait_steps": 7, "enforce_eager": False}


@pytest.mark.slow  # a fresh interpreter importing the server's stack
def test_server_builds_its_options_without_the_cli():
    code = ("import argparse, sys\n"
            "import flowrt.server.cli as c\n"
            "p = argparse.ArgumentParser(); c.add_arguments(p)\n"
            "assert not [m for m in sys.modules if m.startswith('flowrt.cli')], 'the CLI was imported'\n"
            "assert '--scheduling-policy' in p.format_help()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
