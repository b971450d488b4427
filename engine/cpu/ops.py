"""The CPU kernels, called through ctypes: projections over prepacked weights (PackedLinear, float32;
PackedLinearBF16, bfloat16 with AVX512-BF16), paged decode and flash attention that read the KV pool in place (no
gather), the KV cache write, residual-add + RMSNorm, SiLU x up and rotary embedding in place, for float32 and
bfloat16 tensors (bf16 kernels compute in float32 registers).

The sources live in kernels/cpu/ and are built lazily, once per instruction-set variant, by engine/cpu/build.py;
`lib()` loads the highest variant the CPU runs (or FLOWRT_CPU_ISA's), and returns None when no compiler is present,
compiling fails or FLOWRT_CPU_OPS=0: every caller then uses its plain-torch path (the tests run both). The kernels
parallelize with OpenMP, which resolves to the libgomp torch has already loaded (one thread pool); their team size
follows torch.get_num_threads() (checked on every `lib()` call, which each forward makes). Each wrapper checks its
tensors' dtypes, layouts and shapes (ValueError naming the problem) and, while the torch profiler runs, appears in
it as `flowrt::<kernel>`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from . import build as cpu_build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_isa: str | None = None
_threads = 0
_tried = False
_error: str | None = None
_disabled = False
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_profiling = torch._C._autograd._profiler_enabled

# The ctypes mirrors of the structs in kernels/cpu/flowrt_cpu.h (generated from it; see there for each field), the
# one-call decode step's arguments. The library is checked to lay them out the same when it loads.
_structs = cpu_build.structures()
FrWeightPart = _structs["FrWeightPart"]
FrProjection = _structs["FrProjection"]
FrLayer = _structs["FrLayer"]
FrDecodeCall = _structs["FrDecodeCall"]
FrFlashCall = _structs["FrFlashCall"]
FrDecodeProgram = _structs["FrDecodeProgram"]
FrDecodeStep = _structs["FrDecodeStep"]
MAX_PARTS = cpu_build.constants()["FR_MAX_PARTS"]  # weight parts of one FrProjection


def cache_dir() -> Path:
    return cpu_build.cache_dir()


def build(force: bool = False) -> Path:
    """Compiles the library of the variant `lib()` would load (or finds it cached) and returns its path. Raises
    RuntimeError on failure."""
    return cpu_build.build(cpu_build.choose(), force=force)


def _sync_threads(kernels: ctypes.CDLL) -> None:
    """The loaded library's thread count follows torch's."""
    global _threads
    n = torch.get_num_threads()
    if n != _threads:
        kernels.flowrt_set_num_threads(n)
        _threads = n


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they are unavailable (then callers use plain torch). Raises ValueError
    when FLOWRT_CPU_ISA names an unknown variant or one this CPU lacks."""
    global _lib, _tried, _error, _isa
    if _tried:
        if _lib is None or _disabled:
            return None
        if torch.get_num_threads() != _threads:
            _sync_threads(_lib)
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("FLOWRT_CPU_OPS", "1") == "0":
                _error = "disabled by FLOWRT_CPU_OPS=0"
            else:
                isa = cpu_build.choose()
                try:
                    _lib = cpu_build.load(isa)
                    _isa = isa.name
                    _sync_threads(_lib)
                except Exception as exc:  # noqa: BLE001 - no compiler, failed build, unloadable library: use torch
                    _error = str(exc)
                    logger.warning("flowrt CPU kernels unavailable, using plain torch: %s", exc)
            _tried = True
    return lib()


def isa() -> str | None:
    """The instruction-set variant of the loaded kernels (None when they are unavailable)."""
    return _isa if lib() is not None else None


@contextlib.contextmanager
def use_isa(name: str):
    """Tests and benchmarks: run the kernels of variant `name` (built if needed) inside the block."""
    global _lib, _isa, _threads, _tried
    lib()
    saved = _lib, _isa, _tried
    variant = cpu_build.load(cpu_build.choose(name))
    _lib, _isa, _threads, _tried = variant, name, 0, True
    try:
        _sync_threads(variant)
        yield variant
    finally:
        _lib, _isa, _tried = saved
        _threads = 0
        if _lib is not None:
            _sync_threads(_lib)


