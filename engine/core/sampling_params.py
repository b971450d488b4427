"""Sampling parameters, validated by pydantic so a bad value names its field before any work starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..decoding.structured_output import StructuredOutputsParams


class SamplingParams(BaseModel):
    """What to generate for one request; field names follow vLLM's SamplingParams."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    n: int = Field(default=1, ge=1, le=1024)
    max_tokens: int = Field(default=16, ge=0)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # per-request generator seed (sample i uses seed + i)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop strings must be non-empty strings")
        return list(v)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v):
        return [] if v is None else list(v)

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_BEAM_WIDTH = 10  # a beam's 2W candidates come from its top-k logprobs, which stop at 20


class BeamSearchParams(BaseModel):
    """vLLM's BeamSearchParams. The score of a beam is cum_logprob / generated_len ** length_penalty (as in
    transformers, a final EOS counts in the length). At most MAX_BEAM_WIDTH beams."""

    model_config = ConfigDict(extra="forbid")

    beam_width: int = Field(default=4, ge=1, le=MAX_BEAM_WIDTH)
    max_tokens: int = Field(default=16, ge=1)
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)   # NaN or inf would make every score NaN
    structured_outputs: StructuredOutputsParams | None = None  # every beam follows the constraint

    @field_validator("temperature")
    @classmethod
    def _deterministic(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("beam search scores the model's log-probabilities: temperature must be 0.0")
        return v
