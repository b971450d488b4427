"""flowrt.engine.cpu.ops (the fused float32 CPU kernels) against plain-torch references, and the engine's
fallback when the kernels cannot be built (no compiler): same greedy tokens either way."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from support import hf_greedy
from flowrt.engine import LLM, SamplingParams
from flowrt.engine.cpu import ops as cpu_ops
from flowrt.engine.model.models.llama import rms_norm, rotate_half
from flowrt.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

pytestmark = pytest.mark.skipif(cpu_ops.lib() is None, reason=f"CPU kernels unavailable: {cpu_ops._error}")


@pytest.mark.parametrize("T,E", [(1, 64), (7, 576), (300, 576)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_matches_torch(T, E, with_delta):
    torch.manual_seed(T)
    h, d, w = torch.randn(T, E), torch.randn(T, E), torch.randn(E)
    ref_h = h + d if with_delta else h.clone()
    ref = rms_norm(ref_h, w, 1e-6)
    out = cpu_ops.add_rmsnorm(h, d if with_delta else None, w, 1e-6)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)  # the residual is updated in place
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,inter", [(1, 8), (2, 13), (3, 1536), (64, 1536)])
def test_silu_mul_matches_torch(T, inter):
    torch.manual_seed(inter + T)
    gu = torch.randn(T, 2 * inter) * 6  # large magnitudes too: exp over- and underflow must saturate cleanly
    gu[0, 0], gu[-1, inter - 1] = -200.0, 200.0
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    out = cpu_ops.silu_mul(gu)
    assert out.shape == (T, inter) and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T,nh,D", [(1, 3, 16), (5, 12, 64), (200, 6, 128)])
def test_rope_in_place_matches_torch(T, nh, D):
    torch.manual_seed(D)
    x = torch.randn(T, nh * D + 40)  # extra columns (the V heads) stay untouched
    cos, sin = torch.randn(512, D), torch.randn(512, D)
    pos = torch.randint(0, 512, (T,))
    qk = x[:, : nh * D].view(T, nh, D)
    ref = qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)
    tail = x[:, nh * D :].clone()
    cpu_ops.rope_(x, nh, D, cos, sin, pos)
    torch.testing.assert_close(x[:, : nh * D].view(T, nh, D), ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(x[:, nh * D :], tail)


@pytest.mark.parametrize("T,width", [(1, 64), (3, 100), (32, 1536), (5, 580)])
def test_bf16_glue_matches_torch(T, width):
    """The bf16 glue at the model's widths and at odd ones (the vector loops, their tails): rotary bit for bit as
    transformers' bf16 ops round, the residual sum exactly, RMSNorm and SiLU x up to bf16 rounding."""
    torch.manual_seed(width)
    bf = torch.bfloat16
    h, d, w = (torch.randn(T, width) * 3).to(bf), torch.randn(T, width).to(bf), torch.randn(width).to(bf)
    ref_h = h + d
    out = cpu_ops.add_rmsnorm(h, d, w, 1e-5)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out, rms_norm(ref_h, w, 1e-5), atol=1e-2, rtol=8e-3)
    gu = (torch.randn(T, 2 * width) * 6).to(bf)
    torch.testing.assert_close(cpu_ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :width]) * gu[:, width:],
                               atol=1e-2, rtol=8e-3)
    D = width if width % 2 == 0 and width <= 128 else 40
    x = torch.randn(T, 3 * D + 8).to(bf)
    cos, sin = torch.randn(64, D).to(bf), torch.randn(64, D).to(bf)
    pos = torch.randint(0, 64, (T,))
    qk = x[:, : 3 * D].view(T, 3, D)
    ref = (qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)).view(T, -1)
    cpu_ops.rope_(x, 3, D, cos, sin, pos)
    assert torch.equal(x[:, : 3 * D], ref)



