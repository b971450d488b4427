"""Which Hugging Face tensors ``quantization="int8"|"int4"`` quantizes at load, and into what.

int8: every projection, the token embedding and the LM head as Q8_0 (int8 in groups of 32 with one float16 scale:
6% more bytes than per-channel int8, more accurate, and the GGUF kernels run it). int4: the layers' projections as
Q4_1 (4 bits in groups of 32 with a float16 scale and minimum, 11% more bytes than Q4_0): measured on stories260K
(float32, a 120-token story), perplexity 2.483 float, 2.473 int8, 2.488 int4 as Q4_1 (+0.2%), 2.607 as Q4_0 (+5%).
The embedding and LM head are Q8_0 in both modes, as the shipped SmolLM2 Q4_1 file keeps them: the LM head's
errors land straight on the logits. Rows that do not fill whole
blocks of 32 (stories260K's FFN width 172) and 1-D tensors (norms, biases) stay float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .formats import QuantType
from .linear import QuantLinear
from .mode import Quantization
from .quantize import BLOCK, quantize

_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")

#: projections' format by mode
PROJECTION_FORMAT = {Quantization.INT8: QuantType.Q8_0, Quantization.INT4: QuantType.Q4_1}
#: the token embedding's and the LM head's format in both modes
TABLE_FORMAT = QuantType.Q8_0


@dataclass(frozen=True)
class LoadQuantizer:
    """Quantizes the tensors of a Hugging Face checkpoint as they are read (weights.load_safetensors_dir), so the
    float checkpoint is never held whole."""

    mode: Quantization

    def __post_init__(self):
        if not self.mode.quantizes_at_load:
            raise ValueError(f"quantization={self.mode.value!r} does not quantize at load")

    def format_for(self, name: str, shape: tuple[int, ...]) -> QuantType | None:
        """The block format tensor ``name`` of ``shape`` is quantized to, or None when it stays float."""
        if len(shape) != 2 or shape[1] % BLOCK:
            return None
        if name in _TABLES:
            return TABLE_FORMAT
        if _PROJECTION.match(name):
            return PROJECTION_FORMAT[self.mode]
        return None

    def __call__(self, name: str, tensor: torch.Tensor) -> QuantLinear:
        """``tensor`` (one :meth:`format_for` selects) quantized."""
        qtype = self.format_for(name, tuple(tensor.shape))
        if qtype is None:
            raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} is not one that quantization="
                             f"{self.mode.value!r} quantizes")
        return quantize(tensor, qtype)
