"""The CPU kernel library per instruction-set variant (engine/cpu/build.py, kernels/cpu/): every variant the CPU runs
is built and checked against the torch references in float32 and bfloat16 (variants the CPU lacks skip, saying
so); each lower variant can be forced on a higher CPU; the header, the build's lock and cache key, the wrappers'
input checks, the thread count and the profiler labels."""

import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from support import ROOT
from cpu_variants import HAVE_CXX, SUPPORTED, cpu_variant
from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops
from flowrt.engine.model.models.llama import rms_norm, rotate_half
from flowrt.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

needs_kernels = pytest.mark.skipif(cpu_ops.lib() is None, reason=f"CPU kernels unavailable: {cpu_ops._error}")


_variant = cpu_variant  # the tests say `with _variant(name)`


def _paged(B, Hkv, G, D, bs, lens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nblk = [(L + bs - 1) // bs for L in lens]
    N = sum(nblk) + 2
    perm = torch.randperm(N, generator=g)
    tables = torch.zeros(B, max(nblk), dtype=torch.int32)
    at = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[at : at + n].int()
        at += n
    kc = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


def _check_kernels(dtype):
    """Every kernel of the loaded variant against its torch reference, in `dtype` (float32: to float rounding;
    bfloat16: the bf16 glue as transformers' bf16 ops round, attention to bf16 output rounding)."""
    bf16 = dtype == torch.bfloat16
    tol = dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    # residual + RMSNorm (an E that is not a multiple of the vector width)
    h, d, w = (torch.randn(5, 580).to(dtype), torch.randn(5, 580).to(dtype), torch.randn(580).to(dtype))
    ref_h = h + d
    out = cpu_ops.add_rmsnorm(h, d, w, 1e-5)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out, rms_norm(ref_h, w, 1e-5), **(dict(atol=1e-2, rtol=8e-3) if bf16 else tol))
    # rotary in place (extra columns untouched)
    x = torch.randn(7, 4 * 64 + 24).to(dtype)
    cos, sin = torch.randn(100, 64).to(dtype), torch.randn(100, 64).to(dtype)
    pos = torch.randint(0, 100, (7,))
    qk = x[:, : 4 * 64].view(7, 4, 64)
    ref = (qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)).view(7, -1)
    tail = x[:, 256:].clone()
    cpu_ops.rope_(x, 4, 64, cos, sin, pos)
    if bf16:
        assert torch.equal(x[:, :256], ref)  # the same roundings as the reference, in the same order
    else:
        torch.testing.assert_close(x[:, :256], ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(x[:, 256:], tail)
    # SiLU x up, with saturating exponents and a tail shorter than a vector
    gu = (torch.randn(3, 2 * 37) * 6).to(dtype)
    gu[0, 0], gu[-1, 36] = -200.0, 200.0
    ref = F.silu(gu[:, :37]) * gu[:, 37:]
    torch.testing.assert_close(cpu_ops.silu_mul(gu), ref, **(dict(atol=1e-2, rtol=8e-3) if bf16 else tol))
    # KV write
    kc, vc = torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)
    k, v = torch.randn(3, 2, 16).to(dtype), torch.randn(3, 2, 16).to(dtype)
    slots = torch.tensor([0, 9, 15])
    cpu_ops.kv_write(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 16)[slots], k) and torch.equal(vc.view(-1, 2, 16)[slots], v)
    # paged decode: a vectorized head size, a scalar one; shared-prefix order; suffix with its log-sum-exp
    for Hkv, G, D, bs in [(3, 3, 64, 16), (2, 2, 96, 8), (2, 2, 12, 4)]:  # 64: fixed-size code; 96: any 32k; 12: scalar
        lens = [1, 17, 150, 33]
        q, kc, vc, tables, seq_lens = _paged(4, Hkv, G, D, bs, lens, dtype, D)
        ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, seq_lens, 0.17)
        out = torch.empty_like(q)
        cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out, 0.17)
        torch.testing.assert_close(out.float(), ref, **tol)
        out2 = torch.empty_like(q)
        cpu_ops.paged_decode(q, kc, vc, tables, seq_lens, out2, 0.17, rows=torch.arange(4), shared_prefix=True)
        assert torch.equal(out2, out)
    # flash: prefill chunks and a shared prefix, per head size (64, and 48: not a multiple of 32)
    if cpu_ops.flash_supported(64):
        for Hkv, G, D, bs in [(2, 3, 64, 16), (2, 2, 48, 8)]:
            _check_flash_chunks(Hkv, G, D, bs, dtype, tol)
            _check_flash_cascade(Hkv, G, D, bs, dtype, tol)
    # projections (float32 only: bf16 projections stay with oneDNN)
    lin = cpu_ops.PackedLinear.create(torch.randn(40, 33))
    if lin is not None:
        wt = torch.randn(40, 33)
        lin = cpu_ops.PackedLinear.create(wt)
        xx = torch.randn(9, 33)
        torch.testing.assert_close(lin(xx), xx @ wt.T, atol=1e-4, rtol=1e-5)


