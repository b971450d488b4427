"""The numerics of a quantized projection, in plain torch: what every kernel is tested against.

A quantized projection computes ``y = x @ W^T (+ bias)`` where W is the dequantized weight (exactly the values
the GGUF file stores, ``dequantize_rows``) and x is first quantized per row in blocks of 32 elements to int16 with
one float32 scale per block: ``d = amax(|x_block|) / 32767``, ``q = round(x / d)`` (half away from zero; q = 0
where d = 0). The kernels then sum integer products within each block and scale by
``d_x * (the weight block's scales)``, so they equal this reference up to float32 summation order. Why integer
activations: an integer dot product of 32 pairs is a few instructions on AVX2 (int16 pairs: madd), so a decode step
streams the quantized weights at memory speed. Why int16 and not llama.cpp's int8 (q8_0): int8 activations moved the
135M model's logits by ~0.1 nats and flipped greedy choices against the dequantized float32 path on 3 of 5 prompts;
int16 adds ~1e-5 relative error, and costs the same on AVX2.
"""

from __future__ import annotations

import torch

ACT_BLOCK = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (q int16 [M, K], d float32 [M, K // 32])."""
    M, K = x.shape
    if K % ACT_BLOCK:
        raise ValueError(f"quantized projections need K a multiple of {ACT_BLOCK}, got {K}")
    xb = x.float().reshape(M, K // ACT_BLOCK, ACT_BLOCK)
    d = xb.abs().amax(-1) / 32767.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    v = xb * inv.unsqueeze(-1)
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # round half away from zero, as C's roundf
    return q.to(torch.int16).reshape(M, K), d


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    M, K = q.shape
    return (q.float().reshape(M, K // ACT_BLOCK, ACT_BLOCK) * d.unsqueeze(-1)).reshape(M, K)


def dequantize_rows(data: torch.Tensor, qtype, n: int, k: int) -> torch.Tensor:
    """The float32 [n, k] values of a weight stored as ``data`` (uint8 [n, row_bytes]) in ``qtype``."""
    from ..model.gguf_loader import dequantize

    return dequantize(data.reshape(-1), int(qtype), (n, k), torch.float32)


def linear(x: torch.Tensor, data: torch.Tensor, qtype, n: int, k: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference y [M, n] in float64 (compare kernels to it with a float32 tolerance)."""
    w = dequantize_rows(data, qtype, n, k).double()
    xq = dequantize_activations(*quantize_activations(x)).double()
    y = xq @ w.T
    return y if bias is None else y + bias.double()
