"""The Responses API event stream: text and tool-call deltas into ``response.*`` events, in the order the
openai client and the Agents SDK read them, each with its ``sequence_number``.

``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``, then for a
message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, and for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``; last ``response.completed``
(``response.incomplete`` when the output was cut off, ``response.failed`` on an error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from . import responses_items as I


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class EventStream:
    """Builds the events of one response; `items` are its output items as streamed (the final object's)."""
    items: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    _open: dict[str, Any] | None = None        # the item being streamed
    _text: list[str] = field(default_factory=list)
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # ToolStream call index -> item

    def event(self, kind: str, **fields: Any) -> str:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(e)

    def response(self, kind: str, body: dict[str, Any]) -> str:
        return self.event(kind, response=body)

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self.close()
            item = I.message_item("", status="in_progress")
            self._open, self._text = item, []
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                                  content_index=0, part=I.output_text("")))
        self._text.append(delta)
        out.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.items),
                              content_index=0, delta=delta, logprobs=[]))
        return out

    def calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        """Chat-style tool-call deltas (structured.ToolStream): a new call opens a function_call item."""
        out = []
        for d in deltas:
            if "id" in d:
                out += self.close()
                item = I.call_item(d["id"], d["function"]["name"], "", status="in_progress")
                self._open = self._calls[d["index"]] = item
                out.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
            args = d["function"].get("arguments", "")
            item = self._calls[d["index"]]
            if args and item is self._open:
                item["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items), delta=args))
        return out

    def close(self) -> list[str]:
        """Ends the item being streamed (its done events); it joins `items`."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, out = len(self.items), []
        if item["type"] == "message":
            text = "".join(self._text)
            part = I.output_text(text)
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            item = {**item, "status": "completed", "content": [part]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
