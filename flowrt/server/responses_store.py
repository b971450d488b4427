"""Stored responses: what ``GET /v1/responses/{id}`` returns and what ``previous_response_id`` continues.

Each entry keeps the response object, the conversation so far as chat messages (without the request's
``instructions``, which OpenAI does not carry over) and the exact token sequence the model saw and wrote
(prompt + output, as ``array('i')``), with its text. A follow-up that renders to that text plus more
continues that token sequence, so the engine's prefix cache serves the whole history (the model's own
sampled tokens included, which re-tokenizing its text may not reproduce).

Bounded by count and by bytes (the JSON size of the object and the messages, the text, 4 bytes a token):
the oldest entries go first; an entry larger than the whole byte bound is not kept. Only the event loop
touches the store, so it needs no lock.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .defaults import DEFAULT_RESPONSES_MAX, DEFAULT_RESPONSES_MAX_BYTES
from .responses_items import nbytes


@dataclass
class StoredResponse:
    body: dict[str, Any]
    messages: list[dict[str, Any]]   # the conversation, output included (chat messages)
    token_ids: array                 # prompt + output tokens
    text: str                        # their text: the prompt as rendered, the output as decoded

    @property
    def nbytes(self) -> int:
        return (nbytes(self.body) + nbytes(self.messages) + len(self.text.encode("utf-8"))
                + self.token_ids.itemsize * len(self.token_ids))


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_RESPONSES_MAX,
                 max_bytes: int = DEFAULT_RESPONSES_MAX_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Keeps `entry` (evicting the oldest as needed); False when it alone is over the bounds."""
        size = entry.nbytes
        if size > self.max_bytes or self.max_responses == 0:
            return False
        self.delete(entry.body["id"])
        while self._entries and (len(self._entries) >= self.max_responses or self.bytes + size > self.max_bytes):
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= old
            self.evicted += 1
        self._entries[entry.body["id"]] = (entry, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        return found[0] if found else None

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is None:
            return False
        self.bytes -= found[1]
        return True
