"""The engine's one table of dtype names and its one bfloat16-support probe."""

from __future__ import annotations

import functools

import torch

#: every accepted spelling of a floating dtype (the canonical name is str(dtype) without "torch.")
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def cpu_supports_bf16() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively through oneDNN (decides dtype="auto" on CPU and
    whether bf16 weights are prepacked for oneDNN)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
