"""flowrt.engine: the in-process continuous-batching LLM engine (vLLM-style API). See engine/API.md."""

from .async_llm import AsyncLLM, EngineSequence
from .beam_search import BeamSearchOutput, BeamSearchSequence
from .kv.block_pool import hash_block  # the prefix hash that names a KV block (flowrt/replicas routes by it)
from .config import EngineArgs, default_model_path
from .llm import LLM
from .llm_engine import LLMEngine
from .request.outputs import CompletionOutput, Logprob, RequestOutput
from .request.program import ProgramContext, ProgramState
from .interfaces import EngineClient, KVTransfer, SequenceHandle  # the typed contract the runtime and server use
from .core.sampling_params import BeamSearchParams, SamplingParams
from .decoding.structured_output import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "EngineArgs",
    "EngineSequence",
    "EngineClient",
    "SequenceHandle",
    "KVTransfer",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "default_model_path",
    "ProgramContext",
    "ProgramState",
    "hash_block",
]
