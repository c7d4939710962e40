"""The repository's one markdown-table helper (`tasks.reporting.markdown.table`) and one
figure-to-PNG helper (`tasks.stages.plots.figure`, `tasks.stages.plots.png`): their output, and
that no other module builds either."""

import re
from pathlib import Path

import pytest

from tasks.reporting.markdown import table
from tasks.stages.plots import figure, png

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_table_header_rule_and_rows():
    assert table(["a", "b"], [[1, 0.5], ["x|y", None]]) == (
        "| a | b |\n|---|---|\n| 1 | 0.5 |\n| x|y | None |")
    assert table(["name", "n", "share"], [], align="lrr") == "| name | n | share |\n|---|---:|---:|"
    for bad in ("l", "lx", "lrr"):
        with pytest.raises(ValueError, match="'l' or 'r' for each of the 2 columns"):
            table(["a", "b"], [], align=bad)


def _size(data: bytes) -> tuple[int, int]:
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_png_of_a_figure_on_its_own_canvas():
    fig = figure(2.0, 1.0)  # 90 dpi by default
    fig.add_subplot().plot([0, 1], [1, 0])
    data = png(fig)
    assert data.startswith(PNG_MAGIC) and _size(data) == (180, 90)
    assert _size(png(figure(2.0, 1.0, dpi=100))) == (200, 100)
    narrow = figure(4.0, 2.0)
    narrow.add_subplot().plot([0, 1], [1, 0])
    png(narrow, rect=(0, 0, 0.5, 1))  # the axes fit in the left half
    assert narrow.subplotpars.right <= 0.5


def test_no_other_module_builds_a_markdown_rule_or_saves_a_figure():
    rule = re.compile(r"""["']\|?-{3}:?\|""")  # a string that builds a table rule: "|---|", "---|"
    found = []
    for folder in ("cast_core", "tasks", "flows", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            name = path.relative_to(ROOT).as_posix()
            if rule.search(text) and name != "tasks/reporting/markdown.py":
                found.append(f"{name}: markdown rule")
            if "savefig(" in text and name != "tasks/stages/plots.py":
                found.append(f"{name}: savefig")
    assert not found, (f"use tasks.reporting.markdown.table / tasks.stages.plots.png instead: "
                       f"{found}")
