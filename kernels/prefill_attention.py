"""Paged prefill attention: varlen causal attention of new tokens over their cached prefix plus themselves.

Grid: (query tiles, KV heads). A query tile is BLOCK_Q consecutive new tokens of one sequence times the
GROUP query heads that share a KV head, so a tile has BLOCK_M = BLOCK_Q * next_pow2(GROUP) rows and each
K/V tile it loads serves all of them. Sequence b owns tiles ``query_start_loc[b] // BLOCK_Q + b`` up to
(not including) the next sequence's first tile, which is at least ``ceil(q_len_b / BLOCK_Q)`` tiles;
so ``T // BLOCK_Q + B`` programs cover any batch without reading lengths on the host, and each
program finds its sequence by binary search over ``query_start_loc``. Surplus programs exit at once.

Keys below the tile's first query position are visible to every row and need no mask; only the last
few K/V tiles (the causal diagonal) are masked. Rows with q_len == 1 (decode rows in a mixed batch) are
served by a tile of their own; ``max_query_len`` shrinks BLOCK_Q when the whole batch is short.
"""

from __future__ import annotations

import torch

from ._dispatch import (LOG2E, Kernel, dot_precision, dot_upcast, log2_ceil, next_pow2,  # noqa: F401
                        tl, tl_dtype, triton)
from .paged_args import PagedStrides, check_paged_caches, unit_stride_inputs
from .online_softmax import online_softmax_output
from .paged_tile import attend_paged_range

__all__ = ["paged_prefill_attention"]


def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs, search_steps, strides,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # sequence b = the last one whose first tile index (qsl[b] // BLOCK_Q + b) is <= pid
    lo = pid * 0
    hi = num_seqs - 1 + lo
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_up = first_tile <= pid
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    b = lo
    q_begin = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_begin
    q0 = (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q  # first new token (local index) of this tile
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # cached tokens before the new ones

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q0 + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    row = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * strides.q_row + head[:, None] * strides.q_head + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok  # absolute position of each row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * strides.table_row

    # Phase 1: keys every row of the tile sees (positions <= prefix + q0), whole tiles, no masks.
    full_end = ((prefix + q0 + 1) // BLOCK_N) * BLOCK_N
    m_i, l_i, acc = attend_paged_range(
        q, m_i, l_i, acc, 0, full_end, None, k_ptr, v_ptr, bt_row, kvh, offs_n, offs_d, d_mask, scale_log2, strides,
        PAGE=PAGE, BLOCK_N=BLOCK_N, BOUNDS=False, CAUSAL=False, DOT_PREC=DOT_PREC, UPCAST=UPCAST)

    # Phase 2: the causal diagonal, up to the tile's last valid query position.
    kv_end = prefix + tl.minimum(q0 + BLOCK_Q, q_len)
    m_i, l_i, acc = attend_paged_range(
        q, m_i, l_i, acc, full_end, kv_end, q_pos, k_ptr, v_ptr, bt_row, kvh, offs_n, offs_d, d_mask, scale_log2,
        strides,
        PAGE=PAGE, BLOCK_N=BLOCK_N, BOUNDS=True, CAUSAL=True, DOT_PREC=DOT_PREC, UPCAST=UPCAST)
    o = online_softmax_output(acc, l_i)
    tl.store(out_ptr + row[:, None] * strides.out_row + head[:, None] * strides.out_head + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


_PREFILL = Kernel(_prefill_kernel)

PREFILL_BLOCK_M = 128  # rows (tokens x heads of a group) per program
PREFILL_BLOCK_N = 64   # keys per inner step


def _tile_config(group: int, max_query_len: int, head_dim: int, dtype: torch.dtype):
    """(BLOCK_G, BLOCK_Q, BLOCK_M, BLOCK_N, num_warps) for a launch."""
    block_g = next_pow2(group)
    block_n = PREFILL_BLOCK_N
    block_m = PREFILL_BLOCK_M if head_dim <= 128 else 64
    if dtype == torch.float32:  # exact fp32 dots are unrolled FMAs: small tiles (registers, compile time)
        block_m, block_n = 32, 32
    # Short queries (decode rows, small chunks): shrink the tile to what the longest query needs.
    block_m = max(16, min(block_m, next_pow2(max(1, max_query_len) * block_g)))
    block_m = max(block_m, block_g)
    block_q = max(1, block_m // block_g)
    num_warps = 8 if block_m >= 128 else 4
    return block_g, block_q, block_m, block_n, num_warps


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                            out=None):
    """``q`` ``[T, H, D]`` (new tokens of B sequences, flattened) -> ``[T, H, D]`` in ``q.dtype``.

    ``query_start_loc`` int32 ``[B+1]``, ``seq_lens`` int32 ``[B]`` (context including the new tokens, whose
    K/V must already be in the cache), ``block_tables`` int32 ``[B, max_blocks]``. ``max_query_len`` is an
    upper bound on the per-sequence query length (a host int; it only picks the tile size). Rows past
    ``query_start_loc[B]`` are not written. Needs no host sync.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = check_paged_caches(q, k_cache, v_cache)
    bsz = seq_lens.shape[0]
    if query_start_loc.shape != (bsz + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)}, block_tables {tuple(block_tables.shape)} "
                         f"and seq_lens {tuple(seq_lens.shape)} disagree on the batch size")
    q, block_tables, out = unit_stride_inputs(q, block_tables, out)
    if bsz == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    dev = q.device
    block_g, block_q, block_m, block_n, num_warps = _tile_config(group, int(max_query_len), head_dim, q.dtype)
    grid = (num_tokens // block_q + bsz, num_kv_heads)
    _PREFILL.on(dev)[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * LOG2E, bsz, log2_ceil(bsz), PagedStrides.of(q, k_cache, v_cache, block_tables, out),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),  # tl.dot needs K >= 16
        PAGE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype, dev),
        num_warps=num_warps, num_stages=2,
    )
    return out
