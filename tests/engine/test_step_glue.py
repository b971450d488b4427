"""The model's glued forward (cpu_ops.StepGlue: the glue kernels bound once per step, buffers reused across layers)
computes LlamaLayer.forward's arithmetic bit for bit, and StepGlue rejects tensors that do not fit the step."""

import pytest
import torch

from cpu_variants import cpu_variant
from support import make_tiny_model
from flowrt.engine import LLM, SamplingParams
from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops
from flowrt.engine.model.models.llama import _Rope

pytestmark = pytest.mark.skipif(cpu_ops.lib() is None, reason=f"CPU kernels unavailable: {cpu_ops._error}")


def _steps(llm, prompts):
    """The inputs of every step that generating from `prompts` runs (a prefill step, then decode steps)."""
    runner = llm.engine.runner
    steps, orig = [], runner.prepare
    runner.prepare = lambda *a, **k: steps.append(orig(*a, **k)) or steps[-1]
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        runner.prepare = orig
    return steps


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "bfloat16")],
                         ids=["fp32", "bf16", "fp32-kv-bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a qkv bias
def test_glued_forward_matches_layer_by_layer(tmp_path, dtype, kv, arch, bf16_kernel_cpu):
    """Bit-equal hidden states, prefill and decode; the KV write fused with rotary where the pool has the model's
    dtype, the backend's write where it does not."""
    llm = LLM(make_tiny_model(tmp_path / arch, arch=arch), dtype=dtype, kv_cache_dtype=kv)
    runner = llm.engine.runner
    model = runner.model
    one_call = []
    orig = cpu_ops.StepGlue.decode_layers
    cpu_ops.StepGlue.decode_layers = lambda self, *a: one_call.append(a) or orig(self, *a)
    try:
        steps = _steps(llm, [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60))])
    finally:
        cpu_ops.StepGlue.decode_layers = orig
    # the decode steps ran as one call where the projections are flowrt's packed kernels (float32 with AVX2 + FMA,
    # bfloat16 with AVX512-BF16) and the pools have the model's dtype
    packed = cpu_ops.PackedLinear.create(torch.ones(1, 1)) if dtype == "float32" else \
        cpu_ops.PackedLinearBF16.create(torch.ones(1, 2, dtype=torch.bfloat16))
    assert bool(one_call) == (packed is not None and kv == "auto")
    for inp in steps:
        with torch.inference_mode():
            args = (runner.kv_caches, inp.meta, runner.backend)
            glued = model(inp.input_ids, inp.positions, *args)
            h = torch.nn.functional.embedding(inp.input_ids, model.embed)
            rope, delta = _Rope(model, inp.positions, True), None
            for layer, (kc, vc) in zip(model.layers, runner.kv_caches):
                h, delta = layer(h, delta, rope, kc, vc, inp.meta, runner.backend)
            assert torch.equal(glued, h + delta)


