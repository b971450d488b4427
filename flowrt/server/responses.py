"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over the chat
machinery (template, tool-call constraints, structured outputs), with the conversation kept on the server.

A request is translated into a chat request (responses_items), its prompt built to continue the previous
response's token sequence (responses_prompt), run as one engine request, and answered as a response object
or as the Responses event stream (responses_events). Unless ``store`` is false, the finished response is
kept (responses_store) for ``GET`` and for a later ``previous_response_id``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from . import protocol as P
from . import responses_items as I
from . import responses_prompt
from . import structured as S
from .errors import OpenAIError, from_validation_errors
from .generation import Job, Submission, answer, sampling_params
from .outputs import Delta
from .prompts import max_tokens_for
from .responses_events import EventStream
from .responses_protocol import ResponsesRequest
from .responses_store import ResponseStore, StoredResponse
from .state import State

router = APIRouter(prefix="/v1")
logger = logging.getLogger("flowrt.server")


def store_of(request: Request) -> ResponseStore:
    return request.app.state.flowrt_responses


@contextlib.contextmanager
def _renamed() -> Iterator[None]:
    """Errors of the shared chat code name this request's fields (text.format, input, max_output_tokens)."""
    try:
        yield
    except OpenAIError as e:
        e.message = I.rename_param(e.message)
        e.param = "input" if e.param == "prompt" else I.rename_param(e.param) if e.param else e.param
        e.args = (e.message,)
        raise


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> P.ChatCompletionRequest:
    fields = {"messages": messages, "tools": I.chat_tools(req.tools),
              "tool_choice": I.chat_tool_choice(req.tool_choice),
              "parallel_tool_calls": req.parallel_tool_calls, "max_tool_calls": req.max_tool_calls,
              "response_format": I.response_format((req.text or {}).get("format")),
              "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
              "seed": req.seed, "user": req.user}
    try:
        return P.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise from_validation_errors(e.errors(include_url=False)) from None


def _no_calls() -> S.Constraint:
    """tool_choice "none" with tools in the prompt: free text that never opens a call (the thread API's rule;
    a small model otherwise writes call markup as text)."""
    from flowrt.engine import StructuredOutputsParams
    from flowrt.llm.chat import _NO_TOOL_CALL_GRAMMAR

    return S.Constraint(StructuredOutputsParams(grammar=_NO_TOOL_CALL_GRAMMAR), "tool_choice")


@dataclass
class _Turn:
    """One response being made: what its object, its events and its stored entry need."""
    req: ResponsesRequest
    id: str
    model: str
    tokenizer: Any
    store: ResponseStore
    history: list[dict[str, Any]]          # the conversation before the output, without instructions
    prompt: responses_prompt.Prompt
    tools: S.Tools | None
    created: int = field(default_factory=P.now)

    def body(self, status: str, items: list[dict[str, Any]], out: Any = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.req
        o = out.outputs[0] if out is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if o is not None and o.finish_reason == "length"
                                   else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "model": self.model, "output": items,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store, "temperature": r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto", "tools": I.tools_echo(r.tools),
            "top_p": r.top_p, "truncation": "disabled", "user": r.user, "metadata": r.metadata or {},
            "usage": self.usage(out) if out is not None else None,
            **({"completed_at": P.now()} if status == "completed" else {}),
        }

    def usage(self, out: Any) -> dict[str, Any]:
        n_in, n_out = len(self.prompt.token_ids), len(out.outputs[0].token_ids)
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0,
                                                                  "cache_write_tokens": 0},
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}

    def complete(self, items: list[dict[str, Any]], out: Any) -> dict[str, Any]:
        """The finished response's object; kept in the store unless `store` is false."""
        o = out.outputs[0]
        status = "completed" if o.finish_reason == "stop" else "incomplete"
        body = self.body(status, items, out)
        if self.req.store:
            generated = self.tokenizer.decode(list(o.token_ids), skip_special_tokens=False)
            self.store.put(StoredResponse(body, self.history + I.items_as_messages(items),
                                          array("i", self.prompt.token_ids + list(o.token_ids)),
                                          self.prompt.text + generated))
        return body

    def finish(self, finals: dict[int, Any]) -> dict[str, Any]:
        o = finals[0].outputs[0]
        message, _ = S.message(o.text, o.finish_reason, self.tools)
        return self.complete(I.output_items(message), finals[0])


@router.post("/responses")
async def create_response(req: ResponsesRequest, request: Request, st: State) -> Response:
    t0 = time.perf_counter()
    st.check_model(req.model)
    req.check_unsupported()
    store = store_of(request)
    previous = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise OpenAIError(f"Previous response with id '{req.previous_response_id}' not found.", 404,
                              type="invalid_request_error", param="previous_response_id",
                              code="previous_response_not_found")
    history = (list(previous.messages) if previous else []) + I.input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    with _renamed():
        chat = _chat_request(req, system + history)
        constraint, tools = S.resolve(chat)
        if constraint is None and tools is not None and tools.choice == "none":
            constraint = _no_calls()
        prompt = await responses_prompt.build(st, chat, tools.specs if tools else None, previous)
        kw = chat.sampling_kwargs(max_tokens_for(st, len(prompt.token_ids), req.max_output_tokens, "input"))
        if constraint is not None:
            kw["structured_outputs"] = constraint.params
        params = sampling_params(kw)
        await S.precompile(st.engine, constraint)
        rid = I.new_id("resp")
        sub = Submission(st, [Job(0, prompt.token_ids, prompt.text, rid)], params, t0, user=req.user)
    turn = _Turn(req, rid, st.model_name(req.model), st.tokenizer, store, history, prompt, tools)
    events = _events(turn, sub) if req.stream else None
    return await answer(st, request, sub, events, f"response stream {rid}", turn.finish)


async def _events(turn: _Turn, sub: Submission) -> AsyncGenerator[str, None]:
    es = EventStream()
    yield es.response("response.created", turn.body("in_progress", []))
    yield es.response("response.in_progress", turn.body("in_progress", []))
    delta = Delta(0)
    calls = S.ToolStream() if turn.tools is not None and turn.tools.parse else None
    final = None
    try:
        async with contextlib.aclosing(sub.outputs()) as outputs:
            async for _, out in outputs:
                o = out.outputs[0]
                done = o.finish_reason is not None
                text = delta.text(0, o.text, done)
                call_deltas: list[dict[str, Any]] = []
                if calls is not None:
                    text, call_deltas = calls.feed(text, done)
                for e in es.text(text) + es.calls(call_deltas):
                    yield e
                if out.finished:
                    final = out
        for e in es.close():
            yield e
        if final is None:
            raise RuntimeError("the engine request ended without a final output")
        body = turn.complete(es.items, final)
        yield es.response("response.completed" if body["status"] == "completed" else "response.incomplete", body)
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        logger.warning("response stream %s failed: %s", turn.id, e, exc_info=not isinstance(e, ValueError))
        error = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
        yield es.response("response.failed", turn.body("failed", es.items, error=error))


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, type="invalid_request_error",
                       param="response_id")


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    entry = store_of(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.body


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not store_of(request).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
