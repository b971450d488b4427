"""Loading a single-file GGUF checkpoint (llama.cpp's format) into Hugging Face form.

``load_gguf(path, dtype)`` returns a :class:`GGUFCheckpoint`: the config of the Hugging Face architecture
(a dict; a transformers config on request), flowrt's tokenizer with the chat template the file carries
(converted by transformers once, then cached, see :func:`gguf_tokenizer`), and every weight under its Hugging
Face name, as ``dtype`` or kept quantized (``quantization``, below), so the engine's model definitions load a
GGUF exactly as they load a safetensors directory.

What the loader undoes, relative to a Hugging Face checkpoint:

* Quantization, unless it is kept (``quantization="auto"``, the default): then every projection and the token
  embedding stored in a block format the kernels multiply (``engine.quant.NATIVE_TYPES``) is returned as its raw
  rows in a :class:`~flowrt.engine.quant.QuantLinear`, and only norms, biases, float types and block formats
  without a kernel (IQ2_*, TQ*, ...: one log line names them) are dequantized. F32/F16/BF16 are cast; Q8_0,
  Q4_0 and Q4_1 are dequantized by vectorized torch code (bit-identical to the ``gguf`` package's reference
  ``gguf.quants.dequantize``, several times faster); the other block formats ``gguf.quants`` knows go through
  that reference, which is slower. Anything else is a ValueError naming the tensor and the type.
* Names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` and so on.
* RoPE layout. llama.cpp's converter permutes the rows of the Llama q/k projections (and their biases)
  within each head so that rotary pairs are interleaved (GPT-J style); Hugging Face models use the
  rotate-half (NeoX) layout. For the ``llama`` architecture the inverse permutation is applied to the
  packed rows before dequantizing. Qwen2/Qwen3 files are written in NeoX layout and are not permuted.
* Llama-3 RoPE scaling, which llama.cpp stores as a ``rope_freqs.weight`` tensor of per-frequency
  factors instead of config values: the ``rope_scaling`` dict is recovered from it (and checked).
* Tokenizer pre-tokenization, see :func:`restore_pre_tokenizer`.

The header is parsed here (a small, fast reader: the ``gguf`` package's ``GGUFReader`` spends seconds
turning every vocabulary string into a numpy array). Tensor data is read once, tensor by tensor, into a
scratch buffer, so peak memory is the result plus the largest stored tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from ..quant import NATIVE_TYPES, QuantLinear, QuantType
from ..quant.mode import Quantization
from .weights import resolve_dtype

__all__ = [
    "GGUFCheckpoint", "GGUFHeader", "GGUFTensorInfo", "load_gguf", "read_gguf_header",
    "dequantize", "gguf_config", "gguf_config_dict", "gguf_tokenizer", "convert_gguf_tokenizer",
    "transformers_gguf_tokenizer",
    "restore_pre_tokenizer", "restore_sentencepiece_prefix",
    "hf_tensor_name",
    "SUPPORTED_ARCHITECTURES",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

#: ``general.architecture`` values this loader maps to a Hugging Face Llama-family config
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_HF_ARCH = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# architectures whose q/k rows llama.cpp permutes for its interleaved RoPE
_PERMUTED_ARCHS = {"llama", "mistral"}

# ggml type ids (gguf.GGMLQuantizationType); sizes are (elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16, F64 = 0, 1, 2, 3, 8, 30, 28
_FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16, F64: torch.float64}
_FAST_BLOCK_TYPES = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# metadata value types
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


class _F32(float):
    """A float that was stored as float32 in the file (so that it can be shown at float32 precision)."""


def _qtype_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(ggml_type).name
    except Exception:  # noqa: BLE001 - unknown to this gguf version
        return f"ggml type {ggml_type}"


def _block_size(ggml_type: int) -> tuple[int, int] | None:
    """(elements, bytes) per block for a block-quantized type, None for a plain float type."""
    if ggml_type in _FLOAT_TYPES:
        return None
    if ggml_type in _FAST_BLOCK_TYPES:
        return _FAST_BLOCK_TYPES[ggml_type]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"unsupported GGUF tensor type {_qtype_name(ggml_type)}") from exc


# --------------------------------------------------------------------------------------------- header


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first): a Linear weight is (out, in)
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _qtype_name(self.ggml_type)


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # string arrays not asked for are given as their length (an int)
    tensors: dict[str, GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    array_keys: frozenset = frozenset()  # metadata keys whose value is an array in the file

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


class _Cursor:
    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str, size: int):
        try:
            value = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise ValueError(f"{self.path}: GGUF header is truncated (at byte {self.pos})") from exc
        self.pos += size
        return value

    def string(self) -> str:
        (n,) = self.unpack("<Q", 8)
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header is truncated (string at byte {self.pos})")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def skip_string(self) -> None:
        (n,) = self.unpack("<Q", 8)
        self.pos += n

    def value(self, vtype: int, keep_strings: bool):
        if vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            (v,) = self.unpack(fmt, struct.calcsize(fmt))
            return _F32(v) if vtype == _FLOAT32 else v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ", 12)
            if etype in _NUMPY_TYPES:
                dt = np.dtype(_NUMPY_TYPES[etype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ValueError(f"{self.path}: GGUF header is truncated (array at byte {self.pos})")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos = end
                return [(_F32(x) if etype == _FLOAT32 else x) for x in arr.tolist()] if count <= 64 else arr
            if etype == _STRING:
                if keep_strings:
                    return [self.string() for _ in range(count)]
                for _ in range(count):
                    self.skip_string()
                return count
            if etype == _ARRAY:
                return [self.value(_ARRAY, keep_strings) for _ in range(count)]
            raise ValueError(f"{self.path}: GGUF metadata array of unknown type {etype}")
        raise ValueError(f"{self.path}: GGUF metadata value of unknown type {vtype}")


def read_gguf_header(path: PathLike, keep_string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading tensor data.

    String arrays (the vocabulary, the merges) are returned as their length unless their key is in
    ``keep_string_arrays``. Raises FileNotFoundError for a missing file and ValueError (naming the
    file) for a file that is not GGUF, is big-endian or of an unsupported version, or is truncated.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"GGUF file does not exist: {p}")
    if not p.is_file():
        raise ValueError(f"{p} is not a file")
    size = p.stat().st_size
    if size < 24:
        raise ValueError(f"{p} is not a GGUF file (only {size} bytes)")
    buf = np.memmap(p, dtype=np.uint8, mode="r")
    try:
        if bytes(buf[:4]) != _GGUF_MAGIC:
            raise ValueError(f"{p} is not a GGUF file (no GGUF magic bytes)")
        cur = _Cursor(buf, p)
        cur.pos = 4
        (version,) = cur.unpack("<I", 4)
        if version not in (2, 3):
            if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
                raise ValueError(f"{p} is a big-endian GGUF file, which is not supported")
            raise ValueError(f"{p} has GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = cur.unpack("<QQ", 16)
        metadata: dict[str, Any] = {}
        array_keys = set()
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("<I", 4)
            metadata[key] = cur.value(vtype, key in keep_string_arrays)
            if vtype == _ARRAY:
                array_keys.add(key)
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("<I", 4)
            dims = cur.unpack(f"<{n_dims}Q", 8 * n_dims)
            ggml_type, offset = cur.unpack("<IQ", 12)
            raw_infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        data_offset = (cur.pos + alignment - 1) // alignment * alignment
    finally:
        del buf

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, offset in raw_infos:
        n = int(np.prod(shape)) if shape else 1
        if ggml_type in _FLOAT_TYPES:
            nbytes = n * _FLOAT_TYPES[ggml_type].itemsize
        else:
            try:
                bsize = _block_size(ggml_type)
            except ValueError:
                bsize = None  # reported when (if) the tensor is loaded
            nbytes = 0 if bsize is None else n // bsize[0] * bsize[1]
        start = data_offset + offset
        if start + nbytes > size:
            raise ValueError(
                f"{p} is truncated: tensor {name!r} needs bytes up to {start + nbytes}, the file has {size}"
            )
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFHeader(p, version, metadata, tensors, alignment, data_offset, size, frozenset(array_keys))


# ------------------------------------------------------------------------------------------ dequantize


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].view(torch.float16).to(torch.float32)
    x = blocks[:, 2:].view(torch.int8).to(torch.float32)
    return x.mul_(d)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed uint8 -> (n, 32) float32: low nibbles are elements 0-15, high nibbles 16-31."""
    n = qs.shape[0]
    q = torch.empty((n, 2, qs.shape[1]), dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    return q.view(n, -1).to(torch.float32)


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].view(torch.float16).to(torch.float32)
    return _nibbles(blocks[:, 2:]).sub_(8.0).mul_(d)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].view(torch.float16).to(torch.float32)
    m = blocks[:, 2:4].view(torch.float16).to(torch.float32)
    return _nibbles(blocks[:, 4:]).mul_(d).add_(m)


