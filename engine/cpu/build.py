"""Builds and loads the CPU kernel library from its sources in kernels/cpu/ (shipped as package data).

One library per instruction-set variant (ISAS: generic, AVX2 + FMA, AVX-512, AVX-512 + BF16, AMX), each compiled with
that variant's flags (and -mtune=native), so one set of sources serves every x86 CPU and a run can be forced onto a
lower variant (FLOWRT_CPU_ISA=avx2) to test or compare it. The library is compiled lazily with the system's C++
compiler ($CXX or g++), the translation units in parallel, and cached under ~/.cache/flowrt/cpu_ops/ keyed by the
sources, the variant's flags, the compiler's version and the CPU's flags; an exclusive file lock around the build
means N processes starting on one host (Ray replicas) compile once and the others load the result. The ctypes
signatures come from the one header that declares every exported function (flowrt_cpu.h), so Python and C++ cannot
disagree on an argument list: a function missing from the library, or a type the loader cannot map, is an error. The
structs some functions take are declared there too: their ctypes mirrors are generated from those declarations, and
each build compiles in a function generated from them that reports the compiler's size and field offsets of each
(flowrt_struct_layout); loading compares the two and refuses a library whose layout differs from its mirror's.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

SOURCE_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cpu"
HEADER = "flowrt_cpu.h"
ENV_ISA = "FLOWRT_CPU_ISA"

COMMON_FLAGS = ("-O3", "-mtune=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
                "-fPIC", "-std=c++17")


@dataclass(frozen=True)
class Isa:
    """An instruction-set variant: the compiler flags it is built with and the /proc/cpuinfo flags it needs."""

    name: str
    flags: tuple[str, ...]
    cpu: tuple[str, ...]


_AVX2 = Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
_AVX512 = Isa("avx512", _AVX2.flags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
              _AVX2.cpu + ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
# every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids on, Zen4 on) also has AVX512-VNNI
_AVX512BF16 = Isa("avx512bf16", _AVX512.flags + ("-mavx512bf16", "-mavx512vnni"),
                  _AVX512.cpu + ("avx512_bf16", "avx512_vnni"))
#: lowest first; the default is the highest the CPU runs
ISAS: tuple[Isa, ...] = (
    Isa("generic", (), ()),
    _AVX2,
    _AVX512,
    _AVX512BF16,
    # Sapphire Rapids and later Xeons: bfloat16 products on the AMX tiles (gemm_amx.h) from a few rows
    Isa("amx", _AVX512BF16.flags + ("-mamx-tile", "-mamx-bf16"), _AVX512BF16.cpu + ("amx_tile", "amx_bf16")),
)
ISA_NAMES = tuple(i.name for i in ISAS)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is unreadable: then only the generic variant runs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported() -> list[Isa]:
    """The variants this CPU runs, lowest first."""
    have = cpu_flags()
    return [i for i in ISAS if all(f in have for f in i.cpu)]


def get_isa(name: str) -> Isa:
    try:
        return ISAS[ISA_NAMES.index(name)]
    except ValueError:
        raise ValueError(f"unknown CPU instruction set {name!r} (choose one of {', '.join(ISA_NAMES)})") from None


def choose(requested: str | None = None) -> Isa:
    """The variant to load: `requested` (default: $FLOWRT_CPU_ISA), else the highest this CPU runs. Raises
    ValueError for an unknown name or one the CPU lacks (its code would die on an illegal instruction)."""
    requested = requested or os.environ.get(ENV_ISA) or None
    if requested is None:
        return supported()[-1]
    isa = get_isa(requested)
    missing = [f for f in isa.cpu if f not in cpu_flags()]
    if missing:
        raise ValueError(f"{ENV_ISA}={requested}: this CPU lacks {', '.join(missing)}")
    return isa


def cache_dir() -> Path:
    base = os.environ.get("FLOWRT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flowrt")
    return Path(base) / "cpu_ops"


@functools.cache
def compiler_version(cxx: str) -> str:
    proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return (proc.stdout or proc.stderr).strip().splitlines()[0] if proc.returncode == 0 else f"{cxx} (no --version)"


def sources() -> list[Path]:
    files = sorted(p for p in SOURCE_DIR.glob("*") if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in files):
        raise RuntimeError(f"no CPU kernel sources in {SOURCE_DIR}")
    return files


def _key(isa: Isa, cxx: str) -> str:
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(layout_source().encode() + b"\0")
    h.update("\0".join([cxx, compiler_version(cxx), *COMMON_FLAGS, *isa.flags, " ".join(sorted(cpu_flags()))])
             .encode())
    return h.hexdigest()[:16]


def build(isa: Isa, force: bool = False) -> Path:
    """Compiles the variant's library (or finds it cached) and returns its path. Raises RuntimeError on failure."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
    out = cache_dir() / f"flowrt_cpu_{isa.name}_{_key(isa, cxx)}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{isa.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if out.exists() and not force:
            return out  # another process built it while this one waited
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            flags = [*COMMON_FLAGS, *isa.flags, "-I", str(SOURCE_DIR)]
            layout = Path(tmp) / LAYOUT_SOURCE
            layout.write_text(layout_source())
            cpps = [p for p in sources() if p.suffix == ".cpp"] + [layout]
            objs = [Path(tmp) / (p.stem + ".o") for p in cpps]
            procs = [subprocess.Popen([cxx, *flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for src, obj in zip(cpps, objs)]
            errors = []
            for src, proc in zip(cpps, procs):
                _, err = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    errors.append(f"{src.name}:\n{err[-2000:]}")
            if errors:
                raise RuntimeError(f"compiling the CPU kernels ({isa.name}) failed:\n" + "\n".join(errors))
            so = Path(tmp) / out.name
            link = subprocess.run([cxx, *flags, "-shared", *map(str, objs), "-o", str(so)], capture_output=True,
                                  text=True, timeout=300)
            if link.returncode != 0:
                raise RuntimeError(f"linking the CPU kernels ({isa.name}) failed:\n{link.stderr[-2000:]}")
            os.replace(so, out)
    return out


_CTYPES = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
           "float": ctypes.c_float}


def _ctype(decl: str, structs: Mapping[str, type[ctypes.Structure]]):
    """The ctypes type of one C type (a parameter or field with or without its name, or a return type): a pointer
    to a struct of the header is a POINTER to its mirror (ctypes then refuses any other argument), any other pointer
    a void pointer."""
    decl = decl.replace("const ", "").strip()
    if "*" in decl:
        base = decl.split("*")[0].strip()
        if decl.count("*") > 1:
            return ctypes.c_void_p
        if base == "char":
            return ctypes.c_char_p
        return ctypes.POINTER(structs[base]) if base in structs else ctypes.c_void_p
    base = decl.split()[0]
    if base in structs:
        return structs[base]
    if base not in _CTYPES:
        raise ValueError(f"{HEADER}: no ctypes mapping for C type {decl!r}")
    return _CTYPES[base]


def _header_text(text: str | None) -> str:
    """The header (or `text`) without its comments."""
    text = (SOURCE_DIR / HEADER).read_text() if text is None else text
    return re.sub(r"//[^\n]*", "", text)


def constants(text: str | None = None) -> dict[str, int]:
    """name -> value of every integer #define of the header."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s*#define\s+(\w+)\s+(\d+)\s*$", _header_text(text), re.M)}


_FIELD = re.compile(r"(.+?)\b(\w+)\s*(?:\[\s*(\w+)\s*\])?")


@functools.lru_cache(maxsize=8)
def _structures(text: str) -> dict[str, type[ctypes.Structure]]:
    consts = constants(text)
    out: dict[str, type[ctypes.Structure]] = {}
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^}]*)\}\s*;", _header_text(text)):
        name, fields = m[1], []
        for decl in (" ".join(d.split()) for d in m[2].split(";")):
            if not decl:
                continue
            f = _FIELD.fullmatch(decl)
            if f is None or "," in decl:
                raise ValueError(f"{HEADER}: struct {name}: cannot read the field {decl!r} (one field a line: type "
                                 f"name or type name[length])")
            try:
                ctype = _ctype(f[1], out)
            except ValueError:
                ctype = None
            if ctype is None:  # an unmapped type, or void
                raise ValueError(f"{HEADER}: struct {name}: no ctypes mapping for field {f[2]!r} of type "
                                 f"{f[1].strip()!r}")
            if f[3] is not None:
                if not f[3].isdigit() and f[3] not in consts:
                    raise ValueError(f"{HEADER}: struct {name}: array length {f[3]!r} is not a number or #define")
                ctype = ctype * (int(f[3]) if f[3].isdigit() else consts[f[3]])
            fields.append((f[2], ctype))
        out[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"{HEADER}'s struct {name}."})
    return out


def structures(text: str | None = None) -> Mapping[str, type[ctypes.Structure]]:
    """name -> the ctypes mirror of every struct the header (or `text`) declares, in declaration order (read-only);
    the same classes on every call for the same text (the library's signatures name them)."""
    return MappingProxyType(_structures((SOURCE_DIR / HEADER).read_text() if text is None else text))


def declarations(text: str | None = None) -> dict[str, tuple[object, list]]:
    """name -> (restype, argtypes) of every function declared in the header's extern "C" block."""
    structs = structures(text)
    text = _header_text(text)
    body = text[text.index('extern "C" {') + len('extern "C" {'):text.rindex("}")]
    out = {}
    for m in re.finditer(r"([\w\s\*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", body):
        ret, name, params = m.group(1), m.group(2), m.group(3).strip()
        args = [] if params in ("", "void") else [_ctype(p, structs) for p in params.split(",")]
        out[name] = (_ctype(ret, structs), args)
    if not out:
        raise ValueError(f"{HEADER}: no declarations found")
    return out


LAYOUT_SOURCE = "flowrt_struct_layout.cpp"


def layout_source(text: str | None = None) -> str:
    """The C++ of flowrt_struct_layout for the header's structs (compiled into every build): each struct's sizeof
    and the name and offsetof of each field its mirror has, as this compiler lays them out."""
    cases = []
    for name, cls in structures(text).items():
        fields = ", ".join(f'{{"{f}", (int64_t)offsetof({name}, {f})}}' for f, *_ in cls._fields_)
        cases.append(f'    if (!std::strcmp(name, "{name}")) {{\n        static const Field f[] = {{{fields}}};\n'
                     f"        return pick(sizeof({name}), f, (int)(sizeof f / sizeof *f), index, field);\n    }}\n")
    return (f"// Generated by engine/cpu/build.py from {HEADER}: the size and field offsets of each of its structs.\n"
            f'#include <cstddef>\n#include <cstring>\n#include "{HEADER}"\n\n'
            "namespace {\nstruct Field {\n    const char* name;\n    int64_t offset;\n};\n\n"
            "int64_t pick(int64_t size, const Field* f, int n, int index, const char** field) {\n"
            "    if (index < 0) return size;\n    if (index >= n) return -1;\n"
            "    *field = f[index].name;\n    return f[index].offset;\n}\n}  // namespace\n\n"
            'extern "C" int64_t flowrt_struct_layout(const char* name, int index, const char** field) {\n'
            + "".join(cases) + "    return -1;\n}\n")


def library_layout(lib: ctypes.CDLL, name: str) -> tuple[int, dict[str, int]] | None:
    """(sizeof, field -> offset) of struct `name` as the library was compiled, or None where it has no such
    struct."""
    size = lib.flowrt_struct_layout(name.encode(), -1, None)
    if size < 0:
        return None
    fields: dict[str, int] = {}
    field = ctypes.c_char_p()
    while (off := lib.flowrt_struct_layout(name.encode(), len(fields), ctypes.byref(field))) >= 0:
        fields[(field.value or b"").decode()] = off  # set by the library for every index it answers
    return size, fields


def check_layouts(lib: ctypes.CDLL, structs: Mapping[str, type[ctypes.Structure]] | None = None) -> None:
    """Raises RuntimeError where the library lays out a struct differently from its ctypes mirror (default: the
    header's), naming the struct and what differs: the library would read other bytes than Python wrote."""
    structs = structures() if structs is None else structs
    for name, cls in structs.items():
        there = library_layout(lib, name)
        if there is None:
            raise RuntimeError(f"the CPU kernel library does not know struct {name}, which its ctypes mirror declares")
        size, offsets = there
        here = {f: getattr(cls, f).offset for f, *_ in cls._fields_}
        diff = [f"size {ctypes.sizeof(cls)} here, {size} in the library"] if ctypes.sizeof(cls) != size else []
        diff += [f"{f} at {off} here, " + (f"{offsets[f]} in the library" if f in offsets else "not in the library")
                 for f, off in here.items() if offsets.get(f) != off]
        diff += [f"{f} only in the library" for f in offsets if f not in here]
        if diff:
            raise RuntimeError(f"struct {name}: the CPU kernel library's layout differs from its ctypes mirror "
                               f"({'; '.join(diff)}): refusing to load it")


def load(isa: Isa, force_build: bool = False) -> ctypes.CDLL:
    """The variant's library, built if needed, with every header declaration applied; checks that the library is
    the variant asked for and lays out every struct as its ctypes mirror does."""
    lib = ctypes.CDLL(str(build(isa, force=force_build)))
    for name, (restype, argtypes) in declarations().items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise RuntimeError(f"the CPU kernel library lacks {name}, which {HEADER} declares")
        fn.restype, fn.argtypes = restype, argtypes
    got = lib.flowrt_cpu_isa().decode()
    if got != isa.name:
        raise RuntimeError(f"the CPU kernel library built for {isa.name} reports {got}")
    check_layouts(lib)
    return lib
