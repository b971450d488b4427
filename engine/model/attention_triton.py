"""The GPU attention backend: flowrt.kernels' Triton PagedAttention over the same per-step metadata.

Decode-only steps use the decode kernel (GQA, split-K for few long sequences); any step with a prefill
chunk runs one varlen prefill launch over the whole mixed batch. On a CPU the kernels run through
Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check this backend.

Decode steps are capturable in CUDA graphs (engine/model/cuda_graphs.py): `prepare` does nothing, and the decode
forward reads only tensors plus `max_query_len`/`max_seq_len`, which a graph's metadata fixes per bucket
(max_seq_len = max_model_len, so the split-K launch shape is fixed too); rows with slot -1 write no K/V.
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True  # see the module docstring

    def __init__(self) -> None:
        from flowrt import kernels

        if not kernels.HAS_TRITON:
            raise ValueError(f"attention_backend='triton' needs triton: {kernels.TRITON_IMPORT_ERROR}")
        self.k = kernels

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.k.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q.to(k_cache.dtype)
        if meta.max_query_len == 1:
            return self.k.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                 max_seq_len=meta.max_seq_len)
        return self.k.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                              meta.seq_lens, scale, meta.max_query_len)

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k.copy_blocks_stacked(kv, src, dst)
