"""Attention over the paged KV cache: per-step metadata and the plain-PyTorch backend.

The model runner builds one `AttentionMetadata` per step (the batch flattened into one token stream)
and the backend's `prepare` turns it into whatever the backend wants, once per step; every layer then
reuses it. The Triton backend (flowrt.kernels) takes the same metadata.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cpu import ops as cpu_ops


@dataclass
class AttentionMetadata:
    """One step's batch. Sequence b's new tokens are rows query_start_loc[b]:query_start_loc[b+1] of the
    flattened stream and sit at absolute positions seq_lens[b]-query_lens[b] .. seq_lens[b]-1."""

    slot_mapping: torch.Tensor  # int64 [T]: where each new token's K/V is written
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]: context length including the new tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    prepared: dict = field(default_factory=dict)  # backend-specific, built once per step
    # sequences whose new tokens are a speculative verify chunk (the pending token and its drafts: flat rows
    # qsl[b] + j at positions seq_lens[b] - query_lens[b] + j). Their rows predict tokens that plain decoding
    # computes one step at a time, so a backend may attend them as decode rows to round as decode does.
    verify: frozenset[int] = frozenset()


def _attend(q, k, v, scale: float, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over part of the keys: (normalized output, log-sum-exp of the scores [..., 1]).

    q [B, h, Lq, D], k/v [B, h, Lk, D], bias additive and broadcastable to [B, h, Lq, Lk]. On CPU this is
    the fused flash kernel, which also returns the log-sum-exp; elsewhere plain products.
    """
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                            scale=scale)
        return o, lse.unsqueeze(-1)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v), lse


def _merge(o1, lse1, o2, lse2) -> torch.Tensor:
    """Attention output over the union of two key sets, from each part's output and log-sum-exp."""
    m = torch.maximum(lse1, lse2)
    a, b = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1 * a + o2 * b) / (a + b)


@dataclass(frozen=True)
class DecodePlan:
    """Decode rows (one new token each) attended together. The C++ kernel reads the pool in place through
    `tables`/`seq_lens`; the torch path gathers `blocks` (whole blocks) and masks with `valid`."""

    rows: torch.Tensor | None  # int64 [B] flat rows of the tokens; None when they are rows 0..B-1 (a pure decode step)
    tables: torch.Tensor  # int32 [B, W] contiguous
    seq_lens: torch.Tensor  # int32 [B]
    blocks: torch.Tensor  # int64 [B * nblk]
    nblk: int
    valid: torch.Tensor  # bool [B, 1, 1, nblk * block_size]


@dataclass(frozen=True)
class CascadeDecodePlan:
    """Decode rows of sequences that share their first `n_common` blocks: the prefix is read once for all."""

    rows: torch.Tensor  # int64 [B]
    common: torch.Tensor  # int64 [n_common] shared block ids
    tables: torch.Tensor  # int32 [B, W] (kernel path)
    seq_lens: torch.Tensor  # int32 [B] (kernel path)
    suffix: torch.Tensor  # int64 [B * nsuf] (torch path)
    nsuf: int
    bias: torch.Tensor  # float [B, 1, 1, nsuf * block_size] additive mask (torch path)
    n_prefix: int  # tokens in the shared blocks (kernel path: the suffix starts there)
    common_span: tuple[int, int] | None = None  # the shared blocks are ids span[0]..span[1]-1: read as a view


@dataclass(frozen=True)
class ChunkPlan:
    """One sequence's prefill chunk (rows start:end). blocks None: nothing cached before, causal over itself."""

    start: int
    end: int
    blocks: torch.Tensor | None  # int64 block ids covering the context
    mask: torch.Tensor | None  # bool [n, ctx] (or [n, L] for a cascade member: keys after the shared prefix)
    span: tuple[int, int] | None = None  # `blocks` are the consecutive ids span[0]..span[1]-1: read as a view


@dataclass(frozen=True)
class FlashPlan:
    """Rows the C++ flash kernel attends in place in the pool, grouped by the block table they read: group g is the flat
    rows rows[group_start[g]:group_start[g+1]], reading tables[g]; row i attends keys key_start .. ends[i]-1 (a prefill
    chunk's causal limits; a shared prefix's length for every member)."""

    rows: torch.Tensor  # int64 [R]
    ends: torch.Tensor  # int32 [R]
    group_start: torch.Tensor  # int32 [NG + 1]
    tables: torch.Tensor  # int32 [NG, W]
    key_start: int = 0


