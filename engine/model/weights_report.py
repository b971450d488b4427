"""What a loaded model's weights cost in memory and in which formats they are held: ``stats()``'s ``weights_bytes``
and ``weights_formats``, and the engine's load log line.

Bytes are resident bytes: each distinct tensor storage the weights hold, counted once (quantized blocks, float
parameters, the packed copies the CPU kernels multiply with; a tied LM head is the embedding).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .dtypes import dtype_name
from ..quant import ConcatLinear, QuantLinear


@dataclass(frozen=True)
class WeightsReport:
    bytes: int
    formats: dict[str, str]  # tensor class ("embed", "attn_qkv", ... "norms") -> "Q4_K", "Q6_K+Q4_K", "float32"

    def describe(self) -> str:
        """``98.4 MB (embed Q8_0, attn_qkv/attn_output/ffn_gate_up/ffn_down Q4_1, lm_head Q8_0 (tied), ...)``: classes
        of one format named together."""
        groups: dict[str, list[str]] = {}
        for cls, fmt in self.formats.items():
            groups.setdefault(fmt, []).append(cls)
        return f"{self.bytes / 1e6:.1f} MB ({', '.join('/'.join(c) + ' ' + f for f, c in groups.items())})"


def weights_report(model) -> WeightsReport:
    """The report for a LlamaModel (engine/model/models/llama.py: weight_classes, resident_tensors)."""
    classes = model.weight_classes()
    formats = {cls: _class_format(ws, model.dtype) for cls, ws in classes.items()}
    if model.cfg.tie_word_embeddings:
        formats["lm_head"] = f"{formats['embed']} (tied)"
    return WeightsReport(_resident_bytes(model.resident_tensors()), formats)


def _formats(w, dtype: torch.dtype) -> list[str]:
    if isinstance(w, QuantLinear):
        return [w.qtype.name]
    if isinstance(w, ConcatLinear):
        return [p.qtype.name for p in w.parts]
    if isinstance(w, torch.Tensor):
        return [dtype_name(w.dtype)]
    return [dtype_name(dtype)]  # a packed float projection's multiply (its plain weight dropped)


def _class_format(weights: list, dtype: torch.dtype) -> str:
    """The formats of a class's tensors, the most frequent first: "Q4_K", "Q4_K+Q6_K"."""
    counts = Counter(f for w in weights for f in _formats(w, dtype))
    return "+".join(f for f, _ in counts.most_common())


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[object, int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            seen[("storage", storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # an opaque (oneDNN-packed) tensor: no storage to share
            seen[("tensor", id(t))] = t.numel() * t.element_size()
    return sum(seen.values())
