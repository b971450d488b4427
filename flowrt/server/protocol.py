"""Request models of the OpenAI API subset the server speaks, and the shapes of its responses.

Requests are pydantic models (a bad field gives a 400 naming it). Responses are built as plain dicts in
OpenAI's wire format (what the official client parses); the builders live here so that streaming and
non-streaming paths share them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import bad_request

MAX_LOGPROBS = 20
# A seed seeds a torch generator per sample (seed + sample index): int64 keeps every one in range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class _Request(BaseModel):
    # Unknown fields are ignored (clients send fields from newer API versions); fields that we know and
    # cannot honour are declared and refused in `check_unsupported`.
    model_config = ConfigDict(extra="ignore")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in a decoded JSON body that holds a lone
    surrogate (JSON's ``"\\ud800"`` decodes to one; no tokenizer can encode it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for k, v in value.items():
            shown = str(k).encode("utf-8", "backslashreplace").decode("utf-8")  # a key may be the bad string
            name = f"{path}.{shown}" if path else shown
            found = lone_surrogate_at(k, name) or lone_surrogate_at(v, name)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate_at(v, f"{path}[{i}]")
            if found:
                return found
    return None


class _Body(_Request):
    """A whole request body: a string that is not valid Unicode is a 400 naming its field (raised as an
    OpenAIError, which pydantic lets through, before any field is read)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise bad_request(f"{where} contains a lone surrogate (a \\ud800-\\udfff escape without its pair): "
                              "not valid Unicode text.", param=where, code="invalid_unicode")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM names; the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    # (at most one; see structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bound_numbers: bool | None = None  # False: JSON numbers as long as the schema allows (default: bounded)

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported.", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for flowrt.engine.SamplingParams (which validates the values)."""
        kw: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
        }
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        optional = {
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "stop": stop or None,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # vLLM's beam search extension: `n` beams per prompt, best first
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.use_beam_search:
            for name in ("stream", "stop"):
                if getattr(self, name):
                    raise bad_request(f"{name} is not supported with use_beam_search.", param=name)
            if self.logprobs is not None:   # also 0: the beams' choices carry no log-probabilities
                raise bad_request("logprobs is not supported with use_beam_search.", param="logprobs")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of different from n is not supported.", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported.", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists (a request may carry several)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty.", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # one prompt of token ids
        if isinstance(p[0], list):
            if any(len(x) == 0 for x in p):
                raise bad_request("prompt must not contain an empty token list.", param="prompt")
            return [list(x) for x in p]
        return list(p)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (OpenAI shape)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"Message content parts of type {part.type!r} are not supported; only 'text'.",
                                  param="messages")
            out.append(part.text)
        return "".join(out)

    def for_template(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            m["tool_calls"] = [_template_call(c, i) for i, c in enumerate(self.tool_calls)]
        return m


def _template_call(c: Any, i: int) -> dict[str, Any]:
    """An OpenAI tool call as chat templates take it: function.arguments as a dict (templates `tojson` it)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("An assistant message's tool_calls need function.name.", param=f"messages.tool_calls.{i}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request("tool_calls function.arguments must be a JSON object (as a string).",
                              param=f"messages.tool_calls.{i}") from None
    if not isinstance(args, dict):
        raise bad_request("tool_calls function.arguments must be a JSON object.", param=f"messages.tool_calls.{i}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if c.get("id") is not None:
        out["id"] = c["id"]
    return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # calls in one response (default toolcalls.MAX_CALLS)
    # Extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server trusts request templates

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message requires add_generation_prompt to be false.",
                              param="continue_final_message")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class WorkflowRunRequest(_Body):
    inputs: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    stream_tokens: bool = False   # with stream: also a `token` event per piece of generated text


class WorkflowResumeRequest(_Body):
    answer: Any = None            # what the interrupted step's fr.interrupt() call returns
    answers: dict[str, Any] | None = None   # {step: answer}, for a run waiting at several interrupts
    stream: bool = False
    stream_tokens: bool = False


class WorkflowForkRequest(_Body):
    at: str                       # the step to run again (with its downstream): "step" or "outer/inner"
    inputs: dict[str, Any] = Field(default_factory=dict)   # inputs replacing the source run's of those names
    stream: bool = False
    stream_tokens: bool = False


# ---------------------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event carrying `data` (a dict is sent as compact JSON)."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())


def model_card(name: str, root: str | None, max_model_len: int | None, created: int) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": created, "owned_by": "flowrt"}
    if root is not None:
        card["root"] = root
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card