def _poison_unused(kc, vc, tables, lens):
    """NaN in every pool slot no sequence holds (past each one's length, unused blocks): a kernel that reads a key or
    value it should not gives NaN."""
    bs = kc.shape[1]
    used = torch.zeros(kc.shape[0] * bs, dtype=torch.bool)
    for b, L in enumerate(lens):
        pos = torch.arange(L)
        used[tables[b][pos // bs].long() * bs + pos % bs] = True
    kc.view(-1, *kc.shape[2:])[~used] = float("nan")
    vc.view(-1, *vc.shape[2:])[~used] = float("nan")


def _check_flash_chunks(Hkv, G, D, bs, dtype, tol):
    """Prefill chunks (a fresh one, two over cached context; odd lengths ending mid-block) as three groups, their
    rows shuffled in a wider stream, with each row's log-sum-exp."""
    specs = [(0, 45), (260, 37), (131, 5)]  # (cached, new) per sequence
    lens = [c + n for c, n in specs]
    _, kc, vc, tables, _ = _paged(3, Hkv, G, D, bs, lens, dtype, D + 1)
    _poison_unused(kc, vc, tables, lens)
    R = sum(n for _, n in specs)
    qs = torch.randn(R + 3, Hkv * G, D).to(dtype)
    rows = torch.randperm(R + 3)[:R]
    ends = torch.tensor([e for c, n in specs for e in range(c + 1, c + n + 1)], dtype=torch.int32)
    starts = torch.tensor([0, 45, 82, 87], dtype=torch.int32)
    out, lse = torch.zeros_like(qs), torch.empty(R, Hkv * G)
    cpu_ops.paged_flash(qs, kc, vc, rows, ends, starts, tables, out, D**-0.5, lse_out=lse)
    for g, (c, n) in enumerate(specs):
        sl = rows[starts[g] : starts[g + 1]]
        ref = paged_prefill_attention_ref(qs[sl].float(), kc.float(), vc.float(), tables[g : g + 1],
                                          torch.tensor([0, n], dtype=torch.int32),
                                          torch.tensor([c + n], dtype=torch.int32), D**-0.5, n)
        torch.testing.assert_close(out[sl].float(), ref, **tol)
        # the log-sum-exp of the group's last row, directly
        pos = torch.arange(c + n)
        k = kc.view(-1, Hkv, D)[tables[g][pos // bs].long() * bs + pos % bs].float().repeat_interleave(G, dim=1)
        s = torch.einsum("hd,lhd->hl", qs[sl[-1]].float(), k) * D**-0.5
        torch.testing.assert_close(lse[starts[g + 1] - 1], torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)
    assert not out[[r for r in range(R + 3) if r not in set(rows.tolist())]].any()


def _check_flash_cascade(Hkv, G, D, bs, dtype, tol):
    """A shared prefix ending mid-block (its full blocks shared, the partial one copied per member, as forks hold it):
    each member's own keys first (key_start = prefix, lse_out), then the prefix for every member's rows at once as
    one group (lse_in), against each member's whole context."""
    P, own, new = 21, [1, 9, 30], [1, 4, 30]  # prefix; each member's own tokens, the last `new` of them queried
    lens = [P + o for o in own]
    _, kc, vc, tables, _ = _paged(3, Hkv, G, D, bs, lens, dtype, D + 2)
    full = P // bs
    for m in (1, 2):
        tables[m, :full] = tables[0, :full]
        kc[tables[m, full], : P % bs] = kc[tables[0, full], : P % bs]
        vc[tables[m, full], : P % bs] = vc[tables[0, full], : P % bs]
    _poison_unused(kc, vc, tables, lens)
    R = sum(new)
    qs = torch.randn(R + 2, Hkv * G, D).to(dtype)
    rows = torch.randperm(R + 2)[:R]
    ends = torch.tensor([e for L, n in zip(lens, new) for e in range(L - n + 1, L + 1)], dtype=torch.int32)
    own_start = torch.tensor([0, 1, 5, 35], dtype=torch.int32)
    out, lse = torch.zeros_like(qs), torch.empty(R, Hkv * G)
    cpu_ops.paged_flash(qs, kc, vc, rows, ends, own_start, tables, out, D**-0.5, key_start=P, lse_out=lse)
    cpu_ops.paged_flash(qs, kc, vc, rows, torch.full((R,), P, dtype=torch.int32),
                        torch.tensor([0, R], dtype=torch.int32), tables[:1], out, D**-0.5, lse_in=lse)
    for m, (L, n) in enumerate(zip(lens, new)):
        sl = rows[own_start[m] : own_start[m + 1]]
        ref = paged_prefill_attention_ref(qs[sl].float(), kc.float(), vc.float(), tables[m : m + 1],
                                          torch.tensor([0, n], dtype=torch.int32),
                                          torch.tensor([L], dtype=torch.int32), D**-0.5, n)
        torch.testing.assert_close(out[sl].float(), ref, **tol)


@pytest.mark.slow  # builds the variant's library on a first run (cached afterwards)
@pytest.mark.parametrize("name", cpu_build.ISA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_variant_matches_torch(name, dtype):
    with _variant(name) as lib:
        assert lib.flowrt_cpu_isa().decode() == name and cpu_ops.isa() == name
        _check_kernels(dtype)


@pytest.mark.parametrize("name", [pytest.param("avx2", marks=pytest.mark.slow), "avx512bf16"])  # slow: a build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_splits_few_items_for_the_threads(name, dtype):
    """Decode rows of 8 forks against their shared prefix are one tile per KV head (3 items); with 2 threads the flash
    kernel splits their rows into more tiles: the same bits as 1 thread (no split), and the reference's values."""
    n = torch.get_num_threads()
    q, kc, vc, tables, _ = _paged(1, 3, 3, 64, 16, [100], dtype, seed=11)
    rows = torch.arange(8)
    qs = torch.randn(8, 9, 64, generator=torch.Generator().manual_seed(12)).to(dtype)
    ends, starts = torch.full((8,), 100, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    outs = {}
    try:
        with _variant(name):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out, lse = torch.zeros_like(qs), torch.empty(8, 9)
                cpu_ops.paged_flash(qs, kc, vc, rows, ends, starts, tables, out, 0.125, lse_out=lse)
                outs[threads] = out, lse
    finally:
        torch.set_num_threads(n)
        cpu_ops.lib()
    assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][1], outs[2][1])
    k = kc[tables[0, :7].long()].reshape(-1, 3, 64)[:100].float().repeat_interleave(3, dim=1).transpose(0, 1)
    v = vc[tables[0, :7].long()].reshape(-1, 3, 64)[:100].float().repeat_interleave(3, dim=1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(qs.float().transpose(0, 1), k, v, scale=0.125).transpose(0, 1)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2][0].float(), ref, **tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", cpu_build.ISA_NAMES[:-1])
def test_lower_variant_forced_by_env(name):
    """FLOWRT_CPU_ISA loads a lower variant than the CPU's best (the code paths a lesser CPU runs), in a fresh
    process, as a deployment would set it."""
    if name not in SUPPORTED or not HAVE_CXX:
        pytest.skip("needs a C++ compiler and a CPU that runs the variant")
    code = ("from flowrt.engine.cpu import ops as cpu_ops; lib = cpu_ops.lib(); print(cpu_ops.isa(), "
            "lib.flowrt_cpu_isa().decode())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, cpu_build.ENV_ISA: name})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [name, name]


def test_isa_choice(monkeypatch):
    """The highest variant the CPU runs by default; an unknown name, or one the CPU lacks, is a clear error."""
    monkeypatch.delenv(cpu_build.ENV_ISA, raising=False)
    flags = frozenset({"avx2", "fma", "f16c", "sse2"})
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    assert cpu_build.choose().name == "avx2"
    assert cpu_build.choose("generic").name == "generic"
    with pytest.raises(ValueError, match="lacks avx512f"):
        cpu_build.choose("avx512")
    monkeypatch.setenv(cpu_build.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="unknown CPU instruction set 'sse9'"):
        cpu_build.choose()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset())
    monkeypatch.delenv(cpu_build.ENV_ISA)
    assert cpu_build.choose().name == "generic"


def test_header_declarations():
    """The ctypes signatures come from the header; a type the loader cannot map is an error, not a guess."""
    decl = cpu_build.declarations()
    assert decl["paged_decode_bf16"][0] is not None and len(decl["paged_decode_bf16"][1]) == 19
    assert decl["rope_f32"][0] is None and decl["flowrt_cpu_isa"][0].__name__ == "c_char_p"
    with pytest.raises(ValueError, match="no ctypes mapping for C type 'double x'"):
        cpu_build.declarations('extern "C" {\nint f(double x);\n}')
    # every function a .cpp file exports (defined in an extern "C" block) is declared in the header
    for src in cpu_build.SOURCE_DIR.glob("*.cpp"):
        text = src.read_text()
        if 'extern "C" {' not in text:
            continue
        body = text[text.index('extern "C" {'):]
        defined = re.findall(r"^(?:int|void|const char\*) (\w+)\(", body, flags=re.M)
        assert defined and set(defined) <= set(decl), (src.name, set(defined) - set(decl))


def test_sources_are_package_data():
    """An installed (non-editable) package carries every kernel source: pyproject's package-data globs cover them."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = cfg["package-data"]["flowrt.kernels"]
    assert cfg["package-dir"]["flowrt.kernels"] == "kernels"
    for p in cpu_build.SOURCE_DIR.iterdir():
        assert any(fnmatch.fnmatch(f"cpu/{p.name}", g) for g in globs), p.name


def test_cache_key_has_compiler_version(monkeypatch):
    isa = cpu_build.get_isa("avx2")
    monkeypatch.setattr(cpu_build, "compiler_version", lambda cxx: "g++ 12.2")
    a = cpu_build._key(isa, "g++")
    monkeypatch.setattr(cpu_build, "compiler_version", lambda cxx: "g++ 13.1")
    assert cpu_build._key(isa, "g++") != a


@pytest.mark.slow  # one build of the generic variant
@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler here")
def test_concurrent_processes_build_once(tmp_path):
    """Three processes starting together on an empty cache: the file lock lets one compile, the others load it."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "cxx"
    real = shutil.which(os.environ.get("CXX") or "g++")
    cxx.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo "$*" >> {log} ;; esac\nexec {real} "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "FLOWRT_CACHE_DIR": str(tmp_path / "cache")}
    code = "from flowrt.engine.cpu import build as cpu_build; print(cpu_build.build(cpu_build.get_isa('generic')))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-500:] for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    n_cpp = len(list(cpu_build.SOURCE_DIR.glob("*.cpp")))
    # each source compiled once (and the struct layout file generated from the header), one link
    assert len(log.read_text().splitlines()) == n_cpp + 2


@needs_kernels
def test_wrappers_reject_bad_tensors():
    q = torch.randn(2, 4, 16)
    kc = torch.zeros(3, 4, 2, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_decode: q must be a 3-d CPU torch.float32"):
        cpu_ops.paged_decode(q.bfloat16(), kc, kc, tables, lens, torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        cpu_ops.paged_decode(q, kc.transpose(0, 1), kc, tables, lens, torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="block_tables must be a 2-d CPU torch.int32"):
        cpu_ops.paged_decode(q, kc, kc, tables.long(), lens, torch.empty_like(q), 1.0)
    with pytest.raises(ValueError, match="do not fit together"):
        cpu_ops.paged_decode(torch.randn(2, 4, 8), kc, kc, tables, lens, torch.empty(2, 4, 8), 1.0)
    with pytest.raises(ValueError, match="dtype torch.float16 not supported"):
        cpu_ops.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(ValueError, match="weight of 7 for rows of 8"):
        cpu_ops.add_rmsnorm(torch.randn(2, 8), None, torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="h must be contiguous"):
        cpu_ops.add_rmsnorm(torch.randn(8, 2).T, None, torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="do not fit together"):
        cpu_ops.kv_write(torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc, torch.arange(2))
    with pytest.raises(ValueError, match="rope: x"):
        cpu_ops.rope_(torch.randn(3, 16), 2, 16, torch.randn(4, 16), torch.randn(4, 16), torch.arange(3))
    lin = cpu_ops.PackedLinear.create(torch.randn(16, 8))
    if lin is not None:
        with pytest.raises(ValueError, match=r"PackedLinear: x must be a float32 \[M, 8\]"):
            lin(torch.randn(2, 9))


@needs_kernels
def test_thread_count_follows_torch():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_ops.lib().flowrt_get_num_threads() == 1
        torch.set_num_threads(2)
        assert cpu_ops.lib().flowrt_get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
        cpu_ops.lib()


@needs_kernels
def test_kernels_show_in_profiler():
    h, w = torch.randn(4, 64), torch.randn(64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cpu_ops.add_rmsnorm(h, None, w, 1e-5)
        cpu_ops.silu_mul(torch.randn(4, 32))
    names = {e.name for e in prof.events()}
    assert {"flowrt::add_rmsnorm", "flowrt::silu_mul"} <= names
