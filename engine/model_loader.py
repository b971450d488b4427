"""Builds our model definition from a Hugging Face directory or a GGUF file, plus its tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .model_config import ModelConfig, model_config_from_hf
from .models.llama import LlamaModel


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: object
    load_seconds: float


def _generation_eos(path: Path):
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            return json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            return None
    return None


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None, tokenizer_path: str | None = None
) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.perf_counter()
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from .gguf_loader import load_gguf

        ckpt = load_gguf(p, dtype)
        cfg = model_config_from_hf(ckpt.config)
        tensors, tokenizer = ckpt.tensors, ckpt.tokenizer
    else:
        from .weights import load_safetensors_dir

        if not p.exists():
            raise FileNotFoundError(f"model path does not exist: {p}")
        if p.is_dir() and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (expected a Hugging Face model directory or a .gguf file)")
        hf = AutoConfig.from_pretrained(str(p if p.is_dir() else p.parent), trust_remote_code=False)
        cfg = model_config_from_hf(hf, _generation_eos(p if p.is_dir() else p.parent))
        tensors = load_safetensors_dir(p, dtype)
        tokenizer = None
    if tokenizer_path is not None or tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or str(p if p.is_dir() else p.parent),
                                                  trust_remote_code=False)
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": (tokenizer.eos_token_id,)})
    max_positions = max(max_model_len or 0, cfg.max_position_embeddings)
    model = LlamaModel(cfg, dtype, max_positions)
    model.load_hf_state_dict(tensors)
    del tensors
    model.to(device)
    model.eval()
    model.pack_cpu_weights()
    return LoadedModel(cfg, model, tokenizer, time.perf_counter() - t0)