def set_enabled(enabled: bool) -> None:
    """Tests and benchmarks: force the plain-torch paths (False) or use the kernels again (True)."""
    global _disabled
    _disabled = not enabled


def enabled() -> bool:
    """False while set_enabled(False) is in force (loaded or not)."""
    return not _disabled


def available() -> bool:
    return lib() is not None


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernels are loaded and have a variant for this storage dtype (float32, bfloat16)."""
    return dtype in _SUFFIX and lib() is not None


def _profiled(name: str):
    """The kernel wrapper, shown as flowrt::<name> in the torch profiler while it records (one C-level check
    otherwise)."""
    label = f"flowrt::{name}"

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _profiling():
                with torch.profiler.record_function(label):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return call

    return wrap


def profiling() -> bool:
    """Whether the torch profiler is recording (callers keep their per-kernel paths then, so it sees each kernel)."""
    return _profiling()


def _p(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def projection(parts: Sequence[ctypes.Structure], cols: int) -> ctypes.Structure:
    """An FrProjection for StepGlue.decode_layers over `cols` input features: the FrWeightParts stacked by rows (each
    writes its slice of the output; at most MAX_PARTS). The tensors the parts point to must outlive its use."""
    if not 1 <= len(parts) <= MAX_PARTS or not all(isinstance(p, FrWeightPart) for p in parts):
        raise ValueError(f"projection: 1 to {MAX_PARTS} FrWeightPart, got {[type(p).__name__ for p in parts]}")
    return FrProjection(parts=(FrWeightPart * MAX_PARTS)(*parts), n_parts=len(parts), cols=cols)


def _kernel(base: str, dtype: torch.dtype):
    suffix = _SUFFIX.get(dtype)
    if suffix is None:
        raise ValueError(f"{base}: dtype {dtype} not supported (float32 or bfloat16)")
    return getattr(_lib, f"{base}_{suffix}")


def _check(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, dims: int, contiguous: bool = False,
           rows: bool = False) -> None:
    """t must be a CPU tensor of `dtype` with `dims` dimensions; contiguous: wholly; rows: every dimension but the
    first contiguous (any row stride)."""
    if t.dtype != dtype or t.ndim != dims or not t.is_cpu:  # (cheap attributes only: this runs ~300 times a step)
        raise ValueError(f"{op}: {name} must be a {dims}-d CPU {dtype} tensor, got {t.ndim}-d {t.device.type} "
                         f"{t.dtype}")
    if contiguous:
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    elif rows:
        st = t.stride()
        if st[-1] != 1 or (dims >= 3 and st[-2] != t.shape[-1]):
            raise ValueError(f"{op}: {name} must have contiguous rows (stride 1 in the last dims)")


def _check_attention(op: str, q, k_cache, v_cache, out):
    """The checks paged_decode and paged_flash share: pools [N, bs, Hkv, D] contiguous, q and out [*, H, D] with
    contiguous rows, all of the pools' dtype, H a multiple of Hkv. Returns that dtype."""
    dt = k_cache.dtype
    _check(op, "k_cache", k_cache, dt, 4, contiguous=True)
    _check(op, "v_cache", v_cache, dt, 4, contiguous=True)
    _check(op, "q", q, dt, 3, rows=True)
    _check(op, "out", out, dt, 3, rows=True)
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] or out.shape[1:] != q.shape[1:] \
            or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: q {tuple(q.shape)}, out {tuple(out.shape)}, caches {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)} do not fit together")
    return dt


# ---- wrappers (CPU tensors; callers check `lib()` first) ------------------------------------------------------