@dataclass(frozen=True)
class DecodeProgram:
    """A step whose every row is a decode row, as the kernel calls that attend it in TorchAttentionBackend.forward's
    order (so the same bits), for the one-call decode step (cpu_ops.StepGlue.decode_layers): paged decode calls, then
    at most one paged flash call over the shared prefixes, merged into their rows by log-sum-exp. `struct` is the
    cpu_ops.FrDecodeProgram the kernel reads (its calls an array of FrDecodeCall); `keep` holds what its pointers
    refer to."""

    struct: ctypes.Structure  # cpu_ops.FrDecodeProgram
    keep: tuple


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _decode_program(p: dict, heads: int, head_dim: int) -> DecodeProgram:
    """The prepared plans of a step of decode rows only (`p`: meta.prepared) as one DecodeProgram."""
    calls, keep = [], []

    def call(rows, tables, lens, start=0, lse=None, heads_outer=0):
        keep.extend(t for t in (rows, tables, lens, lse) if t is not None)
        calls.append(cpu_ops.FrDecodeCall(rows=_ptr(rows), tables=tables.data_ptr(), table_stride=tables.stride(0),
                                          seq_lens=lens.data_ptr(), lse=_ptr(lse), n_rows=lens.shape[0],
                                          first_key=start, heads_outer=heads_outer))

    dp = p.get("decode")
    if dp is not None:
        call(dp.rows, dp.tables, dp.seq_lens)
    fp = p["cascade_prefixes"] if cpu_ops.flash_supported(head_dim) else None
    flash = cpu_ops.FrFlashCall()  # n_groups 0: no call
    if fp is not None:  # each member's own suffix with its log-sum-exp, then every shared prefix at once (flash)
        lse = torch.empty(fp.rows.shape[0], heads)
        r0 = 0
        for cp in p["cascade"]:
            n = cp.rows.shape[0]
            call(cp.rows, cp.tables, cp.seq_lens, cp.n_prefix, lse[r0 : r0 + n])
            r0 += n
        keep.extend((fp.rows, fp.ends, fp.group_start, fp.tables, lse))
        flash = cpu_ops.FrFlashCall(rows=fp.rows.data_ptr(), ends=fp.ends.data_ptr(),
                                    group_start=fp.group_start.data_ptr(), tables=fp.tables.data_ptr(),
                                    table_stride=fp.tables.stride(0), lse_in=lse.data_ptr(),
                                    n_groups=fp.group_start.shape[0] - 1, key_start=fp.key_start)
    else:  # each member's whole context, ordered so the shared prefix stays in the CPU caches
        for cp in p["cascade"]:
            call(cp.rows, cp.tables, cp.seq_lens, heads_outer=1)
    array = (cpu_ops.FrDecodeCall * len(calls))(*calls)
    return DecodeProgram(cpu_ops.FrDecodeProgram(calls=array, n_calls=len(calls), flash=flash), (array, *keep))


# Decode rows of sequences sharing a prefix take the flash kernel (own suffix, then each shared prefix once for all its
# members) when the step's groups hold at least this many (member x prefix token) pairs; below it, the decode kernel
# reading each member's whole context (the prefix from the CPU caches after the first member) costs less. Zen3 fp32,
# 30 layers: 1 x 32 members over 512 tokens 18.1 vs 23.4 ms, 4 x 8 over 256 14.3 vs 16.3; 4 x 8 over 96 9.5 vs 8.6,
# 1 x 8 over 256 6.9 vs 5.7, 8 x 2 over 256 17.7 vs 15.5. bf16 on AVX512-BF16 (EPYC, one thread, CPU time, SmolLM2
# shape): the same threshold, flash / whole contexts at 8,192 pairs 0.77-0.93 (32 x 256, 16 x 512, 8 x 1,024), at 4,096
# 0.91-1.23 (32 x 128 .. 4 x 1,024), below it 1.1-1.9; with 2 threads the flash kernel has 3 items for 9-21 members (one
# tile per KV head), so lower thresholds would not pay there either.
FLASH_DECODE_MIN_SHARED = 8192


