"""GGUF (ggml) block formats: their ids, block shapes, and which ones flowrt multiplies without dequantizing."""

from __future__ import annotations

import enum


class QuantType(enum.IntEnum):
    """ggml type ids, as stored in a GGUF tensor table (gguf.GGMLQuantizationType's values)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    BF16 = 30

    @classmethod
    def parse(cls, value: "QuantType | int | str") -> "QuantType":
        """A QuantType from itself, its ggml id or its name ("q4_k" too); ValueError naming the value otherwise."""
        try:
            if isinstance(value, str):
                return cls[value.strip().upper()]
            return cls(int(value))
        except (KeyError, ValueError):
            raise ValueError(f"unknown weight format {value!r}; known: {', '.join(t.name for t in cls)}") from None


# (elements, bytes) per block
_BLOCKS = {
    QuantType.F32: (1, 4), QuantType.F16: (1, 2), QuantType.BF16: (1, 2),
    QuantType.Q4_0: (32, 18), QuantType.Q4_1: (32, 20), QuantType.Q5_0: (32, 22), QuantType.Q5_1: (32, 24),
    QuantType.Q8_0: (32, 34), QuantType.IQ4_NL: (32, 18),
    QuantType.Q2_K: (256, 84), QuantType.Q3_K: (256, 110), QuantType.Q4_K: (256, 144), QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
}

#: block formats that stay quantized in memory and are multiplied by the kernels (the float types are not
#: "quantized": they load as the model dtype)
NATIVE_TYPES: frozenset[QuantType] = frozenset({
    QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0, QuantType.IQ4_NL,
    QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K,
})


def block_shape(qtype: QuantType) -> tuple[int, int]:
    """(elements, bytes) per block of ``qtype``."""
    return _BLOCKS[QuantType(qtype)]


def row_bytes(qtype: QuantType, k: int) -> int:
    """Bytes of one row of ``k`` elements; ValueError when ``k`` is not a whole number of blocks."""
    per, nbytes = block_shape(qtype)
    if k % per:
        raise ValueError(f"{QuantType(qtype).name} rows hold whole blocks of {per} elements; {k} is not a multiple")
    return k // per * nbytes