def test_bf16_glue_keeps_subnormals():
    """The bf16 glue rounds subnormal results as torch does (the vector path converts whole vectors with one
    instruction that would flush them to zero, so lanes it cannot convert take the exact integer rounding): the
    residual sum and rotary bit for bit, RMSNorm's output and NaN positions as torch's."""
    torch.manual_seed(3)
    bf = torch.bfloat16
    T, E, D = 5, 96, 64
    tiny = torch.tensor([1e-39, -3e-40, 5e-41, 2e-38, -1e-38])
    h = (torch.randn(T, E) * 1e-38).to(bf)
    d = tiny[torch.randint(0, 5, (T, E))].to(bf)
    h[1, 7], d[2, 3], h[3] = float("nan"), float("inf"), 0.0
    ref_h = h + d
    out = cpu_ops.add_rmsnorm(h, d, torch.ones(E, dtype=bf), 1e-5)
    assert torch.equal(h.isnan(), ref_h.isnan()) and torch.equal(h.nan_to_num(), ref_h.nan_to_num())
    ref = rms_norm(ref_h, torch.ones(E, dtype=bf), 1e-5)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), atol=1e-2, rtol=8e-3)
    x = (torch.randn(T, 2 * D) * 1e-36).to(bf)
    cos, sin = (torch.rand(8, D) * 1e-3).to(bf), (torch.rand(8, D) * 1e-3).to(bf)
    pos = torch.randint(0, 8, (T,))
    qk = x.view(T, 2, D)
    ref = (qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)).view(T, -1)
    assert (ref.abs() < torch.finfo(torch.float32).tiny).sum() > 50 and ref.abs().max() > 0
    cpu_ops.rope_(x, 2, D, cos, sin, pos)
    assert torch.equal(x, ref)


def _silu_unfused_f32(g: np.ndarray) -> np.ndarray:
    """silu(g) = g / (1 + fexp(-g)) in float32 with every operation rounded separately, as the kernels' scalar path
    (fexp.h's fexp: the clamp, the range reduction, the polynomial, the scale by 2^n)."""
    f = np.float32
    x = np.minimum(np.maximum(-g, f(-87.3)), f(88.3))
    n = np.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375)
    r = r + n * f(2.12194440e-4)
    p = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * r * r + r + f(1.0)
    return g / (f(1.0) + p * np.ldexp(f(1.0), n.astype(np.int32)))