@_profiled("paged_decode")
def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, scale: float, rows=None, start: int = 0,
                 lse=None, shared_prefix: bool = False) -> None:
    """q/out [*, H, D] (rows contiguous in the last two dims), caches [N, bs, Hkv, D] contiguous, all float32 or all
    bfloat16; block_tables int32 [B, W] (row-contiguous), seq_lens int32 [B], rows int64 [B] or None, lse float32
    [B, H]. shared_prefix: the sequences share their first blocks (the work is ordered to keep that prefix in L2)."""
    dt = _check_attention("paged_decode", q, k_cache, v_cache, out)
    _check("paged_decode", "block_tables", block_tables, torch.int32, 2, rows=True)
    _check("paged_decode", "seq_lens", seq_lens, torch.int32, 1, contiguous=True)
    N, bs, Hkv, D = k_cache.shape
    H = q.shape[1]
    B = seq_lens.shape[0]
    if block_tables.shape[0] < B or (rows is None and q.shape[0] < B):
        raise ValueError(f"paged_decode: {B} sequences, but {block_tables.shape[0]} block tables / {q.shape[0]} rows")
    if rows is not None:
        _check("paged_decode", "rows", rows, torch.int64, 1, contiguous=True)
    if lse is not None:
        _check("paged_decode", "lse", lse, torch.float32, 2, contiguous=True)
    rc = _kernel("paged_decode", dt)(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                     block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), _p(rows),
                                     start, out.data_ptr(), out.stride(0), _p(lse), B, H, Hkv, D, bs, scale,
                                     int(shared_prefix))
    if rc != 0:
        raise ValueError(f"paged_decode: head size {D} not supported")


def flash_supported(head_dim: int) -> bool:
    """Whether paged_flash runs here for this head size (the kernels are loaded, with AVX2 + FMA)."""
    return head_dim % 16 == 0 and head_dim <= 256 and (kernels := lib()) is not None \
        and bool(kernels.gemm_packed_available())


@_profiled("paged_flash")
def paged_flash(q, k_cache, v_cache, rows, ends, group_start, tables, out, scale: float, key_start: int = 0,
                lse_in=None, lse_out=None) -> None:
    """Rows of q [*, H, D] (rows contiguous in the last two dims) attend keys of the pools [N, bs, Hkv, D] in place
    (float32 or bfloat16, as q and out). Group g is the rows rows[group_start[g]:group_start[g+1]] (int64 flat rows;
    group_start int32 [NG+1]), reading block table tables[g] (int32 [NG, W], row-contiguous); row i attends keys
    key_start .. ends[i]-1 (ends int32 [R]). lse_out (float32 [R, H]) receives each row's log-sum-exp; with lse_in
    instead, out already holds each row's attention over other keys with that log-sum-exp and the two are merged."""
    dt = _check_attention("paged_flash", q, k_cache, v_cache, out)
    _check("paged_flash", "rows", rows, torch.int64, 1, contiguous=True)
    _check("paged_flash", "ends", ends, torch.int32, 1, contiguous=True)
    _check("paged_flash", "group_start", group_start, torch.int32, 1, contiguous=True)
    _check("paged_flash", "tables", tables, torch.int32, 2, rows=True)
    N, bs, Hkv, D = k_cache.shape
    if ends.shape[0] != rows.shape[0] or tables.shape[0] != group_start.shape[0] - 1:
        raise ValueError(f"paged_flash: {rows.shape[0]} rows with {ends.shape[0]} ends, {tables.shape[0]} tables for "
                         f"{group_start.shape[0] - 1} groups")
    for name, t in (("lse_in", lse_in), ("lse_out", lse_out)):
        if t is not None:
            _check("paged_flash", name, t, torch.float32, 2, contiguous=True)
    rc = _kernel("paged_flash", dt)(q.data_ptr(), q.stride(0), rows.data_ptr(), ends.data_ptr(),
                                    group_start.data_ptr(), group_start.shape[0] - 1, tables.data_ptr(),
                                    tables.stride(0), key_start, k_cache.data_ptr(), v_cache.data_ptr(),
                                    out.data_ptr(), out.stride(0), _p(lse_in), _p(lse_out), q.shape[1], Hkv, D, bs,
                                    scale)
    if rc != 0:
        raise ValueError(f"paged_flash: head size {D} not supported (needs AVX2 + FMA and a multiple of 16)")


