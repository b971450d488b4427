"""Plain-torch twins of the Triton kernels: same signatures, same semantics.

They are what the tests compare the kernels to, and they are the specification:

KV pool (one per layer): ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token slot ``s`` lives at ``cache[s // block_size, s % block_size]``.

A step's batch is flattened "varlen": the new tokens of all sequences are concatenated into one
token dimension ``T``. ``query_start_loc[b] .. query_start_loc[b+1]`` are sequence ``b``'s rows;
``seq_lens[b]`` is its whole context length *including* its new tokens, so its new tokens sit at
absolute positions ``seq_lens[b] - q_len_b .. seq_lens[b] - 1`` and their K/V are already in the
cache (written by :func:`write_kv`). ``block_tables[b, i]`` is the physical block holding positions
``i*block_size .. (i+1)*block_size - 1`` of sequence ``b``; entries past ``seq_lens[b]`` are never read.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

All math is in fp32; outputs are cast to ``q.dtype``. A sequence with no context (``seq_lens[b] == 0``,
e.g. a padded decode row) yields zeros.
"""

from __future__ import annotations

import torch

__all__ = [
    "write_kv_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "copy_blocks_ref",
    "copy_blocks_stacked_ref",
    "gather_kv_ref",
]


def write_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (int64 ``[T]``; -1 = skip)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    slots = slots[keep]
    k_cache.view(num_blocks * block_size, hkv, d)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, hkv, d)[slots] = value[keep].to(v_cache.dtype)


def gather_kv_ref(cache, block_table_row, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, ``[length, Hkv, D]``, read through its block table."""
    block_size = cache.shape[1]
    nblk = -(-length // block_size)
    blocks = block_table_row[:nblk].to(torch.long)
    return cache[blocks].reshape(nblk * block_size, *cache.shape[2:])[:length]


def _attend(q, k, v, scale, causal_offset):
    """q [M, H, D], k/v [N, Hkv, D] -> [M, H, D] in fp32; query row i sees keys <= causal_offset + i."""
    m, h, d = q.shape
    n, hkv, _ = k.shape
    group = h // hkv
    qf = q.float().view(m, hkv, group, d)
    kf = k.float()
    vf = v.float()
    scores = torch.einsum("mkgd,nkd->kgmn", qf, kf) * scale
    if causal_offset is not None:
        qpos = causal_offset + torch.arange(m, device=q.device)
        kpos = torch.arange(n, device=q.device)
        scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgmn,nkd->mkgd", probs, vf)
    return out.reshape(m, h, d)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None,
                               max_seq_len=None):
    """One query token per sequence (``q`` ``[B, H, D]``) attending to its whole context of ``seq_lens[b]`` tokens."""
    del num_splits, max_seq_len  # performance knobs of the kernel; no effect on the result
    bsz = q.shape[0]
    res = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lens = seq_lens.tolist()
    for b in range(bsz):
        n = int(lens[b])
        if n <= 0:
            res[b].zero_()
            continue
        k = gather_kv_ref(k_cache, block_tables[b], n)
        v = gather_kv_ref(v_cache, block_tables[b], n)
        res[b] = _attend(q[b : b + 1], k, v, scale, None)[0].to(res.dtype)
    return res


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                                out=None):
    """Varlen causal attention: the rows of sequence ``b`` are its last ``q_len_b`` positions of ``seq_lens[b]``.

    Rows of ``q`` past ``query_start_loc[-1]`` (padding) are left untouched in ``out`` (zeros if ``out`` is None).
    """
    del max_query_len
    res = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        if e <= s:
            continue
        n = int(lens[b])
        q_len = e - s
        k = gather_kv_ref(k_cache, block_tables[b], n)
        v = gather_kv_ref(v_cache, block_tables[b], n)
        res[s:e] = _attend(q[s:e], k, v, scale, n - q_len).to(res.dtype)
    return res


def copy_blocks_ref(k_caches, v_caches, src, dst) -> None:
    """For every pair i: block ``dst[i]`` := block ``src[i]`` in every cache of every layer.

    All sources are read before any destination is written. Destinations must be distinct and must not
    appear among the sources (the kernel copies the pairs concurrently).
    """
    src = torch.as_tensor(src, dtype=torch.long).to(k_caches[0].device)
    dst = torch.as_tensor(dst, dtype=torch.long).to(k_caches[0].device)
    for cache in list(k_caches) + list(v_caches):
        cache[dst] = cache[src]


def copy_blocks_stacked_ref(kv, src, dst) -> None:
    """Same as :func:`copy_blocks_ref` on one tensor holding every layer:
    ``[num_layers, 2, num_blocks, block_size, Hkv, D]`` (any number of leading dims before the block dim,
    which is ``kv.dim() - 4``)."""
    src = torch.as_tensor(src, dtype=torch.long).to(kv.device)
    dst = torch.as_tensor(dst, dtype=torch.long).to(kv.device)
    lead = kv.dim() - 4
    idx = (slice(None),) * lead
    kv[idx + (dst,)] = kv[idx + (src,)]