def test_bf16_silu_mul_is_the_scalar_path_for_every_gate():
    """Every one of the 65,536 bf16 gate values: silu rounded to bf16 exactly as the scalar path's operations give it
    (the vector code may contract the exponential's multiply-adds only because no bf16 gate rounds differently)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = bits.view(torch.bfloat16)
    gu = torch.cat([g, torch.ones_like(g)]).view(1, -1)
    out = cpu_ops.silu_mul(gu)[0]
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(_silu_unfused_f32(g.float().numpy())).to(torch.bfloat16)
    finite = g.float().isfinite()
    assert torch.equal(out[finite].view(torch.int16), ref[finite].view(torch.int16))

def test_f32_silu_mul_is_the_scalar_path():
    """float32 silu_mul gives the scalar path's bits for the vector body and the scalar tail alike (an odd row): fexp
    is written once (fexp_lanes) for float, AVX2 and AVX-512 lanes, so every form runs the same operations; saturating
    and clamped gates included."""
    g = torch.cat([torch.randn(4091, generator=torch.Generator().manual_seed(3)) * 8,
                   torch.tensor([-200.0, 200.0, -88.3, 87.3, 1e-30, 0.0, -0.0])])
    out = cpu_ops.silu_mul(torch.cat([g, torch.ones_like(g)]).view(1, -1))[0]
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(_silu_unfused_f32(g.numpy()))
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (100, 37), (16, 1), (7, 64)])
@pytest.mark.parametrize("M", [1, 5, 6, 7, 32, 96, 97, 803])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_torch(N, K, M, with_bias):
    """Every row-tile size (1-6 rows), outputs past the last whole panel of 16, odd K, a bias and strided rows; 803
    rows take the row-block split (a partial last block and tile)."""
    torch.manual_seed(N + K + M)
    w, b = torch.randn(N, K), torch.randn(N)
    lin = cpu_ops.PackedLinear.create(w, b if with_bias else None)
    if lin is None:
        pytest.skip("no AVX2 + FMA: the projections keep oneDNN/MKL")
    x = torch.randn(M, K + 3)[:, :K]  # rows with a stride larger than K
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if with_bias else None).float()
    y = lin(x)
    assert y.shape == (M, N) and y.is_contiguous()
    torch.testing.assert_close(y, ref, atol=1e-4 * K**0.5, rtol=1e-5)


def test_packed_linear_is_used_and_respects_set_enabled(stories_path):
    """A float32 model's projections run the packed kernel, and turning the kernels off restores plain F.linear
    (bit-identical to the reference matmul)."""
    llm = LLM(stories_path, dtype="float32")
    model = llm.engine.runner.model
    if cpu_ops.PackedLinear.create(torch.zeros(16, 8)) is None:
        pytest.skip("no AVX2 + FMA")
    x = torch.randn(3, model.layers[0].qkv.shape[1])
    calls = []
    orig = cpu_ops.PackedLinear.__call__
    cpu_ops.PackedLinear.__call__ = lambda self, v: calls.append(1) or orig(self, v)
    try:
        on = model.layers[0].mm["qkv"](x)
        assert calls, "the packed kernel was not used"
        cpu_ops.set_enabled(False)
        calls.clear()
        off = model.layers[0].mm["qkv"](x)
        assert not calls
    finally:
        cpu_ops.PackedLinear.__call__ = orig
        cpu_ops.set_enabled(True)
    assert torch.equal(off, torch.nn.functional.linear(x, model.layers[0].qkv, model.layers[0].qkv_bias))
    torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)


def test_kv_write_matches_index_copy():
    """New K/V rows (views of a wider projection output, as the model passes them) land in their slots; an
    out-of-range slot raises and writes nothing."""
    torch.manual_seed(3)
    N, bs, Hkv, D, T = 6, 4, 3, 16, 5
    qkv = torch.randn(T, (3 + 2 * Hkv) * D)
    k = qkv[:, 3 * D: (3 + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (3 + Hkv) * D:].view(T, Hkv, D)
    slots = torch.tensor([0, 23, 7, 8, 12])
    kc, vc = torch.zeros(N, bs, Hkv, D), torch.zeros(N, bs, Hkv, D)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.view(-1, Hkv, D).index_copy_(0, slots, k)
    ref_v.view(-1, Hkv, D).index_copy_(0, slots, v)
    cpu_ops.kv_write(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    # rows whose heads are not laid out contiguously are copied first
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    cpu_ops.kv_write(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc2, vc2, slots)
    assert torch.equal(kc2, ref_k) and torch.equal(vc2, ref_v)
    with pytest.raises(IndexError, match="outside the KV pool"):
        cpu_ops.kv_write(k, v, kc, vc, torch.tensor([0, 1, 2, 3, N * bs]))
    assert torch.equal(kc, ref_k)


def _paged_case(B, Hkv, G, D, bs, lens, seed):
    g = torch.Generator().manual_seed(seed)
    nblk = [(L + bs - 1) // bs for L in lens]
    N = sum(nblk) + 3
    perm = torch.randperm(N, generator=g).tolist()
    tables = torch.zeros(B, max(nblk), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor(perm[i : i + n])
        i += n
    kc = torch.randn(N, bs, Hkv, D, generator=g)
    vc = torch.randn(N, bs, Hkv, D, generator=g)
    q = torch.randn(B, Hkv * G, D, generator=g)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("Hkv,G,D,bs", [(3, 3, 64, 16), (2, 1, 128, 8), (1, 4, 48, 4), (4, 2, 16, 16), (2, 2, 12, 4)])
def test_paged_decode_matches_reference(Hkv, G, D, bs):
    lens = [1, 17, bs, 150, 33]
    q, kc, vc, tables, seq_lens = _paged_case(len(lens), Hkv, G, D, bs, lens, D + G)
    ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.17)
    out = torch.empty_like(q)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out, 0.17)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # rows scattered in a larger stream, read through a row stride (a view of a wider tensor)
    wide = torch.randn(9, Hkv * G + 2, D)
    rows = torch.tensor([7, 0, 4, 2, 8])
    wide[rows, : Hkv * G] = q
    out2 = torch.zeros(9, Hkv * G, D)
    cpu_ops.paged_decode(wide[:, : Hkv * G], kc, vc, tables, seq_lens, out2, 0.17, rows=rows)
    torch.testing.assert_close(out2[rows], ref, atol=1e-5, rtol=1e-5)
    assert not out2[[1, 3, 5, 6]].any()
    # the shared-prefix work order computes the very same numbers
    out3 = torch.zeros(9, Hkv * G, D)
    cpu_ops.paged_decode(wide[:, : Hkv * G], kc, vc, tables, seq_lens, out3, 0.17, rows=rows, shared_prefix=True)
    assert torch.equal(out3, out2)


def test_paged_decode_suffix_with_lse():
    """Tokens from `start` on only, with the log-sum-exp that cascade attention merges by."""
    Hkv, G, D, bs, start = 3, 3, 64, 16, 32
    lens = [40, 33, 100, 32]
    q, kc, vc, tables, seq_lens = _paged_case(len(lens), Hkv, G, D, bs, lens, 5)
    out, lse = torch.empty_like(q), torch.empty(len(lens), Hkv * G)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out, 0.125, start=start, lse=lse)
    for b, L in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(start, L)], dtype=torch.long)
        k = kc.view(-1, Hkv, D)[slots].repeat_interleave(G, dim=1)  # [L', H, D]
        v = vc.view(-1, Hkv, D)[slots].repeat_interleave(G, dim=1)
        if len(slots) == 0:
            assert not out[b].any() and torch.isinf(lse[b]).all()
            continue
        s = torch.einsum("hd,lhd->hl", q[b], k) * 0.125
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b], torch.einsum("hl,lhd->hd", s.softmax(-1), v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Hkv,G,D,bs", [(3, 3, 64, 16), (1, 8, 128, 16), (2, 5, 96, 5), (2, 1, 32, 3),
                                        (1, 2, 160, 8)])
@pytest.mark.parametrize("start", [0, 7])
def test_bf16_paged_decode_matches_reference(Hkv, G, D, bs, start):
    """bfloat16 pools (on AVX-512 with BF16: the dpbf16 kernel) for every query-head group size (1 .. 8: whole and
    partial groups of four in the value product), head sizes with a 32-column tail, odd block sizes and lengths
    around the 16-token score groups, from token 0 or from an odd `start` with the log-sum-exp. Pool slots no
    sequence holds are NaN: a kernel that reads past a sequence's end (its padding rows) gives NaN."""
    lens = [1, 2, 15, 16, 17, 33, 150, 8]
    lens = [max(L, start) for L in lens]
    B = len(lens)
    q, kc, vc, tables, seq_lens = _paged_case(B, Hkv, G, D, bs, lens, D + G + bs)
    used = torch.zeros(kc.shape[0] * bs, dtype=torch.bool)
    for b, L in enumerate(lens):
        pos = torch.arange(L)
        used[tables[b][pos // bs].long() * bs + pos % bs] = True
    kc.view(-1, Hkv, D)[~used] = float("nan")
    vc.view(-1, Hkv, D)[~used] = float("nan")
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out, lse = torch.empty_like(q), torch.empty(B, Hkv * G)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out, 0.17, start=start, lse=lse)
    for b, L in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(start, L)], dtype=torch.long)
        if len(slots) == 0:
            assert not out[b].any() and torch.isinf(lse[b]).all()
            continue
        k = kc.view(-1, Hkv, D)[slots].float().repeat_interleave(G, dim=1)  # [L', H, D]
        v = vc.view(-1, Hkv, D)[slots].float().repeat_interleave(G, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].float(), k) * 0.17
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)
        ref = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
        torch.testing.assert_close(out[b].float(), ref, atol=1e-2, rtol=1e-2)
    # per-(sequence, KV head) work items compute the very same numbers
    out2 = torch.empty_like(q)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out2, 0.17, start=start, shared_prefix=True)
    assert torch.equal(out2, out)


