"""Request validation at submission: prompts to token ids, and every check that can fail before any work.

Everything here raises ValueError (pydantic's ValidationError is one) naming what is wrong, in the
caller's thread, so a bad request never reaches a step and a server can answer 400.
"""

from __future__ import annotations

import numbers

import numpy as np

from .sampling_params import SamplingParams
from ..request.sequence import Matcher
from ..model.tokenizer import check_text


def token_id_list(ids, what: str, vocab_size: int) -> list[int]:
    """The one vocabulary check: `ids` (ints, numpy integers or a 1-D integer array) as a list of ints
    in 0..vocab_size-1."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
            raise ValueError(f"{what} must be a 1-D integer array of token ids, got shape {ids.shape} "
                             f"of {ids.dtype}")
        ids = ids.tolist()
    out = []
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= (i := int(t)) < vocab_size:
            raise ValueError(f"{what} contains token id {t!r}, outside the vocabulary (0..{vocab_size - 1})")
        out.append(i)
    return out


def is_token_ids(prompt) -> bool:
    """Whether `prompt` is one prompt of token ids (a 1-D array, or a list/tuple of integers)."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], numbers.Integral)


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int,
                 structured=None):
        self.tokenizer = tokenizer
        self.structured = structured  # StructuredOutputManager: compiles structured_outputs constraints
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size

    def tokenize(self, prompt: str, what: str = "prompt") -> list[int]:
        check_text(prompt, what)  # any tokenizer (transformers' too) would fail on it with a bare TypeError
        return list(self.tokenizer(prompt).input_ids)

    def token_ids(self, ids, what: str) -> list[int]:
        return token_id_list(ids, what, self.vocab_size)

    def check_tokens(self, token_ids: list[int], what: str) -> None:
        """Raises ValueError naming `what` when the tokens cannot be run."""
        if not token_ids:
            raise ValueError(f"{what} is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{what} has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        self._check_fits(len(token_ids), f"{what} has {len(token_ids)} tokens")

    def _check_fits(self, num_slots: int, desc: str) -> None:
        capacity = self.num_kv_blocks * self.block_size
        if num_slots > capacity:
            raise ValueError(
                f"{desc}, more than the KV cache holds ({self.num_kv_blocks} blocks of {self.block_size} "
                f"= {capacity} tokens)"
            )

    def resolve_prompt(self, prompt, what: str = "prompt") -> tuple[str | None, list[int]]:
        """A str, a list/tuple/1-D array of token ids, or a dict with 'prompt' or 'prompt_token_ids'."""
        text: str | None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{what} is empty")
            ids, text = self.tokenize(prompt, what), prompt
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = self.token_ids(prompt["prompt_token_ids"], what), prompt.get("prompt")
            elif "prompt" in prompt:
                return self.resolve_prompt(prompt["prompt"], what)
            else:
                raise ValueError(f"{what} must have 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids, text = self.token_ids(prompt, what), None
        else:
            raise ValueError(f"{what} must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        self.check_tokens(ids, what)
        return text, ids

    def check_request(self, num_tokens: int, params: SamplingParams, what: str = "prompt") -> None:
        """The request can run to its end: stop_token_ids are token ids, and the prompt plus max_tokens
        (capped where max_model_len ends it) fits the whole KV pool. The last sampled token is never fed
        back, so a sequence of T tokens holds T - 1 in the KV cache."""
        self.token_ids(params.stop_token_ids, "stop_token_ids")
        self.constraint_matcher(params)  # compiled (and cached) now: a bad constraint fails before any work
        if params.max_tokens:
            final = min(num_tokens + params.max_tokens, self.max_model_len)
            self._check_fits(max(num_tokens, final - 1),
                             f"{what} has {num_tokens} tokens and max_tokens={params.max_tokens}: "
                             f"up to {max(num_tokens, final - 1)} tokens of KV")

    def constraint_matcher(self, params: SamplingParams) -> Matcher | None:
        """A fresh llguidance matcher for params.structured_outputs (None when unconstrained). Raises ValueError
        "structured_outputs.KIND: ..." for a bad, too large or too slow to compile constraint."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.structured is None:
            raise ValueError("structured_outputs: not supported by this engine")
        return self.structured.compile(so)
