"""``POST /v1/completions``: legacy text completions (several prompts, n, echo, logprobs, streaming)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from . import protocol as P
from . import structured as S
from .errors import bad_request, from_exception
from .generation import Job, Submission, answer, sampling_params
from .outputs import CompletionLogprobs, Delta, stop_holdback, usage_of
from .prompts import check_token_ids, encode, max_tokens_for
from .state import ServerState, State
from .streaming import until_disconnect

router = APIRouter(prefix="/v1")


@dataclass
class _Completion:
    """One completions request once validated: what both the JSON and the streamed answer need."""
    req: P.CompletionRequest
    tokenizer: Any
    id: str
    model: str
    created: int = field(default_factory=P.now)

    def prompt_text(self, job: Job) -> str:
        if job.prompt_text is None:
            job.prompt_text = self.tokenizer.decode(job.prompt_ids)
        return job.prompt_text

    def logprob_builder(self, job: Job, out: Any) -> tuple[CompletionLogprobs, dict[str, Any] | None]:
        """A builder for one choice's logprobs, and the echoed prompt's logprobs when echo is set."""
        req = self.req
        b = CompletionLogprobs(self.tokenizer, req.logprobs or 0, [] if req.echo else job.prompt_ids)
        echo_lp = None
        if req.echo:
            plps = out.prompt_logprobs or [None] * len(job.prompt_ids)
            plps = [None] * (len(job.prompt_ids) - len(plps)) + list(plps)
            echo_lp = b.build(job.prompt_ids, plps)
            b.offset = len(self.prompt_text(job))  # generated tokens' offsets continue after the echo
        return b, echo_lp

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        d: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": choices}
        if self.req.include_usage:
            d["usage"] = usage
        return P.sse(d)


async def _jobs(st: ServerState, req: P.CompletionRequest, base: str) -> list[Job]:
    jobs = []
    for i, p in enumerate(req.prompts()):
        if isinstance(p, str):
            ids, text = await encode(st.tokenizer, p, True, "prompt"), p
        else:
            check_token_ids(st.tokenizer, p)
            ids, text = p, None
        jobs.append(Job(i, ids, text, f"{base}-{i}"))
    return jobs


def _sampling(req: P.CompletionRequest, max_tokens: int, constraint: S.Constraint | None) -> Any:
    kw = req.sampling_kwargs(max_tokens)
    if constraint is not None:
        kw["structured_outputs"] = constraint.params
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.echo:
            kw["prompt_logprobs"] = req.logprobs
    return sampling_params(kw)


@router.post("/completions")
async def completions(req: P.CompletionRequest, request: Request, st: State) -> Response:
    t0 = time.perf_counter()
    st.check_model(req.model)
    req.check_unsupported()
    constraint = S.from_request(req)
    base = f"cmpl-{uuid.uuid4().hex}"
    jobs = await _jobs(st, req, base)
    max_tokens = min(max_tokens_for(st, len(j.prompt_ids), req.max_tokens, "prompt") for j in jobs)
    c = _Completion(req, st.tokenizer, base, st.model_name(req.model))
    if req.use_beam_search:
        return await _beam_search(st, request, c, jobs, max_tokens, constraint)
    params = _sampling(req, max_tokens, constraint)
    await S.precompile(st.engine, constraint)  # off the event loop; the submission then hits the cache
    sub = Submission(st, jobs, params, t0, user=req.user)
    events = _events(c, sub) if req.stream else None
    return await answer(st, request, sub, events, f"completion stream {base}",
                        lambda finals: {"id": base, "object": "text_completion", "created": c.created,
                                        "model": c.model, "choices": _choices(c, jobs, finals),
                                        "usage": usage_of(finals, jobs)})


async def _beam_search(st: ServerState, request: Request, c: _Completion, jobs: list[Job], max_tokens: int,
                       constraint: S.Constraint | None) -> Response:
    """vLLM's `use_beam_search`: `n` beams per prompt (the engine's beam search), best first, as choices. A
    client that goes away aborts the searches (each releases its beams' KV), as it does any request."""
    from fastapi.responses import JSONResponse

    from flowrt.engine import BeamSearchParams

    req = c.req
    search = getattr(st.engine, "beam_search", None)
    if search is None:
        raise bad_request("use_beam_search is not supported by this engine.", param="use_beam_search")
    try:
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos),
                                  temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
                                  structured_outputs=constraint.params if constraint is not None else None)
    except ValueError as e:
        raise from_exception(e) from None

    async def searches() -> list[Any]:   # a task: a gather cancelled from outside holds a CancelledError instead
        return await asyncio.gather(*(search({"prompt_token_ids": j.prompt_ids}, params) for j in jobs))

    done, outs = await until_disconnect(st, request, searches())
    if not done or outs is None:   # outs is None only when not done
        return Response(status_code=499)
    choices, completion = [], 0
    for job, out in zip(jobs, outs):
        for i, b in enumerate(out.sequences):
            completion += len(b.output_tokens)
            text = (c.prompt_text(job) if req.echo else "") + b.output_text
            choices.append({"index": job.index * req.n + i, "text": text, "logprobs": None,
                            "finish_reason": b.finish_reason, "stop_reason": b.stop_reason})
    usage = P.usage(sum(len(j.prompt_ids) for j in jobs), completion, 0)
    return JSONResponse({"id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
                         "choices": choices, "usage": usage})


