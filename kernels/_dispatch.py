"""How flowrt.kernels launches its Triton kernels.

Every kernel is written once, as a plain Python function in Triton's language, and wrapped in
:class:`Kernel`, which builds the launchable object on first use. A launch on CUDA tensors compiles
it (``triton.jit``); a launch on CPU tensors runs it through Triton's interpreter, the only way Triton
runs on a CPU. The interpreter needs ``TRITON_INTERPRET=1`` in the environment *before triton is first
imported* (triton.language's own helpers such as ``tl.zeros`` are built at that moment); a CPU launch
without it raises a RuntimeError that says so.

Kernels call no helpers of ours but ``paged_tile.attend_paged_range`` and ``online_softmax``'s update and output
(``@triton.jit`` functions, built at import as the interpreter's kind when TRITON_INTERPRET=1 is set).
"""

from __future__ import annotations

import functools
import math

import torch

try:  # pragma: no cover - exercised by the import itself
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any failure means "no triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

LOG2E = 1.4426950408889634


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            "flowrt.kernels needs triton (pip install 'flowrt[triton]'); "
            f"importing it failed: {TRITON_IMPORT_ERROR}"
        )


class Kernel:
    """A Triton kernel source that is compiled for CUDA and interpreted for CPU tensors."""

    def __init__(self, fn):
        self.fn = fn
        self._jit = None
        self._interp = None
        functools.update_wrapper(self, fn)

    def on(self, device: torch.device):
        require_triton()
        if device.type == "cpu":
            if self._interp is None:
                from triton.runtime.interpreter import InterpretedFunction

                if not isinstance(tl.zeros, InterpretedFunction):
                    raise RuntimeError(
                        "flowrt.kernels on CPU tensors runs Triton's interpreter, which needs TRITON_INTERPRET=1 "
                        "in the environment before triton is first imported (on a GPU, pass CUDA tensors)"
                    )
                self._interp = InterpretedFunction(self.fn)
            return self._interp
        if self._jit is None:
            self._jit = triton.jit(self.fn)
        return self._jit

    def jit(self):
        """The compiled flavour (for ahead-of-time compile checks)."""
        require_triton()
        if self._jit is None:
            self._jit = triton.jit(self.fn)
        return self._jit


def interpreted(device: torch.device) -> bool:
    return device.type == "cpu" or (HAS_TRITON and bool(triton.knobs.runtime.interpret))


def can_interpret() -> bool:
    """True when Triton kernels can run on CPU tensors in this process (see the module docstring)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_TL_DTYPES = {}


def tl_dtype(dtype: torch.dtype):
    require_triton()
    if not _TL_DTYPES:
        _TL_DTYPES.update({torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32})
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}; flowrt.kernels takes float16, bfloat16 or float32") from None


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (no TF32), so fp32 results match torch's default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Triton 3.x's interpreter multiplies bf16 tensors as their raw uint16 bits in tl.dot.

    Under the interpreter we round operands to bf16 exactly as the GPU path does, then multiply them
    as fp32 (which is what the tensor cores do with bf16 inputs and an fp32 accumulator).
    """
    return interpreted(device) and dtype == torch.bfloat16


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return 0 if n <= 1 else math.ceil(math.log2(n))
