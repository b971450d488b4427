"""Chat threads: a ``Thread`` whose text is a conversation rendered through the model's chat template, with
the tool loop (``assistant(tools=...)``); see ``ChatThread``."""

from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncGenerator, Iterable

from .thread import Thread

if TYPE_CHECKING:
    from .model import Model

__all__ = ["ChatThread", "DEFAULT_CHAT_TEMPLATE"]

# Used when the tokenizer has no chat template of its own (e.g. base models): plain ChatML text.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DEFAULT_TEMPLATE_STOP = "<|im_end|>"
# tool_choice="none" with tools in the prompt: any text without a "<tool_call>" (llguidance lexeme negation)
_NO_TOOL_CALL_GRAMMAR = "start: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/"


class ChatThread(Thread):
    """A conversation rendered through the model's chat template.

    ``c.system(...)``, ``c.user(...)`` and ``c.message(role, content)`` add messages (nothing runs);
    ``await c.assistant(**sampling)`` renders the conversation with the generation prompt, generates the
    reply, records it as an assistant message and returns it. ``c.stream(...)`` and ``c.select(...)`` do
    the same with streaming / a choice of replies.

    Earlier turns stay byte-stable: each call renders the whole conversation, checks that what the thread
    already holds is a prefix of it, and appends only the rest, so every turn reuses the KV of all earlier
    turns. When a template re-renders history differently (some strip earlier reasoning, or trim the
    reply), the thread falls back to the full rendering in a fresh sequence (shared full blocks still come
    from the prefix cache); ``llm.counters["chat_rerenders"]`` counts those fallbacks.
    """

    _special_prefix = False  # chat templates carry their own BOS

    def __init__(self, model: "Model", *, system: str | None = None, messages: Iterable[dict[str, Any]] = (),
                 chat_template: str | None = None) -> None:
        super().__init__(model, "")
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        if system is not None:
            self.messages.insert(0, {"role": "system", "content": system})
        tok = model.tokenizer
        self.chat_template = chat_template
        self._fallback_template = chat_template is None and not getattr(tok, "chat_template", None)
        self.tools: list[Any] = []  # the tools rendered into the conversation (set by assistant(tools=...))

    def _copy_extra_state(self, child: "Thread") -> None:
        assert isinstance(child, ChatThread)
        child.messages = [dict(m) for m in self.messages]
        child.chat_template = self.chat_template
        child._fallback_template = self._fallback_template
        child.tools = list(self.tools)

    def _new_like(self) -> "Thread":
        child = super()._new_like()
        assert isinstance(child, ChatThread)
        child.messages, child.chat_template, child._fallback_template = [], None, False
        child.tools = []
        return child

    # ------------------------------------------------------------------ messages
    def message(self, role: str, content: str) -> "ChatThread":
        if not isinstance(content, str):
            raise TypeError(f"message content must be a str, got {type(content).__name__}")
        from ..engine.model.tokenizer import check_text

        check_text(content, f"{role} message content")
        self._check_usable()
        self.messages.append({"role": role, "content": content})
        return self

    def system(self, content: str) -> "ChatThread":
        return self.message("system", content)

    def user(self, content: str) -> "ChatThread":
        return self.message("user", content)

    def append(self, text: str) -> "ChatThread":
        raise TypeError("a chat thread holds messages: use c.user(...), c.system(...) or c.message(role, ...) "
                        "(raw text would not survive the chat template's rendering)")

    def render(self, add_generation_prompt: bool = False) -> str:
        template = DEFAULT_CHAT_TEMPLATE if self._fallback_template else self.chat_template
        if not self.messages:
            return ""
        from .tools import messages_for_template

        messages, tools = messages_for_template(
            self.messages, self.tools, template or getattr(self.model.tokenizer, "chat_template", None))
        return self.model.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"chat_template": template} if template else {}), **({"tools": tools} if tools else {}))

    def _sync(self, add_generation_prompt: bool) -> None:
        """Bring the thread's text up to the rendering of ``messages``, appending only what is new."""
        rendered = self.render(add_generation_prompt)
        current = self._text + self._pending
        if rendered.startswith(current):
            self._pending += rendered[len(current):]
        else:
            self.model.counters["chat_rerenders"] += 1
            self._drop_state()
            self._text, self._pending = "", rendered

    def fork(self, n: int = 1) -> list["Thread"]:
        self._check_usable()
        self._sync(add_generation_prompt=False)
        return super().fork(n)

    # ------------------------------------------------------------------ model calls
    def _chat_params(self, sampling: dict[str, Any]) -> dict[str, Any]:
        if self._fallback_template and "stop" not in sampling and "sampling_params" not in sampling:
            sampling = {**sampling, "stop": [_DEFAULT_TEMPLATE_STOP]}
        return sampling

    async def assistant(self, *, tools: Iterable[Any] | None = None, tool_choice: str | None = None,
                        parallel_tool_calls: bool = True, max_tool_calls: int | None = None,
                        **sampling: Any) -> Any:
        """Generate the assistant's reply to the conversation so far and record it.

        ``json=`` / ``regex=`` / ``choice=`` / ``grammar=`` constrain the reply as in ``Thread.gen`` (``json=``
        returns the parsed value; the message records the text). ``tools=[...]`` (``@fr.tool`` functions,
        ToolSpecs or OpenAI tool dicts) are rendered through the chat template and stay with the chat
        (``c.tools``; ``tools=[]`` removes them). With tools the reply is an ``AssistantReply`` (a str, plus
        ``.content`` and ``.tool_calls``); ``tool_choice``: "auto" (default: the model may call; a call it
        starts is constrained to the tools' schemas), "required" (at least one call, constrained),
        a tool's name (a call of that tool), "none" (no calls: generation stops at a ``<tool_call>``).
        A reply makes at most ``max_tool_calls`` calls (default ``toolcalls.MAX_CALLS``), so it always ends."""
        from . import toolcalls
        from .tools import TOOL_CHOICES, AssistantReply, as_tools, assistant_message

        self._check_usable()
        if tools is not None:
            self.tools = as_tools(tools)
        if not self.tools:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError(f"tool_choice={tool_choice!r} needs tools: pass tools=[...]")
            self._sync(add_generation_prompt=True)
            reply = await super().gen(**self._chat_params(sampling))
            assert self.last_output is not None
            self.messages.append({"role": "assistant", "content": self.last_output.outputs[0].text})
            self.model.counters["chat_turns"] += 1
            return reply
        choice = "auto" if tool_choice is None else tool_choice
        names = [t.name for t in self.tools]
        if not isinstance(choice, str) or (choice not in TOOL_CHOICES and choice not in names):
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a tool's name "
                             f"({', '.join(names)}), got {choice!r}")
        if choice != "none" and any(sampling.get(k) is not None for k in ("json", "regex", "choice", "grammar")):
            raise ValueError("json=/regex=/choice=/grammar= cannot be combined with tool calls: pass "
                             "tool_choice='none'")
        from .tools import specs as _specs

        tool_specs = _specs(self.tools)
        sampling = dict(sampling)
        user_constraint = any(sampling.get(k) is not None for k in ("json", "regex", "choice", "grammar"))
        if choice == "none":
            if not user_constraint and "sampling_params" not in sampling and "structured_outputs" not in sampling:
                # Free text that never opens a call block (a stop string would leave the turn empty).
                from ..engine import StructuredOutputsParams

                sampling["structured_outputs"] = StructuredOutputsParams(grammar=_NO_TOOL_CALL_GRAMMAR)
        elif "sampling_params" in sampling:
            raise ValueError("tool calls need sampling keywords, not sampling_params=")
        else:
            constraint = (toolcalls.call_constraint(tool_specs, choice, parallel_tool_calls, max_tool_calls)
                          if choice != "auto" else toolcalls.auto_constraint(tool_specs, max_tool_calls))
            if constraint is not None:
                sampling["structured_outputs"] = constraint
                sampling.setdefault("max_tokens", 256)
        self._sync(add_generation_prompt=True)
        value = await super().gen(**self._chat_params(sampling))
        assert self.last_output is not None
        co = self.last_output.outputs[0]
        text = co.text
        if choice == "none":
            reply = AssistantReply(text, text, [])
            if user_constraint and sampling.get("json") is not None:  # json= returns the parsed value
                self.messages.append(assistant_message(reply))
                self.model.counters["chat_turns"] += 1
                return value
        else:
            content, calls = toolcalls.parse_tool_calls(text)
            if choice != "auto" and not calls:  # (parallel calls cut off after a complete one keep those)
                from .structured import IncompleteOutputError

                raise IncompleteOutputError(
                    f"assistant(tool_choice={choice!r}): the tool call was cut off at max_tokens="
                    f"{sampling.get('max_tokens')} (finish_reason {co.finish_reason!r}); raise max_tokens", text)
            reply = AssistantReply(text, content, calls)
        self.messages.append(assistant_message(reply))
        self.model.counters["chat_turns"] += 1
        return reply

    async def call_tools(self, reply: Any, *, tools: Iterable[Any] | None = None) -> list[str]:
        """Run the tool calls of ``reply`` (an ``AssistantReply``, or a list of ToolCalls) concurrently (sync
        tools in worker threads), with the chat's tools (or ``tools``), and append one ``role: "tool"``
        message per call (``tool_call_id``, ``name``, ``content``). Invalid arguments, unknown tools and
        exceptions become the tool message's text ("error: ..."), not a crash. Returns the results."""
        from .tools import as_tools, run_tool_calls

        self._check_usable()
        calls = list(getattr(reply, "tool_calls", reply) or [])
        available = as_tools(tools) if tools is not None else self.tools
        results = await run_tool_calls(calls, available)
        self._check_usable()
        for call, result in zip(calls, results):
            self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
        return results

    async def gen(self, **sampling: Any) -> str:  # a chat thread's generation is the assistant turn
        return await self.assistant(**sampling)

    async def stream(self, **sampling: Any) -> AsyncGenerator[str, None]:
        self._check_usable()
        self._sync(add_generation_prompt=True)
        parts: list[str] = []
        async with aclosing(super().stream(**self._chat_params(sampling))) as pieces:
            async for piece in pieces:
                parts.append(piece)
                yield piece
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        self.model.counters["chat_turns"] += 1

    async def beam(self, *, width: int = 4, max_tokens: int = 16, length_penalty: float = 1.0,
                   ignore_eos: bool = False, **constraint: Any) -> list["Thread"]:
        """Beam search for the assistant's reply (see ``Thread.beam``): the conversation is rendered with the
        generation prompt, and each beam is a chat thread whose last message is its reply (the beam's
        text), ready for the next turn. This thread is unchanged."""
        self._check_usable()
        before = self._pending
        self._sync(add_generation_prompt=True)
        # The search runs on a fork holding the generation prompt (tokenized with the new messages as one
        # piece, as assistant() does), so this thread's own tokens end where its conversation does.
        prompt, self._pending = self._pending, ""
        holder = self._fork_raw(1)[0]
        self._copy_extra_state(holder)
        holder._pending = prompt
        self._pending = before if self._has_tokens() else ""  # (without tokens, the next sync renders it all)
        try:
            beams = await Thread.beam(holder, width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                                      ignore_eos=ignore_eos, **constraint)
        finally:
            holder.close()
        self.model.counters["chat_turns"] += 1
        return beams

    def _record_beam(self, child: "Thread", beam: Any) -> None:
        assert isinstance(child, ChatThread)
        child.messages.append({"role": "assistant", "content": beam.output_text})

    async def select(self, options: Iterable[str], *, by: str = "total", append: bool = True) -> str:
        """The most likely assistant reply among ``options`` (recorded as the reply when ``append``)."""
        self._check_usable()
        self._sync(add_generation_prompt=True)
        choice = await super().select(options, by=by, append=append)
        if append:
            self.messages.append({"role": "assistant", "content": choice})
        return choice

    async def scores(self, options: Iterable[str], *, by: str = "total") -> dict[str, float]:
        self._check_usable()
        before, rerenders = self._pending, self.model.counters["chat_rerenders"]
        self._sync(add_generation_prompt=True)
        try:
            return await super().scores(options, by=by)
        finally:
            # Scoring leaves the conversation as it was: drop the generation prompt again (unless the
            # sync fell back to a fresh rendering, whose pending text is all there is).
            if self.model.counters["chat_rerenders"] == rerenders and not self._closed:
                self._pending = before
