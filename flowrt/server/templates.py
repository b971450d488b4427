"""Rendering a chat request's messages through the chat template, safely.

A chat template is a program (Jinja). The model's own template is the operator's; a template sent in a
request is a client's program running in the server, so it is refused unless the server was started with
``--trust-request-chat-template``. Either way rendering runs in a worker thread under a time cap that
stops it, so a slow template costs its own request a 400, not every other client their event loop.
"""

from __future__ import annotations

import functools

from . import protocol as P
from .deadline import run_with_deadline
from .errors import bad_request
from .state import ServerState


def _request_template(req: P.ChatCompletionRequest) -> tuple[str | None, str]:
    """The template a request supplies (if any) and the parameter that carries it."""
    kwargs = req.chat_template_kwargs or {}
    if "chat_template" in kwargs:
        return kwargs["chat_template"], "chat_template_kwargs.chat_template"
    return req.chat_template, "chat_template"


async def render_chat(st: ServerState, req: P.ChatCompletionRequest) -> str:
    template, param = _request_template(req)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    if template is not None:
        if not st.trust_request_chat_template:
            raise bad_request(f"{param} is not accepted: this server renders only the model's own chat "
                              f"template (start it with --trust-request-chat-template to allow "
                              f"request-supplied templates).", param=param, code="chat_template_not_allowed")
        if not isinstance(template, str):
            raise bad_request(f"{param} must be a string.", param=param)
        kwargs["chat_template"] = template
    elif not getattr(st.tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions instead.", param="messages",
                          code="no_chat_template")
    render = functools.partial(st.tokenizer.apply_chat_template, [m.for_template() for m in req.messages],
                               tokenize=False, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, **kwargs)
    cap, where = st.chat_template_timeout, param if template is not None else "messages"
    try:
        return await run_with_deadline(render, cap, "flowrt-chat-template")
    except TimeoutError:
        raise bad_request(f"Rendering the chat template took longer than the server's limit of {cap:g} s.",
                          param=where, code="chat_template_timeout") from None
    except Exception as e:  # noqa: BLE001 - template errors (e.g. raise_exception in the template)
        raise bad_request(f"Could not apply the chat template: {e}", param=where) from None
