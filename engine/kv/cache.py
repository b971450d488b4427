"""Sizing and allocating the KV cache tensor: [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import mmap

import torch

from ..model.model_config import ModelConfig

if TYPE_CHECKING:
    from ..config import EngineArgs


DEFAULT_KV_CAP = 2 << 30


def zeros_lazy(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages the OS maps only when first written (an anonymous mapping), so a large
    KV pool costs resident memory only for the blocks actually used. Zeros matter: masked attention
    multiplies unused slots by 0, and garbage there could be NaN.

    Not numpy's zeros: numpy advises transparent huge pages for large arrays, and where the kernel then
    compacts memory on each fault (THP defrag "madvise", the common default) the first write to every
    2 MiB costs milliseconds: on a 2-core Zen3 VM 3 s per GiB against 0.3 s with 4 KiB pages, which the
    engine paid inside its steps as it wrote fresh KV blocks (7 ms of a 100 ms decode step of 32
    sequences). Huge pages gave the attention kernels nothing measurable in return."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)  # the tensor keeps the mapping alive


def _available_memory() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def num_kv_blocks(args: EngineArgs, cfg: ModelConfig, kv_dtype: torch.dtype, max_len: int) -> int:
    """num_kv_blocks if given; else as many as kv_cache_memory bytes hold; else a quarter of free memory up
    to 2 GiB, and no more than every sequence slot at full length needs."""
    bs = args.block_size
    block_bytes = cfg.kv_bytes_per_token * kv_dtype.itemsize * bs
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_memory is not None:
        n = args.kv_cache_memory // block_bytes
        if n < 1:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory} bytes is less than one KV block ({block_bytes})")
        return n
    want = args.max_num_seqs * -(-max_len // bs)
    budget = min(int(_available_memory() * 0.25), DEFAULT_KV_CAP)
    return max(1, min(budget // block_bytes, want))


def allocate_kv_cache(args: EngineArgs, cfg: ModelConfig, kv_dtype: torch.dtype, max_len: int,
                      device: torch.device) -> torch.Tensor:
    n = num_kv_blocks(args, cfg, kv_dtype, max_len)
    return zeros_lazy((cfg.num_layers, 2, n, args.block_size, cfg.num_kv_heads, cfg.head_dim), kv_dtype, device)