@dataclass(frozen=True)
class DecodeRows:
    """The step's decode rows, one item each: a sequence's single new token, or one row of a verify chunk (row j
    attends as the decode of position ctx - q + j would, over the first ctx - q + 1 + j keys)."""

    rows: list[int]  # flat row
    seqs: list[int]  # batch index (its block table)
    lens: list[int]  # keys it attends (its own included)


def _decode_rows(meta: AttentionMetadata, qsl: list[int]) -> DecodeRows:
    if meta.max_query_len == 1:  # a pure decode step: row b is sequence b's one token (no per-row loop)
        every = list(range(len(meta.query_lens_list)))
        return DecodeRows(every, every, list(meta.seq_lens_list))
    rows: list[int] = []
    seqs: list[int] = []
    lens: list[int] = []
    for b, (q, ctx) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q == 1 or b in meta.verify:
            rows.extend(range(qsl[b], qsl[b] + q))
            seqs.extend([b] * q)
            lens.extend(range(ctx - q + 1, ctx + 1))
    return DecodeRows(rows, seqs, lens)


def _flash_plan(meta: AttentionMetadata, qsl: list[int], seqs: list[int], key_start: int = 0) -> FlashPlan:
    """Every new row of `seqs` (one group each; qsl: query_start_loc as a list), attending its sequence's keys up to
    its own position."""
    dev = meta.seq_lens.device
    qlens = [meta.query_lens_list[b] for b in seqs]
    slens = [meta.seq_lens_list[b] for b in seqs]
    rows = torch.cat([torch.arange(qsl[b], qsl[b] + q, device=dev) for b, q in zip(seqs, qlens)])
    ends = torch.cat([torch.arange(ctx - q + 1, ctx + 1, dtype=torch.int32, device=dev)
                      for q, ctx in zip(qlens, slens)])
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=dev)
    starts[1:] = torch.tensor(qlens, dtype=torch.int32, device=dev).cumsum(0)
    nblk = (max(slens) + meta.block_size - 1) // meta.block_size
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    return FlashPlan(rows, ends, starts, meta.block_tables[idx, :nblk].contiguous(), key_start)


def _prefixes_flash_plan(groups: list[tuple[torch.Tensor, torch.Tensor]], bs: int) -> FlashPlan | None:
    """Each group's rows (of several sequences) against the blocks they share (common32, int32), one flash group per
    shared prefix: every prefix of the step in one kernel call, so that its work items spread over all the threads."""
    if not groups:
        return None
    dev = groups[0][0].device
    rows = torch.cat([r for r, _ in groups])
    ends = torch.cat([torch.full((r.shape[0],), c.shape[0] * bs, dtype=torch.int32, device=dev) for r, c in groups])
    starts = torch.zeros(len(groups) + 1, dtype=torch.int32, device=dev)
    starts[1:] = torch.tensor([r.shape[0] for r, _ in groups], dtype=torch.int32, device=dev).cumsum(0)
    tables = torch.zeros(len(groups), max(c.shape[0] for _, c in groups), dtype=torch.int32, device=dev)
    for g, (_, c) in enumerate(groups):
        tables[g, : c.shape[0]] = c
    return FlashPlan(rows, ends, starts, tables)


@dataclass(frozen=True)
class CascadePrefillPlan:
    """Prefill chunks of sequences that share cached leading blocks, for the torch path: the shared prefix for all
    members at once, each member's own keys, merged by log-sum-exp (the flash kernel has its own plans)."""

    rows: torch.Tensor  # int64 flat rows of every member's chunk, member by member
    common: torch.Tensor  # int64 shared block ids
    own: tuple[ChunkPlan, ...]  # each member's own part (blocks after the shared prefix, causal mask)
    bias: tuple[torch.Tensor, ...]  # additive float masks [n, L] matching `own`
    common_span: tuple[int, int] | None = None  # as CascadeDecodePlan.common_span


