"""The quantized-weight CPU kernels (kernels/cpu/quant_*.cpp through engine/quant/kernels.py) per instruction-set
variant the CPU runs: every native GGUF block type against reference.linear on random blocks (float32 and bfloat16
activations, with and without bias, the decode and prefill regimes), bit-equal across thread counts and batch sizes,
activation quantization bit-equal to the reference, dequantize / rows() bit-equal to gguf.quants.dequantize."""


import gguf
import numpy as np
import pytest
import torch

from cpu_variants import cpu_variant
from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops
from flowrt.engine.quant import (NATIVE_TYPES, ConcatLinear, QuantLinear, QuantType, block_shape, concat, dequant,
                                 kernels, reference)

TYPES = sorted(NATIVE_TYPES, key=int)
# byte offsets of each block's float16 fields (scales, minimums)
HALF_FIELDS = {QuantType.Q8_0: [0], QuantType.Q4_0: [0], QuantType.Q4_1: [0, 2], QuantType.Q5_0: [0],
               QuantType.Q5_1: [0, 2], QuantType.IQ4_NL: [0], QuantType.Q2_K: [80, 82], QuantType.Q3_K: [108],
               QuantType.Q4_K: [0, 2], QuantType.Q5_K: [0, 2], QuantType.Q6_K: [208]}
N = 37  # odd: not a multiple of any tile (2 or 4 columns, chunks and panels of 16)
# the scalar variant is the slow one (and the fallback of CPUs without AVX2): in the CI suite, not the fast tier
VARIANTS = [pytest.param(n, marks=pytest.mark.slow) if n == "generic" else n for n in cpu_build.ISA_NAMES]


_variant = cpu_variant  # the tests say `with _variant(name)`


def _k(qtype: QuantType) -> int:
    """Several blocks: two super-blocks of the K-quants, five blocks of the others."""
    return 512 if block_shape(qtype)[0] == 256 else 160