_FAST_DEQUANT = {Q8_0: _dequant_q8_0, Q4_0: _dequant_q4_0, Q4_1: _dequant_q4_1}
# block rows dequantized per chunk: bounds the float32 scratch (about 64 MiB) for huge tensors
_CHUNK_BLOCKS = 1 << 19


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Turn the stored bytes of one tensor (a uint8 tensor) into a new ``dtype`` tensor of ``shape``.

    Q4_0/Q4_1/Q8_0 match ``gguf.quants.dequantize`` bit for bit in float32 (the value is computed in
    float32 and then rounded to ``dtype``). The result never shares memory with ``raw``.
    """
    shape = tuple(shape)
    numel = int(np.prod(shape)) if shape else 1
    raw = raw.reshape(-1)
    if ggml_type in _FLOAT_TYPES:
        src = raw.view(_FLOAT_TYPES[ggml_type])
        if src.numel() != numel:
            raise ValueError(f"tensor data holds {src.numel()} values, shape {shape} needs {numel}")
        src = src.reshape(shape)
        return src.clone() if src.dtype == dtype else src.to(dtype)
    if ggml_type in _FAST_DEQUANT:
        per_block, block_bytes = _FAST_BLOCK_TYPES[ggml_type]
        if numel % per_block or raw.numel() != numel // per_block * block_bytes:
            raise ValueError(f"{_qtype_name(ggml_type)} data of {raw.numel()} bytes does not fit shape {shape}")
        blocks = raw.view(-1, block_bytes)
        fn = _FAST_DEQUANT[ggml_type]
        if blocks.shape[0] <= _CHUNK_BLOCKS:
            values = fn(blocks)  # a fresh float32 tensor
            return (values if dtype == torch.float32 else values.to(dtype)).view(shape)
        out = torch.empty((blocks.shape[0], per_block), dtype=dtype)
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = min(start + _CHUNK_BLOCKS, blocks.shape[0])
            out[start:stop] = fn(blocks[start:stop])
        return out.view(shape)
    fast = _kernel_dequantize(raw, ggml_type, shape, dtype)
    return fast if fast is not None else _dequantize_reference(raw, ggml_type, shape, dtype)


def _kernel_dequantize(raw: torch.Tensor, ggml_type: int, shape, dtype) -> torch.Tensor | None:
    """The C++ dequantizer (bit-equal to gguf.quants in float32, parallel) for the block formats it reads, else
    None. Imported here, not at the top: engine.quant.reference imports this module."""
    from ..quant import kernels
    from ..quant.formats import QuantType

    try:
        qtype = QuantType(ggml_type)
    except ValueError:
        return None
    if len(shape) != 2 or dtype not in (torch.float32, torch.bfloat16) or not kernels.usable(qtype):
        return None
    return kernels.dequantize(raw.contiguous(), qtype, shape[0], shape[1], None, dtype)


def _reference_qtype(ggml_type: int):
    """The ``gguf.GGMLQuantizationType`` for a block type ``gguf.quants`` can dequantize, else ValueError."""
    try:
        from gguf import GGMLQuantizationType, quants
        qtype = GGMLQuantizationType(ggml_type)
    except Exception as exc:  # noqa: BLE001 - a type id this gguf version does not know
        raise ValueError(f"unsupported GGUF tensor type {_qtype_name(ggml_type)}") from exc
    traits = getattr(quants, "_type_traits", None)  # the block formats gguf.quants implements
    if qtype.name in ("I8", "I16", "I32", "I64") or (traits is not None and qtype not in traits):
        raise ValueError(f"unsupported GGUF tensor type {qtype.name} (not a supported weight format)")
    return qtype


def _dequantize_reference(raw: torch.Tensor, ggml_type: int, shape, dtype) -> torch.Tensor:
    """The gguf package's numpy dequantizer, for the block types without a fast path here."""
    from gguf import quants

    qtype = _reference_qtype(ggml_type)
    try:
        values = quants.dequantize(raw.numpy(), qtype)
    except NotImplementedError as exc:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(dtype)


