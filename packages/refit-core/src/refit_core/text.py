"""Plain-text tables for the CLI and reports (stdlib only)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align_columns"]


def align_columns(
    rows: Sequence[Sequence[str]], *, right: bool = False, rule: bool = False
) -> list[str]:
    """``rows`` of cells as lines: every column padded to its widest cell, two spaces apart,
    trailing spaces stripped.

    Args:
        rows: the first row is the header; every row has the same number of cells.
        right: right-align the cells (numbers) instead of left-aligning them.
        rule: put a row of dashes under the header.
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [rows[0], *([["-" * w for w in widths]] if rule else []), *rows[1:]]
    pad = str.rjust if right else str.ljust
    return [
        "  ".join(pad(cell, w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
