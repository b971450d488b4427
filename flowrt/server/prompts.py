"""Prompts into token ids, and the token budget they leave, checked before anything reaches the engine.

Tokenizing runs in a worker thread: a long prompt must not stall the event loop that serves every other
client (and /health).
"""

from __future__ import annotations

import asyncio
from typing import Any

from .errors import OpenAIError, bad_request
from .state import ServerState


async def encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    ids = list(await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens))
    if not ids:
        raise bad_request(f"The {param} is empty: it encodes to no tokens.", param=param)
    return ids


def check_token_ids(tokenizer: Any, ids: list[int]) -> None:
    vocab = len(tokenizer)
    bad = next((t for t in ids if t < 0 or t >= vocab), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of the vocabulary (0..{vocab - 1}).", param="prompt")


def max_tokens_for(st: ServerState, prompt_len: int, requested: int | None, param: str) -> int:
    """The completion's token budget: `requested` when the prompt plus it fits the context length,
    else a 400; unset, whatever room the context and the KV pool leave."""
    limit = st.max_model_len
    if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
        want = f" and {requested} for the completion" if requested is not None else ""
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the prompt{want}). "
            f"Please reduce the length of the prompt or the completion.", 400, param=param,
            code="context_length_exceeded")
    if requested is not None:
        return requested  # whether the KV pool can hold it is the engine's call (a 400 at submission)
    capacity = st.kv_capacity()
    room = min(limit, capacity) - prompt_len if capacity is not None else limit - prompt_len
    if room < 1:
        raise OpenAIError(f"The prompt ({prompt_len} tokens) leaves no room in the server's KV cache "
                          f"({capacity} tokens).", 400, param=param, code="context_length_exceeded")
    return room
