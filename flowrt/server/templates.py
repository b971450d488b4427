"""Rendering a chat request's messages through the chat template, safely.

A chat template is a program (Jinja). The model's own template is the operator's; a template sent in a
request is a client's program running in the server, so it is refused unless the server was started with
``--trust-request-chat-template``. Either way rendering runs in a worker thread under a time cap that
stops it, so a slow template costs its own request a 400, not every other client their event loop.
"""

from __future__ import annotations

import functools

from flowrt.llm import toolcalls as TC

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


def _messages(req: P.ChatCompletionRequest, template: str, tools: list | None) -> tuple[list[dict], dict]:
    """The messages for the template, and its extra keyword arguments. Tools go to the template as
    `tools=` when it renders them; a template that ignores them (SmolLM2's own) gets a Hermes-style
    description in the system message instead, and an assistant turn's tool_calls as call blocks in its
    content when the template does not render `tool_calls`."""
    msgs = [m.for_template() for m in req.messages]
    extra: dict = {}
    if not TC.template_supports_tools(template):
        if tools:
            desc = TC.tools_system_prompt(tools)
            if msgs and msgs[0]["role"] in ("system", "developer"):
                msgs[0] = {**msgs[0], "content": (msgs[0]["content"] + "\n\n" + desc).strip()}
            else:
                msgs.insert(0, {"role": "system", "content": desc})
    elif tools:
        extra["tools"] = TC.render_tools_for_template(tools)
    if "tool_calls" not in template:
        for i, m in enumerate(msgs):
            if m.get("tool_calls"):
                blocks = "\n".join(TC.format_call(c["function"]["name"], c["function"]["arguments"])
                                    for c in m["tool_calls"])
                msgs[i] = {k: v for k, v in m.items() if k != "tool_calls"}
                msgs[i]["content"] = ((m.get("content") or "") + "\n" + blocks).strip()
    return msgs, extra


async def render_chat(st: ServerState, req: P.ChatCompletionRequest, tools: list | None = None) -> str:
    """`tools`: ToolSpecs to show the model (None: no tools)."""
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
    source = template if template is not None else st.tokenizer.chat_template
    msgs, extra = _messages(req, source if isinstance(source, str) else str(source), tools)
    kwargs.update(extra)
    render = functools.partial(st.tokenizer.apply_chat_template, msgs, tokenize=False,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, **kwargs)
    cap, where = st.chat_template_timeout, param if template is not None else "messages"
    try:
        return await run_with_deadline(render, cap, "flowrt-chat-template")
    except TimeoutError:
        raise bad_request(f"Rendering the chat template took longer than the server's limit of {cap:g} s.",
                          param=where, code="chat_template_timeout") from None
    except Exception as e:  # noqa: BLE001 - template errors (e.g. raise_exception in the template)
        raise bad_request(f"Could not apply the chat template: {e}", param=where) from None
