"""The typed interface of the one-call decode step (kernels/cpu/flowrt_cpu.h's structs): their ctypes mirrors are
generated from the header, a library whose layout differs from them is refused at load, and decode_layers refuses
arguments that are not those structs or a projection that does not fit the step."""

import ctypes
import re

import pytest
import torch

from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops

needs_kernels = pytest.mark.skipif(cpu_ops.lib() is None, reason=f"CPU kernels unavailable: {cpu_ops._error}")

HEADER = (cpu_build.SOURCE_DIR / cpu_build.HEADER).read_text()


def test_mirrors_follow_the_header():
    """Field names, order and types as declared (arrays of #define'd length, nested structs by value, struct pointers
    typed), and the functions that take a struct pointer are declared with its mirror."""
    s = cpu_build.structures()
    assert list(s) == ["FrWeightPart", "FrProjection", "FrLayer", "FrDecodeCall", "FrFlashCall", "FrDecodeProgram",
                       "FrDecodeStep"]
    assert [f for f, _ in s["FrWeightPart"]._fields_] == ["w", "bias", "ggml_type", "rows"]
    parts = dict(s["FrProjection"]._fields_)["parts"]
    assert parts._type_ is s["FrWeightPart"] and parts._length_ == cpu_build.constants()["FR_MAX_PARTS"] == 4
    assert dict(s["FrLayer"]._fields_)["qkv"] is s["FrProjection"]
    assert dict(s["FrDecodeStep"]._fields_)["layers"]._type_ is s["FrLayer"]
    assert cpu_build.structures()["FrLayer"] is s["FrLayer"]  # the same classes on every call
    assert cpu_build.declarations()["decode_layers_bf16"][1][0]._type_ is s["FrDecodeStep"]
    assert cpu_ops.FrLayer is s["FrLayer"]


@pytest.mark.parametrize("field", ["int a, b;", "int32_t x[N_UNDEFINED];", "double d;", "void v;"])
def test_unreadable_field_is_an_error(field):
    with pytest.raises(ValueError, match="struct Bad"):
        cpu_build.structures(f"struct Bad {{\n    {field}\n}};\n")


def test_generated_layout_source_names_every_field():
    src = cpu_build.layout_source()
    for name, cls in cpu_build.structures().items():
        assert f'"{name}"' in src and f"sizeof({name})" in src
        assert all(f"offsetof({name}, {f})" in src for f, _ in cls._fields_)


@needs_kernels
def test_library_layout_matches_the_mirrors():
    cpu_build.check_layouts(cpu_ops.lib())  # (load did too)
    assert cpu_build.library_layout(cpu_ops.lib(), "FrWeightPart") == (24, {"w": 0, "bias": 8, "ggml_type": 16,
                                                                            "rows": 20})
    assert cpu_build.library_layout(cpu_ops.lib(), "NoSuchStruct") is None


@pytest.mark.parametrize("edit,diff", [
    (("int32_t rows;       // its output features", "int64_t rows;"),
     "struct FrWeightPart: .*(size 32 here, 24 in the library; rows at 24 here, 20 in the library)"),
    (("    int32_t ggml_type;", "    int32_t rows_first;\n    int32_t ggml_type;"),
     r"struct FrWeightPart: .*\(size 32 here, 24 in the library; rows_first at 16 here, not in the library; "
     r"ggml_type at 20 here, 16 in the library; rows at 24 here, 20 in the library\)"),
    (("    int32_t n_calls;\n    FrFlashCall flash;", "    FrFlashCall flash;\n    int32_t n_calls;"),
     r"struct FrDecodeProgram: .*\(flash at 8 here, 16 in the library; n_calls at 64 here, 8 in the library\)"),
    (("    float scale;\n};", "};"), r"struct FrDecodeStep: .*\(size 112 here, 120 in the library; scale only in the "
                                    r"library\)"),
], ids=["widened", "added", "reordered", "dropped"])
@needs_kernels
def test_a_wrong_layout_is_refused(edit, diff):
    """Mirrors generated from a header that differs from the library's (a field widened, added, moved or dropped)
    are refused, naming the struct and the fields that differ."""
    old, new = edit
    assert old in HEADER
    wrong = cpu_build.structures(HEADER.replace(old, new))
    with pytest.raises(RuntimeError, match="the CPU kernel library's layout differs from its ctypes mirror") as err:
        cpu_build.check_layouts(cpu_ops.lib(), wrong)
    assert re.search(diff, str(err.value)) and str(err.value).endswith("refusing to load it")


