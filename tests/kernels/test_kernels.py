"""flowrt.kernels: every Triton kernel against its plain-torch twin on random data.

Without CUDA the kernels run through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before triton is imported when the test command did not); with CUDA they run natively on the GPU.

Tolerances (max abs and rel error vs the fp32 reference on the same low-precision inputs; outputs are
rounded to the input dtype and the kernels round softmax probabilities to it before the P@V product):
fp32 1e-4, fp16 3e-3, bf16 2e-2. KV writes and block copies are exact.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from flowrt import kernels as K  # noqa: E402
from flowrt.kernels import _dispatch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = [
    pytest.mark.skipif(not K.HAS_TRITON, reason=f"triton is not importable: {K.TRITON_IMPORT_ERROR}"),
    pytest.mark.skipif(
        K.HAS_TRITON and DEVICE.type == "cpu" and not _dispatch.can_interpret(),
        reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 was set (run with TRITON_INTERPRET=1)",
    ),
]

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_params(fast: torch.dtype) -> list:
    """DTYPES as parameters, all but ``fast`` marked slow (the interpreter takes seconds per launch; the other
    dtypes of each kernel run in the fast tier through other tests)."""
    return [pytest.param(dt, id=DT_ID[dt], marks=() if dt == fast else pytest.mark.slow) for dt in DTYPES]


def attention_shapes(*shapes: tuple):
    """Parametrizes an attention test over (gqa, hkv, d, bs, dtype) rows, each id its values (dtypes by name)."""
    return pytest.mark.parametrize("gqa,hkv,d,bs,dtype", shapes, ids=lambda v: DT_ID.get(v, str(v)))


def close(out, ref, dtype, what=""):
    tol = TOL[dtype]
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------------------------- setup
class Batch:
    """A random paged batch: seqs is a list of (query_len, context_len), context including the queries.

    Blocks are drawn at random from a pool ~8x larger than needed. Everything a kernel must never read
    is NaN: blocks no sequence owns, the slots past each context's end in its last block, and the
    padded block-table entries (which point at a NaN block), so any stray read poisons the output.
    """

    def __init__(self, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, pad_blocks=3):
        g = torch.Generator().manual_seed(seed)
        self.seqs = seqs
        self.block_size = block_size
        nblk = [-(-c // block_size) for _, c in seqs]
        need = sum(nblk)
        num_blocks = max(8 * need, 64) + 1
        perm = torch.randperm(num_blocks - 1, generator=g)[:need] + 1  # block 0 stays all-NaN
        width = max(nblk) + pad_blocks
        bt = torch.zeros(len(seqs), width, dtype=torch.int32)  # padding -> block 0 (NaN)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        kvals = torch.randn(shape, generator=g).to(dtype)
        vvals = torch.randn(shape, generator=g).to(dtype)
        i = 0
        for b, (_, ctx) in enumerate(seqs):
            blocks = perm[i : i + nblk[b]]
            i += nblk[b]
            bt[b, : nblk[b]] = blocks.to(torch.int32)
            for j, blk in enumerate(blocks.tolist()):
                n = min(block_size, ctx - j * block_size)
                self.k_cache[blk, :n] = kvals[blk, :n]
                self.v_cache[blk, :n] = vvals[blk, :n]
        qlens = [q for q, _ in seqs]
        self.query_start_loc = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
        self.seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
        self.block_tables = bt
        self.max_query_len = max(qlens)
        self.q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(dtype)
        self.scale = head_dim**-0.5
        for name in ("k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables", "q"):
            setattr(self, name, getattr(self, name).to(DEVICE))


# ----------------------------------------------------------------------------------------------- write_kv
WRITE_KV_SHAPES = [(1, 64, 16), (3, 80, 32), (8, 128, 16)]


@pytest.mark.parametrize("hkv,d,bs,dtype", [
    pytest.param(*shape, dt, id=f"{'-'.join(map(str, shape))}-{DT_ID[dt]}", marks=() if i == j else pytest.mark.slow)
    for i, shape in enumerate(WRITE_KV_SHAPES) for j, dt in enumerate(DTYPES)
])  # the fast tier: each shape once and each dtype once (the diagonal)
def test_write_kv(hkv, d, bs, dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, t = 40, 37
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype).to(DEVICE)
    # key/value are strided views of a fused qkv projection output, as in the model
    qkv = torch.randn(t, 4 + 2 * hkv, d, generator=g).to(dtype).to(DEVICE)
    key, value = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
    slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(DEVICE)
    slots[[0, 5, t - 1]] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    K.write_kv(key, value, kc, vc, slots)
    K.write_kv_ref(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_write_kv_converts_dtype_and_int32_slots():
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    key = torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 63, 40], dtype=torch.int32, device=DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    K.write_kv(key, key * 2, kc, vc, slots)
    K.write_kv_ref(key, key * 2, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc.view(-1, 2, 64)[17].float().abs().sum() > 0


# ----------------------------------------------------------------------------------------------- decode
# long context spanning many blocks and ending mid-block, short ones, exact block boundaries, length 1
DECODE_CTX = [1328, 18, 463, 512, 1, 33]


@attention_shapes((1, 4, 64, 16, torch.float32), (3, 2, 80, 16, torch.float16), (4, 2, 128, 32, torch.bfloat16),
                  (8, 2, 96, 16, torch.float16), (4, 1, 128, 16, torch.float32))
@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 5, None])
def test_paged_decode(gqa, hkv, d, bs, dtype, num_splits):
    bt = Batch([(1, c) for c in DECODE_CTX], gqa * hkv, hkv, d, bs, dtype, seed=gqa + d)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.seq_lens, bt.scale)
    out = K.paged_decode_attention(*args, num_splits=num_splits)
    ref = K.paged_decode_attention_ref(*args)
    close(out, ref, dtype, f"decode splits={num_splits}")


@pytest.mark.parametrize("dtype", dtype_params(fast=torch.bfloat16))
def test_paged_decode_dtypes_out_and_max_seq_len(dtype):
    bt = Batch([(1, c) for c in (700, 16, 95)], 8, 2, 64, 16, dtype, seed=3, pad_blocks=40)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.seq_lens, bt.scale)
    ref = K.paged_decode_attention_ref(*args)
    out = torch.full_like(bt.q, 7.0)
    res = K.paged_decode_attention(*args, out=out, num_splits=3, max_seq_len=700)
    assert res is out
    close(out, ref, dtype, "decode out=")


def test_paged_decode_zero_length_row_gives_zeros():
    bt = Batch([(1, 40), (1, 1), (1, 17)], 4, 2, 64, 16, torch.float32)
    seq_lens = bt.seq_lens.clone()
    seq_lens[1] = 0  # a padded row (e.g. CUDA-graph padding)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, seq_lens, bt.scale)
    for splits in (1, 2):
        out = K.paged_decode_attention(*args, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        close(out, K.paged_decode_attention_ref(*args), torch.float32, "decode zero row")


def test_choose_num_splits():
    assert K.choose_num_splits(256, 8, 32768, 132) == 1  # plenty of programs
    assert K.choose_num_splits(1, 8, 100, 132) == 1  # too short to split
    assert K.choose_num_splits(1, 8, 4096, 132) == 64  # one long sequence: fill the GPU (one tile per split)
    assert K.choose_num_splits(1, 3, 4096, 132) == 64  # few KV heads (SmolLM2): as many as whole tiles allow
    assert K.choose_num_splits(1, 3, 32768, 132) == 128  # capped by MAX_SPLITS (the merge holds them all)
    assert K.choose_num_splits(4, 8, 1024, 132) == 16  # capped by the one-tile minimum chunk
    assert K.choose_num_splits(1, 8, 32768, 1) == 1  # a CPU ("1 SM"): 8 programs are enough
    assert 1 < K.choose_num_splits(8, 8, 8192, 132) <= 10


@pytest.mark.parametrize("batch,hkv,ctx", [(1, 8, 4096), (1, 8, 32768), (1, 3, 4096), (1, 3, 32768), (1, 1, 300),
                                           (8, 8, 8192), (32, 8, 4096), (64, 3, 2048), (256, 8, 4096)])
def test_split_choice_fills_the_gpu_with_whole_tiles(batch, hkv, ctx):
    """H200: 132 SMs. Splits are whole 64-token tiles, cover the context exactly, stay under the merge's cap,
    and give batch 1 at long context at least 1x (2x from 8 KV heads or 32k tokens on) the SMs in programs."""
    from flowrt.kernels.decode_attention import DECODE_BLOCK_N, MAX_SPLITS, split_plan

    sms = 132
    s = K.choose_num_splits(batch, hkv, ctx, sms)
    n, tps = split_plan(ctx, s)
    assert n == s and 1 <= s <= MAX_SPLITS
    if s > 1:
        assert tps % DECODE_BLOCK_N == 0 and (s - 1) * tps < ctx <= s * tps
    programs = batch * hkv * s
    if batch == 1 and ctx >= 4096:
        assert programs >= (2 * sms if hkv >= 8 or ctx >= 32768 else sms), (s, programs)
    if batch * hkv >= 4 * sms:
        assert s == 1


@pytest.mark.slow
def test_paged_decode_many_splits_and_graph_bound():
    """The split counts the heuristic picks for an H200, on a ragged batch whose max_seq_len is a far larger
    bound (as CUDA graphs pass max_model_len): most splits are empty, the merge must ignore them."""
    from flowrt.kernels.decode_attention import MAX_SPLITS

    bt = Batch([(1, c) for c in (700, 1, 65, 128)], 4, 1, 64, 16, torch.float32, seed=11, pad_blocks=60)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.seq_lens, bt.scale)
    ref = K.paged_decode_attention_ref(*args)
    bound = bt.block_tables.shape[1] * 16
    for splits in (K.choose_num_splits(1, 1, bound, 132), MAX_SPLITS):
        assert splits > 16
        close(K.paged_decode_attention(*args, num_splits=splits, max_seq_len=bound), ref, torch.float32,
              f"decode splits={splits} max_seq_len={bound}")


# ----------------------------------------------------------------------------------------------- prefill
PREFILL_SEQS = [(1, 1328), (5, 18), (129, 463), (0, 20), (32, 32), (1, 1), (17, 64), (40, 103)]


@attention_shapes((1, 2, 64, 16, torch.float32), (3, 2, 80, 32, torch.float16), (4, 2, 128, 16, torch.bfloat16),
                  (8, 1, 96, 16, torch.float16))
@pytest.mark.slow
def test_paged_prefill_mixed_batch(gqa, hkv, d, bs, dtype):
    bt = Batch(PREFILL_SEQS, gqa * hkv, hkv, d, bs, dtype, seed=gqa * d)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.query_start_loc, bt.seq_lens, bt.scale,
            bt.max_query_len)
    out = K.paged_prefill_attention(*args)
    ref = K.paged_prefill_attention_ref(*args)
    close(out, ref, dtype, "prefill")


@pytest.mark.parametrize("dtype", dtype_params(fast=torch.bfloat16))
def test_paged_prefill_dtypes_and_padding_rows(dtype):
    seqs = [(3, 50), (24, 24), (1, 300)]
    bt = Batch(seqs, 8, 2, 64, 32, dtype, seed=5)
    q = torch.cat([bt.q, torch.randn(4, 8, 64).to(dtype).to(DEVICE)])  # 4 padding rows past query_start_loc[-1]
    out = torch.full_like(q, 3.0)
    args = (q, bt.k_cache, bt.v_cache, bt.block_tables, bt.query_start_loc, bt.seq_lens, bt.scale, 24)
    K.paged_prefill_attention(*args, out=out)
    ref = K.paged_prefill_attention_ref(*args)
    close(out[:-4], ref[:-4], dtype, "prefill")
    assert torch.equal(out[-4:], torch.full_like(out[-4:], 3.0)), "padding rows were written"


@pytest.mark.slow  # two interpreted launches over 12 heads (the fast tier runs each kernel in the tests above)
def test_prefill_of_decode_rows_matches_decode_kernel():
    """One launch can serve a mixed batch: q_len == 1 rows give what the decode kernel gives."""
    bt = Batch([(1, c) for c in (300, 16, 1, 77)], 12, 4, 80, 16, torch.float16, seed=9)
    dec = K.paged_decode_attention(bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.seq_lens, bt.scale)
    pre = K.paged_prefill_attention(bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.query_start_loc, bt.seq_lens,
                                    bt.scale, 1)
    close(pre, dec, torch.float16, "prefill vs decode")


def test_prefill_single_sequence_large_max_query_len_bound():
    """max_query_len is only an upper bound (it picks the tile), so an overestimate is still correct."""
    bt = Batch([(7, 7), (2, 90)], 4, 4, 64, 16, torch.float32, seed=2)
    args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.query_start_loc, bt.seq_lens, bt.scale)
    close(K.paged_prefill_attention(*args, 512), K.paged_prefill_attention_ref(*args, 512), torch.float32, "prefill")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_ID.get)
def test_chunked_prefill_through_cache_matches_sdpa(dtype):
    """The engine's use: write_kv each chunk's K/V, then prefill over cache; equals causal SDPA on
    contiguous tensors (an independent check of the reference semantics too)."""
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, bs, n = 8, 2, 64, 16, 300
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    num_blocks = 64
    perm = torch.randperm(num_blocks, generator=g)[: -(-n // bs)].to(torch.int32)
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    bt = perm[None].to(DEVICE)
    out = torch.empty(n, hq, d, dtype=dtype, device=DEVICE)
    chunks = [(0, 45), (45, 46), (46, 200), (200, 300)]  # includes a one-token chunk
    for s, e in chunks:
        pos = torch.arange(s, e)
        slots = (perm[pos // bs].long() * bs + pos % bs).to(DEVICE)
        K.write_kv(k[s:e].to(DEVICE), v[s:e].to(DEVICE), kc, vc, slots)
        qsl = torch.tensor([0, e - s], dtype=torch.int32, device=DEVICE)
        sl = torch.tensor([e], dtype=torch.int32, device=DEVICE)
        K.paged_prefill_attention(q[s:e].to(DEVICE), kc, vc, bt, qsl, sl, d**-0.5, e - s, out=out[s:e])
    qt, kt, vt = (x.float().transpose(0, 1) for x in (q, k, v))
    kt = kt.repeat_interleave(hq // hkv, 0)
    vt = vt.repeat_interleave(hq // hkv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=d**-0.5)
    close(out.cpu(), want.transpose(0, 1), dtype, "chunked prefill vs sdpa")


@pytest.mark.slow
def test_random_batches_property():
    """Random ragged batches (hypothesis): prefill and decode kernels equal the reference in fp32."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    seq = st.tuples(st.integers(0, 70), st.integers(0, 200))  # (new tokens, cached prefix)

    @hyp.settings(max_examples=6, deadline=None, derandomize=True, database=None)
    @hyp.given(st.lists(seq, min_size=1, max_size=5), st.sampled_from([1, 3, 4, 8]), st.sampled_from([64, 80]),
               st.sampled_from([16, 32]), st.integers(1, 4))
    def check(seqs, gqa, d, bs, splits):
        seqs = [(q, q + p) for q, p in seqs if q + p > 0] or [(1, 1)]
        bt = Batch(seqs, gqa, 1, d, bs, torch.float32, seed=len(seqs) + d)
        args = (bt.q, bt.k_cache, bt.v_cache, bt.block_tables, bt.query_start_loc, bt.seq_lens, bt.scale,
                bt.max_query_len)
        close(K.paged_prefill_attention(*args), K.paged_prefill_attention_ref(*args), torch.float32, f"{seqs}")
        qd = bt.q[: len(seqs)] if bt.q.shape[0] >= len(seqs) else torch.randn(len(seqs), gqa, d, device=DEVICE)
        dargs = (qd, bt.k_cache, bt.v_cache, bt.block_tables, bt.seq_lens, bt.scale)
        close(K.paged_decode_attention(*dargs, num_splits=splits), K.paged_decode_attention_ref(*dargs),
              torch.float32, f"decode {seqs}")

    check()