def _choices(c: _Completion, jobs: list[Job], finals: dict[int, Any]) -> list[dict[str, Any]]:
    req, choices = c.req, []
    for job in jobs:
        out = finals[job.index]
        for o in out.outputs:
            lp = None
            if req.logprobs is not None:
                b, echo_lp = c.logprob_builder(job, out)
                gen_lp = b.build(list(o.token_ids), list(o.logprobs or []))
                lp = {k: echo_lp[k] + gen_lp[k] for k in gen_lp} if echo_lp is not None else gen_lp
            text = (c.prompt_text(job) if req.echo else "") + o.text
            choices.append({"index": job.index * req.n + o.index, "text": text, "logprobs": lp,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    return sorted(choices, key=lambda ch: ch["index"])


async def _events(c: _Completion, sub: Submission) -> AsyncGenerator[str, None]:
    req = c.req
    delta = Delta(stop_holdback(req.stop))
    builders: dict[int, CompletionLogprobs] = {}
    finals: dict[int, Any] = {}
    echoed: set[int] = set()
    async with contextlib.aclosing(sub.outputs()) as outputs:
        async for job, out in outputs:
            if out.finished:
                finals[job.index] = out
            for o in out.outputs:
                ci = job.index * req.n + o.index
                head, head_lp = "", None
                if req.echo and ci not in echoed:
                    echoed.add(ci)
                    head = c.prompt_text(job)
                    if req.logprobs is not None:
                        builders[ci], head_lp = c.logprob_builder(job, out)
                text = delta.text(ci, o.text, o.finish_reason is not None)
                lp = None
                if req.logprobs is not None:
                    if ci not in builders:
                        builders[ci] = CompletionLogprobs(c.tokenizer, req.logprobs, job.prompt_ids)
                    lp = builders[ci].build(*delta.tokens(ci, o))
                    if head_lp is not None:
                        lp = {k: head_lp[k] + lp[k] for k in lp}
                fin = o.finish_reason if (o.finish_reason is not None and ci not in delta.done) else None
                if fin is not None:
                    delta.done.add(ci)
                if head or text or fin is not None or (lp and lp["tokens"]):
                    # one choice per chunk, as OpenAI streams n > 1
                    yield c.chunk([{"index": ci, "text": head + text, "logprobs": lp, "finish_reason": fin,
                                    **({"stop_reason": o.stop_reason} if fin else {})}])
    if req.include_usage:
        yield c.chunk([], usage_of(finals, sub.jobs))
    yield P.SSE_DONE
