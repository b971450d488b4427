#!/usr/bin/env bash
# Sets up (scripts/setup.sh, skipped when nothing it depends on changed) and runs the whole test suite.
# Triton kernels run through Triton's interpreter on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --if-changed
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q tests "$@"