def _span(ids: list[int]) -> tuple[int, int] | None:
    """(first, last + 1) when the block ids are consecutive (then the blocks are one contiguous slice of the
    pool, read in place instead of gathered: fresh prompts and forked prefixes usually are), else None."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return ids[0], ids[-1] + 1
    return None


def _blocks(cache: torch.Tensor, ids: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    """The pool's blocks `ids` [N, bs, Hkv, D] -> [len(ids) * bs, Hkv, D]: a view of a consecutive span, else
    a gather of whole blocks (one contiguous row each)."""
    N, bs, Hkv, D = cache.shape
    if span is not None:
        return cache[span[0] : span[1]].view(-1, Hkv, D)
    return cache.view(N, -1).index_select(0, ids).view(-1, Hkv, D)


def _rows_of_heads(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] with each row's heads contiguous (any row stride), as the kernel reads it."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def _use_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C++ kernels serve float32 and bfloat16 (queries in the cache's dtype; bf16 computes in float32)."""
    return (q.device.type == "cpu" and k_cache.dtype == q.dtype and q.shape[-1] <= 256 and k_cache.is_contiguous()
            and cpu_ops.supports(q.dtype))


def _chunk_plan(meta: AttentionMetadata, qsl: list[int], b: int, first_block: int = 0) -> ChunkPlan:
    """Sequence b's prefill chunk against its keys from block first_block on (0: its whole context; a cascade
    member: the keys after the shared prefix): the blocks to gather and the causal mask [q, keys]."""
    bs, dev = meta.block_size, meta.seq_lens.device
    s, q, ctx = qsl[b], meta.query_lens_list[b], meta.seq_lens_list[b]
    blocks = meta.block_tables[b, first_block : (ctx + bs - 1) // bs].long()
    causal = torch.arange(first_block * bs, ctx, device=dev)[None, :] <= torch.arange(ctx - q, ctx, device=dev)[:, None]
    return ChunkPlan(s, s + q, blocks, causal, _span(blocks.tolist()))


def _bias_of(mask: torch.Tensor | None, dev: torch.device) -> torch.Tensor:
    """The additive attention bias of a cascade member's mask: 0 where it attends, -inf elsewhere."""
    assert mask is not None  # _chunk_plan sets every member's mask
    return torch.zeros(mask.shape, device=dev).masked_fill_(~mask, float("-inf"))


class TorchAttentionBackend:
    """Reads K/V of the paged pool on CPU; computes attention in float32.

    With the C++ kernels (flowrt.engine.cpu.ops, float32 or bfloat16 caches: bf16 is read in place and widened in
    registers) everything is read in place in the pool: decode rows
    (one new token) by the paged decode kernel, one row per (sequence, KV head); prefill chunks by the flash kernel,
    which attends a tile of rows x query heads per KV head as small matrix products over packed chunks of keys. Rows
    whose sequences share leading blocks (forks, prefix-cache hits) are grouped (cascade attention): each member's own
    keys first, with their log-sum-exp, then the shared prefix once for all members of the group (flash), merged. The
    plain-torch path does the same with gathered blocks: one masked SDPA over the decode rows, a cascade of two
    attentions per shared prefix, one SDPA call per prefill chunk. Attention stays per sequence (or per shared prefix):
    never one dense mask over the batch. `prepare` builds immutable plans once per step (meta.prepared: "decode",
    "cascade", "cascade_prefixes", "cascade_prefill" groups with their "cascade_prefill_own" and
    "cascade_prefill_prefixes", "prefill_flash", "all_decode"; the torch path's prefill plans, which need masks, and the
    one-call decode step's "program", on first use);
    layers only read them.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        qlens = meta.query_lens_list
        slens = meta.seq_lens_list
        p = meta.prepared
        dev = meta.seq_lens.device
        qsl = meta.query_start_loc.tolist()
        d = _decode_rows(meta, qsl)
        p["all_decode"] = len(d.rows) == qsl[-1]  # every row a decode row: decode_program applies
        plain = list(range(len(d.rows)))
        cascade, shared = [], 0
        if len(d.rows) > 1:
            plain = []
            for members, n_common in self._shared_prefix_groups(meta, d.seqs, [n - 1 for n in d.lens]):
                if n_common == 0:
                    plain.extend(members)
                    continue
                rows = torch.tensor([d.rows[i] for i in members], dtype=torch.long, device=dev)
                lens = torch.tensor([d.lens[i] for i in members], dtype=torch.int32, device=dev)
                nblk = (max(d.lens[i] for i in members) + bs - 1) // bs
                tables = meta.block_tables[torch.tensor([d.seqs[i] for i in members], device=dev), :nblk]
                suffix = tables[:, n_common:].long().reshape(-1)
                pos = n_common * bs + torch.arange((nblk - n_common) * bs, device=dev)
                bias = torch.zeros(len(members), 1, 1, pos.shape[0], device=dev)
                bias.masked_fill_(~(pos[None, :] < lens.long()[:, None])[:, None, None, :], float("-inf"))
                common = tables[0, :n_common].long()
                cascade.append(CascadeDecodePlan(rows, common, tables, lens, suffix, nblk - n_common, bias,
                                                 n_common * bs, _span(common.tolist())))
                # the path is chosen by the sequences, as in plain decode: a verify chunk's extra rows don't count
                shared += len({d.seqs[i] for i in members}) * n_common * bs
        p["cascade"] = tuple(cascade)
        p["cascade_prefixes"] = _prefixes_flash_plan(
            [(cp.rows, cp.tables[0, : cp.n_prefix // bs]) for cp in cascade], bs
        ) if dev.type == "cpu" and shared >= FLASH_DECODE_MIN_SHARED else None
        if plain:
            all_rows = len(plain) == qsl[-1]  # every row is a decode row, in order: the kernel writes them all
            seqs = [d.seqs[i] for i in plain]
            nblk = (max(d.lens if len(plain) == len(d.lens) else [d.lens[i] for i in plain]) + bs - 1) // bs
            if all_rows and not meta.verify:
                tables, lens = meta.block_tables[:, :nblk], meta.seq_lens
            else:
                tables = meta.block_tables[torch.tensor(seqs, dtype=torch.long, device=dev), :nblk]
                lens = torch.tensor([d.lens[i] for i in plain], dtype=torch.int32, device=dev)
            valid = torch.arange(nblk * bs, device=dev)[None, :] < lens.long()[:, None]
            picked = None if all_rows else torch.tensor([d.rows[i] for i in plain], dtype=torch.long, device=dev)
            p["decode"] = DecodePlan(picked, tables.contiguous(), lens.contiguous(), tables.long().reshape(-1), nblk,
                                     valid[:, None, None, :])
        cascade_prefill = []
        multi = [b for b, q in enumerate(qlens) if q > 1 and b not in meta.verify]
        chunks = [b for b in multi if slens[b] > qlens[b]]
        alone = set(multi) - set(chunks)
        if len(chunks) > 1:
            for items, n_common in self._shared_prefix_groups(meta, chunks, [slens[b] - qlens[b] for b in chunks]):
                members = [chunks[i] for i in items]
                if n_common == 0 or len(members) < 2:
                    alone.update(members)
                else:
                    cascade_prefill.append((members, n_common))
        else:
            alone.update(chunks)
        p["cascade_prefill"] = tuple(cascade_prefill)  # (members, shared blocks); the torch plans on first use
        alone_rows = sorted(alone)
        p["alone"] = alone_rows  # their SDPA plans ("prefill") are built by the first layer that needs them
        cpu = dev.type == "cpu"
        own = tuple(_flash_plan(meta, qsl, m, key_start=n * bs) for m, n in cascade_prefill) if cpu else ()
        p["cascade_prefill_own"] = own
        p["cascade_prefill_prefixes"] = _prefixes_flash_plan(
            [(o.rows, meta.block_tables[m[0], :n]) for o, (m, n) in zip(own, cascade_prefill)], bs)
        p["prefill_flash"] = _flash_plan(meta, qsl, alone_rows) if alone_rows and cpu else None

    @staticmethod
    def _cascade_prefill_plans(meta: AttentionMetadata) -> tuple[CascadePrefillPlan, ...]:
        """The torch path's plans for the prefill chunks over shared prefixes (masks per member), built once."""
        p = meta.prepared
        if "cascade_prefill_torch" not in p:
            dev = meta.seq_lens.device
            qsl = meta.query_start_loc.tolist()
            plans = []
            for members, n_common in p["cascade_prefill"]:
                own = tuple(_chunk_plan(meta, qsl, b, first_block=n_common) for b in members)
                biases = tuple(_bias_of(o.mask, dev) for o in own)
                rows = torch.cat([torch.arange(o.start, o.end, device=dev) for o in own])
                common = meta.block_tables[members[0], :n_common].long()
                plans.append(CascadePrefillPlan(rows, common, own, biases, _span(common.tolist())))
            p["cascade_prefill_torch"] = tuple(plans)
        return p["cascade_prefill_torch"]

    @staticmethod
    def _chunk_plans(meta: AttentionMetadata) -> tuple[ChunkPlan, ...]:
        """One SDPA plan per prefill chunk that shares nothing (the path without the flash kernel), built once."""
        p = meta.prepared
        if "prefill" not in p:
            qsl = meta.query_start_loc.tolist()
            plans = []
            for b in p["alone"]:
                s, q = qsl[b], meta.query_lens_list[b]
                if meta.seq_lens_list[b] == q:
                    plans.append(ChunkPlan(s, s + q, None, None))  # nothing cached before: attend to the fresh K/V
                else:
                    plans.append(_chunk_plan(meta, qsl, b))
            p["prefill"] = tuple(plans)
        return p["prefill"]

    @staticmethod
    def _shared_prefix_groups(meta: AttentionMetadata, seqs: list[int],
                              before: list[int]) -> list[tuple[list[int], int]]:
        """Items (item i: sequence seqs[i], with before[i] tokens preceding its new ones) grouped by their sequence's
        first KV block, with the number of leading full blocks that every member holds in common (the same physical
        blocks: forks and prefix-cache hits) before its new tokens."""
        bs = meta.block_size
        tables = meta.block_tables
        firsts = tables[:, 0].tolist()  # one conversion per step, not one tensor read per sequence
        by_first: dict[int, list[int]] = {}
        for i, b in enumerate(seqs):
            by_first.setdefault(firsts[b], []).append(i)
        groups = []
        for members in by_first.values():
            if len({seqs[i] for i in members}) < 2:
                groups.append((members, 0))
                continue
            limit = min(before[i] for i in members) // bs  # full blocks that precede every member's new tokens
            t = tables[[seqs[i] for i in members], :limit]
            same = (t == t[:1]).all(dim=0).int().cumprod(0)
            groups.append((members, int(same.sum()) if limit else 0))
        return groups

    @staticmethod
    def decode_program(meta: AttentionMetadata, heads: int, head_dim: int) -> DecodeProgram | None:
        """The step's attention as kernel calls (DecodeProgram) where every row is a decode row (a pure decode step,
        decode rows sharing prefixes, verify chunks), else None. Built once per step; valid for the C++ kernels."""
        p = meta.prepared
        if "program" not in p:
            p["program"] = _decode_program(p, heads, head_dim) if p.get("all_decode") else None
        return p["program"]

    #: forward takes kv_written=True: the caller has written k/v to the step's slots itself (the model's fused
    #: rotary + KV write)
    accepts_written_kv = True

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_written: bool = False) -> torch.Tensor:
        """q [T,H,D], k/v [T,Hkv,D] (new tokens); writes k/v into the caches (unless kv_written), returns [T,H,D]."""
        T, H, D = q.shape
        Hkv = k.shape[1]
        kernel = _use_kernel(q, k_cache)
        if kv_written:
            pass
        elif kernel:
            cpu_ops.kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            kflat = k_cache.view(-1, Hkv, D)
            vflat = v_cache.view(-1, Hkv, D)
            kflat.index_copy_(0, meta.slot_mapping, k.to(kflat.dtype))
            vflat.index_copy_(0, meta.slot_mapping, v.to(vflat.dtype))
        prep = meta.prepared
        dp = prep.get("decode")
        if dp is not None and dp.rows is None and kernel:  # a pure decode step: the kernel writes every row
            out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
            cpu_ops.paged_decode(_rows_of_heads(q), k_cache, v_cache, dp.tables, dp.seq_lens, out, scale)
            return out
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        if dp is not None:
            if kernel:
                cpu_ops.paged_decode(_rows_of_heads(q), k_cache, v_cache, dp.tables, dp.seq_lens, out, scale,
                                     rows=dp.rows)
            else:
                # Gather whole blocks (one contiguous row each), then one fused SDPA over the decode rows.
                B, nblk = dp.valid.shape[0], dp.nblk
                bs = k_cache.shape[1]
                kd = k_cache.view(k_cache.shape[0], -1).index_select(0, dp.blocks).view(B, nblk * bs, Hkv, D)
                vd = v_cache.view(v_cache.shape[0], -1).index_select(0, dp.blocks).view(B, nblk * bs, Hkv, D)
                # The G query heads of a KV head are G query rows against that head's keys: K/V are read once
                # per KV head, and the math runs in the cache's dtype (accumulating in float32).
                qd = (q if dp.rows is None else q.index_select(0, dp.rows)).to(k_cache.dtype).view(B, Hkv, H // Hkv, D)
                od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=dp.valid,
                                                    scale=scale)
                od = od.view(B, H, D).to(q.dtype)
                if dp.rows is None:
                    return od
                out.index_copy_(0, dp.rows, od)
        flash = kernel and cpu_ops.flash_supported(D)
        qr = _rows_of_heads(q) if kernel else q
        cascade_flash = flash and prep["cascade_prefixes"] is not None
        if cascade_flash:
            # each member's own suffix (with its log-sum-exp), then every shared prefix for all its members at once
            lse = torch.empty(prep["cascade_prefixes"].rows.shape[0], H)
            r0 = 0
            for cp in prep["cascade"]:
                n = cp.rows.shape[0]
                cpu_ops.paged_decode(qr, k_cache, v_cache, cp.tables, cp.seq_lens, out, scale, rows=cp.rows,
                                     start=cp.n_prefix, lse=lse[r0 : r0 + n])
                r0 += n
            self._flash(qr, k_cache, v_cache, prep["cascade_prefixes"], out, scale, lse_in=lse)
        for cp in prep["cascade"] if not cascade_flash else ():
            if kernel:
                # each member's whole context in place, ordered so the shared prefix stays in the CPU caches
                cpu_ops.paged_decode(qr, k_cache, v_cache, cp.tables, cp.seq_lens, out, scale, rows=cp.rows,
                                     shared_prefix=True)
            else:
                out.index_copy_(0, cp.rows, self._cascade(q, k_cache, v_cache, cp, scale))
        if flash and prep["cascade_prefill_own"]:
            # each group's own parts (with their log-sum-exp), then every shared prefix for all its members at once
            lse = torch.empty(prep["cascade_prefill_prefixes"].rows.shape[0], H)
            r0 = 0
            for fp in prep["cascade_prefill_own"]:
                n = fp.rows.shape[0]
                self._flash(qr, k_cache, v_cache, fp, out, scale, lse_out=lse[r0 : r0 + n])
                r0 += n
            self._flash(qr, k_cache, v_cache, prep["cascade_prefill_prefixes"], out, scale, lse_in=lse)
        elif prep["cascade_prefill"]:
            for cp in self._cascade_prefill_plans(meta):
                self._cascade_prefill(q, k_cache, v_cache, cp, scale, out)
        if prep["prefill_flash"] is not None and flash:
            self._flash(qr, k_cache, v_cache, prep["prefill_flash"], out, scale)
        elif prep["alone"]:
            self._sdpa_chunks(q, k, v, k_cache, v_cache, self._chunk_plans(meta), scale, out)
        return out

    @staticmethod
    def _flash(q, k_cache, v_cache, fp: FlashPlan, out, scale, lse_in=None, lse_out=None) -> None:
        cpu_ops.paged_flash(q, k_cache, v_cache, fp.rows, fp.ends, fp.group_start, fp.tables, out, scale,
                            key_start=fp.key_start, lse_in=lse_in, lse_out=lse_out)

    @staticmethod
    def _sdpa_chunks(q, k, v, k_cache, v_cache, chunks: tuple[ChunkPlan, ...], scale, out) -> None:
        """One SDPA call per chunk: causal over its fresh K/V, or masked over its gathered context."""
        H, Hkv = q.shape[1], k.shape[1]
        for c in chunks:
            s, e = c.start, c.end
            qs = q[s:e].float().transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if c.blocks is None:
                ks, vs = k[s:e], v[s:e]
            else:  # whole blocks (contiguous rows) gathered, then cut to the context
                assert c.mask is not None  # a chunk with blocks has its mask
                ctx = c.mask.shape[1]
                ks = _blocks(k_cache, c.blocks, c.span)[:ctx]
                vs = _blocks(v_cache, c.blocks, c.span)[:ctx]
            ks = ks.float().transpose(0, 1).unsqueeze(0)
            vs = vs.float().transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=H != Hkv
            )
            out[s:e] = o[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _cascade(q, k_cache, v_cache, cp: CascadeDecodePlan, scale) -> torch.Tensor:
        """Decode attention for sequences that share their first blocks (torch path): the shared prefix's K/V is
        read once for all of them (one matrix product over all their queries), each sequence's own suffix
        separately, and the two partial softmaxes are merged by their log-sum-exp."""
        N, bs, Hkv, D = k_cache.shape
        B = cp.rows.shape[0]
        H = q.shape[1]
        G = H // Hkv
        qg = q.index_select(0, cp.rows).float().view(B, Hkv, G, D)
        # shared prefix: all B*G query rows of a KV head against its P prefix keys, in one kernel call
        kp = _blocks(k_cache, cp.common, cp.common_span).float().transpose(0, 1)[None]
        vp = _blocks(v_cache, cp.common, cp.common_span).float().transpose(0, 1)[None]
        op, lp = _attend(qg.permute(1, 0, 2, 3).reshape(1, Hkv, B * G, D), kp, vp, scale)
        op, lp = (t.view(Hkv, B, G, -1).transpose(0, 1) for t in (op, lp))  # -> [B, Hkv, G, *]
        # own suffix: [B, Hkv, G, D] against each sequence's remaining blocks (the new token included)
        ks = k_cache.view(N, -1).index_select(0, cp.suffix).view(B, cp.nsuf * bs, Hkv, D).float().transpose(1, 2)
        vs = v_cache.view(N, -1).index_select(0, cp.suffix).view(B, cp.nsuf * bs, Hkv, D).float().transpose(1, 2)
        os_, ls = _attend(qg, ks, vs, scale, cp.bias)
        return _merge(op, lp, os_, ls).reshape(B, H, D).to(q.dtype)

    @staticmethod
    def _cascade_prefill(q, k_cache, v_cache, cp: CascadePrefillPlan, scale, out) -> None:
        """Prefill chunks of sequences that share cached leading blocks: every query row of the group
        attends the shared prefix in one matrix product (no mask: the prefix precedes all of them); each
        sequence then attends its own remaining context causally; the parts merge by log-sum-exp."""
        N, bs, Hkv, D = k_cache.shape
        R, H = cp.rows.shape[0], q.shape[1]
        G = H // Hkv
        qg = q.index_select(0, cp.rows).float().view(R, Hkv, G, D)
        kp = _blocks(k_cache, cp.common, cp.common_span).float().transpose(0, 1)[None]
        vp = _blocks(v_cache, cp.common, cp.common_span).float().transpose(0, 1)[None]
        op, lp = _attend(qg.permute(1, 0, 2, 3).reshape(1, Hkv, R * G, D), kp, vp, scale)
        op, lp = (t.view(Hkv, R, G, -1).permute(1, 0, 2, 3) for t in (op, lp))  # [R, Hkv, G, *]
        r0 = 0
        for c, bias in zip(cp.own, cp.bias):
            s, e = c.start, c.end
            n, L = e - s, bias.shape[-1]
            bias = bias.repeat_interleave(G, dim=0)  # rows are (token, query head of the KV head) pairs, token-major
            assert c.blocks is not None  # a cascade member reads its own keys' blocks
            ko = _blocks(k_cache, c.blocks, c.span)[:L].float().transpose(0, 1)[None]
            vo = _blocks(v_cache, c.blocks, c.span)[:L].float().transpose(0, 1)[None]
            qo = qg[r0 : r0 + n].permute(1, 0, 2, 3).reshape(1, Hkv, n * G, D)
            oo, lo = (t.view(Hkv, n, G, -1).permute(1, 0, 2, 3) for t in _attend(qo, ko, vo, scale, bias))
            o = _merge(op[r0 : r0 + n], lp[r0 : r0 + n], oo, lo)
            out[s:e] = o.reshape(n, H, D).to(q.dtype)
            r0 += n

    @staticmethod
    def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv [L, 2, N, bs, Hkv, D]: copy whole blocks src[i] -> dst[i] in every layer (copy-on-write)."""
        kv[:, :, dst] = kv[:, :, src]