def _blocks(qtype: QuantType, n: int, k: int, seed: int) -> torch.Tensor:
    """Random rows of blocks: random bytes, the float16 fields replaced by small finite values."""
    g = torch.Generator().manual_seed(seed)
    per, nbytes = block_shape(qtype)
    data = torch.randint(0, 256, (n * (k // per), nbytes), dtype=torch.uint8, generator=g)
    for off in HALF_FIELDS[qtype]:
        v = (torch.rand(data.shape[0], generator=g) * 0.04 - 0.02).half()
        data[:, off:off + 2] = v.view(torch.uint8).view(-1, 2)
    return data.reshape(n, -1)


def _gguf(data: torch.Tensor, qtype: QuantType, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)


def _reference(x, data, qtype, n, k, bias):
    """reference.linear and the error each element may have: float32 summation (bf16 output: plus its rounding)."""
    ref = reference.linear(x, data, qtype, n, k, bias)
    xq = reference.dequantize_activations(*reference.quantize_activations(x)).double()
    bound = xq.abs() @ _gguf(data, qtype, n, k).double().abs().T * 1e-5 + 1e-6
    if x.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    return ref, bound


def _reference_bf16_weights(x, data, qtype, n, k, bias):
    """What the dequantized bfloat16 path computes (the file's values rounded to bfloat16, times x itself), which
    bfloat16 inputs of float_rows() rows and more run where kernels.bf16_rows(): float32 summation and the output's
    rounding."""
    w = _gguf(data, qtype, n, k).bfloat16().double()
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    return ref, x.double().abs() @ w.abs().T * 1e-5 + 1e-6 + ref.abs() * 2.0**-8


def _expected(x, data, qtype, n, k, bias, M):
    """The reference the products of x[:M] are held to in the variant loaded now."""
    bf16_weights = x.dtype == torch.bfloat16 and M >= kernels.float_rows() and kernels.bf16_rows()
    ref, bound = (_reference_bf16_weights if bf16_weights else _reference)(x[:M], data, qtype, n, k, bias)
    return ref, bound


def _assert_within(y, ref, bound, what):
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g} over bound"


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_reference(name, qtype):
    """M rows 1, 3, 4, 17 (decode tiles and their tails) and 70 (prefill panels): each row against the reference
    (bfloat16 from float_rows() rows where bf16_rows(): against the dequantized bfloat16 path's product)."""
    k = _k(qtype)
    data = _blocks(qtype, N, k, seed=int(qtype))
    bias = torch.randn(N)
    with _variant(name):
        for b in (None, bias):
            lin = QuantLinear(qtype, data, N, k, b)
            assert lin.runs_kernels
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(70, k).to(dtype)
                for M in (1, 3, 4, 17, 70):
                    y = lin(x[:M])
                    assert y.dtype == dtype and y.shape == (M, N)
                    ref, bound = _expected(x, data, qtype, N, k, b, M)
                    _assert_within(y, ref, bound, f"{qtype.name} M={M} {dtype} bias={b is not None}")


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_K], ids=lambda t: t.name)
def test_wide_projection_in_groups(name, qtype):
    """A projection wide enough that each thread dequantizes several groups of panels (the AMX path: at most 256 KiB
    of bf16 per group) with a tail of rows: against the reference, bias included."""
    n, k = 1100, 512
    data = _blocks(qtype, n, k, seed=5)
    bias = torch.randn(n)
    with _variant(name):
        lin = QuantLinear(qtype, data, n, k, bias)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(45, k).to(dtype)
            ref, bound = _expected(x, data, qtype, n, k, bias, 45)
            _assert_within(lin(x), ref, bound, f"{qtype.name} {dtype}")


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_K], ids=lambda t: t.name)
def test_prefill_groups_on_amx(qtype):
    """From 256 rows the AMX path dequantizes 1 MiB groups of panels (below, 256 KiB): a projection with several of
    each per thread, 260 rows (a tail of 4) against the bfloat16-weight reference, and its first 45 rows bit-equal to
    the same rows run alone in the smaller groups (a group's size changes no output's summation)."""
    n, k = 2300, 512
    data = _blocks(qtype, n, k, seed=9)
    bias = torch.randn(n)
    with _variant("amx"):
        lin = QuantLinear(qtype, data, n, k, bias)
        x = torch.randn(260, k).bfloat16()
        y = lin(x)
        ref, bound = _reference_bf16_weights(x, data, qtype, n, k, bias)
        _assert_within(y, ref, bound, f"{qtype.name} 260 rows")
        assert torch.equal(y[:45], lin(x[:45]))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_threads_and_batches_give_the_same_bits(name, qtype):
    """1 thread vs 2 bit-equal; a row alone (decode) equals it inside a batch below the float rows (both integer
    regime), and inside a batch of float rows + 11 equals it inside one of 70 and 130 (all float regime)."""
    k = _k(qtype)
    lin = QuantLinear(qtype, _blocks(qtype, N, k, seed=7), N, k, torch.randn(N))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(130, k).to(dtype)
        n = torch.get_num_threads()
        out = {}
        try:
            with _variant(name):
                small, big = min(9, max(2, kernels.float_rows() - 1)), min(17, kernels.float_rows() + 11)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    out[threads] = {M: lin(x[:M]) for M in (1, small, big, 70, 130)}
                alone = torch.cat([lin(x[i:i + 1]) for i in range(small)])
        finally:
            torch.set_num_threads(n)
            cpu_ops.lib()
        for M in out[1]:
            assert torch.equal(out[1][M], out[2][M]), (dtype, M)
        assert torch.equal(alone, out[1][small]), dtype
        assert torch.equal(out[1][130][:70], out[1][70]), dtype
        assert torch.equal(out[1][70][:big], out[1][big]), dtype


