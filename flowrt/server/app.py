"""The OpenAI-compatible FastAPI app over an in-process flowrt engine.

``create_app(engine, ...)`` takes an already-constructed ``flowrt.engine.AsyncLLM`` (tests and embedders
build their own; ``flowrt serve`` builds one from its options) and returns the ASGI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import protocol as P
from .errors import OpenAIError, RequestTooLarge, bad_request, from_exception, install_handlers
from .metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("flowrt.server")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_ABORTED_KEY = "flowrt_aborted"  # set in scope["state"] when the client went away mid-request
_KNOWN_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions")


@dataclass
class ServerState:
    engine: Any
    served_model_names: list[str]
    model_root: str | None
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics
    workflows: dict[str, Any] = field(default_factory=dict)
    workflow_runtime: Any = None
    created: int = field(default_factory=P.now)
    shutting_down: bool = False

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)


# ---------------------------------------------------------------------------------------------------------
# ASGI guard: API key, body size limit, request counting by status


class _Guard:
    """Pure ASGI middleware (streaming-safe): checks the API key on /v1, enforces the body size limit,
    and counts requests by endpoint and final status (499 when the client disconnected)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.st = state

    @staticmethod
    def _endpoint(path: str) -> str:
        if path in _KNOWN_PATHS:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        if path.startswith("/v1/workflows/") and path.endswith("/runs"):
            return "/v1/workflows/{name}/runs"
        return "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        st = self.st
        endpoint = self._endpoint(scope["path"])
        status = {"code": 500}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        st.metrics.in_flight.inc()
        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            err = self._check_key(headers.get("authorization"))
            if err is None:
                err = self._check_length(headers.get("content-length"))
            if err is not None:
                await err.response()(scope, receive, counting_send)
                return
            limit, seen = st.max_body_bytes, 0

            async def limited_receive() -> dict:
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise RequestTooLarge(limit)
                return message

            await self.app(scope, limited_receive, counting_send)
        finally:
            st.metrics.in_flight.dec()
            code = "499" if scope.get("state", {}).get(_ABORTED_KEY) else str(status["code"])
            st.metrics.requests.labels(endpoint=endpoint, status=code).inc()

    def _check_key(self, authorization: str | None) -> OpenAIError | None:
        key = self.st.api_key
        if key is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        what = "Missing API key" if not authorization else "Incorrect API key provided"
        return OpenAIError(f"{what}: pass it as 'Authorization: Bearer <key>'.", 401,
                           type="invalid_request_error", code="invalid_api_key")

    def _check_length(self, content_length: str | None) -> OpenAIError | None:
        if content_length is None:
            return None
        try:
            n = int(content_length)
        except ValueError:
            return bad_request("Invalid Content-Length header.")
        return RequestTooLarge(self.st.max_body_bytes) if n > self.st.max_body_bytes else None


# ---------------------------------------------------------------------------------------------------------
# Engine calls


@dataclass
class _Job:
    """One engine request: a prompt (token ids) with its sampling params."""
    index: int            # prompt index within the HTTP request
    prompt_ids: list[int]
    prompt_text: str | None
    request_id: str


async def _engine_stream(st: ServerState, job: _Job, params: Any, t0: float) -> AsyncIterator[Any]:
    """engine.stream with metrics (TTFT, ITL, tokens); aborts the engine request unless it finished."""
    finished = False
    prev_counts: list[int] = []
    t_prev: float | None = None
    m = st.metrics
    try:
        async for out in st.engine.stream(job.prompt_ids, params, request_id=job.request_id):
            counts = [len(o.token_ids) for o in out.outputs]
            new = max((c - (prev_counts[i] if i < len(prev_counts) else 0) for i, c in enumerate(counts)), default=0)
            if new > 0:
                t = time.perf_counter()
                if t_prev is None:
                    m.ttft.observe(t - t0)
                    for _ in range(new - 1):
                        m.itl.observe(0.0)
                else:
                    for _ in range(new):
                        m.itl.observe((t - t_prev) / new)
                t_prev = t
                prev_counts = counts
            if out.finished:
                finished = True
                m.e2e.observe(time.perf_counter() - t0)
                m.prompt_tokens.inc(len(out.prompt_token_ids or job.prompt_ids))
                m.generation_tokens.inc(sum(counts))
                m.cached_tokens.inc(out.num_cached_tokens or 0)
                for o in out.outputs:
                    m.finished.labels(reason=str(o.finish_reason)).inc()
            yield out
            if finished:
                return
    finally:
        if not finished:
            with contextlib.suppress(Exception):
                st.engine.abort(job.request_id)


