"""Runs one step: flattens the scheduled batch into one token stream, performs the step's block copies,
runs the model once, and returns logits only for the rows that need them.

On CUDA with a graph-capable backend (Triton), pure decode steps replay a CUDA graph of their batch-size
bucket instead (engine/model/cuda_graphs.py); prefill and mixed steps, and batches over the largest bucket, run
eagerly. GraphConfig.emulate runs that same graph path eagerly off CUDA, which is how the CPU tests cover it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata
from .cuda_graphs import DecodeGraphs, GraphConfig, GraphStep, supports_graphs
from .models.llama import LlamaModel

if TYPE_CHECKING:
    from ..core.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    copies: tuple[torch.Tensor, torch.Tensor] | None
    logit_rows: torch.Tensor  # flat row indices whose logits are needed
    graph: GraphStep | None = None  # set: the rows are staged in the decode graphs' static buffers; replay


# ---- the runner's output contract (owned by the engine core) ----
@dataclass
class ModelRunnerOutput:
    """What one step computed: logits [len(logit_rows), vocab] (CPU), row i for flat row logit_rows[i]."""

    logits: torch.Tensor


def make_backend(name: str):
    if name == "torch":
        from .attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from .attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r} (choose auto, torch or triton)")


def _verify_chunks(batch: SchedulerOutput) -> frozenset[int]:
    """Batch indices of the sequences whose chunk is their pending token and speculative drafts."""
    if not batch.spec_rows:
        return frozenset()
    drafting = {seq.seq_id for seq, _, _ in batch.spec_rows}
    return frozenset(b for b, seq in enumerate(batch.seqs) if seq.seq_id in drafting)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: torch.Tensor, block_size: int, backend, device: torch.device,
                 graphs: GraphConfig | None = None):
        self.model = model
        self.kv = kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.graphs: DecodeGraphs | None = None
        self.configure_graphs(graphs if graphs is not None else GraphConfig.from_env())

    def configure_graphs(self, cfg: GraphConfig) -> bool:
        """(Re)decides whether decode steps use graphs: on CUDA (or emulated) with a graph-capable backend,
        unless disabled. Captures nothing yet (buckets are captured at first use). Returns whether they are on."""
        if self.graphs is not None:
            self.graphs.release()
        on = cfg.enabled and supports_graphs(self.backend) and (self.device.type == "cuda" or cfg.emulate)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.block_size, self.device, cfg) \
            if on else None
        return on

    def prepare(self, batch: SchedulerOutput, logit_rows: list[int], eager: bool = False) -> StepInputs:
        """Everything the step needs, built once in tensors (never per layer). A pure decode step that fits a
        graph bucket is staged into the graphs' static buffers instead (unless `eager`)."""
        copies = None
        if batch.plan.copies:
            src, dst = zip(*batch.plan.copies)
            copies = (torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
        graphs = None if eager else self.graphs
        if graphs is not None and (bucket := graphs.bucket(batch)) is not None:
            return self._stage(graphs, batch, bucket, logit_rows, copies)
        bs = self.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []  # decode tokens gather in plain int lists, one array per run of them
        slot_parts: list[np.ndarray] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens, slens = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            kv = seq.kv
            s = kv.num_computed_tokens
            table = kv.block_table
            qlens.append(n)
            slens.append(s + n)
            if n == 1:
                ids.append(seq.token_ids[s])
                pos.append(s)
                slots.append(table[s // bs] * bs + s % bs)
                continue
            ids.extend(seq.token_ids[s : s + n])
            if pos:
                pos_parts.append(np.array(pos, dtype=np.int64))
                slot_parts.append(np.array(slots, dtype=np.int64))
                pos, slots = [], []
            p = np.arange(s, s + n, dtype=np.int64)
            pos_parts.append(p)
            slot_parts.append(np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs)
        if pos:
            pos_parts.append(np.array(pos, dtype=np.int64))
            slot_parts.append(np.array(slots, dtype=np.int64))
        width = max(len(seq.kv.block_table) for seq in batch.seqs)
        tables = np.array([seq.kv.block_table + [0] * (width - len(seq.kv.block_table)) for seq in batch.seqs],
                          dtype=np.int32).reshape(len(batch.seqs), width)
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            query_lens_list=qlens,
            seq_lens_list=slens,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            block_size=bs,
            verify=_verify_chunks(batch),
        )
        self.backend.prepare(meta)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            copies=copies,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )

    def _stage(self, g: DecodeGraphs, batch: SchedulerOutput, bucket: int, logit_rows: list[int],
               copies) -> StepInputs:
        step = g.stage(batch, bucket, logit_rows)
        rows = g.rows[: len(logit_rows)] if step.all_rows else torch.tensor(logit_rows, dtype=torch.long,
                                                                              device=self.device)
        return StepInputs(input_ids=g.input_ids[:bucket], positions=g.positions[:bucket], meta=g.meta(bucket),
                          copies=copies, logit_rows=rows, graph=step)

    def execute(self, inp: StepInputs) -> ModelRunnerOutput:
        return ModelRunnerOutput(logits=self._forward(inp))

    # ---- end of the output contract ----
    @torch.inference_mode()
    def _forward(self, inp: StepInputs) -> torch.Tensor:
        if inp.copies is not None:
            self.backend.copy_blocks(self.kv, *inp.copies)  # outside the graph, before it writes KV
        if inp.graph is not None:
            graphs = self.graphs
            assert graphs is not None  # a staged step was staged in them
            graphs.stats["copies"] += inp.copies is not None
            return graphs.replay(inp.graph, inp.logit_rows)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, self.backend)
        if inp.logit_rows.numel() == 0:
            return torch.empty(0, self.model.cfg.vocab_size)
        return self.model.logits(hidden.index_select(0, inp.logit_rows)).cpu()
