"""flowrt.engine: the in-process continuous-batching LLM engine (vLLM-style API). See engine/API.md."""

from .async_llm import AsyncLLM, EngineSequence
from .config import EngineArgs, default_model_path
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "EngineArgs",
    "EngineSequence",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "default_model_path",
]
