"""Plain-text tables for the CLI's listings: each column as wide as its widest cell, so long cells (nested
step paths such as ``related/summary#2/outline``) never push the columns after them out of line."""

from __future__ import annotations

from typing import Sequence

__all__ = ["text_table"]


def text_table(rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset(), gap: str = "  ") -> list[str]:
    """The rows as aligned lines; columns in ``right`` are right-aligned (numbers). The last column is not
    padded and no line ends in spaces."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        cells[-1] = row[-1]
        lines.append(gap.join(cells).rstrip())
    return lines
