"""Result objects returned to users, shaped like vLLM's so existing code reads them unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