# ------------------------------------------------------------------------------------------------ names

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# tensors that carry no weight of the HF model (consumed into the config, or llama.cpp-only)
_CONSUMED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family models flowrt supports")


def _unpermute_rows(raw: torch.Tensor, rows: int, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of q/k rows on the packed bytes (rows are whole blocks).

    llama.cpp wrote row ``h*D + 2*i + j`` from HF row ``h*D + j*D/2 + i`` (D = head_dim, i < D/2, j < 2).
    """
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads")
    packed = raw.view(rows, -1)
    return packed.view(n_head, rows // n_head // 2, 2, packed.shape[1]).transpose(1, 2).reshape(-1)


# ----------------------------------------------------------------------------------------------- config


def _f32(v):
    """A float32 metadata value at its shortest round-trip decimal (9.999999747e-06 -> 1e-05)."""
    if v is None:
        return None
    return float(str(np.float32(v))) if isinstance(v, _F32) else float(v)


def _meta_int(md: dict, key: str):
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (list, np.ndarray)):
        vals = {int(x) for x in (v.tolist() if isinstance(v, np.ndarray) else v)}
        if len(vals) != 1:
            raise ValueError(f"GGUF metadata {key} varies by layer ({sorted(vals)}), which is not supported")
        return vals.pop()
    return int(v)


def _llama3_rope_scaling(factors: torch.Tensor, rope_theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` (one factor per frequency).

    llama.cpp stores, per rotary frequency, the factor its wavelength is stretched by: 1 for short
    wavelengths, ``factor`` for long ones, a smooth blend between. ``factor`` is the maximum; the
    blend's bounds are searched among the values Llama 3.x checkpoints use and must reproduce the
    tensor, or the file is rejected.
    """
    f = factors.double().flatten()
    dim = f.numel() * 2
    if dim != head_dim:
        raise ValueError(f"rope_freqs.weight has {f.numel()} entries, expected head_dim/2 = {head_dim // 2}")
    factor = float(str(np.float32(f.max().item())))  # stored as float32: 8.0, 32.0, ...
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    wavelen = 2 * torch.pi / inv_freq
    for orig in (8192, 4096, 2048, 16384, 32768, 131072):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.5):
                if high <= low:
                    continue
                smooth = (orig / wavelen - low) / (high - low)
                expect = torch.where(
                    wavelen < orig / high, torch.ones_like(wavelen),
                    torch.where(wavelen > orig / low, torch.full_like(wavelen, factor),
                                1.0 / ((1 - smooth) / factor + smooth)))
                if torch.allclose(expect, f, rtol=1e-3, atol=1e-4):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise ValueError("rope_freqs.weight does not match Llama-3 RoPE scaling with any known parameters; "
                     "this RoPE scaling is not supported")