@pytest.mark.parametrize("name", cpu_build.ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activation_quantization_is_the_reference(name, dtype):
    x = torch.randn(9, 96) * 3
    x[0, :32] = 0  # a zero block: d = 0, q = 0
    x[1, :32] = torch.arange(32) - 15.5  # halves (x * (1 / d) near .5)
    x = x.to(dtype)
    with _variant(name):
        q, d, sx = kernels.quantize_activations(x)
    rq, rd = reference.quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    halves = rq.view(9, 3, 2, 16).int().sum(-1).float() * rd.unsqueeze(-1)  # [row, block, half]
    assert torch.equal(sx, halves.transpose(1, 2))  # laid out [row, half, block]


@pytest.mark.parametrize("name", cpu_build.ISA_NAMES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_and_rows_are_gguf_bits(name, qtype):
    k = _k(qtype)
    data = _blocks(qtype, N, k, seed=11)
    ref = _gguf(data, qtype, N, k)
    ids = torch.tensor([5, 0, 36, 5])
    with _variant(name):
        lin = QuantLinear(qtype, data, N, k)
        assert torch.equal(lin.dequantize(), ref)
        assert torch.equal(dequant.dequantize(data, qtype, N, k, torch.bfloat16), ref.bfloat16())
        assert torch.equal(lin.rows(ids), ref[ids])
        assert torch.equal(lin.rows(ids.int(), torch.bfloat16), ref[ids].bfloat16())
        with pytest.raises(IndexError, match="outside the 37 rows"):
            lin.rows(torch.tensor([37]))


def test_torch_fallback_matches_the_kernels():
    """With the kernels turned off QuantLinear runs the plain-torch reference path, and rows / dequantize fall back
    to gguf's values."""
    qtype, k = QuantType.Q4_K, 512
    data = _blocks(qtype, N, k, seed=3)
    lin = QuantLinear(qtype, data, N, k, torch.randn(N))
    x = torch.randn(5, k)
    cpu_ops.set_enabled(False)
    try:
        assert not lin.runs_kernels
        y = lin(x)
        assert torch.equal(lin.rows(torch.tensor([1, 2])), _gguf(data, qtype, N, k)[1:3])
        assert torch.equal(lin.dequantize(), _gguf(data, qtype, N, k))
        with pytest.raises(IndexError):
            lin.rows(torch.tensor([-1]))
    finally:
        cpu_ops.set_enabled(True)
    _assert_within(y, *_reference(x, data, qtype, N, k, lin.bias), "torch path")


def test_float_types_dequantize():
    w = torch.randn(3, 8)
    assert torch.equal(dequant.dequantize(w.view(torch.uint8), QuantType.F32, 3, 8), w)
    assert torch.equal(dequant.dequantize(w.half().view(torch.uint8), QuantType.F16, 3, 8), w.half().float())


@pytest.mark.skipif(cpu_ops.lib() is None, reason="CPU kernels unavailable")
def test_mixed_formats_concat():
    """q/k/v of different formats: one call (x quantized once) gives each part's own bits in its slice, in both
    regimes (integer and float rows), with and without biases, float32 and bfloat16."""
    fr = kernels.float_rows()
    for biased in (False, True):
        parts = [QuantLinear(t, _blocks(t, n, 512, seed=n), n, 512, torch.randn(n) if biased and n != 9 else None)
                 for t, n in ((QuantType.Q4_K, 20), (QuantType.Q6_K, 9), (QuantType.Q4_K, 11))]
        fused = concat(parts)
        assert isinstance(fused, ConcatLinear) and fused.runs_kernels
        for dtype in (torch.float32, torch.bfloat16):
            for M in sorted({1, 3, max(1, fr - 1), fr, 40}):
                x = torch.randn(M, 512).to(dtype)
                y = fused(x)
                assert y.shape == (M, 40) and y.dtype == dtype
                assert torch.equal(y, torch.cat([p(x) for p in parts], dim=1)), (biased, dtype, M)
        assert torch.equal(concat([parts[0], parts[2]])(x), torch.cat([parts[0](x), parts[2](x)], dim=1))


@pytest.mark.skipif(cpu_ops.lib() is None, reason="CPU kernels unavailable")
def test_bad_inputs_are_named():
    lin = QuantLinear(QuantType.Q8_0, _blocks(QuantType.Q8_0, 4, 64, seed=1), 4, 64)
    with pytest.raises(ValueError, match=r"x must be a float32 or bfloat16 \[M, 64\]"):
        lin(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lin(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match="ids must be an integer tensor"):
        lin.rows(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256"):
        QuantLinear(QuantType.Q4_K, torch.zeros(4, 0, dtype=torch.uint8), 4, 64)
    with pytest.raises(ValueError, match="out must be"):
        kernels.gemm(torch.randn(2, 64), lin.data, lin.qtype, 4, 64, out=torch.empty(2, 5))
