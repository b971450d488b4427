"""The request of ``POST /v1/responses`` (OpenAI's Responses API), and which of its fields the server refuses.

Fields the server cannot honour are a 400 naming the field (``check_unsupported``); fields OpenAI documents
as hints (``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``text.verbosity``,
``stream_options.include_obfuscation``) and fields of newer API versions are ignored, as other endpoints
ignore unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .errors import bad_request
from .protocol import SEED_MAX, SEED_MIN, _Body

# include values that ask for nothing this server makes (it never returns reasoning items)
IGNORED_INCLUDES = {"reasoning.encrypted_content"}


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused unless empty / off (check_unsupported)
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[Any] | None = None
    top_logprobs: int | None = None
    # Extension (vLLM's name; the openai client sends it through extra_body)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)

    def check_unsupported(self) -> None:
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise bad_request("reasoning is not supported: the served model does not reason.", param="reasoning")
        if self.background:
            raise bad_request("background responses are not supported.", param="background")
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported: a prompt over the context length is a 400.",
                              param="truncation")
        extra = [i for i in self.include or [] if i not in IGNORED_INCLUDES]
        if extra:
            raise bad_request(f"include {extra[0]!r} is not supported.", param="include")
        for name in ("prompt", "conversation", "context_management"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported.", param=name)
        if self.top_logprobs:
            raise bad_request("top_logprobs is not supported on /v1/responses.", param="top_logprobs")
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise bad_request("text.format must be an object.", param="text.format")
