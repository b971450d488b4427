"""flowrt.kernels: Triton kernels for the engine's paged KV cache, and their plain-torch twins.

Conventions (see reference.py for the full specification): per-layer KV pools
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block_id * block_size + offset (-1 = skip);
flattened varlen batches described by ``query_start_loc`` ``[B+1]`` and ``seq_lens`` ``[B]`` (context
length including the new tokens); ``block_tables`` ``[B, max_blocks]``; GQA head h -> KV head
``h // (num_heads // num_kv_heads)``. Kernels launched on CUDA tensors are compiled; on CPU tensors they
run through Triton's interpreter (slow; for tests). ``HAS_TRITON`` is False when triton cannot be imported,
and the kernels then raise RuntimeError (the ``*_ref`` twins always work).
"""

from ._dispatch import HAS_TRITON, TRITON_IMPORT_ERROR
from .cache_ops import copy_blocks, copy_blocks_stacked, write_kv
from .decode_attention import choose_num_splits, paged_decode_attention
from .prefill_attention import paged_prefill_attention
from .reference import (copy_blocks_ref, copy_blocks_stacked_ref, gather_kv_ref, paged_decode_attention_ref,
                        paged_prefill_attention_ref, write_kv_ref)

__all__ = [
    "HAS_TRITON", "TRITON_IMPORT_ERROR",
    "write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "copy_blocks_stacked",
    "choose_num_splits",
    "write_kv_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref", "copy_blocks_ref",
    "copy_blocks_stacked_ref", "gather_kv_ref",
]