@needs_kernels
def test_load_refuses_a_library_that_differs(monkeypatch):
    """load itself checks: with other mirrors (or one the library does not know) it raises instead of returning."""
    wrong = cpu_build.structures(HEADER.replace("    int64_t n_slots;", "    int32_t n_slots;"))
    monkeypatch.setattr(cpu_build, "structures", lambda text=None: wrong if text is None else cpu_build._structures(
        text))
    with pytest.raises(RuntimeError, match="struct FrDecodeStep: .*n_layers at 76 here, 80 in the library"):
        cpu_build.load(cpu_build.get_isa(cpu_ops.isa()))
    extra = cpu_build.structures("struct FrNew {\n    int32_t x;\n};\n")
    with pytest.raises(RuntimeError, match="does not know struct FrNew"):
        cpu_build.check_layouts(cpu_ops.lib(), extra)


def _glue(T=1, E=32, heads=2, kv=1, D=16, inter=24):
    h = torch.randn(T, E)
    cos = sin = torch.randn(16, D)
    return cpu_ops.StepGlue(h, torch.zeros(T, dtype=torch.int64), cos, sin, 1e-5, heads + kv, D, (heads + 2 * kv) * D,
                            inter, torch.zeros(T, dtype=torch.int64))


class _Program:
    def __init__(self, struct):
        self.struct = struct


@needs_kernels
def test_decode_layers_refuses_what_is_not_its_structs():
    glue = _glue()
    kc = vc = torch.zeros(4, 16, 1, 16)
    program = _Program(cpu_ops.FrDecodeProgram())
    with pytest.raises(ValueError, match="an array of FrLayer"):
        glue.decode_layers(torch.zeros(1, 13, dtype=torch.int64), kc, vc, program, 2, 0.25)
    with pytest.raises(ValueError, match="an array of FrLayer"):
        glue.decode_layers((cpu_ops.FrProjection * 1)(), kc, vc, program, 2, 0.25)
    with pytest.raises(ValueError, match="an FrDecodeProgram"):
        glue.decode_layers((cpu_ops.FrLayer * 1)(), kc, vc, _Program(cpu_ops.FrFlashCall()), 2, 0.25)
    with pytest.raises(ctypes.ArgumentError):  # the library's signature takes only an FrDecodeStep
        cpu_ops.lib().decode_layers_f32(cpu_ops.FrDecodeProgram())
    with pytest.raises(ValueError, match="1 to 4 FrWeightPart"):
        cpu_ops.projection([cpu_ops.FrWeightPart()] * 5, 32)


@needs_kernels
def test_decode_layers_refuses_a_projection_that_does_not_fit():
    """The C++ side checks each projection's input width and rows against the step (-4) before any product."""
    glue = _glue()
    E, inter, qkv_w, hd = 32, 24, 64, 32
    norm = torch.ones(E)
    kc = vc = torch.zeros(4, 16, 1, 16)

    def proj(rows, cols, n_parts=1):
        part = cpu_ops.FrWeightPart(w=1, ggml_type=0, rows=rows // n_parts)  # never read: the check comes first
        return cpu_ops.projection([part] * n_parts, cols)

    def layer(**kw):
        shapes = dict(qkv=proj(qkv_w, E), o=proj(E, hd), gate_up=proj(2 * inter, E), down=proj(E, inter))
        shapes.update(kw)
        return (cpu_ops.FrLayer * 1)(cpu_ops.FrLayer(input_norm=norm.data_ptr(), post_norm=norm.data_ptr(),
                                                     k_cache=kc.data_ptr(), v_cache=vc.data_ptr(), **shapes))

    program = _Program(cpu_ops.FrDecodeProgram())
    for bad in (dict(qkv=proj(qkv_w, E + 1)), dict(qkv=proj(qkv_w + 2, E, n_parts=2)), dict(qkv=proj(qkv_w - 2, E))):
        with pytest.raises(ValueError, match="-4 a projection that does not fit"):
            glue.decode_layers(layer(**bad), kc, vc, program, 2, 0.25)
