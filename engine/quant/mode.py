"""The ``quantization`` keyword: how the engine keeps a checkpoint's weights in memory."""

from __future__ import annotations

import enum


class Quantization(str, enum.Enum):
    """``AUTO``: a GGUF file keeps its block formats (multiplied by the quantized kernels, CPU only); a Hugging Face
    directory loads as the model dtype. ``NONE``: every weight dequantized to the model dtype. ``INT8`` / ``INT4``:
    a Hugging Face directory's projections quantized at load, into the GGUF block formats the kernels run (see
    :mod:`.quantize`); a GGUF file is already quantized, so these are an error for one."""

    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def parse(cls, value: "Quantization | str | None") -> "Quantization":
        """A Quantization from itself, its name in any case, or None (= NONE); ValueError naming the value otherwise."""
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise ValueError(f"unknown quantization {value!r}; choose one of "
                         f"{', '.join(repr(m.value) for m in cls)} (or None, the same as 'none')")

    @property
    def quantizes_at_load(self) -> bool:
        """Whether float weights are quantized while loading (int8 / int4)."""
        return self in (Quantization.INT8, Quantization.INT4)