@_profiled("kv_write")
def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [T, Hkv, D] (any row stride; rows are copied contiguous first if they are not) into the contiguous pools
    [N, bs, Hkv, D] of the same dtype (float32 or bfloat16) at the flat token slots (int64 [T])."""
    dt = k_cache.dtype
    _check("kv_write", "k_cache", k_cache, dt, 4, contiguous=True)
    _check("kv_write", "v_cache", v_cache, dt, 4, contiguous=True)
    _check("kv_write", "k", k, dt, 3)
    _check("kv_write", "v", v, dt, 3)
    T, Hkv, D = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (Hkv, D) or v_cache.shape != k_cache.shape or slots.shape != (T,):
        raise ValueError(f"kv_write: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)} and caches "
                         f"{tuple(k_cache.shape)} do not fit together")
    k, v = (t if t.stride(2) == 1 and t.stride(1) == D else t.contiguous() for t in (k, v))
    slots = slots.to(torch.int64).contiguous()
    n_slots = k_cache.numel() // (Hkv * D)
    rc = _kernel("kv_write", dt)(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                 v_cache.data_ptr(), slots.data_ptr(), T, Hkv * D, n_slots)
    if rc != 0:
        raise IndexError(f"kv_write: a slot is outside the KV pool of {n_slots} token slots")


@_profiled("add_rmsnorm")
def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (when given); returns rms_norm(h) * weight. h/delta [T, E] contiguous, weight [E], all
    float32 or all bfloat16 (bf16 rounds as transformers' bf16 ops do)."""
    dt = h.dtype
    _check("add_rmsnorm", "h", h, dt, 2, contiguous=True)
    _check("add_rmsnorm", "weight", weight, dt, 1, contiguous=True)
    T, E = h.shape
    if delta is not None:
        _check("add_rmsnorm", "delta", delta, dt, 2, contiguous=True)
        if delta.shape != h.shape:
            raise ValueError(f"add_rmsnorm: delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    if weight.shape[0] != E:
        raise ValueError(f"add_rmsnorm: weight of {weight.shape[0]} for rows of {E}")
    out = torch.empty_like(h)
    _kernel("add_rmsnorm", dt)(h.data_ptr(), _p(delta), weight.data_ptr(), out.data_ptr(), T, E, eps)
    return out


@_profiled("rope")
def rope_(x: torch.Tensor, nheads: int, head_dim: int, cos_table, sin_table, positions) -> None:
    """Rotates the first nheads heads of every row of x [T, >= nheads*head_dim] (row stride x.stride(0)) in place,
    with the rows `positions` (int64 [T]) of the tables [P, head_dim] (x's dtype, float32 or bfloat16)."""
    dt = x.dtype
    _check("rope", "x", x, dt, 2, rows=True)
    _check("rope", "cos_table", cos_table, dt, 2, contiguous=True)
    _check("rope", "sin_table", sin_table, dt, 2, contiguous=True)
    _check("rope", "positions", positions, torch.int64, 1, contiguous=True)
    if (x.shape[1] < nheads * head_dim or cos_table.shape[1] != head_dim or sin_table.shape != cos_table.shape
            or positions.shape[0] != x.shape[0] or head_dim % 2):
        raise ValueError(f"rope: x {tuple(x.shape)}, {nheads} heads of {head_dim}, tables {tuple(cos_table.shape)}, "
                         f"positions {tuple(positions.shape)} do not fit together")
    _kernel("rope", dt)(x.data_ptr(), x.stride(0), x.shape[0], nheads, head_dim, cos_table.data_ptr(),
                        sin_table.data_ptr(), positions.data_ptr())


@_profiled("silu_mul")
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = cat(gate, up) (rows contiguous in the last dim, float32 or bfloat16):
    [T, I]."""
    dt = gate_up.dtype
    _check("silu_mul", "gate_up", gate_up, dt, 2, rows=True)
    T, I2 = gate_up.shape
    if I2 % 2:
        raise ValueError(f"silu_mul: gate_up has an odd width {I2}")
    out = torch.empty(T, I2 // 2, dtype=dt)
    _kernel("silu_mul", dt)(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I2 // 2)
    return out


class StepGlue:
    """One forward step's glue between the projections (residual + RMSNorm, rotary, SiLU x up), bound once for the
    step: the residual stream h (updated in place), the rotary tables and positions are checked here once, and the
    norm output and activation buffers are allocated once and reused by every layer (each is read by the next
    projection before the following layer writes it again). Per layer the calls then pass pointers, checking only
    what a projection hands over; a step of 30 layers makes ~120 such calls, ~4 us each fewer than the wrappers."""

    def __init__(self, h: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 eps: float, rot_heads: int, head_dim: int, qkv_width: int, inter: int,
                 slots: torch.Tensor | None = None):
        if lib() is None:
            raise RuntimeError(f"glue: the CPU kernels are unavailable ({_error or 'turned off'})")
        dt = h.dtype
        _check("glue", "h", h, dt, 2, contiguous=True)
        _check("glue", "cos_table", cos_table, dt, 2, contiguous=True)
        _check("glue", "sin_table", sin_table, dt, 2, contiguous=True)
        _check("glue", "positions", positions, torch.int64, 1, contiguous=True)
        T, E = h.shape
        if (positions.shape[0] != T or cos_table.shape[1] != head_dim or sin_table.shape != cos_table.shape
                or head_dim % 2 or qkv_width < rot_heads * head_dim):
            raise ValueError(f"glue: h {tuple(h.shape)}, positions {tuple(positions.shape)}, tables "
                             f"{tuple(cos_table.shape)}, {rot_heads} heads of {head_dim} in rows of {qkv_width} do "
                             f"not fit together")
        self.h, self.dtype, self.T, self.E, self.inter, self.eps = h, dt, T, E, inter, eps
        self.x = torch.empty(T, E, dtype=dt)  # every norm's output, the next projection's input
        self.act = torch.empty(T, inter, dtype=dt)  # SiLU x up, the down projection's input
        if slots is not None:
            slots = slots.to(torch.int64).contiguous()
            if slots.shape != (T,):
                raise ValueError(f"glue: slots {tuple(slots.shape)} for {T} rows")
        self._keep = (positions, cos_table, sin_table, slots)
        self._slots = _p(slots)
        self._head_dim = head_dim
        # (shape, dtype, kv heads, token slots) of the first KV pool rope_kv_ writes: every layer's is the same
        self._cache: tuple[torch.Size, torch.dtype, int, int] | None = None
        self._rope_args = (T, rot_heads, head_dim, cos_table.data_ptr(), sin_table.data_ptr(), positions.data_ptr())
        self._rows = {"delta": ((T, E), (E, 1)), "qkv": ((T, qkv_width), (qkv_width, 1)),
                      "gate_up": ((T, 2 * inter), (2 * inter, 1))}
        self._norm, self._rope, self._silu, self._rope_kv = (_kernel(k, dt) for k in
                                                              ("add_rmsnorm", "rope", "silu_mul", "rope_kv_write"))

    def _fits(self, name: str, t: torch.Tensor) -> None:
        shape, strides = self._rows[name]
        if t.dtype != self.dtype or t.shape != shape or t.stride() != strides:
            raise ValueError(f"glue: {name} must be a contiguous {self.dtype} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)} with strides {t.stride()}")

    def add_rmsnorm(self, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """h += delta (when given); returns self.x = rms_norm(h) * weight (weight: [E], checked by the caller once)."""
        if delta is not None:
            self._fits("delta", delta)
        if _profiling():
            with torch.profiler.record_function("flowrt::add_rmsnorm"):
                self._norm(self.h.data_ptr(), _p(delta), weight.data_ptr(), self.x.data_ptr(), self.T, self.E,
                           self.eps)
        else:
            self._norm(self.h.data_ptr(), _p(delta), weight.data_ptr(), self.x.data_ptr(), self.T, self.E, self.eps)
        return self.x

    def rope_(self, qkv: torch.Tensor) -> None:
        """Rotates the q and k heads at the start of each row of the qkv projection's output in place."""
        self._fits("qkv", qkv)
        if _profiling():
            with torch.profiler.record_function("flowrt::rope"):
                self._rope(qkv.data_ptr(), qkv.shape[1], *self._rope_args)
        else:
            self._rope(qkv.data_ptr(), qkv.shape[1], *self._rope_args)

    def rope_kv_(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """rope_ and the KV write in one pass: rows [q | k | v] of the qkv projection's output, the k heads (the
        last kv heads of the rotated ones) and v written to the step's slots of the pools [N, bs, Hkv, D]."""
        self._fits("qkv", qkv)
        if self._slots is None:
            raise ValueError("glue: rope_kv_ needs the step's slots")
        if self._cache is None:
            D = self._head_dim
            kv = (qkv.shape[1] - self._rope_args[1] * D) // D
            _check("glue", "k_cache", k_cache, self.dtype, 4, contiguous=True)
            if k_cache.shape[2:] != (kv, D):
                raise ValueError(f"glue: k_cache {tuple(k_cache.shape)} does not hold {kv} heads of {D}")
            self._cache = (k_cache.shape, k_cache.dtype, kv, k_cache.numel() // (kv * D))
        shape, dtype, kv, n_slots = self._cache
        for c in (k_cache, v_cache):
            if c.shape != shape or c.dtype != dtype or not c.is_contiguous():
                raise ValueError(f"glue: KV pools must be contiguous {dtype} {tuple(shape)}, got {c.dtype} "
                                 f"{tuple(c.shape)}")
        T, nh, D, cos, sin, pos = self._rope_args
        args = (qkv.data_ptr(), qkv.shape[1], T, nh - kv, kv, D, cos, sin, pos, k_cache.data_ptr(),
                v_cache.data_ptr(), self._slots, n_slots)
        if _profiling():
            with torch.profiler.record_function("flowrt::rope_kv_write"):
                rc = self._rope_kv(*args)
        else:
            rc = self._rope_kv(*args)
        if rc != 0:
            raise IndexError(f"glue: a slot is outside the KV pool of {n_slots} token slots")

    def decode_layers(self, layers: ctypes.Array, k_cache: torch.Tensor, v_cache: torch.Tensor, program, heads: int,
                      scale: float) -> None:
        """A decode step's layers in one call (decode_layers.cpp): h becomes the stream after the last layer.
        layers: a ctypes array of FrLayer (norm weights, projections, pools), built by the model from its packed or
        quantized projections and pools; k_cache / v_cache: one layer's pools (every layer's has their shape);
        program: the step's attention (engine.attention.DecodeProgram: .struct an FrDecodeProgram, built by the
        backend from its checked plans, every row a decode row); heads: the query heads."""
        T, E, inter = self.T, self.E, self.inter
        _, nh, D, cos, sin, pos = self._rope_args
        Hkv = nh - heads
        prog = program.struct
        if (self._slots is None or not isinstance(layers, ctypes.Array) or layers._type_ is not FrLayer
                or not isinstance(prog, FrDecodeProgram)):
            raise ValueError(f"decode_layers: {T} rows, slots {'set' if self._slots else 'missing'}, layers "
                             f"{type(layers).__name__}, program {type(prog).__name__}: needs the step's slots, an "
                             f"array of FrLayer and an FrDecodeProgram")
        for c in (k_cache, v_cache):
            _check("decode_layers", "kv pool", c, self.dtype, 4, contiguous=True)
            if c.shape[2:] != (Hkv, D):
                raise ValueError(f"decode_layers: pool {tuple(c.shape)} does not hold {Hkv} heads of {D}")
        n_slots = k_cache.numel() // (Hkv * D)
        qkv_w = (heads + 2 * Hkv) * D
        work = torch.empty(T * (2 * E + qkv_w + heads * D + 3 * inter), dtype=self.dtype)
        step = FrDecodeStep(layers=layers, program=ctypes.pointer(prog), h=self.h.data_ptr(), work=work.data_ptr(),
                            cos_t=cos, sin_t=sin, positions=pos, slots=self._slots, rows=T, n_slots=n_slots,
                            n_layers=len(layers), hidden=E, inter=inter, heads=heads, kv_heads=Hkv, head_dim=D,
                            block_size=k_cache.shape[1], eps=self.eps, scale=scale)
        rc = getattr(_lib, f"decode_layers_{_SUFFIX[self.dtype]}")(step)
        if rc == -2:
            raise IndexError(f"decode_layers: a slot is outside the KV pool of {n_slots} token slots")
        if rc != 0:
            raise ValueError(f"decode_layers: a kernel failed ({rc}: -3 attention head size {D} not supported, -4 a "
                             f"projection that does not fit the step, -5 a projection kernel)")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Returns self.act = silu(gate) * up of the gate+up projection's output."""
        self._fits("gate_up", gate_up)
        if _profiling():
            with torch.profiler.record_function("flowrt::silu_mul"):
                self._silu(gate_up.data_ptr(), 2 * self.inter, self.act.data_ptr(), self.T, self.inter)
        else:
            self._silu(gate_up.data_ptr(), 2 * self.inter, self.act.data_ptr(), self.T, self.inter)
        return self.act


class _PackedPanels:
    """A projection y = x @ W^T (+ bias) with W prepacked once into aligned panels of `panel` output features (k in
    steps of `kstep`) for one of flowrt's GEMM kernels; the bias padded to whole panels in float32. Subclasses name
    the dtype, the layout and the library's pack / multiply / availability functions."""

    dtype: torch.dtype
    panel: int  # output features per panel
    kstep: int  # k rows interleaved per panel row (2: bf16 pairs for vdpbf16ps)
    align: int  # bytes of alignment the kernel's loads need
    fns: tuple[str, str, str]  # (pack, multiply, available) in the library

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        N, K = weight.shape
        self.n, self.k = N, K
        self.panels = -(-N // self.panel)
        self.k_padded = -(-K // self.kstep) * self.kstep
        size = self.panels * self.k_padded * self.panel
        esz = torch.finfo(self.dtype).bits // 8
        raw = torch.empty(size + self.align // esz, dtype=self.dtype)
        off = (-(raw.data_ptr() // esz)) % (self.align // esz)
        self.wp = raw[off:off + size]
        w = weight.detach().contiguous()
        if getattr(_lib, self.fns[0])(w.data_ptr(), w.stride(0), N, K, self.wp.data_ptr()) not in (None, 0):
            raise RuntimeError(f"{self.fns[0]}: the loaded CPU kernels ({_isa}) lack it")
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(self.panels * self.panel, dtype=torch.float32)
            self.bias[:N] = bias.detach().float()

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """The packed projection, or None where its kernel is unavailable (no library, or not in this variant)."""
        if (lib() is None or weight.dtype != cls.dtype or weight.device.type != "cpu" or weight.dim() != 2
                or not getattr(_lib, cls.fns[2])()):
            return None
        return cls(weight, bias)

    def part(self) -> ctypes.Structure:
        """The projection as an FrWeightPart (packed float, ggml type 0) for StepGlue.decode_layers."""
        return FrWeightPart(w=self.wp.data_ptr(), bias=_p(self.bias), ggml_type=0, rows=self.n)

    def weight(self) -> torch.Tensor:
        """W [N, K] unpacked from the panels (a new tensor: for the paths that run while the kernels are off)."""
        K2 = self.k_padded // self.kstep
        w = self.wp.view(self.panels, K2, self.panel, self.kstep).permute(0, 2, 1, 3)
        return w.reshape(self.panels * self.panel, self.k_padded)[: self.n, : self.k].contiguous()

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.k or not x.is_cpu:
            raise ValueError(f"{type(self).__name__}: x must be a {str(self.dtype).removeprefix('torch.')} "
                             f"[M, {self.k}] CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device.type}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, self.n, dtype=self.dtype)
        if getattr(_lib, self.fns[1])(x.data_ptr(), x.stride(0), M, self.k, self.wp.data_ptr(), self.n,
                                      _p(self.bias), y.data_ptr(), self.n) != 0:
            raise RuntimeError(f"{self.fns[1]}: the loaded CPU kernels ({_isa}) lack it")
        return y


class PackedLinear(_PackedPanels):
    """float32, panels of 16 features k-major, for gemm_packed_f32: what every float32 step runs on a CPU with AVX2 +
    FMA."""

    dtype, panel, kstep, align = torch.float32, 16, 1, 32
    fns = ("gemm_pack_f32", "gemm_packed_f32", "gemm_packed_available")
    __call__ = _profiled("gemm")(_PackedPanels._multiply)


class PackedLinearBF16(_PackedPanels):
    """bfloat16 for gemm_packed_bf16 (AVX512-BF16's vdpbf16ps): pairs of k in panels of 32 features; float32
    accumulation, one round to nearest even. Only the avx512bf16 variant has it."""

    dtype, panel, kstep, align = torch.bfloat16, 32, 2, 64
    fns = ("gemm_pack_bf16", "gemm_packed_bf16", "gemm_bf16_available")
    __call__ = _profiled("gemm_bf16")(_PackedPanels._multiply)
