"""Weights kept quantized in memory: GGUF block formats (and int8 / int4 for Hugging Face weights, quantized at
load into the same block formats), multiplied in place by the CPU kernels.

The seam to the rest of the engine is :class:`QuantLinear` (one projection) and :class:`QuantType` (a block
format); the numerics every kernel must match are :mod:`.reference`'s.
"""

from .formats import NATIVE_TYPES, QuantType, block_shape, row_bytes
from .linear import ConcatLinear, QuantLinear, concat

__all__ = ["QuantType", "NATIVE_TYPES", "block_shape", "row_bytes", "QuantLinear", "ConcatLinear", "concat"]
