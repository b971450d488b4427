"""The typed contract between the engine and the layers above it (runtime, threads, server).

``EngineClient`` is everything flowrt's runtime and server use of an engine; ``AsyncLLM`` implements it
(see engine/API.md for the semantics). ``SequenceHandle`` is the sequence an ``EngineClient.open`` returns
(``EngineSequence``): token ids whose KV cache outlives one call, forked copy-on-write.

Code above the engine types against these protocols, never against the engine's internals, so another
implementation (a remote replica, a test double) can stand in. Both are ``runtime_checkable``:
``isinstance(obj, EngineClient)`` checks that the members exist (not their signatures).

This module imports nothing of the engine at run time (typing only).
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Mapping, Protocol, Sequence, Union,
                    runtime_checkable)

if TYPE_CHECKING:
    import numpy as np

    from .request.outputs import RequestOutput
    from .core.sampling_params import SamplingParams

__all__ = ["EngineClient", "SequenceHandle", "KVTransfer", "Prompt"]

# What generate / stream accept: text, token ids (a list or a 1-D integer array), a dict with "prompt" or
# "prompt_token_ids", or a sequence handle opened on the same engine (generation appends to it).
Prompt = Union[str, Sequence[int], "np.ndarray", Mapping[str, Any], "SequenceHandle"]


@runtime_checkable
class SequenceHandle(Protocol):
    """A token sequence whose KV cache outlives one request (``EngineSequence``).

    One request at a time: ``append`` / ``fork`` / ``close`` while it generates raise RuntimeError.
    """

    @property
    def token_ids(self) -> list[int]:
        """All tokens (prompt, appended and generated), a copy."""
        ...

    def __len__(self) -> int:
        ...

    def append(self, token_ids: Iterable[int]) -> None:
        """Pending tokens, prefilled by the next request on the sequence."""
        ...

    def fork(self, n: int = 1) -> list[SequenceHandle]:
        """``n`` new sequences sharing every KV block so far, copy-on-write."""
        ...

    def close(self) -> None:
        """Idempotent; full blocks go to the prefix cache."""
        ...

    def set_state(self, state: str, **context: Any) -> None:
        """A scheduling hint: "generating", "waiting" (idle, used again soon) or "finished" (its step is
        done); keywords (run_id, step, thread_id) update its program context (engine/request/program.py)."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """An LLM engine as the runtime and the server use it (implemented by ``AsyncLLM``)."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: flowrt.engine.model.tokenizer.Tokenizer, or a transformers tokenizer where that
        falls back to one (same API subset: encode / decode / ``apply_chat_template`` ...)."""
        ...

    @property
    def max_model_len(self) -> int:
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (keys in engine/API.md: KV blocks, tokens computed, prefix-cache hits, ...)."""
        ...

    def open(self, token_ids: Iterable[int] = (), program: Any = None) -> SequenceHandle:
        """A new sequence; nothing is computed until a request runs on it. ``program``: a ProgramContext
        (run_id, step, thread_id, state), a dict of its fields or a run id; optional everywhere."""
        ...

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, program: Any = None) -> RequestOutput:
        """Run one request to completion; a bad request raises ValueError at submission."""
        ...

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, program: Any = None) -> AsyncIterator[RequestOutput]:
        """Cumulative snapshots, the last with ``finished=True``; validated when called."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request early (finish_reason "abort"); thread-safe. False when it is unknown / done."""
        ...

    def shutdown(self) -> None:
        """Stop the engine; requests in flight fail."""
        ...


@runtime_checkable
class KVTransfer(Protocol):
    """An engine whose KV blocks can leave it and come back (``AsyncLLM``; engine/kv/transfer.py): what
    flowrt's KV checkpoints need beside ``EngineClient``. Blocks are named by their prefix hash (the
    token ids of the whole prefix), their content is bytes that only an engine with the same
    ``kv_fingerprint`` can use. Blocking calls (they copy KV): call them off the event loop."""

    def kv_fingerprint(self) -> str:
        """A hash of what KV content depends on: weights, dtypes, block size, attention backend, version."""
        ...

    def kv_block_bytes(self) -> int:
        """The size of one block's content: what ``kv_import`` takes (a caller checks saved blocks by it)."""
        ...

    def kv_export(self, token_ids: Sequence[int], skip: Callable[[bytes], bool] | None = None
                  ) -> list[tuple[bytes, bytes | None]]:
        """The full blocks of ``token_ids`` in order, as (hash, content) while the engine holds them,
        (hash, None) where ``skip(hash)``; ends at the first block that is neither."""
        ...

    def kv_import(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        """Load (hash, content) blocks into the prefix cache, in chain order; how many were written."""
        ...
