"""A response's prompt: the conversation rendered through the chat template, as token ids that continue the
previous response's own token sequence when it has one.

With ``previous_response_id`` the whole conversation is rendered (text only: a cheap template pass), and
when that text starts with the previous response's text (its prompt and its output as generated) only the
rest is tokenized and appended to the previous token sequence. The engine's prefix cache then holds every
full block of the history, the model's sampled tokens included. A template that renders the history
differently (other instructions or tools, a reply the template rewrites) falls back to tokenizing the
whole rendering (``continued == 0``), which is still correct.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import protocol as P
from .prompts import encode
from .responses_store import StoredResponse
from .state import ServerState
from .templates import render_chat


@dataclass
class Prompt:
    text: str
    token_ids: list[int]
    continued: int   # tokens taken over from the previous response's sequence (0: tokenized afresh)


async def build(st: ServerState, req: P.ChatCompletionRequest, tool_specs: list | None,
                previous: StoredResponse | None) -> Prompt:
    text = await render_chat(st, req, tool_specs)
    if previous is not None and text.startswith(previous.text):
        rest = text[len(previous.text):]
        ids = list(previous.token_ids)
        if rest:
            ids += await encode(st.tokenizer, rest, False, "input")
        return Prompt(text, ids, len(previous.token_ids))
    return Prompt(text, await encode(st.tokenizer, text, False, "input"), 0)
