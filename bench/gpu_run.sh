#!/usr/bin/env bash
# The one prepared GPU session (~8 minutes in all): kernel checks + benchmarks (bench/gpu_check.py: batch-1
# decode attention vs SDPA at 4k/32k, eager and in CUDA graphs, then the decode/prefill/cache tables), the kernel
# tests natively, and the engine on the GPU (bench/gpu_engine_check.py: parity, CUDA graphs on/off, batch-64
# decode step time, main workload). Every part has its own timeout and time budget, so one failure or
# slowness never loses the rest. Makes flowrt importable without installing it (package-dir mapping by links).
# Extra wheels (pydantic etc.), if carried in .whl/, are installed to /tmp/site first.
set -u
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/flowrt
cp -r flowrt/. /tmp/pkg/flowrt/
for p in engine kernels retrieval; do ln -s "$PWD/$p" "/tmp/pkg/flowrt/$p"; done
export PYTHONPATH=/tmp/pkg:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 160 python3 bench/gpu_check.py --budget 80 --skip-pytest 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
# the kernel tests natively, from outside the checkout so that /tmp/pkg's flowrt (with its links) is imported
R=$PWD; (cd /tmp && timeout 100 python3 -m pytest -q -p no:cacheprovider "$R/tests/kernels/test_kernels.py" 2>&1 \
  | tail -5 | tee "${OUT:-/tmp}/gpu_pytest.log")
timeout 210 python3 bench/gpu_engine_check.py --budget 150 2>&1 | tee "${OUT:-/tmp}/gpu_engine.log"
