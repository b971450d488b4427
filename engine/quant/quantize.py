"""Float weights into GGUF blocks (Q8_0, Q4_0, Q4_1), in torch: how ``quantization="int8"|"int4"`` quantizes Hugging
Face weights at load, into the formats the GGUF kernels already multiply.

Bit for bit llama.cpp's reference round-to-nearest quantizers (``quantize_row_q8_0_ref`` and friends in ggml-quants.c,
as ``gguf.quants.quantize`` implements them in numpy): the same float32 operations in the same order, so a Hugging Face
checkpoint quantized here holds exactly the blocks a GGUF converter would write. Rows are quantized in chunks, so
the float32 temporaries stay a few MiB whatever the tensor's size.
"""

from __future__ import annotations

import torch

from .formats import QuantType, row_bytes
from .linear import QuantLinear

BLOCK = 32
CHUNK_ELEMENTS = 1 << 20  # float32 values quantized per chunk (a few MiB of temporaries)
FORMATS = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1)


def quantize(weight: torch.Tensor, qtype: QuantType | str, bias: torch.Tensor | None = None) -> QuantLinear:
    """A float weight [n, k] (k a multiple of 32) as a QuantLinear of ``qtype`` (Q8_0, Q4_0 or Q4_1)."""
    qtype = QuantType.parse(qtype)
    if qtype not in FORMATS:
        raise ValueError(f"cannot quantize to {qtype.name}: flowrt quantizes to {', '.join(t.name for t in FORMATS)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize needs a float [n, k] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    out = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)
    rows = max(1, CHUNK_ELEMENTS // k)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        blocks = weight[start:stop].float().reshape(-1, BLOCK)
        out[start:stop] = quantize_blocks(blocks, qtype).view(stop - start, -1)
    return QuantLinear(qtype, out, n, k, bias)


def quantize_blocks(blocks: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """float32 [B, 32] -> uint8 [B, block bytes] of ``qtype``."""
    if qtype == QuantType.Q8_0:
        return _q8_0(blocks)
    if qtype == QuantType.Q4_0:
        return _q4_0(blocks)
    if qtype == QuantType.Q4_1:
        return _q4_1(blocks)
    raise ValueError(f"no quantizer for {QuantType(qtype).name}")


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (C's roundf; floor(|x| + 0.5) rounds wrongly just below one half)."""
    a = x.abs()
    floored = a.floor()
    return (floored + (2 * (a - floored)).floor()).mul_(x.sign())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 32] of 0..15 -> [B, 16]: element i in the low nibble of byte i, element i + 16 in its high nibble."""
    return q[:, :16] | (q[:, 16:] << 4)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(1, keepdim=True) / 127
    qs = _roundf(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), qs], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d from the element of largest magnitude, with its sign: that element maps to -8, the others to 8 + x/d
    mx = blocks.gather(1, blocks.abs().argmax(1, keepdim=True))
    d = mx / -8
    q = (blocks * _inverse(d) + 8.5).trunc_().clamp_(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    mx, mn = blocks.amax(1, keepdim=True), blocks.amin(1, keepdim=True)
    d = (mx - mn) / 15
    q = ((blocks - mn) * _inverse(d) + 0.5).trunc_().clamp_(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(mn), _pack_nibbles(q)], dim=1)