def gguf_config(header: GGUFHeader, rope_freqs: torch.Tensor | None = None):
    """The transformers config (LlamaConfig, MistralConfig, Qwen2Config or Qwen3Config) of a GGUF file:
    ``AutoConfig.for_model`` on :func:`gguf_config_dict`."""
    return _transformers_config(gguf_config_dict(header, rope_freqs))


def _transformers_config(cfg: dict[str, Any]):
    from transformers import AutoConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "_name_or_path")}
    config = AutoConfig.for_model(cfg["model_type"], **kwargs)
    if cfg.get("_name_or_path"):
        config._name_or_path = cfg["_name_or_path"]
    return config


def gguf_config_dict(header: GGUFHeader, rope_freqs: torch.Tensor | None = None) -> dict[str, Any]:
    """A GGUF file's Hugging Face config as a config.json-style dict (``model_type`` included).

    Built from the llama.cpp metadata keys; where the tensors state a size (vocabulary, head_dim, FFN
    width) they are checked against the metadata. ``rope_freqs`` is the dequantized
    ``rope_freqs.weight`` tensor when the file has one (Llama-3 RoPE scaling). Plain data, so the engine
    reads it without importing transformers (``model_config.hf_config_from_dict``).
    """
    md = header.metadata
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    name = str(md.get("general.name", ""))
    model_type, hf_class = _HF_ARCH[arch]
    if arch == "llama" and "mistral" in name.lower():
        # llama.cpp writes Mistral models as `llama` (as transformers' own GGUF reader also assumes)
        model_type, hf_class = _HF_ARCH["mistral"]

    def key(k):
        return md.get(f"{arch}.{k}")

    t = header.tensors
    for required in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight"):
        if required not in t:
            raise ValueError(f"{header.path}: GGUF file has no {required!r} tensor")
    vocab, hidden = t["token_embd.weight"].shape
    n_layers = _meta_int(md, f"{arch}.block_count")
    n_heads = _meta_int(md, f"{arch}.attention.head_count")
    n_kv = _meta_int(md, f"{arch}.attention.head_count_kv") or n_heads
    if None in (n_layers, n_heads) or key("embedding_length") is None:
        raise ValueError(f"{header.path}: GGUF metadata lacks {arch}.block_count / attention.head_count / "
                         "embedding_length")
    if int(key("embedding_length")) != hidden:
        raise ValueError(f"{header.path}: {arch}.embedding_length={key('embedding_length')} but token_embd "
                         f"has width {hidden}")
    q_rows = t["blk.0.attn_q.weight"].shape[0]
    head_dim = _meta_int(md, f"{arch}.attention.key_length") or q_rows // n_heads
    if q_rows != n_heads * head_dim or t["blk.0.attn_k.weight"].shape[0] != n_kv * head_dim:
        raise ValueError(f"{header.path}: q/k projection shapes do not match {n_heads} heads, {n_kv} KV heads "
                         f"of head_dim {head_dim}")
    intermediate = t["blk.0.ffn_gate.weight"].shape[0]
    n_blocks = len({n.split(".")[1] for n in t if n.startswith("blk.")})
    if n_blocks != n_layers:
        raise ValueError(f"{header.path}: {arch}.block_count={n_layers} but the file has {n_blocks} blocks")

    rope_theta = _f32(key("rope.freq_base")) or 10000.0
    cfg: dict[str, Any] = dict(
        architectures=[hf_class],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(intermediate),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=int(head_dim),
        max_position_embeddings=_meta_int(md, f"{arch}.context_length") or 2048,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")) or 1e-6,
        rope_theta=rope_theta,
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in t,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )
    eos = md.get("tokenizer.ggml.eos_token_id")
    # end-of-turn / end-of-message ids (Llama 3's <|eot_id|>...) also end generation
    eos_ids = [int(x) for x in (eos, md.get("tokenizer.ggml.eot_token_id"), md.get("tokenizer.ggml.eom_token_id"))
               if x is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    cfg["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)

    has_qkv_bias = "blk.0.attn_q.bias" in t
    if model_type in ("llama", "qwen3", "mistral"):
        if has_qkv_bias and model_type == "mistral":
            raise ValueError(f"{header.path}: Mistral GGUF with attention biases is not supported")
        if model_type != "mistral":
            cfg["attention_bias"] = has_qkv_bias
    if model_type == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in t
    if model_type == "mistral":
        cfg["sliding_window"] = _meta_int(md, f"{arch}.attention.sliding_window")
    if model_type == "qwen2":
        if not has_qkv_bias:
            raise ValueError(f"{header.path}: Qwen2 GGUF without q/k/v biases")
        cfg["use_sliding_window"] = False
    if model_type == "qwen3" and "blk.0.attn_q_norm.weight" not in t:
        raise ValueError(f"{header.path}: Qwen3 GGUF without attn_q_norm tensors")

    scaling = None
    stype = key("rope.scaling.type")
    if rope_freqs is not None:
        scaling = _llama3_rope_scaling(rope_freqs, rope_theta, int(head_dim))
    elif stype in (None, "none", ""):
        scaling = None
    elif stype == "linear":
        scaling = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif stype == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(key("rope.scaling.factor"))}
        orig = _meta_int(md, f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = orig
    else:
        raise ValueError(f"{header.path}: unsupported RoPE scaling type {stype!r} in GGUF metadata")
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    cfg["model_type"] = model_type
    if name:
        cfg["_name_or_path"] = name
    return cfg


# -------------------------------------------------------------------------------------------- tokenizer

#: llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) whose split is "each digit alone, then GPT-2's
#: regex" (llama.cpp's llama-vocab.cpp gives all of these the regex list ``\p{N}`` + the GPT-2 pattern).
DIGIT_SPLIT_PRE_TOKENIZERS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
)


def _has_digits_split(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return False
    try:
        state = json.loads(pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001
        return False

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Digits" and node.get("individual_digits"):
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(state)


def restore_pre_tokenizer(tokenizer, pre: str | None) -> bool:
    """Restore a digit-splitting pre-tokenizer that the GGUF metadata only names. Returns True if changed.

    A GGUF stores a BPE vocabulary and merges, but not the pre-tokenizer pipeline; llama.cpp instead
    names it in ``tokenizer.ggml.pre`` and hard-codes each name's regexes. transformers rebuilds the
    pipeline for the names it knows (llama3, qwen2, tekken, ...) and otherwise keeps GPT-2's byte-level
    regex. For the names in :data:`DIGIT_SPLIT_PRE_TOKENIZERS` llama.cpp first splits off every digit on
    its own and then applies GPT-2's regex: the same as the original tokenizer.json of those models
    (SmolLM/SmolLM2: ``Sequence([Digits(individual_digits=True), ByteLevel])``), so that is what gets
    restored here.

    How to detect the case in general: by the ``tokenizer.ggml.pre`` value (which names the pipeline;
    the model name does not), and only when the pipeline transformers built has no digit split yet, so a
    transformers release that learns these names makes this a no-op. Unknown ``pre`` values are left
    alone (``gguf_tokenizer`` logs a warning for them).

    Effect: on a vocabulary with multi-digit tokens, GPT-2's regex alone would keep " 2024" together and
    BPE could emit "2024" as one token; with the split it is always "2", "0", "2", "4". SmolLM2's own
    vocabulary has no token joining a digit to anything, so its ids come out the same either way; the
    pipeline (and the offsets it reports) then matches the original tokenizer's exactly.
    """
    if pre not in DIGIT_SPLIT_PRE_TOKENIZERS:
        return False
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    if _has_digits_split(current):
        return False
    digits = pre_tokenizers.Digits(individual_digits=True)
    if current is None:
        backend.pre_tokenizer = digits
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, current])
    return True


def restore_sentencepiece_prefix(tokenizer, metadata: dict) -> bool:
    """Make a SentencePiece-style (``tokenizer.ggml.model == "llama"``) vocabulary prepend "▁" like
    SentencePiece and llama.cpp do. Returns True if changed.

    transformers rebuilds these tokenizers with ``Metaspace(prepend_scheme="first")``, which skips the
    dummy prefix when the text already starts with a space and after special tokens: " hi" becomes
    ``▁hi`` instead of ``▁▁hi``, and decoding loses the leading space. SentencePiece (``add_dummy_prefix``)
    and llama.cpp (``tokenizer.ggml.add_space_prefix``, default true) always prepend it, to the text and
    to every piece of text that follows a special token; Hugging Face's own Llama-2/Mistral tokenizer.json
    files do this with a ``Prepend("▁")`` + ``Replace(" ", "▁")`` normalizer and no pre-tokenizer, which
    is what is installed here.
    """
    if metadata.get("tokenizer.ggml.model") != "llama" or metadata.get("tokenizer.ggml.add_space_prefix") is False:
        return False
    from tokenizers import normalizers

    backend = tokenizer.backend_tokenizer
    pre = backend.pre_tokenizer
    if backend.normalizer is not None or pre is None or "Metaspace" not in type(pre).__name__:
        return False  # not the pipeline this fix is for
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    return True


_KNOWN_PRE = {"default", "gpt2", "llama3", "llama-bpe", "llama-v3", "qwen2", "tekken", "smaug-bpe", "dbrx",
              "deepseek-r1-qwen", "falcon3", "pixtral", "gpt-4o"} | DIGIT_SPLIT_PRE_TOKENIZERS


#: Bump when the conversion or what a cache entry holds changes: older entries are then rebuilt.
TOKENIZER_CACHE_VERSION = 1
_CACHE_KEEP = 32  # entries kept (newest first); tests write many short-lived GGUF files


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept: $FLOWRT_CACHE_DIR or ~/.cache/flowrt, gguf-tokenizers/."""
    root = os.environ.get("FLOWRT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flowrt")
    return Path(root) / "gguf-tokenizers"


def gguf_tokenizer(header: GGUFHeader, max_length: int | None = None):
    """flowrt's tokenizer (engine/model/tokenizer.py) from the GGUF tokenizer metadata, with the file's chat template.

    The first load of a file converts it with transformers (:func:`convert_gguf_tokenizer`, about 3 s with
    the import) and caches the result under :func:`tokenizer_cache_dir`, keyed by the file's path, size
    and modification time; later loads read the cache and do not import transformers. A cache entry that
    cannot be read or used is rebuilt.
    """
    from .tokenizer import Tokenizer

    md = header.metadata
    if "tokenizer.ggml.model" not in md:
        raise ValueError(f"{header.path}: GGUF file has no tokenizer metadata (tokenizer.ggml.model)")
    pre = md.get("tokenizer.ggml.pre")
    if md.get("tokenizer.ggml.model") == "gpt2" and pre not in _KNOWN_PRE:
        logger.warning("GGUF pre-tokenizer %r is not known to flowrt; tokenization may differ from the "
                       "original model's", pre)
    key = _tokenizer_cache_key(header.path)
    entry = tokenizer_cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
                                     + ".json")
    tok = _cached_tokenizer(entry, key, str(header.path))
    if tok is None:
        data = convert_gguf_tokenizer(header)
        _write_cache_entry(entry, {"key": key, **data})
        tok = Tokenizer(_backend_from_str(data["tokenizer"]), data["config"], str(header.path))
    if max_length:
        tok.model_max_length = int(max_length)
    return tok


def convert_gguf_tokenizer(header: GGUFHeader) -> dict[str, Any]:
    """The GGUF tokenizer converted with transformers (:func:`transformers_gguf_tokenizer`), as
    {"tokenizer": tokenizer.json text, "config": tokenizer_config entries}: what the cache holds."""
    tok = transformers_gguf_tokenizer(header)
    named = {k: str(v) for k, v in tok.special_tokens_map.items() if isinstance(v, str) or hasattr(v, "content")}
    config: dict[str, Any] = {
        **named,
        "extra_special_tokens": [t for t in tok.all_special_tokens if t not in named.values()],
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": bool(tok.clean_up_tokenization_spaces),
        "split_special_tokens": bool(getattr(tok, "split_special_tokens", False)),
    }
    if tok.model_max_length < int(1e29):
        config["model_max_length"] = int(tok.model_max_length)
    return {"tokenizer": tok.backend_tokenizer.to_str(), "config": config}


def transformers_gguf_tokenizer(header: GGUFHeader):
    """A transformers fast tokenizer from the GGUF tokenizer metadata.

    Uses transformers' GGUF tokenizer conversion (the same as ``AutoTokenizer.from_pretrained(dir,
    gguf_file=name)``, without re-reading the whole file for a config), then
    :func:`restore_pre_tokenizer` and :func:`restore_sentencepiece_prefix`.
    """
    md = header.metadata
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer as convert, get_gguf_tokenizer
    except ImportError:  # transformers 4.x: the public path (slower: it parses the file again)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(header.path.parent), gguf_file=header.path.name)
    else:
        from transformers import PreTrainedTokenizerFast
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(header.path))
        backend, extra = convert(arch, tokenizer_dict)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokenizer_config, **extra})
    restore_pre_tokenizer(tok, md.get("tokenizer.ggml.pre"))
    restore_sentencepiece_prefix(tok, md)
    return tok


def _tokenizer_cache_key(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"version": TOKENIZER_CACHE_VERSION, "path": str(path.resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}


def _backend_from_str(text: str):
    import tokenizers

    return tokenizers.Tokenizer.from_str(text)


def _cached_tokenizer(entry: Path, key: dict[str, Any], name: str):
    """The cached tokenizer for ``key``, or None when there is no usable entry."""
    from .tokenizer import Tokenizer

    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        return Tokenizer(_backend_from_str(data["tokenizer"]), data["config"], name)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any damage means: convert again
        logger.warning("rebuilding the unusable GGUF tokenizer cache entry %s (%s)", entry, exc)
        return None


def _write_cache_entry(entry: Path, data: dict[str, Any]) -> None:
    """Atomic write (a temporary file renamed over the entry), then drop the oldest entries; a cache that
    cannot be written only costs the next load a conversion."""
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, entry)
        entries = sorted(entry.parent.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in entries[_CACHE_KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not write the GGUF tokenizer cache entry %s: %s", entry, exc)
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- checkpoint


@dataclass
class GGUFCheckpoint:
    """A GGUF file in Hugging Face form: what a model definition and the engine need."""

    config_dict: dict[str, Any]  # the Hugging Face config as config.json would hold it (gguf_config_dict)
    tokenizer: Any  # flowrt.engine.model.tokenizer.Tokenizer; chat template in tokenizer.chat_template
    tensors: dict[str, torch.Tensor | QuantLinear]  # HF names; lm_head.weight only when not tied
    source: str  # the file's path
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # GGUF metadata, arrays left out
    _config: Any = field(default=None, init=False, repr=False)

    @property
    def config(self):
        """The transformers config (LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config), built on first
        use: the engine itself reads ``config_dict`` and never imports transformers."""
        if self._config is None:
            self._config = _transformers_config(self.config_dict)
        return self._config

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


def load_gguf(path: PathLike, dtype: Union[torch.dtype, str, None] = torch.float32, *,
              quantization: Quantization | str | None = Quantization.AUTO,
              load_tokenizer: bool = True) -> GGUFCheckpoint:
    """Load a llama/mistral/qwen2/qwen3 GGUF file; float tensors come as ``dtype``.

    ``quantization="auto"``: projections and the token embedding stored in a block format with a kernel stay
    quantized (:class:`QuantLinear` values in ``tensors``); ``None`` / ``"none"``: every weight is dequantized to
    ``dtype``. ``"int8"`` / ``"int4"`` quantize Hugging Face weights and are a ValueError for a GGUF file.

    Raises FileNotFoundError for a missing file; ValueError naming the problem for a file that is not
    GGUF or is truncated, an unsupported architecture, an unsupported tensor type, or a tensor that has
    no Hugging Face counterpart.
    """
    target = resolve_dtype(dtype)
    mode = Quantization.parse(quantization)
    header = read_gguf_header(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if mode.quantizes_at_load:
        kinds = sorted({i.type_name for i in header.tensors.values() if len(i.shape) == 2})
        raise ValueError(
            f"{header.path}: quantization={mode.value!r} quantizes Hugging Face weights at load, but a GGUF file "
            f"holds its own formats ({', '.join(kinds)}): use quantization='auto' to keep them or None to "
            "dequantize them")
    # check every tensor's name and type before the expensive part
    try:
        for info in header.tensors.values():
            if info.name not in _CONSUMED:
                hf_tensor_name(info.name)
            if info.ggml_type not in _FLOAT_TYPES and info.ggml_type not in _FAST_BLOCK_TYPES:
                _check_reference_type(info)
    except ValueError as exc:
        raise ValueError(f"{header.path}: {exc}") from exc

    threads = torch.get_num_threads()
    no_kernel: dict[str, int] = {}  # block formats dequantized although they could have been kept: name -> tensors
    with open(header.path, "rb", buffering=0) as f:
        try:
            # The kernels here are short elementwise passes over one tensor at a time: one thread does
            # them about as fast as two on a quiet machine, and several times faster when the cores are
            # shared (OpenMP workers spin waiting for each other). The caller's setting is restored.
            torch.set_num_threads(1)
            # Tensor bytes are read (not memory-mapped) into one scratch buffer, so the file's pages never
            # count in this process's memory: the peak is the result plus the largest stored tensor.
            scratch = torch.empty(max((i.nbytes for i in header.tensors.values()), default=0), dtype=torch.uint8)

            def raw(info: GGUFTensorInfo) -> torch.Tensor:
                return _read_into(f, info, scratch[:info.nbytes], header.path)  # noqa: F821 - closure var, del'd only after last call

            rope_freqs = None
            if "rope_freqs.weight" in header.tensors:
                info = header.tensors["rope_freqs.weight"]
                rope_freqs = dequantize(raw(info), info.ggml_type, info.shape, torch.float32)
            config = gguf_config_dict(header, rope_freqs)
            n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

            tensors: dict[str, torch.Tensor | QuantLinear] = {}
            for info in header.tensors.values():
                if info.name in _CONSUMED:
                    continue
                name = hf_tensor_name(info.name)
                permute = arch in _PERMUTED_ARCHS and (".attn_q." in info.name or ".attn_k." in info.name)
                heads = n_heads if ".attn_q." in info.name else n_kv
                keepable = mode is Quantization.AUTO and _KEPT_QUANTIZED.match(info.name) and len(info.shape) == 2
                if keepable and info.ggml_type in _NATIVE_IDS:
                    tensors[name] = _quantized(f, info, heads if permute else None, header.path)
                    continue
                if keepable and info.ggml_type not in _FLOAT_TYPES:
                    no_kernel[info.type_name] = no_kernel.get(info.type_name, 0) + 1
                if not permute and _FLOAT_TYPES.get(info.ggml_type) == target:
                    # stored as the wanted dtype: read straight into the result
                    out = torch.empty(info.shape, dtype=target)
                    _read_into(f, info, out.view(-1).view(torch.uint8), header.path)
                    tensors[name] = out
                    continue
                src = raw(info)
                if permute:
                    src = _unpermute_rows(src, info.shape[0], heads)
                try:
                    tensors[name] = dequantize(src, info.ggml_type, info.shape, target)
                except ValueError as exc:
                    raise ValueError(f"{header.path}: tensor {info.name!r} ({info.type_name}): {exc}") from exc
            del scratch
        finally:
            torch.set_num_threads(threads)
    if no_kernel:
        logger.info("%s: no quantized kernel for %s: dequantized at load to %s", header.path.name,
                    ", ".join(f"{k} ({n} tensor{'s' * (n > 1)})" for k, n in sorted(no_kernel.items())),
                    str(target).removeprefix("torch."))

    tokenizer = gguf_tokenizer(header, config["max_position_embeddings"]) if load_tokenizer else None
    scalars = {k: v for k, v in header.metadata.items() if k not in header.array_keys}
    return GGUFCheckpoint(config_dict=config, tokenizer=tokenizer, tensors=tensors, source=str(header.path),
                          metadata=scalars)


#: the tensors that stay in their block format under quantization="auto": every projection and the token embedding
_KEPT_QUANTIZED = re.compile(
    r"^(token_embd|output|blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down))\.weight$")
_NATIVE_IDS = frozenset(int(t) for t in NATIVE_TYPES)


def _quantized(f, info: GGUFTensorInfo, unpermute_heads: int | None, path) -> QuantLinear:
    """One tensor's rows as the file stores them (un-permuted for RoPE where ``unpermute_heads`` is set)."""
    n, k = info.shape
    data = _read_into(f, info, torch.empty(info.nbytes, dtype=torch.uint8), path)
    if unpermute_heads is not None:
        data = _unpermute_rows(data, n, unpermute_heads)
    try:
        return QuantLinear(QuantType(info.ggml_type), data.view(n, -1), n, k)
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {info.name!r}: {exc}") from exc


def _read_into(f, info: GGUFTensorInfo, buf: torch.Tensor, path) -> torch.Tensor:
    """Read ``info``'s bytes from the open file ``f`` into the uint8 tensor ``buf``; returns ``buf``."""
    view = buf.numpy().data.cast("B")
    f.seek(info.offset)
    done = 0
    while done < info.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{path} is truncated: tensor {info.name!r} ends past the end of the file")
        done += n
    return buf


def _check_reference_type(info: GGUFTensorInfo) -> None:
    try:
        _reference_qtype(info.ggml_type)
    except ValueError as exc:
        raise ValueError(f"tensor {info.name!r}: {exc}") from exc