@pytest.mark.parametrize("start", [0, 3])
def test_bf16_paged_decode_long_contexts_alone_or_batched(start):
    """Contexts past 512 keys (the dpbf16 kernel cuts them into parts run as separate work items, then merged): the
    reference's numbers with the log-sum-exp, and each row's result the same bits alone as in a batch, in either
    work order (a verify row and a plain decode row must agree)."""
    Hkv, G, D, bs = 3, 3, 64, 16
    lens = [1100, 513, 512, 40, 2049]
    q, kc, vc, tables, seq_lens = _paged_case(len(lens), Hkv, G, D, bs, lens, 11)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out, lse = torch.empty_like(q), torch.empty(len(lens), Hkv * G)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out, 0.125, start=start, lse=lse)
    for b, L in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(start, L)], dtype=torch.long)
        k = kc.view(-1, Hkv, D)[slots].float().repeat_interleave(G, dim=1)
        v = vc.view(-1, Hkv, D)[slots].float().repeat_interleave(G, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].float(), k) * 0.125
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[b].float(), torch.einsum("hl,lhd->hd", s.softmax(-1), v), atol=1e-2, rtol=1e-2)
        one, one_lse = torch.empty_like(q[:1]), torch.empty(1, Hkv * G)
        cpu_ops.paged_decode(q[b : b + 1], kc, vc, tables[b : b + 1], seq_lens[b : b + 1], one, 0.125, start=start,
                             lse=one_lse)
        assert torch.equal(one[0], out[b]) and torch.equal(one_lse[0], lse[b])
    out2 = torch.empty_like(q)
    cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out2, 0.125, start=start, shared_prefix=True)
    assert torch.equal(out2, out)


