"""The architecture facts the engine needs, read once from a model's config.

``hf_config_from_dict`` turns a config.json dict into the attributes a transformers config class would
have (the class defaults filled in), so loading a model does not import transformers (about 3 s of
start-up); ``model_config_from_hf`` accepts either.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())

# config.json's sizes (head_dim and num_key_value_heads may be left out: derived)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


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


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_sizes(hf) -> None:
    """The config's sizes are positive integers (before any is divided by or allocated with), named as in
    config.json when one is not."""
    for name in _SIZES:
        v = getattr(hf, name, None)
        if v is None and name in _OPTIONAL_SIZES:
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)   # JSON may write 1e3 for 1000
        if not _positive_int(v):
            raise ValueError(f"the model's config has {name}={v!r}: it must be a positive integer")


def _check_ranges(cfg: ModelConfig) -> None:
    """What the sizes must satisfy together for the model to run, and the float parameters' ranges."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"the model's config has num_attention_heads={cfg.num_heads} and num_key_value_heads="
                         f"{cfg.num_kv_heads}: the heads must divide into the KV heads' groups")
    if cfg.head_dim % 2:
        raise ValueError(f"the model's config has head_dim={cfg.head_dim}: rotary embeddings need an even one")
    if not (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps >= 0):
        raise ValueError(f"the model's config has rms_norm_eps={cfg.rms_norm_eps}: it must be finite and >= 0")
    if not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ValueError(f"the model's config has rope_theta={cfg.rope_theta}: it must be finite and > 0")


def model_config_from_hf(hf, generation_eos=None) -> ModelConfig:
    """Translate a transformers PretrainedConfig (or :func:`hf_config_from_dict`'s namespace); raises
    ValueError naming what is unsupported or out of range."""
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
    _check_sizes(hf)
    num_heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    sliding = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        sliding = None
    qkv_bias = model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
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
    if cfg["head_dim"] is None and model_type != "qwen2" and _positive_int(cfg["num_attention_heads"]):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]   # else model_config_from_hf refuses
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


#: Positions x head_dim of each rotary table (cos, sin) at most: 512 MiB each in float32, a context of 1M
#: tokens at head_dim 128. The tables are built at load time for the whole context.
MAX_ROTARY_ELEMENTS = 1 << 27
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expected_shapes(cfg: ModelConfig, layers: range) -> dict[str, tuple[tuple[int, ...], str]]:
    """The Hugging Face-named tensors the model loads (of ``layers``), each with its shape and the config fields
    that decide it (for the message when a checkpoint's tensor differs)."""
    V, Hs, F, D = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    qf, kvf = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    out = {"model.embed_tokens.weight": ((V, Hs), "vocab_size, hidden_size"),
           "model.norm.weight": ((Hs,), "hidden_size")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((V, Hs), "vocab_size, hidden_size")
    for i in layers:
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {p + "input_layernorm.weight": ((Hs,), "hidden_size"),
                p + "post_attention_layernorm.weight": ((Hs,), "hidden_size"),
                a + "q_proj.weight": ((q, Hs), f"{qf}, hidden_size"),
                a + "k_proj.weight": ((kv, Hs), f"{kvf}, hidden_size"),
                a + "v_proj.weight": ((kv, Hs), f"{kvf}, hidden_size"),
                a + "o_proj.weight": ((Hs, q), f"hidden_size, {qf}"),
                m + "gate_proj.weight": ((F, Hs), "intermediate_size, hidden_size"),
                m + "up_proj.weight": ((F, Hs), "intermediate_size, hidden_size"),
                m + "down_proj.weight": ((Hs, F), "hidden_size, intermediate_size")}
        if cfg.qkv_bias:
            out |= {a + "q_proj.bias": ((q,), qf), a + "k_proj.bias": ((kv,), kvf), a + "v_proj.bias": ((kv,), kvf)}
        if cfg.qk_norm:
            out |= {a + "q_norm.weight": ((D,), "head_dim"), a + "k_norm.weight": ((D,), "head_dim")}
    return out


def check_model_config(cfg: ModelConfig, tensors: Mapping[str, Any], max_positions: int,
                       max_model_len: int | None = None) -> None:
    """The config against the checkpoint's tensors (names and shapes only) and the rotary tables' size, before
    the model allocates anything: a ValueError naming the config field (a config.json edited, or a GGUF's
    metadata) instead of gigabytes allocated and a missing tensor or a torch shape error later."""
    _check_ranges(cfg)
    if max_positions * cfg.head_dim > MAX_ROTARY_ELEMENTS:
        field = "max_model_len" if (max_model_len or 0) > cfg.max_position_embeddings else "max_position_embeddings"
        gib = 2 * max_positions * cfg.head_dim * 4 / 2**30
        raise ValueError(f"{field}={max_positions} is out of range: its rotary tables would take {gib:,.1f} GiB "
                         f"(at most {MAX_ROTARY_ELEMENTS // cfg.head_dim:,} positions at head_dim {cfg.head_dim})")
    present = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    if len(present) != cfg.num_layers:
        raise ValueError(f"the model's config has num_hidden_layers={cfg.num_layers}, but the checkpoint holds "
                         f"tensors for {len(present)} layers")
    for name, (shape, fields) in expected_shapes(cfg, range(cfg.num_layers)).items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        got = tuple(getattr(t, "shape", shape))
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got}, but the model's config ({fields}) makes it {shape}")
