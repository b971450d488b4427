"""KV blocks in and out of the engine: the content of full, hashed blocks exported as bytes, and blocks
imported into the prefix cache, so that a layer above (flowrt's KV checkpoints) can keep KV across
processes. A block is named by its prefix hash (block_pool.hash_block: the whole prefix's token ids), so an
imported block is found by ``match_prefix`` exactly where the same tokens would have computed it.

Bytes are only meaningful to an engine with the same ``fingerprint``: the model's weights, the KV layout
and dtype, the block size, the attention backend and this module's format version. The caller keeps them
apart by fingerprint; the engine checks only the size of what it imports.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from .block_pool import BlockHash, NoFreeBlocksError, hash_block

if TYPE_CHECKING:
    from ..llm_engine import LLMEngine

__all__ = ["KV_FORMAT", "chain_hashes", "fingerprint", "block_bytes", "export_blocks", "import_blocks"]

KV_FORMAT = 1
_SAMPLES = 4096   # values of each weight tensor in the fingerprint (evenly spaced; every value of small ones)


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The prefix hashes of the full blocks of ``token_ids``."""
    out: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        out.append(hash_block(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size]))
    return out


def fingerprint(engine: "LLMEngine") -> str:
    """What KV bytes depend on, hashed: weights (every tensor's name, shape, dtype and a spread sample of its
    values, so another fine-tune differs), model config, KV dtype and shape, block size, backend, version."""
    h = hashlib.blake2b(digest_size=16)
    try:
        version = metadata.version("flowrt")
    except metadata.PackageNotFoundError:
        version = "?"
    kv = engine.kv
    head = (f"kv{KV_FORMAT}|{version}|{engine.model_config!r}|{kv.dtype}|{tuple(kv.shape[:2])}|"
            f"{tuple(kv.shape[3:])}|{engine.block_size}|{engine.backend_name}|{engine.dtype}")
    h.update(head.encode())
    with torch.no_grad():
        for name, t in engine.runner.model.named_weights():  # float parameters and quantized blocks
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
            flat = t.detach().reshape(-1)
            if flat.numel() > _SAMPLES:
                flat = flat[:: flat.numel() // _SAMPLES][:_SAMPLES]
            h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def block_bytes(engine: "LLMEngine") -> int:
    """The size of one block's content (every layer's K and V of its slots)."""
    kv = engine.kv
    return kv[:, :, 0].numel() * kv.element_size()


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(kv: torch.Tensor):
    """The pool as integers of its element size: a numpy view on CPU (a block's strided copy is ~15x faster
    there than torch's bfloat16 copy_), else the tensor itself."""
    ints = kv.view(_INTS[kv.element_size()])
    return ints.numpy() if kv.device.type == "cpu" else ints


def _read_block(raw, bid: int) -> bytes:
    block = raw[:, :, bid]
    return block.tobytes() if not isinstance(block, torch.Tensor) else block.contiguous().cpu().numpy().tobytes()


def _write_block(raw, bid: int, data: bytes) -> None:
    import numpy as np

    dst = raw[:, :, bid]
    if isinstance(dst, torch.Tensor):
        dst.copy_(torch.frombuffer(bytearray(data), dtype=dst.dtype).view(dst.shape).to(dst.device))
    else:
        dst[...] = np.frombuffer(data, dtype=dst.dtype).reshape(dst.shape)


def export_blocks(engine: "LLMEngine", token_ids: Sequence[int],
                  skip: Callable[[BlockHash], bool] | None = None) -> list[tuple[BlockHash, bytes | None]]:
    """The full blocks of ``token_ids`` in order: (hash, content) for a block the engine holds (computed,
    in a sequence or the prefix cache), (hash, None) where ``skip(hash)`` says the caller has it already.
    Ends at the first block that is neither (later ones would not be found without it)."""
    chain = chain_hashes(token_ids, engine.block_size)
    out: list[tuple[BlockHash, bytes | None]] = []
    held: list[int] = []
    with engine.lock:
        for h in chain:
            if skip is not None and skip(h):
                out.append((h, None))
                continue
            bid = engine.pool.lookup(h)
            if bid is None:
                break
            engine.pool.incref(bid)   # held while copied outside the lock: not evicted, not rewritten
            held.append(bid)
            out.append((h, b""))
    try:
        it, raw = iter(held), _raw(engine.kv)
        for i, (h, data) in enumerate(out):
            if data is not None:
                out[i] = (h, _read_block(raw, next(it)))
    finally:
        with engine.lock:
            for bid in held:
                engine.pool.decref(bid)
    return out


def import_blocks(engine: "LLMEngine", blocks: Iterable[tuple[BlockHash, bytes]]) -> int:
    """Put blocks (hash, content from ``export_blocks`` of an engine with the same fingerprint) into the
    prefix cache, in chain order; a hash already cached is kept as it is. Returns how many blocks were
    written. Stops when the pool has no block to spare: at most as many as were free when it began (more
    would evict the chain's own first blocks, and the rest is unusable without them). A content of the
    wrong size is a ValueError."""
    if not engine.pool.enable_prefix_caching:
        return 0
    size, raw = block_bytes(engine), _raw(engine.kv)
    n, budget = 0, engine.pool.num_free
    for h, data in blocks:
        if len(data) != size:
            raise ValueError(f"a KV block of {len(data)} bytes; this engine's blocks hold {size}")
        with engine.lock:
            if engine.pool.lookup(h) is not None:
                continue
            if n >= budget:
                break
            try:
                bid = engine.pool.allocate()   # ours alone until registered: written outside the lock
            except NoFreeBlocksError:
                break
        written = False
        try:
            _write_block(raw, bid, data)
            written = True
        finally:
            with engine.lock:
                if written:
                    engine.pool.register(bid, h)
                engine.pool.decref(bid)   # cached and free: evictable like any released block
        n += 1
    return n
