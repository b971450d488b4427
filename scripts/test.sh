#!/usr/bin/env bash
# Sets up (scripts/setup.sh, skipped when nothing it depends on changed) and runs the whole test suite.
# Triton kernels run through Triton's interpreter on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --if-changed
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Bytecode caching on, whatever the environment says: with PYTHONDONTWRITEBYTECODE=1 every run (and every Python
# subprocess the tests start) compiles this checkout's modules again, and pytest rewrites the asserts of every test
# module again (~10 s of a fast-tier run). The caches go to __pycache__/ (git-ignored), or under PYTHONPYCACHEPREFIX
# where that is set; on a fresh clone the first run writes them and the later processes of that run read them.
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q tests "$@"
