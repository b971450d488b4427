"""The engine's torch attention backend against the plain paged-attention reference, including the
shared-prefix (cascade) decode path that reads blocks common to several sequences once."""

import pytest
import torch

from flowrt.engine import cpu_ops
from flowrt.engine.attention import AttentionMetadata, TorchAttentionBackend
from flowrt.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref


@pytest.fixture(autouse=True, params=["cpu-kernel", "plain-torch"])
def kernel_mode(request):
    """Every test runs with the C++ decode kernel (where it builds) and with the plain-torch gathers."""
    if request.param == "cpu-kernel" and cpu_ops.lib() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_ops._error}")
    cpu_ops.set_enabled(request.param == "cpu-kernel")
    yield request.param
    cpu_ops.set_enabled(True)


def make_meta(tables, seq_lens, q_lens, bs):
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    slots = []
    for t, L, n in zip(tables, seq_lens, q_lens):
        slots += [t[p // bs] * bs + p % bs for p in range(L - n, L)]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return AttentionMetadata(torch.tensor(slots), qsl, torch.tensor(seq_lens, dtype=torch.int32), bt, list(q_lens),
                             list(seq_lens), max(q_lens), max(seq_lens), bs)


def assert_matches_prefill_reference(be, meta, N, Hkv, G, D, scale):
    """Random pools and new q/k/v for the step in `meta` (prepared by `be`): the backend's output equals the paged
    prefill reference's."""
    bs = meta.block_size
    kc, vc = torch.randn(N, bs, Hkv, D), torch.randn(N, bs, Hkv, D)
    T = sum(meta.query_lens_list)
    q, k, v = torch.randn(T, Hkv * G, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    out = be.forward(q, k, v, kc, vc, meta, scale)
    ref = paged_prefill_attention_ref(q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                                      meta.max_query_len)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_with_shared_prefix_groups_matches_reference():
    torch.manual_seed(0)
    bs, Hkv, G, D, N = 16, 2, 3, 32, 64
    perm = torch.randperm(N).tolist()
    shared, other = perm[:5], perm[5:]
    # three sequences share 5 blocks (one ends its shared part mid-way), two share 2, one stands alone
    tables = [shared + [other[0], other[1]], shared + [other[2]], shared[:4] + [other[3]],
              [other[4], other[5], other[6]], [other[4], other[5], other[7], other[8]], [other[9], other[10]]]
    seq_lens = [100, 85, 70, 40, 60, 20]
    meta = make_meta(tables, seq_lens, [1] * 6, bs)
    be = TorchAttentionBackend()
    be.prepare(meta)
    assert len(meta.prepared["cascade"]) == 2  # the plain path takes the rest
    kc, vc = torch.randn(N, bs, Hkv, D), torch.randn(N, bs, Hkv, D)
    q, k, v = torch.randn(6, Hkv * G, D), torch.randn(6, Hkv, D), torch.randn(6, Hkv, D)
    out = be.forward(q, k, v, kc, vc, meta, 0.2)
    ref = paged_decode_attention_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_matches_reference():
    torch.manual_seed(1)
    bs, Hkv, G, D, N = 8, 3, 2, 16, 80
    perm = torch.randperm(N).tolist()
    tables = [perm[0:6], perm[6:9], perm[9:14], perm[0:3] + perm[14:17]]
    seq_lens, q_lens = [45, 20, 33, 41], [1, 20, 9, 1]
    meta = make_meta(tables, seq_lens, q_lens, bs)
    be = TorchAttentionBackend()
    be.prepare(meta)
    assert_matches_prefill_reference(be, meta, N, Hkv, G, D, 0.25)


def test_prefill_chunks_sharing_a_cached_prefix_match_reference():
    torch.manual_seed(2)
    bs, Hkv, G, D, N = 8, 2, 4, 16, 96
    perm = torch.randperm(N).tolist()
    shared = perm[:4]
    tables = [shared + perm[4:7], shared + perm[7:9], shared[:3] + perm[9:12], perm[12:16], shared + perm[16:18]]
    seq_lens, q_lens = [50, 44, 40, 30, 35], [10, 12, 9, 7, 1]
    meta = make_meta(tables, seq_lens, q_lens, bs)
    be = TorchAttentionBackend()
    be.prepare(meta)
    assert len(meta.prepared["cascade_prefill"]) == 1  # the three chunks over the shared blocks
    assert_matches_prefill_reference(be, meta, N, Hkv, G, D, 0.3)


def test_pure_decode_step_matches_reference():
    """Every row a decode of its own sequence (no shared blocks): the whole step in one kernel call / one SDPA."""
    torch.manual_seed(3)
    bs, Hkv, G, D, N = 16, 3, 3, 64, 60
    perm = torch.randperm(N).tolist()
    tables = [perm[0:10], perm[10:11], perm[11:14], perm[14:30]]
    seq_lens = [150, 1, 40, 256]
    meta = make_meta(tables, seq_lens, [1] * 4, bs)
    be = TorchAttentionBackend()
    be.prepare(meta)
    assert meta.prepared["decode"].rows is None and not meta.prepared["cascade"]
    kc, vc = torch.randn(N, bs, Hkv, D), torch.randn(N, bs, Hkv, D)
    qkv = torch.randn(4, (Hkv * G + 2 * Hkv) * D)  # q as a strided view, as the model passes it
    q = qkv[:, : Hkv * G * D].view(4, Hkv * G, D)
    k, v = torch.randn(4, Hkv, D), torch.randn(4, Hkv, D)
    out = be.forward(q, k, v, kc, vc, meta, 0.125)
    ref = paged_decode_attention_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_are_one_flash_plan_grouped_by_sequence():
    """Every prefill chunk that shares nothing (long over a cache, fresh, short over a cache) is one group of the flash
    plan, each row with its causal end; beside a decode row, the step matches the reference (flash kernel and SDPA)."""
    torch.manual_seed(5)
    bs, Hkv, G, D = 16, 3, 3, 64
    long_ctx = 600  # over more than one chunk of the flash kernel (256 keys), not a whole number of them
    sizes = [(long_ctx + bs - 1) // bs, 3, 2, 2]
    N = sum(sizes) + 4
    perm = torch.randperm(N).tolist()
    tables, at = [], 0
    for n in sizes:
        tables.append(perm[at : at + n])
        at += n
    seq_lens, q_lens = [long_ctx, 40, 30, 25], [40, 40, 12, 1]  # long cached + short, fresh, cached short, decode
    meta = make_meta(tables, seq_lens, q_lens, bs)
    be = TorchAttentionBackend()
    be.prepare(meta)
    fp = meta.prepared["prefill_flash"]
    assert fp.rows.tolist() == list(range(0, 92))
    assert fp.group_start.tolist() == [0, 40, 80, 92]
    assert fp.ends.tolist() == list(range(561, 601)) + list(range(1, 41)) + list(range(19, 31))
    assert fp.tables[0].tolist() == tables[0] and fp.tables[2, :2].tolist() == tables[2]
    assert_matches_prefill_reference(be, meta, N, Hkv, G, D, 0.125)


def test_flash_kernel_matches_reference_for_odd_shapes():
    """The flash kernel alone: head sizes 16-128, GQA and MHA, block sizes 4-16, chunks that end mid-block, rows in a
    shuffled order of a wider stream; the log-sum-exp it returns and a merge with a second part (key_start) agree."""
    if cpu_ops.lib() is None or not cpu_ops.flash_supported(64):
        pytest.skip("flash kernel unavailable here")
    for D, Hkv, G, bs in [(64, 3, 3, 16), (128, 2, 4, 16), (32, 2, 2, 8), (16, 4, 1, 4)]:
        torch.manual_seed(D + bs)
        specs = [(0, 300), (260, 37), (600, 5)]  # (cached, new) per sequence
        nblk = [(c + n + bs - 1) // bs for c, n in specs]
        N = sum(nblk) + 3
        perm = torch.randperm(N).int()
        tables = torch.zeros(3, max(nblk), dtype=torch.int32)
        at, ends, starts = 0, [], [0]
        for g, (c, n) in enumerate(specs):
            tables[g, : nblk[g]] = perm[at : at + nblk[g]]
            at += nblk[g]
            ends += list(range(c + 1, c + n + 1))
            starts.append(starts[-1] + n)
        R = starts[-1]
        kc, vc = torch.randn(N, bs, Hkv, D), torch.randn(N, bs, Hkv, D)
        q = torch.randn(R + 4, Hkv * G, D)
        rows = torch.randperm(R + 4)[:R]
        ends_t, starts_t = torch.tensor(ends, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
        scale = D**-0.5
        out, lse = torch.zeros(R + 4, Hkv * G, D), torch.empty(R, Hkv * G)
        cpu_ops.paged_flash(q, kc, vc, rows, ends_t, starts_t, tables, out, scale, lse_out=lse)
        # the same rows in two parts: keys from 256 on (with their log-sum-exp), then keys before 256 merged in
        split = torch.zeros(R + 4, Hkv * G, D)
        lse_hi = torch.empty(R, Hkv * G)
        cpu_ops.paged_flash(q, kc, vc, rows, ends_t, starts_t, tables, split, scale, key_start=256, lse_out=lse_hi)
        cpu_ops.paged_flash(q, kc, vc, rows, ends_t.clamp(max=256), starts_t, tables, split, scale, lse_in=lse_hi)
        for g in range(3):
            sl = slice(starts[g], starts[g + 1])
            n = starts[g + 1] - starts[g]
            qsl = torch.tensor([0, n], dtype=torch.int32)
            ref = paged_prefill_attention_ref(q[rows[sl]], kc, vc, tables[g : g + 1], qsl,
                                              torch.tensor([ends[starts[g + 1] - 1]], dtype=torch.int32), scale, n)
            torch.testing.assert_close(out[rows[sl]], ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(split[rows[sl]], ref, atol=1e-5, rtol=1e-5)
            # log-sum-exp of the scaled scores, against a direct computation for the last row of the group
            last = starts[g + 1] - 1
            pos = torch.arange(ends[last])
            slots = tables[g][pos // bs].long() * bs + pos % bs
            k = kc.view(-1, Hkv, D)[slots].repeat_interleave(G, dim=1)
            s = torch.einsum("hd,lhd->hl", q[rows[last]], k) * scale
            torch.testing.assert_close(lse[last], torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
        assert not out[[r for r in range(R + 4) if r not in set(rows.tolist())]].any()
