"""bench/gpu_check.py: the one-shot GPU script, smoke-run on tiny CPU shapes (Triton's interpreter)."""

import subprocess
import sys

import pytest
import torch

from support import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, run bench/gpu_check.py for real")
def test_gpu_check_script_smoke():
    """bench/gpu_check.py --smoke runs the one-shot GPU script's every code path on tiny CPU shapes."""
    script = ROOT / "bench" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--dtype", "fp16"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout
