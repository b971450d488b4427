"""CUDA graphs for pure decode steps: the model's forward (and LM head) captured once per batch-size bucket.

A decode step of a small model is bound by Python and kernel launches, not by the GPU (hundreds of
launches per step). A captured graph replays all of them with one call. Everything the captured forward
reads lives in static buffers sized for the largest bucket; a step copies its rows in (two host-to-device
copies from pinned staging) and pads up to its bucket:

- padded rows have token 0 at position 0, slot -1 (the KV write skips them: they never touch a real block),
  seq_len 1 and block 0 in their table (a finite, read-only read), so nothing NaNs and no real row changes;
- the decode kernel's launch shape is fixed per bucket: it is told ``max_seq_len = max_model_len``, so its
  split-K choice depends only on the bucket (splits past a row's context find no tokens).

Graphs are captured lazily, the first time a bucket is needed (each capture runs two eager warm-up passes on
the step's own staged inputs, which rewrite the same K/V values, then records one pass), into one shared
memory pool. Lazy because only the buckets a workload uses cost capture time, engine construction stays
fast, and the runner can be switched to eager after construction; ``capture()`` pre-captures a list of
buckets (largest first) for a warm start.

Off CUDA (``emulate``) nothing is recorded and a "replay" runs the same forward eagerly on the same padded
static buffers: the CPU tests exercise the staging, padding and bucket logic of the GPU path.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .attention import AttentionMetadata

logger = logging.getLogger("flowrt.engine")

EMULATE_ENV = "FLOWRT_GRAPH_EMULATE"  # "1": use the graph path off CUDA too (eager replays; for tests)
EAGER_ENV = "FLOWRT_ENFORCE_EAGER"  # "1": never use CUDA graphs in this process


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 to 32, every 16 to 128, every 32 beyond, and
    max_batch itself. A step pads up to the next bucket, so the waste stays under ~25% of the rows."""
    sizes = [1, 2, 4, 8, *range(16, 33, 8), *range(48, 129, 16), *range(160, max_batch + 1, 32)]
    return tuple(sorted({s for s in sizes if s < max_batch} | {max_batch}))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows; None when n exceeds the largest (the step runs eagerly)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class GraphConfig:
    """Whether and how the runner uses decode graphs. ``enabled`` False is EngineArgs.enforce_eager."""

    enabled: bool = True
    emulate: bool = False  # off CUDA: run the graph path eagerly (tests); on CUDA it changes nothing
    max_batch: int = 256  # the largest bucket (EngineArgs.max_num_seqs); bigger steps run eagerly
    max_model_len: int | None = None  # block-table width and split-K bound; None: the model's rotary table length

    @classmethod
    def from_env(cls, **kw) -> GraphConfig:
        """Defaults, with FLOWRT_ENFORCE_EAGER=1 / FLOWRT_GRAPH_EMULATE=1 from the environment applied."""
        kw.setdefault("enabled", os.environ.get(EAGER_ENV, "0") in ("", "0"))
        kw.setdefault("emulate", os.environ.get(EMULATE_ENV, "0") not in ("", "0"))
        return cls(**kw)


@dataclass(frozen=True)
class GraphStep:
    """A staged decode step: replay `bucket`'s graph; logits of rows 0..num_rows-1 (all_rows) or of logit_rows."""

    bucket: int
    num_rows: int
    all_rows: bool


class DecodeGraphs:
    """Static buffers, per-bucket graphs and the staging of decode steps into them (see the module doc)."""

    def __init__(self, model, kv_caches, backend, block_size: int, device: torch.device, cfg: GraphConfig):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.cuda = device.type == "cuda"
        self.buckets = batch_buckets(cfg.max_batch)
        self.max_batch = self.buckets[-1]
        self.max_model_len = int(cfg.max_model_len or model.cos_table.shape[0])
        self.width = -(-self.max_model_len // block_size)
        n, w = self.max_batch, self.width
        pin = self.cuda
        # host staging (pinned on CUDA): int64 [ids | positions | slots], int32 [seq_lens | tables (n x w)]
        self._host64 = torch.zeros(3 * n, dtype=torch.long, pin_memory=pin)
        self._host32 = torch.zeros(n + n * w, dtype=torch.int32, pin_memory=pin)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._ids, self._pos, self._slots = (self._np64[i * n : (i + 1) * n] for i in range(3))
        self._lens = self._np32[:n]
        self._tables = self._np32[n:].reshape(n, w)
        self._slots[:] = -1
        self._lens[:] = 1
        # the static device buffers the graphs read
        self._dev64 = torch.empty_like(self._host64, device=device).copy_(self._host64)  # a copy on CPU too
        self._dev32 = torch.empty_like(self._host32, device=device).copy_(self._host32)
        self.input_ids, self.positions, self.slot_mapping = (self._dev64[i * n : (i + 1) * n] for i in range(3))
        self.seq_lens = self._dev32[:n]
        self.block_tables = self._dev32[n:].view(n, w)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self._metas: dict[int, AttentionMetadata] = {}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.stats = {"replays": 0, "captures": 0, "capture_seconds": 0.0, "padded_rows": 0, "copies": 0}

    # ---- which steps ------------------------------------------------------------------------------------
    def bucket(self, batch) -> int | None:
        """The bucket for a scheduled batch, or None when it must run eagerly (a prefill chunk in it, more rows
        than the largest bucket, a block table wider than max_model_len allows)."""
        if any(n != 1 for n in batch.num_new_tokens):
            return None
        b = bucket_for(len(batch.seqs), self.buckets)
        if b is None or any(len(seq.kv.block_table) > self.width for seq in batch.seqs):
            return None
        return b

    # ---- staging ------------------------------------------------------------------------------------------
    def stage(self, batch, bucket: int, logit_rows: list[int]) -> GraphStep:
        """Writes the step's rows (padded to `bucket`) into the static buffers; the step then replays."""
        bs = self.block_size
        ids, pos, slots, lens, tables = self._ids, self._pos, self._slots, self._lens, self._tables
        n = len(batch.seqs)
        for b, seq in enumerate(batch.seqs):
            kv = seq.kv
            s = kv.num_computed_tokens
            table = kv.block_table
            ids[b] = seq.token_ids[s]
            pos[b] = s
            slots[b] = table[s // bs] * bs + s % bs
            lens[b] = s + 1
            tables[b, : len(table)] = table
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        slots[n:bucket] = -1
        lens[n:bucket] = 1
        tables[n:bucket, 0] = 0
        m = self.max_batch
        self._dev64.copy_(self._host64, non_blocking=True)  # 3 x max_batch int64: one small copy
        k = m + bucket * self.width  # seq_lens, then the bucket's table rows: a contiguous prefix
        self._dev32[:k].copy_(self._host32[:k], non_blocking=True)
        self.stats["padded_rows"] += bucket - n
        return GraphStep(bucket, n, logit_rows == list(range(n)))

    def meta(self, bucket: int) -> AttentionMetadata:
        """The bucket's metadata over the static buffers (fixed shapes; max_seq_len fixed at max_model_len)."""
        meta = self._metas.get(bucket)
        if meta is None:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:bucket],
                query_start_loc=self.query_start_loc[: bucket + 1],
                seq_lens=self.seq_lens[:bucket],
                block_tables=self.block_tables[:bucket],
                query_lens_list=[1] * bucket,
                seq_lens_list=[self.max_model_len] * bucket,  # upper bounds: the real lengths live on the device
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_size=self.block_size,
            )
            self.backend.prepare(meta)
            self._metas[bucket] = meta
        return meta

    # ---- capture and replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, bucket: int) -> torch.Tensor:
        """Float32 logits [bucket, vocab] of the static rows: what a graph records."""
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, self.meta(bucket),
                            self.backend)
        return self.model.logits(hidden)

    def captured(self, bucket: int) -> bool:
        return bucket in self._replays

    def capture_bucket(self, bucket: int) -> float:
        """Captures `bucket`'s graph on whatever the static buffers hold (staged rows or padding: the warm-up
        passes rewrite identical K/V); returns the seconds it took."""
        t0 = time.perf_counter()
        if not self.cuda:
            self._replays[bucket] = lambda: self._forward(bucket)  # emulation: an eager "replay"
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels, sizes cuBLAS workspaces
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward(bucket)
            self._graphs[bucket], self._outputs[bucket] = graph, out

            def replay(graph=graph, out=out) -> torch.Tensor:
                graph.replay()
                return out

            self._replays[bucket] = replay
        dt = time.perf_counter() - t0
        self.stats["captures"] += 1
        self.stats["capture_seconds"] += dt
        logger.info("decode graph for batch %d captured in %.0f ms%s", bucket, dt * 1e3,
                    "" if self.cuda else " (emulated: eager replays)")
        return dt

    def capture(self, buckets: list[int] | None = None) -> float:
        """Pre-captures buckets (default: all), largest first so that smaller graphs reuse the pool's memory.
        The static buffers hold padding then (slot -1: no KV is written). Returns the total seconds."""
        want = sorted(set(buckets or self.buckets) & set(self.buckets) - set(self._replays), reverse=True)
        if not want:
            return 0.0
        self._slots[:] = -1
        self._lens[:] = 1
        self._ids[:] = 0
        self._pos[:] = 0
        self._tables[:, 0] = 0
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)
        total = sum(self.capture_bucket(b) for b in want)
        logger.info("captured %d decode graphs (batch %d..%d) in %.2f s", len(want), want[-1], want[0], total)
        return total

    def replay(self, step: GraphStep, logit_rows: torch.Tensor) -> torch.Tensor:
        """Runs the staged step (capturing its bucket first if needed); CPU float32 logits of the wanted rows."""
        if step.bucket not in self._replays:
            self.capture_bucket(step.bucket)
        out = self._replays[step.bucket]()
        self.stats["replays"] += 1
        if step.all_rows:
            return out[: step.num_rows].cpu()
        if logit_rows.numel() == 0:
            return torch.empty(0, out.shape[1])
        return out.index_select(0, logit_rows).cpu()

    def release(self) -> None:
        """Drops every graph and its memory (e.g. before switching to eager for good)."""
        self._replays.clear()
        self._graphs.clear()
        self._outputs.clear()


def supports_graphs(backend) -> bool:
    """Only backends whose decode forward reads tensors and fixed ints alone can be captured (the Triton one)."""
    return bool(getattr(backend, "supports_cuda_graphs", False))

