"""One projection whose weight stays in a GGUF block format: ``y = x @ W^T (+ bias)``.

``QuantLinear`` holds the rows' blocks as the file stores them (uint8 [n, row_bytes]; a row is whole blocks, so
rows can be permuted, sliced and concatenated on the bytes) and multiplies with the CPU kernels where they are
loaded, else through the plain-torch reference (dequantize, then F.linear: slow, for machines without a compiler).
Fused projections (q/k/v, gate/up) are one QuantLinear when their parts share a format, else a
:class:`ConcatLinear` that writes each part into its slice of one output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cpu import ops as cpu_ops
from . import dequant, kernels, reference
from .formats import QuantType, block_shape, row_bytes


@dataclass(eq=False)
class QuantLinear:
    """A projection over quantized rows. ``data`` is uint8 [n, row_bytes(qtype, k)]; ``bias`` float32 [n] or None."""

    qtype: QuantType
    data: torch.Tensor
    n: int
    k: int
    bias: torch.Tensor | None = None
    _plain: torch.Tensor | None = field(default=None, init=False, repr=False)  # dequantized, for the torch path

    def __post_init__(self):
        self.qtype = QuantType.parse(self.qtype)
        block_shape(self.qtype)  # KeyError-free check that the format is a known block type
        expected = (self.n, row_bytes(self.qtype, self.k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.qtype.name} weight [{self.n}, {self.k}] needs uint8 data of shape {expected}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")
        if not self.data.is_contiguous():
            self.data = self.data.contiguous()
        if self.bias is not None:
            self.bias = self.bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        """Resident bytes of the weight (and bias)."""
        return self.data.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def runs_kernels(self) -> bool:
        """Whether calls run the CPU kernels now (else the plain-torch reference path)."""
        return kernels.usable(self.qtype)

    def part(self):
        """These rows as a cpu_ops.FrWeightPart, for the kernels that take projections (decode_layers)."""
        return kernels.part(self.data, self.qtype, self.n, self.k, self.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [n, k] as ``dtype`` (a new tensor)."""
        return dequant.dequantize(self.data, self.qtype, self.n, self.k, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of W as ``dtype`` [len(ids), k], only those dequantized: the lookup of a quantized token
        embedding. IndexError for an id outside the n rows."""
        ids = ids.reshape(-1)
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{self.qtype.name} rows: ids must be an integer tensor, got {ids.dtype}")
        if self.runs_kernels and dtype in (torch.float32, torch.bfloat16):
            return kernels.dequantize(self.data, self.qtype, self.n, self.k, ids, dtype)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"{self.qtype.name} rows: an id is outside the {self.n} rows")
        picked = self.data[ids.long()]
        return reference.dequantize_rows(picked, self.qtype, picked.shape[0], self.k).to(dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, n] in x's dtype (float32 or bfloat16) for x [M, k]; ``out``: an [M, n] view to write into."""
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{self.qtype.name} projection [{self.n}, {self.k}]: x must be a float32 or bfloat16 "
                             f"[M, {self.k}] tensor, got {x.dtype} {tuple(x.shape)}")
        if self.runs_kernels:
            return kernels.gemm(x, self.data, self.qtype, self.n, self.k, self.bias, out)
        y = self._torch(x)
        if out is None:
            return y
        out.copy_(y)
        return out

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        """The plain-torch path: the reference numerics (int16 activations), weights dequantized once and kept."""
        if self._plain is None:
            self._plain = self.dequantize(torch.float32)
        xq = reference.dequantize_activations(*reference.quantize_activations(x))
        y = torch.nn.functional.linear(xq, self._plain, self.bias)
        return y.to(x.dtype)


@dataclass(eq=False)
class ConcatLinear:
    """Parts of different formats stacked by rows: one output [M, sum(n)], each part writing its slice."""

    parts: list[QuantLinear]
    _projection: Any = field(default=None, init=False, repr=False)

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    @property
    def runs_kernels(self) -> bool:
        return all(p.runs_kernels for p in self.parts)

    @property
    def projection(self):
        """The parts as one cpu_ops.FrProjection (built once; the parts keep what it points into)."""
        if self._projection is None:
            self._projection = cpu_ops.projection([p.part() for p in self.parts], self.k)
        return self._projection

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_kernels and len(self.parts) <= cpu_ops.MAX_PARTS:  # one call: x quantized once for every part
            return kernels.gemm_projection(x, self.projection, self.n)
        out = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        start = 0
        for p in self.parts:
            p(x, out=out[:, start:start + p.n])
            start += p.n
        return out


def concat(parts: list[QuantLinear]) -> QuantLinear | ConcatLinear:
    """Row-stack projections over the same input (q/k/v, gate/up): one QuantLinear when all share a format."""
    if len({p.k for p in parts}) != 1:
        raise ValueError(f"cannot stack projections with different inputs: {[p.k for p in parts]}")
    if len({p.qtype for p in parts}) == 1:
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.n) for b, p in zip(biases, parts)])
        return QuantLinear(parts[0].qtype, torch.cat([p.data for p in parts]), sum(p.n for p in parts), parts[0].k,
                           bias)
    return ConcatLinear(list(parts))
