"""The architecture facts the engine needs, read once from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V per token over all layers (multiply by the KV dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _eos_ids(*sources) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def model_config_from_hf(hf, generation_eos=None) -> ModelConfig:
    """Translate a transformers PretrainedConfig; raises ValueError naming what is unsupported."""
    archs = list(getattr(hf, "architectures", None) or [])
    model_type = getattr(hf, "model_type", None)
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"unsupported architecture {archs}; flowrt supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; flowrt supports {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (only silu is implemented)")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not rope and legacy:
        rope = dict(legacy)
    rope_theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0) or 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
    if scaling is not None and rope_type not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    sliding = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        sliding = None
    qkv_bias = model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_ids(generation_eos, getattr(hf, "eos_token_id", None)),
    )
