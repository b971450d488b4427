"""Whole-tensor dequantization for every GGUF type: the loader's path for ``quantization=None`` and for formats
without a product kernel. The block formats of quant_blocks.h run in C++ where the kernels are loaded (bit-identical
to gguf.quants.dequantize in float32, parallel, no numpy temporaries); float types and the rest (IQ2/IQ3, TQ, ...)
go through engine.gguf_loader.dequantize (torch, or the gguf package's numpy reference).
"""

from __future__ import annotations

import torch

from . import kernels
from .formats import QuantType


def dequantize(data: torch.Tensor, qtype: QuantType | int, n: int, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [n, k] as ``dtype`` (a new tensor) from its stored bytes ``data`` (uint8, any shape holding them)."""
    ggml_type = int(qtype)
    try:
        known = QuantType(ggml_type)
    except ValueError:
        known = None
    if known is not None and dtype in (torch.float32, torch.bfloat16) and kernels.usable(known):
        return kernels.dequantize(data.reshape(-1).contiguous(), known, n, k, None, dtype)
    from ..model.gguf_loader import dequantize as loader_dequantize

    return loader_dequantize(data.reshape(-1), ggml_type, (n, k), dtype)
