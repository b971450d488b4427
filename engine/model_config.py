"""The architecture facts the engine needs, read once from a model's config.

``hf_config_from_dict`` turns a config.json dict into the attributes a transformers config class would
have (the class defaults filled in), so loading a model does not import transformers (about 3 s of
start-up); ``model_config_from_hf`` accepts either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
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
    """Translate a transformers PretrainedConfig (or :func:`hf_config_from_dict`'s namespace); raises
    ValueError naming what is unsupported."""
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


#: The defaults of transformers' config classes (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) for
#: the keys ``model_config_from_hf`` reads; a config.json may leave any of them out.
_COMMON_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, num_key_value_heads=None,
    head_dim=None, vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
)
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(intermediate_size=11008, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(intermediate_size=14336, max_position_embeddings=4096 * 32, num_key_value_heads=8,
                    sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768, num_key_value_heads=32,
                  use_sliding_window=False, sliding_window=4096, eos_token_id=None),
    "qwen3": dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768, num_key_value_heads=32,
                  head_dim=128, attention_bias=False, use_sliding_window=False, sliding_window=4096, eos_token_id=None),
}


def _standard_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters as transformers 5 standardizes them: one dict with rope_type and rope_theta (a
    legacy ``rope_scaling`` dict wins over ``rope_parameters``, as in transformers)."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in cfg:
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rope


def hf_config_from_dict(raw: dict[str, Any]) -> SimpleNamespace:
    """The attributes of the transformers config class for ``raw["model_type"]`` (defaults filled in the
    way the class's constructor fills them), for the architectures flowrt supports; other model types
    get no defaults, and ``model_config_from_hf`` then rejects them."""
    model_type = raw.get("model_type")
    if model_type not in _TYPE_DEFAULTS:
        return SimpleNamespace(**raw)
    cfg = {**_COMMON_DEFAULTS, **_TYPE_DEFAULTS[model_type], **raw}
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg["head_dim"] is None and model_type != "qwen2":
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if model_type in ("qwen2", "qwen3") and not cfg["use_sliding_window"]:
        cfg["sliding_window"] = None
    cfg["rope_parameters"] = _standard_rope(cfg)
    cfg.pop("rope_scaling", None)
    return SimpleNamespace(**cfg)


def read_hf_config(model_dir: str | Path) -> SimpleNamespace:
    """config.json of a Hugging Face model directory, as :func:`hf_config_from_dict` fills it."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return hf_config_from_dict(raw)
