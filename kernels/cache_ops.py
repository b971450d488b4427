"""KV-cache write (scatter by slot mapping) and whole-block copies for copy-on-write."""

from __future__ import annotations

import torch

from ._dispatch import Kernel, next_pow2, tl, tl_dtype, triton  # noqa: F401 - tl is used inside kernels

__all__ = ["write_kv", "copy_blocks", "copy_blocks_stacked"]


# --------------------------------------------------------------------------------------------- write_kv
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = key_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    dst_k = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, k, mask=mask)
    tl.store(dst_v, v, mask=mask)


_WRITE_KV = Kernel(_write_kv_kernel)


def _check_cache(name, cache):
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in head_dim, got strides {cache.stride()}")
    tl_dtype(cache.dtype)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into ``k_cache``/``v_cache`` in place.

    ``slot_mapping`` is int64 (or int32) ``[T]``: slot = block_id * block_size + offset, -1 = skip the row.
    ``key``/``value`` may be strided views (e.g. slices of a fused qkv output) as long as head_dim is
    contiguous; other dtypes than the cache's are converted first (an extra copy).
    """
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    _, block_size, hkv, d = k_cache.shape
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, hkv, d) or value.shape != (num_tokens, hkv, d):
        raise ValueError(f"key/value must be [T, {hkv}, {d}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    # Convert in torch when dtypes differ (one extra pass; the engine writes in the cache dtype anyway):
    # exact round-to-nearest on every backend, the interpreter included.
    if key.dtype != k_cache.dtype:
        key = key.to(k_cache.dtype)
    if value.dtype != v_cache.dtype:
        value = value.to(v_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _WRITE_KV.on(key.device)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), PAGE=block_size,
        num_warps=4 if hkv * d >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------- block copies
def _copy_blocks_kernel(
    base_ptr, ptr_table, src_ptr, dst_ptr, stride_lead, stride_block, block_numel,
    USE_PTR_TABLE: tl.constexpr, DTYPE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (pair, tensor): copy block src[pair] to dst[pair] in one cache tensor, CHUNK elements at a time.

    Cache tensors are either slices of one base tensor (``base_ptr + tensor * stride_lead``) or separate
    tensors whose addresses are listed in ``ptr_table`` (int64).
    """
    pair = tl.program_id(0)
    which = tl.program_id(1)
    if USE_PTR_TABLE:
        base = tl.load(ptr_table + which).to(tl.pointer_type(DTYPE))
    else:
        base = base_ptr + which.to(tl.int64) * stride_lead
    s = tl.load(src_ptr + pair).to(tl.int64)
    d = tl.load(dst_ptr + pair).to(tl.int64)
    src = base + s * stride_block
    dst = base + d * stride_block
    for start in range(0, block_numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < block_numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


_COPY_BLOCKS = Kernel(_copy_blocks_kernel)
_PTR_TABLES: dict = {}


def _pairs(src, dst, device):
    src = torch.as_tensor(src, device=device)
    dst = torch.as_tensor(dst, device=device)
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be 1-D and of one length, got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.dtype not in (torch.int32, torch.int64) or dst.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"src/dst must be int32 or int64 tensors, got {src.dtype} and {dst.dtype}")
    return src, dst


def _block_layout(cache, block_dim):
    """(stride of a block, elements per block); requires each block to be one contiguous run."""
    inner = cache.shape[block_dim + 1 :]
    numel = 1
    expected = 1
    for size, stride in zip(reversed(inner), reversed(cache.stride()[block_dim + 1 :])):
        if size != 1 and stride != expected:
            raise ValueError(f"each KV block must be contiguous; got shape {tuple(cache.shape)} "
                             f"strides {cache.stride()}")
        expected *= size
        numel *= size
    return cache.stride(block_dim), numel


def _chunk(numel: int) -> int:
    return min(4096, next_pow2(numel))


def copy_blocks_stacked(kv, src, dst) -> None:
    """Copy-on-write block copies in one launch over every layer's K and V.

    ``kv`` is ``[..., num_blocks, block_size, Hkv, D]`` (the engine's all-layer layout is
    ``[num_layers, 2, num_blocks, block_size, Hkv, D]``; a single ``[num_blocks, ...]`` pool works too);
    the leading dims must flatten to one stride (true for a contiguous tensor). For every i, block
    ``dst[i]`` := block ``src[i]`` in every leading slice. Destinations must be distinct and not among the sources.
    """
    if kv.dim() < 4:
        raise ValueError(f"kv must be [..., num_blocks, block_size, Hkv, D], got shape {tuple(kv.shape)}")
    src, dst = _pairs(src, dst, kv.device)
    if src.numel() == 0:
        return
    block_dim = kv.dim() - 4
    stride_block, numel = _block_layout(kv, block_dim)
    lead = 1
    for s in kv.shape[:block_dim]:
        lead *= s
    if block_dim == 0:
        stride_lead = 0
    else:
        try:
            flat = kv.view(lead, *kv.shape[block_dim:])
        except RuntimeError as exc:
            raise ValueError(f"kv's leading dims {tuple(kv.shape[:block_dim])} must flatten to one stride") from exc
        stride_lead = flat.stride(0)
    _COPY_BLOCKS.on(kv.device)[(src.numel(), lead)](
        kv, kv, src, dst, stride_lead, stride_block, numel,
        USE_PTR_TABLE=False, DTYPE=tl_dtype(kv.dtype), CHUNK=_chunk(numel), num_warps=4,
    )


def copy_blocks(k_caches, v_caches, src, dst) -> None:
    """For every pair i: block ``dst[i]`` := block ``src[i]`` in every layer's K and V cache, in one launch.

    ``k_caches``/``v_caches`` are lists of ``[num_blocks, block_size, Hkv, D]`` pools, all of one shape and
    dtype with contiguous blocks. Destinations must be distinct and not among the sources.
    """
    caches = list(k_caches) + list(v_caches)
    if not caches:
        return
    first = caches[0]
    for c in caches:
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device or c.stride() != first.stride():
            raise ValueError("copy_blocks needs every cache of one shape, dtype, device and layout")
        if c.dim() != 4:
            raise ValueError(f"caches must be [num_blocks, block_size, Hkv, D], got shape {tuple(c.shape)}")
    src, dst = _pairs(src, dst, first.device)
    if src.numel() == 0:
        return
    stride_block, numel = _block_layout(first, 0)
    key = (first.device, tuple(c.data_ptr() for c in caches))
    table = _PTR_TABLES.get(key)
    if table is None:
        if len(_PTR_TABLES) > 16:
            _PTR_TABLES.clear()
        table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
        _PTR_TABLES[key] = table
    _COPY_BLOCKS.on(first.device)[(src.numel(), len(caches))](
        first, table, src, dst, 0, stride_block, numel,
        USE_PTR_TABLE=True, DTYPE=tl_dtype(first.dtype), CHUNK=_chunk(numel), num_warps=4,
    )
