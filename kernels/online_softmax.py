"""The online-softmax update the attention kernels share (flash attention's inner step).

One step folds a tile of scores ``s`` [rows, keys] (log2 domain, masked entries -inf) and its values ``v``
[keys, head_dim] into the running row maximum ``m_i``, row sum ``l_i`` and unnormalised output ``acc``:
earlier terms are rescaled by ``exp2(m_i - m_new)``; ``online_softmax_output`` is the normalised result (rows that
saw no key give zeros). ``@triton.jit`` helpers, so both the compiled and the
interpreted kernels inline it (built as the interpreter's kind when TRITON_INTERPRET=1 was set first).
"""

from __future__ import annotations

from ._dispatch import HAS_TRITON, tl, triton

__all__ = ["online_softmax_update", "online_softmax_output"]


def _online_softmax_update(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)
    if UPCAST:  # the interpreter's bf16 tl.dot (see _dispatch.dot_upcast)
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    return m_new, l_i, acc


def _online_softmax_output(acc, l_i):
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None]


online_softmax_update = triton.jit(_online_softmax_update) if HAS_TRITON else None
online_softmax_output = triton.jit(_online_softmax_output) if HAS_TRITON else None
