"""The AVX512-BF16 projection kernel (kernels/cpu/gemm_bf16.cpp, cpu_ops.PackedLinearBF16) against torch, and the
bfloat16 model's dispatch to it: every step while the kernels are on, oneDNN
otherwise. Skipped, saying why, where the CPU lacks AVX512-BF16; lower variants report the kernel unavailable."""

import pytest
import torch
import torch.nn.functional as F

from flowrt.engine import LLM
from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.lib() is None, reason=f"CPU kernels unavailable: {cpu_ops._error}")


def _kernel_or_skip(w, b=None):
    lin = cpu_ops.PackedLinearBF16.create(w, b)
    if lin is None:
        pytest.skip(f"the loaded CPU kernels ({cpu_ops.isa()}) lack AVX512-BF16 (CPU has avx512_bf16: "
                    f"{'avx512_bf16' in cpu_build.cpu_flags()})")
    return lin


@pytest.mark.parametrize("N,K", [(960, 576), (100, 37), (33, 64), (70, 1), (7, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_for_every_row_count(N, K, with_bias):
    """Rows 1-70 (every row-tile and panel-group size, partial last tiles), a partial last panel of 32, odd K (the
    lone last k), a bias, strided rows: within one bf16 rounding of the exact product."""
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if with_bias else None
    lin = _kernel_or_skip(w, b)
    xs = torch.randn(70, K + 5, generator=g).bfloat16()[:, :K]  # rows with a stride larger than K
    exact = xs.double() @ w.double().T + (b.double() if with_bias else 0)
    for M in range(1, 71):
        y = lin(xs[70 - M:])  # a different first row for each M
        assert y.dtype == torch.bfloat16 and y.shape == (M, N) and y.is_contiguous()
        # one bf16 rounding (2^-8 relative, at most) plus float32 accumulation error
        torch.testing.assert_close(y.double(), exact[70 - M:], rtol=2**-8, atol=1e-5 * K, msg=f"M={M}")


@pytest.mark.parametrize("N,K", [(1100, 576), (200, 2048)])
def test_prefill_rows_in_groups_of_panels(N, K):
    """Prefill row counts (on AMX from 128 rows the panels go in groups, every 32-row block of x over a group: more
    than one group per thread here; 32- and 16-row blocks and a padded tail of M % 16 rows): within one bf16
    rounding of the exact product, a row's bits the same in a batch of 137 as of 300."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    lin = _kernel_or_skip(w, b)
    x = torch.randn(300, K, generator=g).bfloat16()
    exact = x.double() @ w.double().T + b.double()
    out = {M: lin(x[:M]) for M in (137, 300)}
    for M, y in out.items():
        torch.testing.assert_close(y.double(), exact[:M], rtol=2**-8, atol=1e-5 * K, msg=f"M={M}")
    assert torch.equal(out[300][:137], out[137])


def test_close_to_onednn_and_checks_input():
    w = (torch.randn(96, 160) * 0.05).bfloat16()
    lin = _kernel_or_skip(w)
    x = torch.randn(9, 160).bfloat16()
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=2**-7, atol=1e-3)
    for bad in (x.float(), x[:, :100], x[None]):
        with pytest.raises(ValueError, match="PackedLinearBF16"):
            lin(bad)


def test_lower_variants_report_it_unavailable():
    """The kernel is compiled only into the variants with AVX512-BF16 (avx512bf16, amx): the others say so and the
    model keeps oneDNN."""
    lower = [i.name for i in cpu_build.supported() if "avx512_bf16" not in i.cpu]
    with cpu_ops.use_isa(lower[-1]) as lib:
        assert lib.gemm_bf16_available() == 0
        assert cpu_ops.PackedLinearBF16.create(torch.zeros(32, 8, dtype=torch.bfloat16)) is None


def test_model_uses_it_at_every_row_count_with_one_copy(stories_path, bf16_kernel_cpu):
    """A bfloat16 model's projections run the kernel at every row count while the kernels are on, holding only its
    packed weights; turned off, oneDNN runs on the weights unpacked from the panels, with the same results. (The
    CPU is presented without AMX, where the dispatch keeps oneDNN: test_model_keeps_onednn_on_amx.)"""
    llm = LLM(stories_path, dtype="bfloat16")
    model = llm.engine.runner.model
    _kernel_or_skip(torch.zeros(32, 8, dtype=torch.bfloat16))
    assert not any(hasattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down"))
    calls = []
    orig = cpu_ops.PackedLinearBF16.__call__
    cpu_ops.PackedLinearBF16.__call__ = lambda self, v: calls.append(v.shape[0]) or orig(self, v)
    hidden = model.cfg.hidden_size
    try:
        for rows in (1, 7, 129, 2048):
            model.layers[0].mm["qkv"](torch.randn(rows, hidden).bfloat16())
            model.mm["lm_head"](torch.randn(rows, hidden).bfloat16())
        assert calls == [1, 1, 7, 7, 129, 129, 2048, 2048]
        calls.clear()
        x = torch.randn(33, model.cfg.intermediate_size).bfloat16()
        on = model.layers[0].mm["down"](x)
        assert calls == [33]
        cpu_ops.set_enabled(False)
        off = model.layers[0].mm["down"](x)
        assert calls == [33]
        torch.testing.assert_close(on, off, rtol=2**-7, atol=1e-2)
    finally:
        cpu_ops.PackedLinearBF16.__call__ = orig
        cpu_ops.set_enabled(True)


def test_unpacked_weight_is_the_original():
    w = torch.randn(100, 37).bfloat16()
    k = _kernel_or_skip(w)
    assert torch.equal(k.weight(), w)


def test_model_keeps_onednn_on_amx(stories_path, monkeypatch):
    """On a CPU with AMX (where oneDNN runs bf16 on AMX tiles; the kernel was not measured against that) the
    projections stay on oneDNN."""
    _kernel_or_skip(torch.zeros(32, 8, dtype=torch.bfloat16))
    flags = cpu_build.cpu_flags() | {"amx_bf16"}
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    model = LLM(stories_path, dtype="bfloat16").engine.runner.model
    calls = []
    orig = cpu_ops.PackedLinearBF16.__call__
    monkeypatch.setattr(cpu_ops.PackedLinearBF16, "__call__", lambda self, v: calls.append(1) or orig(self, v))
    model.layers[0].mm["qkv"](torch.randn(2, model.cfg.hidden_size).bfloat16())
    model.mm["lm_head"](torch.randn(2, model.cfg.hidden_size).bfloat16())
    assert not calls