async def _merged(st: ServerState, jobs: list[_Job], params: Any, t0: float) -> AsyncIterator[tuple[_Job, Any]]:
    """Snapshots of several engine requests, interleaved as they arrive. Closing the iterator (or
    cancelling its consumer) aborts every request that has not finished."""
    if len(jobs) == 1:
        job = jobs[0]
        async with contextlib.aclosing(_engine_stream(st, job, params, t0)) as it:
            async for out in it:
                yield job, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def pump(job: _Job) -> None:
        try:
            async with contextlib.aclosing(_engine_stream(st, job, params, t0)) as it:
                async for out in it:
                    queue.put_nowait((job, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the consumer
            queue.put_nowait((job, e))
        finally:
            queue.put_nowait((job, _END))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        remaining = len(tasks)
        while remaining:
            job, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(st: ServerState, request: Request, jobs: list[_Job], params: Any,
                   t0: float) -> dict[int, Any] | None:
    """Final outputs by prompt index, or None when the client disconnected first (requests aborted)."""

    async def run() -> dict[int, Any]:
        final: dict[int, Any] = {}
        async with contextlib.aclosing(_merged(st, jobs, params, t0)) as it:
            async for job, out in it:
                if out.finished:
                    final[job.index] = out
        return final

    gen = asyncio.create_task(run())
    disc = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({gen, disc}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gen.done():
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
        disc.cancel()
        await asyncio.gather(disc, return_exceptions=True)
    if gen.cancelled():
        _mark_aborted(st, request)
        return None
    try:
        return gen.result()
    except ValueError as e:  # the engine refused the request (pydantic ValidationError is a ValueError)
        raise from_exception(e) from None


# ---------------------------------------------------------------------------------------------------------
# Output helpers


def _clean_logprob(x: float) -> float:
    return -9999.0 if (x is None or math.isinf(x) or math.isnan(x)) else float(x)


_PIECE_WINDOW = 6


class _TokenText:
    """The text each token adds in context, for logprobs: decoding a token alone loses what depends on
    its neighbours (SentencePiece's leading space), so a token's text is decode(context + [token]) minus
    decode(context), over a short window of the tokens before it. Alternatives (top logprobs) are
    decoded in the same context. Special tokens are shown (e.g. "</s>")."""

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self.tok = tokenizer
        self.ctx = list(context[-_PIECE_WINDOW:])
        self._base: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def piece(self, tid: int) -> str:
        if not self.ctx:
            return self._decode([tid])
        if self._base is None:
            self._base = self._decode(self.ctx)
        full = self._decode(self.ctx + [tid])
        return full[len(self._base):] if full.startswith(self._base) else self._decode([tid])

    def advance(self, tid: int) -> None:
        self.ctx = (self.ctx + [tid])[-_PIECE_WINDOW:]
        self._base = None


def _top_entries(lp_dict: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    return sorted(((t, e) for t, e in lp_dict.items() if e.rank is not None and 1 <= e.rank <= k),
                  key=lambda te: te[1].rank)


class _CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset); the decoding context and `offset` continue across streamed chunks."""

    def __init__(self, tokenizer: Any, k: int, context: list[int]) -> None:
        self.text = _TokenText(tokenizer, context)
        self.k = k
        self.offset = 0

    def build(self, token_ids: list[int], lps: list[dict[int, Any] | None]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps):
            s = self.text.piece(tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if d is None:
                values.append(None)
                tops.append(None)
            else:
                entry = d.get(tid)
                values.append(_clean_logprob(entry.logprob) if entry is not None else None)
                top = {self.text.piece(t): _clean_logprob(e.logprob) for t, e in _top_entries(d, self.k)}
                if entry is not None:
                    top.setdefault(s, _clean_logprob(entry.logprob))
                tops.append(top)
            self.text.advance(tid)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class _ChatLogprobs:
    """Chat `logprobs.content` entries; the decoding context continues across streamed chunks."""

    def __init__(self, tokenizer: Any, k: int, context: list[int]) -> None:
        self.text = _TokenText(tokenizer, context)
        self.k = k

    def build(self, token_ids: list[int], lps: list[dict[int, Any]]) -> list[dict[str, Any]]:
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.text.piece(tid)
            entry = (d or {}).get(tid)
            tops = []
            for t, e in _top_entries(d or {}, self.k):
                ts = self.text.piece(t)
                tops.append({"token": ts, "logprob": _clean_logprob(e.logprob), "bytes": list(ts.encode("utf-8"))})
            content.append({"token": s, "logprob": _clean_logprob(entry.logprob if entry is not None else None),
                            "bytes": list(s.encode("utf-8")), "top_logprobs": tops})
            self.text.advance(tid)
        return content


class _Delta:
    """Turns cumulative per-choice snapshots into increments. While a choice is running it holds back
    text that could still change: a trailing incomplete UTF-8 character and, when stop strings are
    set, the last (longest stop string - 1) characters, which the engine may still remove."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.done: set[int] = set()

    def text(self, ci: int, text: str, finished: bool) -> str:
        sent = self.text_sent.get(ci, 0)
        end = len(text)
        if not finished:
            end -= self.holdback
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= sent:
            return ""
        self.text_sent[ci] = end
        return text[sent:end]

    def tokens(self, ci: int, o: Any) -> tuple[list[int], list[Any]]:
        sent = self.tokens_sent.get(ci, 0)
        if o.logprobs is None:
            return [], []
        end = min(len(o.token_ids), len(o.logprobs))
        self.tokens_sent[ci] = max(sent, end)
        return list(o.token_ids[sent:end]), list(o.logprobs[sent:end])


def _finish_reason(o: Any) -> str | None:
    return o.finish_reason


def _usage_of(finals: dict[int, Any], jobs: list[_Job]) -> dict[str, Any]:
    prompt = completion = cached = 0
    for job in jobs:
        out = finals.get(job.index)
        prompt += len(job.prompt_ids)
        if out is not None:
            completion += sum(len(o.token_ids) for o in out.outputs)
            cached += out.num_cached_tokens or 0
    return P.usage(prompt, completion, cached)


# ---------------------------------------------------------------------------------------------------------
# The app


def create_app(engine: Any, *, served_model_name: str | list[str] | None = None, model_path: str | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               workflows: dict[str, Any] | None = None, workflow_runtime: Any = None,
               owns_engine: bool = False) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a flowrt.engine.AsyncLLM).

    served_model_name: the name(s) clients must pass as `model` (default: the model directory's name, or
    "flowrt"). api_key: when set, every /v1 request needs `Authorization: Bearer <key>`.
    workflows: name -> fr.Workflow served at POST /v1/workflows/{name}/runs (see flowrt.server.workflows);
    workflow_runtime: the fr.Runtime they run on (default: one over `engine`).
    owns_engine: shut the engine down when the app shuts down.
    """
    from flowrt.engine import SamplingParams  # the engine is imported only when an app is built

    if served_model_name is None:
        served_model_name = default_model_name(model_path)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    st = ServerState(engine=engine, served_model_names=names, model_root=model_path, api_key=api_key,
                     max_body_bytes=max_body_bytes, metrics=ServerMetrics(engine.stats),
                     workflows=dict(workflows or {}), workflow_runtime=workflow_runtime)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        st.shutting_down = True
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flowrt", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.flowrt = st
    install_handlers(app)
    app.add_middleware(_Guard, state=st)

    # ---- plain endpoints -----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if st.shutting_down:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        try:
            stats = engine.stats()
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"status": "error", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse({"status": "ok", "running": stats.get("num_running"),
                             "waiting": stats.get("num_waiting")})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list",
                "data": [P.model_card(n, st.model_root, st.max_model_len, st.created) for n in names]}

    @v1.get("/models/{model:path}")
    async def get_model(model: str) -> dict:
        _check_model(model)
        return P.model_card(model, st.model_root, st.max_model_len, st.created)

    def _check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise OpenAIError(f"The model '{model}' does not exist. This server serves: {', '.join(names)}.", 404,
                              type="invalid_request_error", param="model", code="model_not_found")

    def _check_not_shutting_down() -> None:
        if st.shutting_down:
            raise OpenAIError("The server is shutting down.", 503)

    def _max_tokens(prompt_len: int, requested: int | None, param: str) -> int:
        limit = st.max_model_len
        if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
            want = f" and {requested} for the completion" if requested is not None else ""
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the prompt{want}). "
                f"Please reduce the length of the prompt or the completion.", 400, param=param,
                code="context_length_exceeded")
        return requested if requested is not None else limit - prompt_len

    def _sampling(kw: dict[str, Any]) -> Any:
        try:
            return SamplingParams(**kw)
        except Exception as e:  # ValidationError / ValueError name the field
            raise from_exception(e) from None

    # ---- completions -----------------------------------------------------------------------------------

    @v1.post("/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        _check_not_shutting_down()
        _check_model(req.model)
        req.check_unsupported()
        tok = st.tokenizer
        base = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        for i, p in enumerate(req.prompts()):
            if isinstance(p, str):
                ids, text = await _encode(tok, p, True), p
            else:
                vocab = len(tok)
                bad = next((t for t in p if t < 0 or t >= vocab), None)
                if bad is not None:
                    raise bad_request(f"Token id {bad} is out of the vocabulary (0..{vocab - 1}).", param="prompt")
                ids, text = p, None
            jobs.append(_Job(i, ids, text, f"{base}-{i}"))
        max_tokens = min(_max_tokens(len(j.prompt_ids), req.max_tokens, "prompt") for j in jobs)
        kw = req.sampling_kwargs(max_tokens)
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
            if req.echo:
                kw["prompt_logprobs"] = req.logprobs
        params = _sampling(kw)
        n = req.n
        model = req.model or names[0]
        created = P.now()

        def prompt_text(job: _Job) -> str:
            if job.prompt_text is None:
                job.prompt_text = tok.decode(job.prompt_ids)
            return job.prompt_text

        def logprob_builder(job: _Job, out: Any) -> tuple[_CompletionLogprobs, dict[str, Any] | None]:
            """A builder for one choice's logprobs, and the echoed prompt's logprobs when echo is set."""
            b = _CompletionLogprobs(tok, req.logprobs or 0, [] if req.echo else job.prompt_ids)
            echo_lp = None
            if req.echo:
                plps = out.prompt_logprobs or [None] * len(job.prompt_ids)
                plps = [None] * (len(job.prompt_ids) - len(plps)) + list(plps)
                echo_lp = b.build(job.prompt_ids, plps)
            return b, echo_lp

        if not req.stream:
            finals = await _collect(st, request, jobs, params, t0)
            if finals is None:
                return Response(status_code=499)
            choices = []
            for job in jobs:
                out = finals[job.index]
                for o in out.outputs:
                    lp = None
                    if req.logprobs is not None:
                        b, echo_lp = logprob_builder(job, out)
                        if req.echo:
                            # offsets of generated tokens continue after the echoed prompt text
                            b.offset = len(prompt_text(job))
                        gen_lp = b.build(list(o.token_ids), list(o.logprobs or []))
                        if echo_lp is not None:
                            lp = {k: echo_lp[k] + gen_lp[k] for k in gen_lp}
                        else:
                            lp = gen_lp
                    text = (prompt_text(job) if req.echo else "") + o.text
                    choices.append({"index": job.index * n + o.index, "text": text, "logprobs": lp,
                                    "finish_reason": _finish_reason(o), "stop_reason": o.stop_reason})
            choices.sort(key=lambda c: c["index"])
            return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": _usage_of(finals, jobs)})

        holdback = max((len(s) for s in (params_stop(req.stop))), default=1) - 1
        include_usage = req.include_usage

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            d: dict[str, Any] = {"id": base, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices}
            if include_usage:
                d["usage"] = usage
            return P.sse(d)

        async def events() -> AsyncIterator[str]:
            delta = _Delta(holdback)
            builders: dict[int, _CompletionLogprobs] = {}
            finals: dict[int, Any] = {}
            echoed: set[int] = set()
            try:
                async with contextlib.aclosing(_merged(st, jobs, params, t0)) as it:
                    async for job, out in it:
                        if out.finished:
                            finals[job.index] = out
                        choices = []
                        for o in out.outputs:
                            ci = job.index * n + o.index
                            head, head_lp = "", None
                            if req.echo and ci not in echoed:
                                echoed.add(ci)
                                head = prompt_text(job)
                                if req.logprobs is not None:
                                    builders[ci], head_lp = logprob_builder(job, out)
                                    builders[ci].offset = len(head)
                            text = delta.text(ci, o.text, o.finish_reason is not None)
                            lp = None
                            if req.logprobs is not None:
                                if ci not in builders:
                                    builders[ci] = _CompletionLogprobs(tok, req.logprobs, job.prompt_ids)
                                b = builders[ci]
                                ids, lps = delta.tokens(ci, o)
                                lp = b.build(ids, lps)
                                if head_lp is not None:
                                    lp = {k: head_lp[k] + lp[k] for k in lp}
                            fin = o.finish_reason if (o.finish_reason is not None and ci not in delta.done) else None
                            if fin is not None:
                                delta.done.add(ci)
                            if head or text or fin is not None or (lp and lp["tokens"]):
                                choices.append({"index": ci, "text": head + text, "logprobs": lp,
                                                "finish_reason": fin,
                                                **({"stop_reason": o.stop_reason} if fin else {})})
                        for c in choices:  # one choice per chunk, as OpenAI streams n > 1
                            yield chunk([c])
                if include_usage:
                    yield chunk([], _usage_of(finals, jobs))
                yield P.SSE_DONE
            except (asyncio.CancelledError, GeneratorExit):
                _mark_aborted(st, request)
                raise
            except Exception as e:  # noqa: BLE001 - a failure after the headers went out
                logger.warning("completion stream %s failed: %s", base, e, exc_info=not isinstance(e, ValueError))
                err = from_exception(e) if isinstance(e, ValueError) else OpenAIError(f"{type(e).__name__}: {e}", 500)
                yield err.sse()
                yield P.SSE_DONE

        return _sse_response(events())

    # ---- chat completions ------------------------------------------------------------------------------

    @v1.post("/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        _check_not_shutting_down()
        _check_model(req.model)
        req.check_unsupported()
        tok = st.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions instead.", param="messages",
                              code="no_chat_template")
        messages = [m.for_template() for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           **(req.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (e.g. raise_exception in the template)
            raise bad_request(f"Could not apply the chat template: {e}", param="messages") from None
        ids = await _encode(tok, text, False)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        job = _Job(0, ids, text, base)
        max_tokens = _max_tokens(len(ids), req.requested_max_tokens, "messages")
        kw = req.sampling_kwargs(max_tokens)
        k = (req.top_logprobs or 0) if req.logprobs else None
        if k is not None:
            kw["logprobs"] = k
        params = _sampling(kw)
        model = req.model or names[0]
        created = P.now()

        if not req.stream:
            finals = await _collect(st, request, [job], params, t0)
            if finals is None:
                return Response(status_code=499)
            out = finals[0]
            choices = []
            for o in out.outputs:
                lp = {"content": _ChatLogprobs(tok, k, ids).build(list(o.token_ids), list(o.logprobs or []))} \
                    if k is not None else None
                choices.append({"index": o.index, "message": {"role": "assistant", "content": o.text},
                                "logprobs": lp, "finish_reason": _finish_reason(o), "stop_reason": o.stop_reason})
            return JSONResponse({"id": base, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": _usage_of(finals, [job])})

        holdback = max((len(s) for s in params_stop(req.stop)), default=1) - 1
        include_usage = req.include_usage

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            d: dict[str, Any] = {"id": base, "object": "chat.completion.chunk", "created": created,
                                 "model": model, "choices": choices}
            if include_usage:
                d["usage"] = usage
            return P.sse(d)

        async def events() -> AsyncIterator[str]:
            delta = _Delta(holdback)
            lp_builders: dict[int, _ChatLogprobs] = {}
            final = None
            try:
                for i in range(req.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async with contextlib.aclosing(_merged(st, [job], params, t0)) as it:
                    async for _, out in it:
                        if out.finished:
                            final = out
                        choices = []
                        for o in out.outputs:
                            text = delta.text(o.index, o.text, o.finish_reason is not None)
                            lp = None
                            if k is not None:
                                if o.index not in lp_builders:
                                    lp_builders[o.index] = _ChatLogprobs(tok, k, ids)
                                new_ids, lps = delta.tokens(o.index, o)
                                lp = {"content": lp_builders[o.index].build(new_ids, lps)}
                            fin = o.finish_reason if (o.finish_reason is not None
                                                      and o.index not in delta.done) else None
                            if fin is not None:
                                delta.done.add(o.index)
                            if text or fin is not None or (lp and lp["content"]):
                                choices.append({"index": o.index, "delta": {"content": text} if text else {},
                                                "logprobs": lp, "finish_reason": fin,
                                                **({"stop_reason": o.stop_reason} if fin else {})})
                        for c in choices:  # one choice per chunk, as OpenAI streams n > 1
                            yield chunk([c])
                if include_usage:
                    yield chunk([], _usage_of({0: final} if final is not None else {}, [job]))
                yield P.SSE_DONE
            except (asyncio.CancelledError, GeneratorExit):
                _mark_aborted(st, request)
                raise
            except Exception as e:  # noqa: BLE001
                logger.warning("chat stream %s failed: %s", base, e, exc_info=not isinstance(e, ValueError))
                err = from_exception(e) if isinstance(e, ValueError) else OpenAIError(f"{type(e).__name__}: {e}", 500)
                yield err.sse()
                yield P.SSE_DONE

        return _sse_response(events())

    app.include_router(v1)
    from . import workflows as _wf  # noqa: PLC0415 - keeps the workflow runtime optional
    _wf.install(app, st)
    return app


_LONG_TEXT = 8192  # characters; longer texts are tokenized off the event loop


async def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _LONG_TEXT:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens))


def params_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _mark_aborted(st: ServerState, request: Request) -> None:
    """Counts an aborted request; _Guard reports it with status 499 (request.state is scope["state"])."""
    setattr(request.state, _ABORTED_KEY, True)
    st.metrics.aborted.inc()


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def default_model_name(model_path: str | None) -> str:
    if not model_path:
        return "flowrt"
    name = os.path.basename(os.path.normpath(str(model_path)))
    return name[:-5] if name.endswith(".gguf") else name