# ----------------------------------------------------------------------------------------------- block copies
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_copy_blocks(dtype):
    g = torch.Generator().manual_seed(4)
    shape = (50, 16, 3, 80)
    ks = [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    vs = [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    ks2, vs2 = [x.clone() for x in ks], [x.clone() for x in vs]
    src = torch.tensor([1, 5, 9, 2, 49], device=DEVICE)
    dst = torch.tensor([30, 31, 40, 0, 7], device=DEVICE)
    K.copy_blocks(ks, vs, src, dst)
    K.copy_blocks_ref(ks2, vs2, src, dst)
    for a, b in zip(ks + vs, ks2 + vs2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_copy_blocks_stacked(dtype):
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(3, 2, 40, 32, 2, 96, generator=g).to(dtype).to(DEVICE)  # [layers, k/v, blocks, bs, Hkv, D]
    kv2 = kv.clone()
    src = torch.tensor([3, 4, 39], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([10, 0, 20], dtype=torch.int32, device=DEVICE)
    K.copy_blocks_stacked(kv, src, dst)
    K.copy_blocks_stacked_ref(kv2, src, dst)
    assert torch.equal(kv, kv2)
    one = kv[0, 1].clone()  # a single pool works too
    K.copy_blocks_stacked(one, src, dst)


def test_bad_inputs_raise_clear_errors():
    kc = torch.zeros(4, 16, 2, 64, device=DEVICE)
    q = torch.zeros(2, 6, 64, device=DEVICE)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    sl = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        K.paged_decode_attention(torch.zeros(2, 5, 64, device=DEVICE), kc, kc, bt, sl, 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        K.paged_decode_attention(q.half(), kc, kc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="key/value"):
        K.write_kv(torch.zeros(3, 2, 32, device=DEVICE), torch.zeros(3, 2, 32, device=DEVICE), kc, kc,
                   torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        K.copy_blocks_stacked(torch.zeros(4, 16, 64, 2, device=DEVICE).transpose(-1, -2), [0], [1])


# ----------------------------------------------------------------------------------------------- GPU compile
def _nvidia_backend():
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="compiled for real by the other tests on this CUDA machine")
@pytest.mark.skipif(not (K.HAS_TRITON and _nvidia_backend()), reason="triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90():
    """Ahead-of-time compile for an H100/H200 (sm_90) without a GPU: catches what the interpreter accepts
    but the compiler rejects (tl.dot shapes, types, shared memory). A subprocess, because the compiler
    needs triton imported without TRITON_INTERPRET."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "flowrt.kernels.compile_check", "--arch", "90", "--quick"],
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
