"""Paged decode attention: one query token per sequence over its whole paged context.

One program per (sequence, KV head, split). It loads each K/V tile of its KV head once and scores it
against all the query heads of that group at once (GQA: the group's heads are the rows of a small
``tl.dot``). Long contexts are cut into ``num_splits`` chunks (split-K, "flash decoding"): each chunk
writes its normalised partial output and log-sum-exp, and a second kernel merges them.
"""

from __future__ import annotations

import torch

from ._dispatch import (LOG2E, Kernel, cdiv, dot_precision, dot_upcast, next_pow2, num_sms,  # noqa: F401
                        tl, tl_dtype, triton)
from .paged_args import PagedStrides, check_paged_caches, unit_stride_inputs
from .online_softmax import online_softmax_output
from .paged_tile import attend_paged_range

__all__ = ["paged_decode_attention", "choose_num_splits", "split_plan"]


def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, tokens_per_split, num_splits, num_heads, strides,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g

    q = tl.load(q_ptr + b.to(tl.int64) * strides.q_row + heads[:, None] * strides.q_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * strides.table_row
    m_i, l_i, acc = attend_paged_range(
        q, m_i, l_i, acc, start, end, None, k_ptr, v_ptr, bt_row, kvh, offs_n, offs_d, d_mask, scale_log2, strides,
        PAGE=PAGE, BLOCK_N=BLOCK_N, BOUNDS=True, CAUSAL=False, DOT_PREC=DOT_PREC, UPCAST=UPCAST)
    o = online_softmax_output(acc, l_i)
    o_mask = g_mask[:, None] & d_mask[None, :]
    if not IS_SPLIT:
        tl.store(out_ptr + b.to(tl.int64) * strides.out_row + heads[:, None] * strides.out_head + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # part_o: [B, H, num_splits, HEAD_DIM] fp32, part_lse: [B, H, num_splits] fp32 (log2 domain)
        row = (b.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=o_mask)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


def _reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row0 = (b.to(tl.int64) * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = tl.where(s_mask & (lse > float("-inf")), w, 0.0)
    o = tl.load(part_o_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.where((w > 0.0)[:, None], o, 0.0)
    total = tl.sum(w, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    res = tl.sum(o * w[:, None], axis=0) / total
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


_DECODE = Kernel(_decode_kernel)
_REDUCE = Kernel(_reduce_kernel)

# Tokens scored per inner-loop step; 64 keeps register use modest for head_dim 128 on every GPU.
DECODE_BLOCK_N = 64
# Split-K: aim for this many decode programs per SM (one wave, enough loads in flight to saturate HBM),
# never cut a chunk shorter than MIN_TOKENS_PER_SPLIT (its partial result and the merge stay a few % of
# its K/V bytes), and never merge more than MAX_SPLITS partials (the merge holds them in registers).
PROGRAMS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = DECODE_BLOCK_N
MAX_SPLITS = 128


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K factor for a decode launch of ``batch * num_kv_heads`` programs over up to ``max_seq_len``
    tokens on a GPU with ``num_sms`` SMs (pure: pass the SM count in).

    Few programs (batch 1 with a handful of KV heads) leave most SMs idle and each one streams the whole
    context serially, so the context is cut into enough splits to give every SM ~PROGRAMS_PER_SM programs,
    bounded by MIN_TOKENS_PER_SPLIT and MAX_SPLITS. The result is what the kernel actually launches:
    chunks are whole tiles (see :func:`split_plan`), so it may be lower than the ideal count.
    """
    programs = max(1, batch * num_kv_heads)
    target = PROGRAMS_PER_SM * max(1, num_sms)
    most = min(MAX_SPLITS, max_seq_len // MIN_TOKENS_PER_SPLIT)
    if programs >= target or most < 2:
        return 1
    return split_plan(max_seq_len, min(cdiv(target, programs), most))[0]


def split_plan(max_seq_len: int, num_splits: int) -> tuple[int, int]:
    """(splits launched, tokens per split) for cutting ``max_seq_len`` tokens into ``num_splits`` chunks of
    whole DECODE_BLOCK_N tiles; one split covers everything (no partials, no merge)."""
    max_seq_len = max(1, int(max_seq_len))
    num_splits = max(1, min(int(num_splits), cdiv(max_seq_len, DECODE_BLOCK_N)))
    if num_splits == 1:
        return 1, 1 << 30
    tokens_per_split = cdiv(cdiv(max_seq_len, num_splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    num_splits = cdiv(max_seq_len, tokens_per_split)
    return (num_splits, tokens_per_split) if num_splits > 1 else (1, 1 << 30)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None,
                           max_seq_len=None):
    """``q`` ``[B, H, D]`` (query b at position ``seq_lens[b]-1``) -> ``[B, H, D]`` in ``q.dtype``.

    ``block_tables`` int32 ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]`` (context including the new token,
    whose K/V are already in the cache; 0 gives a zero row). ``num_splits`` None picks split-K from the
    GPU's SM count, the batch and ``max_seq_len`` (an upper bound on ``seq_lens``; None means
    ``block_tables.shape[1] * block_size``; pass it when block tables are padded far beyond the real
    contexts, e.g. to ``max_model_len``). Needs no host sync, and its launch shape depends only on the
    shapes, ``max_seq_len`` and ``num_splits``: safe under CUDA graphs when those are fixed (the engine's graphs
    pass ``max_model_len``; splits past a row's context find no tokens and write an empty partial).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    bsz, num_heads, head_dim = q.shape
    block_size, num_kv_heads = check_paged_caches(q, k_cache, v_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match batch {bsz}")
    q, block_tables, out = unit_stride_inputs(q, block_tables, out)
    if bsz == 0:
        return out

    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    max_seq_len = max(1, int(max_seq_len))
    if num_splits is None:
        sms = num_sms(q.device.index or 0) if q.device.type == "cuda" else 1
        num_splits = choose_num_splits(bsz, num_kv_heads, max_seq_len, sms)
    num_splits, tokens_per_split = split_plan(max_seq_len, num_splits)
    if num_splits == 1:
        part_o = part_lse = out  # unused
    else:  # one allocation for both partial buffers: [B, H, S, D] outputs then [B, H, S] log-sum-exps
        rows = bsz * num_heads * num_splits
        parts = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        part_o, part_lse = parts[: rows * head_dim], parts[rows * head_dim :]

    block_d = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16; masked lanes are zero
    dev = q.device
    _DECODE.on(dev)[(bsz, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        float(scale) * LOG2E, tokens_per_split, num_splits, num_heads,
        PagedStrides.of(q, k_cache, v_cache, block_tables, out),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=block_size, BLOCK_N=DECODE_BLOCK_N,
        IS_SPLIT=num_splits > 1, DOT_PREC=dot_precision(q.dtype), UPCAST=dot_upcast(q.dtype, dev),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _REDUCE.on(dev)[(bsz, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            BLOCK_S=next_pow2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4 if next_pow2(num_splits) * block_d <= 4096 else 8,
        )
    return out