def test_step_glue_rejects_misfits():
    T, E, D = 3, 32, 8
    h = torch.randn(T, E)
    cos = sin = torch.randn(16, D)
    glue = cpu_ops.StepGlue(h, torch.arange(T), cos, sin, 1e-5, 6, D, 8 * D, 24)
    with pytest.raises(ValueError, match="glue: delta"):
        glue.add_rmsnorm(torch.randn(T, E + 1), torch.ones(E))
    with pytest.raises(ValueError, match="glue: qkv"):
        glue.rope_(torch.randn(T, 8 * D).T.contiguous().T)
    with pytest.raises(ValueError, match="glue: gate_up"):
        glue.silu_mul(torch.randn(T, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="glue: h"):
        cpu_ops.StepGlue(h.T, torch.arange(T), cos, sin, 1e-5, 6, D, 8 * D, 24)
    with pytest.raises(ValueError, match="do not fit together"):
        cpu_ops.StepGlue(h, torch.arange(T + 1), cos, sin, 1e-5, 6, D, 8 * D, 24)
    x = glue.add_rmsnorm(torch.randn(T, E), torch.ones(E))
    assert x is glue.x and x.shape == (T, E)
    assert glue.silu_mul(torch.randn(T, 48)) is glue.act


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_kv_write_is_rope_then_kv_write(dtype):
    T, H, Hkv, D = 5, 6, 2, 16
    torch.manual_seed(0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    cos, sin = torch.randn(40, D).to(dtype), torch.randn(40, D).to(dtype)
    pos, slots = torch.randint(0, 40, (T,)), torch.tensor([3, 17, 0, 30, 9])
    kc, vc = torch.zeros(4, 8, Hkv, D, dtype=dtype), torch.zeros(4, 8, Hkv, D, dtype=dtype)
    ref, rkc, rvc = qkv.clone(), kc.clone(), vc.clone()
    cpu_ops.rope_(ref, H + Hkv, D, cos, sin, pos)
    k, v = ref[:, H * D:].view(T, 2 * Hkv, D).split([Hkv, Hkv], dim=1)
    cpu_ops.kv_write(k, v, rkc, rvc, slots)
    glue = cpu_ops.StepGlue(torch.randn(T, 8).to(dtype), pos, cos, sin, 1e-5, H + Hkv, D, qkv.shape[1], 4, slots)
    glue.rope_kv_(qkv, kc, vc)
    assert torch.equal(qkv, ref) and torch.equal(kc, rkc) and torch.equal(vc, rvc)
    with pytest.raises(ValueError, match="KV pools"):
        glue.rope_kv_(qkv, kc, vc[:2])
    bad = cpu_ops.StepGlue(torch.randn(T, 8).to(dtype), pos, cos, sin, 1e-5, H + Hkv, D, qkv.shape[1], 4,
                           torch.tensor([0, 1, 2, 3, 32]))
    with pytest.raises(IndexError, match="outside the KV pool"):
        bad.rope_kv_(qkv.clone(), kc, vc)


def test_one_call_pointers_follow_the_projections(tmp_path):
    """The cached pointer table is rebuilt when a projection is replaced, and refused when one has no packed
    kernel (the step then runs per kernel)."""
    llm = LLM(make_tiny_model(tmp_path / "llama"), dtype="float32")
    runner = llm.engine.runner
    model = runner.model
    first = model._layer_table(runner.kv_caches, 1)
    if first is None:
        pytest.skip("no packed float32 kernel here (needs AVX2 + FMA)")
    assert model._layer_table(runner.kv_caches, 1) is first  # cached
    layer = model.layers[0]
    packed = layer.mm["o"]
    layer.mm["o"] = lambda x: packed(x)  # the same result, but not marked as the packed kernel
    assert model._layer_table(runner.kv_caches, 1) is None
    layer.mm["o"] = packed
    again = model._layer_table(runner.kv_caches, 1)
    assert again is not None and again is not first and bytes(again) == bytes(first)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("min_shared", [0, 10**9], ids=["prefixes-by-flash", "whole-contexts"])
def test_glued_cascade_decode_matches_layer_by_layer(tmp_path, monkeypatch, dtype, min_shared, bf16_kernel_cpu):
    """Decode steps of sequences sharing a cached prefix (the cascade: each member's own keys, then the shared prefix
    once for all by the flash kernel, or each member's whole context below the threshold) run in the one-call layer
    loop, with the same bits as the backend's per-layer forward."""
    from flowrt.engine.model import attention

    monkeypatch.setattr(attention, "FLASH_DECODE_MIN_SHARED", min_shared)
    llm = LLM(make_tiny_model(tmp_path / "llama", arch="llama"), dtype=dtype)
    runner = llm.engine.runner
    model = runner.model
    prefix = [1] + list(range(100, 140))  # two full blocks of 16 shared by every prompt
    steps = _steps(llm, [prefix + [7, 8, 9], prefix + [300, 301], prefix + list(range(200, 220))])
    cascade = [inp for inp in steps if inp.meta.prepared["cascade"] and inp.meta.prepared["all_decode"]]
    assert cascade  # the decode steps after the prefills share the prefix
    one_call = []
    orig = cpu_ops.StepGlue.decode_layers
    monkeypatch.setattr(cpu_ops.StepGlue, "decode_layers", lambda self, *a: one_call.append(a[3]) or orig(self, *a))
    for inp in cascade:
        with torch.inference_mode():
            glued = model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta, runner.backend)
            h = torch.nn.functional.embedding(inp.input_ids, model.embed)
            rope, delta = _Rope(model, inp.positions, True), None
            for layer, (kc, vc) in zip(model.layers, runner.kv_caches):
                h, delta = layer(h, delta, rope, kc, vc, inp.meta, runner.backend)
            assert torch.equal(glued, h + delta)
    packed = cpu_ops.PackedLinear.create(torch.ones(1, 1)) if dtype == "float32" else \
        cpu_ops.PackedLinearBF16.create(torch.ones(1, 2, dtype=torch.bfloat16))
    if packed is not None:
        assert len(one_call) == len(cascade)
        # flash over the prefixes: a flash call with groups; below the threshold: none
        assert all((p.struct.flash.n_groups > 0) == (min_shared == 0) for p in one_call)


FORMATS = {"qkv": "Q8_0", "o": "Q4_1", "gate_up": "Q5_0", "down": "Q4_0"}
# mixed: q/k/v and gate/up as parts of different formats (one ConcatLinear each), as Q4_K_M stores q/k/v
MIXED = {"qkv": ("Q8_0", "Q4_0", "Q5_1"), "gate_up": ("Q4_1", "Q8_0")}


def _weight_of(projection) -> torch.Tensor:
    """A packed projection's weight: flowrt's kernel's, or oneDNN's reordered copy (the bfloat16 projections where
    the variant has no bf16 kernel, e.g. the generic one on an AVX512-BF16 CPU) back in the plain layout."""
    kernel = getattr(projection, "kernel", None)
    return kernel.weight() if kernel is not None else projection.resident[0].to_dense()


def _quantize(model, mixed: bool) -> dict[str, list[int]]:
    """Every layer's projections kept quantized (engine.quant.QuantLinear), a different GGUF format per projection;
    mixed: qkv and gate_up of parts in different formats. Returns each projection's ggml types."""
    import gguf

    from flowrt.engine.quant import QuantLinear, QuantType, concat

    cfg = model.cfg
    splits = {"qkv": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
              "gate_up": [cfg.intermediate_size] * 2}
    for layer in model.layers:
        for name, fmt in FORMATS.items():
            w = getattr(layer, name, None)
            w = (w if w is not None else _weight_of(layer.mm[name])).float()
            bias = layer.qkv_bias if name == "qkv" else None
            formats = MIXED[name] if mixed and name in MIXED else (fmt,)
            ws = w.split(splits[name]) if len(formats) > 1 else [w]
            bs = [None] * len(ws) if bias is None else list(bias.split([x.shape[0] for x in ws]))
            parts = []
            for wp, bp, f in zip(ws, bs, formats):
                qtype = QuantType[f]
                data = gguf.quants.quantize(wp.numpy(), gguf.GGMLQuantizationType(int(qtype)))
                parts.append(QuantLinear(qtype, torch.from_numpy(data), *wp.shape, bp))
            layer.mm[name] = concat(parts)
    model._table_cache = None
    return {n: [int(QuantType[f]) for f in (MIXED[n] if mixed and n in MIXED else (f0,))] for n, f0 in FORMATS.items()}


def _glued_quantized_matches(tmp_path, dtype, arch, mixed):
    llm = LLM(make_tiny_model(tmp_path / arch, arch=arch), dtype=dtype)
    runner = llm.engine.runner
    model = runner.model
    types = _quantize(model, mixed)
    if not model.layers[0].mm["o"].runs_kernels:
        pytest.skip("the quantized kernels are unavailable")
    one_call = []
    orig = cpu_ops.StepGlue.decode_layers
    cpu_ops.StepGlue.decode_layers = lambda self, *a: one_call.append(a) or orig(self, *a)
    try:
        steps = _steps(llm, [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60))])
    finally:
        cpu_ops.StepGlue.decode_layers = orig
    assert one_call  # the decode steps ran as one call
    table = model._layer_table(runner.kv_caches, 1)
    assert [[[getattr(layer, n).parts[i].ggml_type for i in range(getattr(layer, n).n_parts)] for n in FORMATS]
            for layer in table] == [list(types.values())] * len(model.layers)
    for inp in steps:
        with torch.inference_mode():
            args = (runner.kv_caches, inp.meta, runner.backend)
            glued = model(inp.input_ids, inp.positions, *args)
            h = torch.nn.functional.embedding(inp.input_ids, model.embed)
            rope, delta = _Rope(model, inp.positions, True), None
            for layer, (kc, vc) in zip(model.layers, runner.kv_caches):
                h, delta = layer(h, delta, rope, kc, vc, inp.meta, runner.backend)
            assert torch.equal(glued, h + delta)


@pytest.mark.parametrize("mixed", [False, True], ids=["one-format", "mixed-parts"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a qkv bias
def test_glued_quantized_decode_matches_layer_by_layer(tmp_path, dtype, arch, mixed):
    """Projections kept quantized (engine.quant.QuantLinear, a different GGUF format per projection; mixed: qkv and
    gate_up of parts in different formats, a ConcatLinear) run inside the one-call decode step, with the bits of the
    per-layer forward that calls each QuantLinear."""
    _glued_quantized_matches(tmp_path, dtype, arch, mixed)


@pytest.mark.slow  # a build per variant on a first run, and a model per variant
@pytest.mark.parametrize("name", cpu_build.ISA_NAMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_glued_decode_every_variant(tmp_path, name, dtype, bf16_kernel_cpu):
    """The one-call decode step (float projections where the variant packs them, and quantized ones of mixed parts
    in every variant) has the per-layer forward's bits in each instruction-set variant the CPU runs."""
    with cpu_variant(name):
        test_glued_forward_matches_layer_by_layer(tmp_path / "float", dtype, "auto", "qwen2", bf16_kernel_cpu)
        _glued_quantized_matches(tmp_path / "quant", dtype, "qwen2", mixed=True)