def test_flash_kernel_matches_reference_for_odd_shapes():
    """The flash kernel alone: head sizes 16-128, GQA and MHA, block sizes 4-16, chunks that end mid-block, rows in a
    shuffled order of a wider stream; the log-sum-exp it returns and a merge with a second part (key_start) agree."""
    if not cpu_ops.flash_supported(64):
        pytest.skip("the flash kernel needs AVX2 + FMA")
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


@pytest.mark.slow
def test_greedy_parity_with_kernels_off(stories_path):
    """The plain-torch fallback (as on a machine without a compiler) gives transformers' greedy tokens too."""
    tok = LLM(stories_path, dtype="float32").tokenizer
    ids = [tok(p).input_ids for p in ["Once upon a time", "Tom had a toy car", "The little dog ran to the park"]]
    ref = [hf_greedy(stories_path, p, 16) for p in ids]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu_ops.set_enabled(False)
    try:
        for kw in ({}, {"max_num_batched_tokens": 7}):
            llm = LLM(stories_path, dtype="float32", **kw)
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
            assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        cpu_ops.set_enabled(True)


@pytest.mark.slow
def test_no_compiler_falls_back_to_torch(stories_path, tmp_path):
    """Without a C++ compiler the kernels are unavailable (with a reason) and the engine still generates the
    same greedy tokens through plain torch."""
    code = (
        "import json, sys\n"
        "from flowrt.engine import LLM, SamplingParams; from flowrt.engine.cpu import ops as cpu_ops\n"
        "llm = LLM(sys.argv[1], dtype='float32')\n"
        "out = llm.generate('Once upon a time', SamplingParams(max_tokens=12, temperature=0))[0]\n"
        "print(json.dumps({'lib': cpu_ops.lib() is not None, 'error': cpu_ops._error,"
        " 'ids': out.outputs[0].token_ids}))\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "FLOWRT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code, str(stories_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["lib"] is False and "compiler" in got["error"]
    llm = LLM(stories_path, dtype="float32")
    want = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    assert got["ids"] == want


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 7}], ids=["batched", "chunked"])
def test_bf16_greedy_parity_with_kernels(stories_path, tmp_path, kw):
    """bfloat16 runs the kernels (decode, flash prefill over a cached prefix when chunked, KV write, norm, rotary,
    SiLU) and still gives transformers' bf16 greedy tokens (stories260K, and a tiny Llama with GQA)."""
    from support import make_tiny_model

    tiny = make_tiny_model(tmp_path / "llama", arch="llama")
    calls = []
    orig, orig_layers = cpu_ops.paged_decode, cpu_ops.StepGlue.decode_layers
    cpu_ops.paged_decode = lambda *a, **k: calls.append(a[1].dtype) or orig(*a, **k)
    # a pure decode step runs paged_decode inside the one-call layer loop
    cpu_ops.StepGlue.decode_layers = lambda self, *a: calls.append(a[1].dtype) or orig_layers(self, *a)
    try:
        for path, ids in [(stories_path, [[1, 403, 407, 261, 378], [1, 50, 300, 12, 99, 7]]),
                          (tiny, [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60)), [1, 250]])]:
            ref = [hf_greedy(path, p, 16, dtype=torch.bfloat16) for p in ids]
            llm = LLM(path, dtype="bfloat16", **kw)
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)]
            assert got == ref
    finally:
        cpu_ops.paged_decode, cpu_ops.StepGlue.decode_layers = orig, orig_layers
    assert calls and set(calls) == {torch.bfloat16}
