"""Argument checks the paged attention wrappers share (query rows against a paged K/V pool).

The kernels index with the strides they are given but assume a unit stride in head_dim and in the block
tables' rows; these checks say what is wrong in the caller's terms instead of reading out of bounds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PagedStrides", "check_paged_caches", "unit_stride_inputs"]


class PagedStrides(NamedTuple):
    """The element strides a paged attention kernel indexes with, passed as one argument (a Triton tuple; the kernels
    read ``strides.k_block``, ...): both kernels and their shared key loop take the same set, so it is spelled once.
    The last dimensions are unit-stride (checked below) and have none."""

    q_row: int
    q_head: int
    k_block: int
    k_slot: int
    k_head: int
    v_block: int
    v_slot: int
    v_head: int
    table_row: int
    out_row: int
    out_head: int

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        out: torch.Tensor,
    ) -> PagedStrides:
        """Of ``q`` / ``out`` ``[N, H, D]``, the pools ``[num_blocks, block_size, Hkv, D]`` and ``block_tables``."""
        ks, vs = k_cache.stride(), v_cache.stride()
        return cls(
            q.stride(0),
            q.stride(1),
            ks[0],
            ks[1],
            ks[2],
            vs[0],
            vs[1],
            vs[2],
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
        )


def check_paged_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(block_size, num_kv_heads) of the pools ``[num_blocks, block_size, Hkv, D]`` that ``q`` ``[N, H, D]``
    (already checked to be 3-D) attends over; raises when they do not fit it."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, d = k_cache.shape
    if v_cache.shape != k_cache.shape or d != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} must share a dtype")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need a unit stride in head_dim")
    return block_size, num_kv_heads


def unit_stride_inputs(q: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None):
    """(q, block_tables, out) with a unit last stride: copies of q / block_tables where needed, ``out``
    allocated like q when None (a given ``out`` must already be q's shape with a unit stride in head_dim)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with unit stride in head_dim")
    return q, block_tables, out
