"""ctypes calls into the quantized-weight CPU kernels (kernels/cpu/quant_act.cpp, quant_gemm.cpp, quant_dequant.cpp).

Each wrapper checks what it hands over (ValueError naming the problem) and shows in the torch profiler as
``flowrt::<kernel>`` like cpu_ops' kernels. Callers ask :func:`usable` first: False where the library is not loaded
(no compiler, FLOWRT_CPU_OPS=0), while the kernels are turned off (cpu_ops.set_enabled(False)), or for a format the
library has no kernel for; then they keep their plain-torch path.
"""

from __future__ import annotations

import ctypes

import torch

from ..cpu import ops as cpu_ops
from .formats import QuantType, row_bytes

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ERRORS = {-1: "format without a kernel", -2: "k is not a whole number of blocks", -3: "a row id is out of range"}


def usable(qtype: QuantType) -> bool:
    """Whether the kernels run ``qtype`` here now."""
    lib = cpu_ops.lib()
    return lib is not None and cpu_ops.enabled() and bool(lib.quant_gemm_supported(int(qtype)))


def _fn(base: str, dtype: torch.dtype):
    if dtype not in _SUFFIX:
        raise ValueError(f"{base}: dtype {dtype} not supported (float32 or bfloat16)")
    return getattr(cpu_ops.lib(), f"{base}_{_SUFFIX[dtype]}")


def _raise(op: str, rc: int, qtype: QuantType) -> None:
    if rc:
        raise ValueError(f"{op}: {QuantType(qtype).name}: {_ERRORS.get(rc, f'error {rc}')}")


def _check_x(op: str, x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _SUFFIX or x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
        raise ValueError(f"{op}: x must be a float32 or bfloat16 [M, {k}] CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device.type}")
    return x if x.stride(1) == 1 else x.contiguous()


@cpu_ops._profiled("quant_act")
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int16 [M, K], d float32 [M, K/32], sx float32 [M, 2, K/32]): reference.quantize_activations'
    q and d bit for bit, and the halves' scaled sums the products use for the formats with minimums."""
    M, K = x.shape
    x = _check_x("quant_act", x, K)
    q = torch.empty(M, K, dtype=torch.int16)
    d = torch.empty(M, K // 32, dtype=torch.float32)
    sx = torch.empty(M, 2, K // 32, dtype=torch.float32)
    _raise("quant_act", _fn("quant_act", x.dtype)(x.data_ptr(), x.stride(0), M, K, q.data_ptr(), d.data_ptr(),
                                                   sx.data_ptr()), QuantType.Q8_0)
    return q, d, sx


@cpu_ops._profiled("quant_gemm")
def gemm(x: torch.Tensor, data: torch.Tensor, qtype: QuantType, n: int, k: int, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, n] = x [M, k] @ W^T (+ bias) in x's dtype, W the uint8 rows ``data`` [n, row_bytes] (contiguous, as
    QuantLinear keeps them); ``out``: an [M, n] view with unit column stride to write into (a slice of a wider
    output)."""
    x = _check_x("quant_gemm", x, k)
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, n, dtype=x.dtype)
    elif out.dtype != x.dtype or tuple(out.shape) != (M, n) or out.stride(1) != 1:
        raise ValueError(f"quant_gemm: out must be a {x.dtype} [{M}, {n}] view with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    rc = _fn("quant_gemm", x.dtype)(x.data_ptr(), x.stride(0), M, k, data.data_ptr(), int(qtype), n,
                                    0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))
    _raise("quant_gemm", rc, qtype)
    return out


def part(data: torch.Tensor, qtype: QuantType, n: int, k: int, bias: torch.Tensor | None) -> ctypes.Structure:
    """Quantized rows as a cpu_ops.FrWeightPart (the caller keeps ``data`` and ``bias`` alive)."""
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.numel() != n * row_bytes(qtype, k):
        raise ValueError(f"quant part: {QuantType(qtype).name} [{n}, {k}] needs {n} contiguous uint8 rows of "
                         f"{row_bytes(qtype, k)} bytes, got {data.dtype} {tuple(data.shape)}")
    return cpu_ops.FrWeightPart(w=data.data_ptr(), bias=None if bias is None else bias.data_ptr(),
                                ggml_type=int(qtype), rows=n)


@cpu_ops._profiled("quant_gemm")
def gemm_projection(x: torch.Tensor, proj: ctypes.Structure, n: int) -> torch.Tensor:
    """y [M, n] = x @ W^T (+ biases), W a cpu_ops.FrProjection of quantized parts stacked by rows (``n`` in all):
    x is quantized once for every part."""
    x = _check_x("quant_gemm_proj", x, proj.cols)
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    rc = _fn("quant_gemm_proj", x.dtype)(x.data_ptr(), x.stride(0), x.shape[0], ctypes.byref(proj), out.data_ptr(),
                                         out.stride(0))
    _raise("quant_gemm_proj", rc, QuantType(proj.parts[0].ggml_type))
    return out


def float_rows() -> int:
    """The row count from which the products run in float32 on the dequantized operands (int16 madd below)."""
    kernels = cpu_ops.lib()
    if kernels is None:
        raise RuntimeError("the CPU kernels are not loaded")
    return int(kernels.quant_gemm_float_rows())


def bf16_rows() -> bool:
    """Whether bfloat16 inputs of float_rows() rows and more multiply the weights rounded to bfloat16 with x itself
    (vdpbf16ps: the avx512bf16 variant), which is what the dequantized bfloat16 path computes, instead of float32
    products on the int16-rounded x."""
    kernels = cpu_ops.lib()
    if kernels is None:
        raise RuntimeError("the CPU kernels are not loaded")
    return bool(kernels.quant_gemm_bf16_rows())


@cpu_ops._profiled("quant_dequant")
def dequantize(data: torch.Tensor, qtype: QuantType, n_rows: int, k: int, ids: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64 [R]; None: all n_rows) of W (uint8 rows of whole blocks, contiguous) as ``dtype``
    [R, k]; float32 values equal gguf.quants.dequantize bit for bit."""
    need = n_rows * row_bytes(qtype, k)
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.numel() != need:
        raise ValueError(f"dequantize: {QuantType(qtype).name} [{n_rows}, {k}] needs {need} contiguous uint8 bytes, "
                         f"got {data.dtype} {tuple(data.shape)}")
    if ids is not None:
        ids = ids.to(torch.int64).contiguous().reshape(-1)
    n = n_rows if ids is None else ids.shape[0]
    out = torch.empty(n, k, dtype=dtype)
    rc = _fn("quant_dequant", dtype)(data.data_ptr(), int(qtype), k, 0 if ids is None else ids.data_ptr(), n,
                                     n_rows, out.data_ptr(), k)
    if rc == -3:
        raise IndexError(f"dequantize: a row id is outside the {n_rows} rows")
    _raise("quant_dequant", rc, qtype)
    return out
