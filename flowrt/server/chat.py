"""``POST /v1/chat/completions``: messages through the model's chat template, then one engine request."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from . import protocol as P
from . import structured as S
from .generation import Job, Submission, answer, sampling_params
from .outputs import ChatLogprobs, Delta, stop_holdback, usage_of
from .prompts import encode, max_tokens_for
from .state import State
from .templates import render_chat

router = APIRouter(prefix="/v1")


@dataclass
class _Chat:
    """One chat request once validated: what both the JSON and the streamed answer need."""
    req: P.ChatCompletionRequest
    tokenizer: Any
    id: str
    model: str
    top_logprobs: int | None  # None: no logprobs
    tools: S.Tools | None = None
    created: int = field(default_factory=P.now)

    def logprobs(self, job: Job) -> ChatLogprobs:
        return ChatLogprobs(self.tokenizer, self.top_logprobs or 0, job.prompt_ids)

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        d: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": choices}
        if self.req.include_usage:
            d["usage"] = usage
        return P.sse(d)


@router.post("/chat/completions")
async def chat_completions(req: P.ChatCompletionRequest, request: Request, st: State) -> Response:
    t0 = time.perf_counter()
    st.check_model(req.model)
    req.check_unsupported()
    constraint, tools = S.resolve(req)
    text = await render_chat(st, req, tools.specs if tools else None)
    ids = await encode(st.tokenizer, text, False, "messages")
    base = f"chatcmpl-{uuid.uuid4().hex}"
    job = Job(0, ids, text, base)
    kw = req.sampling_kwargs(max_tokens_for(st, len(ids), req.requested_max_tokens, "messages"))
    k = (req.top_logprobs or 0) if req.logprobs else None
    if k is not None:
        kw["logprobs"] = k
    if constraint is not None:
        kw["structured_outputs"] = constraint.params
    params = sampling_params(kw)
    await S.precompile(st.engine, constraint)  # off the event loop; the submission then hits the cache
    c = _Chat(req, st.tokenizer, base, st.model_name(req.model), k, tools)
    sub = Submission(st, [job], params, t0, user=req.user)
    events = _events(c, sub) if req.stream else None
    return await answer(st, request, sub, events, f"chat stream {base}", lambda finals: _body(c, job, finals))


def _body(c: _Chat, job: Job, finals: dict[int, Any]) -> dict[str, Any]:
    base, k, tools = c.id, c.top_logprobs, c.tools
    choices = []
    for o in finals[0].outputs:
        lp = ({"content": c.logprobs(job).build(list(o.token_ids), list(o.logprobs or []))}
              if k is not None else None)
        message, finish = S.message(o.text, o.finish_reason, tools)
        choices.append({"index": o.index, "message": message,
                        "logprobs": lp, "finish_reason": finish, "stop_reason": o.stop_reason})
    return {"id": base, "object": "chat.completion", "created": c.created, "model": c.model,
            "choices": choices, "usage": usage_of(finals, [job])}


async def _events(c: _Chat, sub: Submission) -> AsyncGenerator[str, None]:
    req, job = c.req, sub.jobs[0]
    delta = Delta(stop_holdback(req.stop))
    builders: dict[int, ChatLogprobs] = {}
    calls: dict[int, S.ToolStream] | None = {} if (c.tools is not None and c.tools.parse) else None
    final = None
    for i in range(req.n):
        yield c.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}])
    async with contextlib.aclosing(sub.outputs()) as outputs:
        async for _, out in outputs:
            if out.finished:
                final = out
            for o in out.outputs:
                text = delta.text(o.index, o.text, o.finish_reason is not None)
                d: dict[str, Any] = {}
                if calls is not None:  # content and tool-call deltas
                    ts = calls.setdefault(o.index, S.ToolStream())
                    text, call_deltas = ts.feed(text, o.finish_reason is not None)
                    if call_deltas:
                        d["tool_calls"] = call_deltas
                if text:
                    d = {"content": text, **d}
                lp = None
                if c.top_logprobs is not None:
                    if o.index not in builders:
                        builders[o.index] = c.logprobs(job)
                    lp = {"content": builders[o.index].build(*delta.tokens(o.index, o))}
                fin = o.finish_reason if (o.finish_reason is not None and o.index not in delta.done) else None
                if fin is not None:
                    delta.done.add(o.index)
                    if fin == "stop" and calls is not None and calls[o.index].made_calls:
                        fin = "tool_calls"
                if d or fin is not None or (lp and lp["content"]):
                    # one choice per chunk, as OpenAI streams n > 1
                    yield c.chunk([{"index": o.index, "delta": d, "logprobs": lp,
                                    "finish_reason": fin, **({"stop_reason": o.stop_reason} if fin else {})}])
    if req.include_usage:
        yield c.chunk([], usage_of({0: final} if final is not None else {}, [job]))
    yield P.SSE_DONE
