"""Which retrieved sources an answer cites.

A citation is a retrieved source's id in square brackets (``[kv_cache.md]``, or several in one pair:
``[a.md, b.md]``) that the model wrote. Models, small ones above all, also copy the prompt: a chunk's label
(``[kv_cache.md] KV cache`` as ``fr.rag`` renders it) or a document sentence that itself mentions
``[copy_on_write.md]``. Such a bracket is not a citation. So a bracket whose surrounding text on its line
(``_CONTEXT`` characters either side) holds real words and appears verbatim in the prompt counts as copied;
one the model wrote on its own line or inside its own sentence counts as cited.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["cited_sources"]

_BRACKET = re.compile(r"\[([^\[\]\n]+)\]")
_CONTEXT = 24  #: characters each side of a bracket compared with the prompt
_MIN_WORDS = 8  #: letters and digits of context needed before a bracket can count as copied


def _copied(line: str, start: int, end: int, prompt: str) -> bool:
    window = line[max(0, start - _CONTEXT) : end + _CONTEXT]
    around = line[max(0, start - _CONTEXT) : start] + line[end : end + _CONTEXT]
    return sum(ch.isalnum() for ch in around) >= _MIN_WORDS and window.strip() in prompt


def cited_sources(answer: str, sources: Iterable[str], prompt: str = "") -> list[str]:
    """The ``sources`` that ``answer`` cites in brackets, sorted; brackets copied from ``prompt`` do not count."""
    known = set(sources)
    cited: set[str] = set()
    for line in answer.splitlines():
        for m in _BRACKET.finditer(line):
            names = {n.strip() for n in re.split(r"[,;]", m.group(1))} & known
            if names and not (prompt and _copied(line, m.start(), m.end(), prompt)):
                cited |= names
    return sorted(cited)
