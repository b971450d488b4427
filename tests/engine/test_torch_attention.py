"""The engine's torch attention backend against the plain paged-attention reference, including the
shared-prefix (cascade) decode path that reads blocks common to several sequences once."""

import pytest
import torch

from flowrt.engine.model import attention
from flowrt.engine.cpu import ops as cpu_ops
from flowrt.engine.model.attention import AttentionMetadata, TorchAttentionBackend
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


@pytest.mark.parametrize("min_shared", [0, None], ids=["prefixes-by-flash", "default-threshold"])
def test_decode_with_shared_prefix_groups_matches_reference(min_shared, monkeypatch):
    """Two groups sharing prefixes of different lengths: with the flash kernel for the shared prefixes (their own
    suffixes first, merged by log-sum-exp), and below the threshold where each member reads its whole context."""
    if min_shared is not None:
        monkeypatch.setattr(attention, "FLASH_DECODE_MIN_SHARED", min_shared)
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
    assert (meta.prepared["cascade_prefixes"] is not None) == (min_shared == 0)
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
