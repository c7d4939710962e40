"""Markdown tables for the reports: one helper, so that every report's tables read alike."""

from __future__ import annotations

from collections.abc import Sequence


def table(columns: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """A markdown table: the header row, the rule, one line per row, each cell as `str(cell)`
    (format numbers before). `align`: one letter a column, "l" (rule `---`, the default for every
    column) or "r" (rule `---:`, right-aligned)."""
    align = "l" * len(columns) if align is None else align
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align must give 'l' or 'r' for each of the {len(columns)} columns; "
                         f"got {align!r}")
    rule = "|" + "".join("---|" if a == "l" else "---:|" for a in align)
    lines = ["| " + " | ".join(columns) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])
