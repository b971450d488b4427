"""Builds our model definition from a Hugging Face directory or a GGUF file, plus its tokenizer.

The normal path imports no transformers: config.json is read as JSON (model_config.read_hf_config), the
tokenizer is flowrt's own (engine/model/tokenizer.py), GGUF tokenizers come from a cache (engine/model/gguf_loader.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .model_config import ModelConfig, check_model_config, hf_config_from_dict, model_config_from_hf, read_hf_config
from .models.llama import LlamaModel
from ..quant.mode import Quantization
from .weights_report import WeightsReport, weights_report

if TYPE_CHECKING:
    from .tokenizer import TokenizerLike  # (imported at load: the module pulls in the tokenizers package)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: TokenizerLike
    load_seconds: float
    weights: WeightsReport


def _generation_eos(path: Path):
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            return json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            return None
    return None


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None, tokenizer_path: str | None = None,
    quantization: Quantization | str | None = Quantization.AUTO,
) -> LoadedModel:
    """``quantization``: see EngineArgs.quantization. The quantized kernels are the CPU's: on another device "auto"
    dequantizes a GGUF file's weights, and "int8" / "int4" are a ValueError."""
    from .tokenizer import load_tokenizer

    t0 = time.perf_counter()
    mode = Quantization.parse(quantization)
    if device.type != "cpu":
        if mode.quantizes_at_load:
            raise ValueError(f"quantization={mode.value!r}: quantized weights run on the CPU only, "
                             f"not on {device.type}")
        mode = Quantization.NONE
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from .gguf_loader import load_gguf

        ckpt = load_gguf(p, dtype, quantization=mode)
        cfg = model_config_from_hf(hf_config_from_dict(ckpt.config_dict))
        tensors, tokenizer = ckpt.tensors, ckpt.tokenizer
    else:
        from .weights import load_safetensors_dir

        if not p.exists():
            raise FileNotFoundError(f"model path does not exist: {p}")
        if p.is_dir() and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (expected a Hugging Face model directory or a .gguf file)")
        model_dir = p if p.is_dir() else p.parent
        cfg = model_config_from_hf(read_hf_config(model_dir), _generation_eos(model_dir))
        quantizer = None
        if mode.quantizes_at_load:
            from ..quant.at_load import LoadQuantizer

            quantizer = LoadQuantizer(mode)
        tensors = load_safetensors_dir(p, dtype, quantizer)
        tokenizer = None
    if tokenizer_path is not None or tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_path or str(p if p.is_dir() else p.parent))
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": (tokenizer.eos_token_id,)})
    max_positions = max(max_model_len or 0, cfg.max_position_embeddings)
    check_model_config(cfg, tensors, max_positions, max_model_len)   # before any allocation, naming the field
    model = LlamaModel.from_weights(cfg, dtype, max_positions, tensors)
    del tensors
    model.to(device)
    model.eval()
    model.pack_cpu_weights()
    return LoadedModel(cfg, model, tokenizer, time.perf_counter() - t0, weights_report(model))
