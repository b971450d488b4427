"""The key loop the decode and prefill kernels share: paged K/V tiles folded into the running softmax.

``attend_paged_range`` walks the positions ``[start, stop)`` of one KV head in tiles of BLOCK_N (position p
lives in block ``block_table[p // PAGE]`` at offset ``p % PAGE``), scores each tile's keys against the query rows
``q`` and folds its values in (``online_softmax_update``), indexing the pools with the launch's ``strides``
(``paged_args.PagedStrides``). Masks are constexpr switches, so a range that needs none (prefill keys every row
sees, in whole tiles) compiles without them:

- ``BOUNDS``: positions from ``stop`` on do not exist (their loads are skipped, their scores -inf);
- ``CAUSAL`` (with ``BOUNDS``): row r sees position p only if ``p <= q_pos[r]``.

A ``@triton.jit`` helper, built like ``online_softmax_update`` (the interpreter's kind when TRITON_INTERPRET=1
was set first).
"""

from __future__ import annotations

from ._dispatch import HAS_TRITON, tl, triton
from .online_softmax import online_softmax_update

__all__ = ["attend_paged_range"]


def _attend_paged_range(
    q, m_i, l_i, acc, start, stop, q_pos,
    k_ptr, v_ptr, bt_row, kvh, offs_n, offs_d, d_mask, scale_log2, strides,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    for n0 in range(start, stop, BLOCK_N):
        pos = n0 + offs_n
        if BOUNDS:
            n_mask = pos < stop
            blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
            kv_mask = d_mask[None, :]
        within = pos % PAGE
        k_row = blk * strides.k_block + within * strides.k_slot + kvh * strides.k_head
        v_row = blk * strides.v_block + within * strides.v_slot + kvh * strides.v_head
        k = tl.load(k_ptr + k_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if BOUNDS:
            if CAUSAL:
                s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            else:
                s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_PREC=DOT_PREC, UPCAST=UPCAST)
    return m_i, l_i, acc


attend_paged_range = triton.jit(_attend_paged_range) if HAS_TRITON else None
