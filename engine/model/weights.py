"""Reading model weights from a Hugging Face directory of safetensors files.

Only safetensors are read: pickle checkpoints (``pytorch_model.bin``, ``*.pt``) can run arbitrary code
when loaded, so they are refused with a message saying how to convert them.

Tensors keep their Hugging Face names (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``,
...). Files are memory-mapped through ``safetensors.safe_open`` and converted one tensor at a time, so the
peak memory is the returned state dict plus one tensor in flight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch

from .dtypes import DTYPE_NAMES

if TYPE_CHECKING:
    from ..quant import QuantLinear
    from ..quant.at_load import LoadQuantizer

__all__ = ["load_safetensors_dir", "resolve_dtype", "find_safetensors_files", "PICKLE_SUFFIXES"]

PathLike = Union[str, "os.PathLike[str]"]

#: file name endings of pickle checkpoints, which are never loaded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")



def resolve_dtype(dtype: Union[torch.dtype, str, None]) -> torch.dtype:
    """``torch.float32`` / ``"float32"`` / ``"bf16"`` ... -> a floating torch dtype (None means float32).

    ``"auto"`` is not resolved here: picking bf16 or fp32 for the machine is the engine's decision.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ValueError(
        f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16 (or a torch.dtype)"
    )


def find_safetensors_files(path: PathLike) -> list[Path]:
    """The safetensors files that make up the checkpoint in ``path``, in load order.

    ``path`` is a directory (``model.safetensors``; or shards listed by ``model.safetensors.index.json``;
    or else every ``*.safetensors`` in it) or a single ``.safetensors`` file.
    Raises FileNotFoundError / ValueError naming the path when there is nothing loadable.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix == ".safetensors":
            return [p]
        if p.name.endswith(PICKLE_SUFFIXES):
            raise ValueError(
                f"{p}: pickle checkpoints are not supported; convert to safetensors "
                "(e.g. load it once in a trusted environment and save with safetensors.torch.save_file)"
            )
        raise ValueError(f"{p} is not a safetensors file (expected a directory or a *.safetensors file)")

    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index (no 'weight_map'): {exc}") from exc
        files = []
        for name in dict.fromkeys(weight_map.values()):  # unique, in first-seen order
            shard = p / name
            if not shard.is_file():
                raise FileNotFoundError(f"{index} lists shard {name!r}, which is missing from {p}")
            files.append(shard)
        if not files:
            raise ValueError(f"{index} lists no shards")
        return files

    single = p / "model.safetensors"
    if single.is_file():
        return [single]

    files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
    # Mistral repos ship the original-format `consolidated.safetensors` next to the HF shards.
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    if hf_files:
        return hf_files
    if files:
        return files

    pickles = sorted(f.name for f in p.iterdir() if f.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{p} holds only pickle checkpoints ({', '.join(pickles[:3])}): pickle checkpoints are not "
            "supported; convert to safetensors"
        )
    raise FileNotFoundError(f"no *.safetensors files in {p}")


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _needs_cast(st_dtype: str, target: torch.dtype) -> bool:
    """Whether a tensor stored as safetensors dtype ``st_dtype`` must be cast to reach ``target``."""
    if st_dtype not in _FLOAT_DTYPES:
        return False  # integer / bool tensors keep their type
    same = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    return same.get(st_dtype) != target


def load_safetensors_dir(path: PathLike, dtype: Union[torch.dtype, str, None] = torch.float32,
                         quantizer: "LoadQuantizer | None" = None) -> "dict[str, torch.Tensor | QuantLinear]":
    """Every tensor of the safetensors checkpoint in ``path``, by Hugging Face name, as ``dtype``.

    Floating point tensors are converted to ``dtype``; integer/bool tensors keep their type. With a ``quantizer``
    (``quantization="int8"|"int4"``), the tensors it selects are quantized from their stored values, one at a time,
    and come as QuantLinear.
    A tensor name present in two files, a tensor listed by the index but absent from its shard, or a
    truncated/corrupt file raise ValueError naming the file.
    """
    from safetensors import SafetensorError, safe_open

    target = resolve_dtype(dtype)
    files = find_safetensors_files(path)

    expected: dict[str, str] | None = None
    index = Path(path) / "model.safetensors.index.json"
    if Path(path).is_dir() and index.is_file():
        expected = json.loads(index.read_text())["weight_map"]

    tensors: dict[str, torch.Tensor | QuantLinear] = {}
    where: dict[str, str] = {}
    for file in files:
        size = file.stat().st_size
        if size < 8:
            raise ValueError(f"{file} is truncated or not a safetensors file ({size} bytes)")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
                quantized = set() if quantizer is None else {
                    n for n in names if f.get_slice(n).get_dtype() in _FLOAT_DTYPES
                    and quantizer.format_for(n, tuple(f.get_slice(n).get_shape())) is not None}
                convert = {n for n in names if _needs_cast(f.get_slice(n).get_dtype(), target)} | quantized
                for name in names:
                    if name in tensors:
                        raise ValueError(f"tensor {name!r} is in both {where[name]} and {file.name}")
                    where[name] = file.name
                    if name not in convert:
                        # same dtype: a view of the (private, copy-on-write) file mapping, no copy at all
                        tensors[name] = f.get_tensor(name)
            for name in sorted(convert, key=names.index):
                # Cast through a mapping opened for this tensor alone: once it is closed the source pages
                # leave this process, so converting a whole checkpoint never holds both copies.
                with safe_open(str(file), framework="pt", device="cpu") as g:
                    stored = g.get_tensor(name)
                    tensors[name] = (quantizer(name, stored) if quantizer is not None and name in quantized
                                     else stored.to(target))
        except SafetensorError as exc:
            raise ValueError(f"cannot read {file}: truncated or corrupt safetensors file ({exc})") from exc
        except (OSError, RuntimeError) as exc:
            # e.g. the header promises more bytes than the file holds
            raise ValueError(f"cannot read {file}: truncated or corrupt safetensors file ({exc})") from exc

    if expected is not None:
        missing = [n for n in expected if n not in tensors]
        if missing:
            raise ValueError(
                f"{index} lists {len(missing)} tensor(s) not found in the shards, e.g. {missing[0]!r} "
                f"(expected in {expected[missing[0]]})"
            )
    if not tensors:
        raise ValueError(f"the safetensors checkpoint in {path} holds no tensors")
    return tensors
