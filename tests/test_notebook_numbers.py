"""Every figure in a notebook's prose comes from the run or carries its source and date.

A figure typed into a markdown cell goes stale the moment the library, the fixtures or the machine
change (issue 34 found every header's decode speed off by 2-5x). So the prose of every notebook in
`notebooks/` (by glob: a new notebook is covered the day it lands) may hold a digit only where it is
not a measured or computed figure, by these rules, checked line by line on each markdown cell:

1. **Code**: inside a fenced block or an inline code span that is not a bare number (`-O2`,
   `tp_degree=8`, `vocab_size=262144` quote code or a config field; `818` in backticks is still a figure).
2. **Names and structure**: variant names (E2B, 12B, 26B-A4B, ...), Gemma-4 / Gemma 3, inf2 and its
   instance names, trn2, dtypes (bf16, int8, float64, ...), notebook names (`0N_name`), versions
   (x.y.z, or "torch 2.13", "SDK release 2.27", "Python 3.12", "Ubuntu 24.04"), dates (YYYY-MM[-DD]),
   section numbers ("## 3.", "section 3", "§3"), list numbering ("1. "), and the notation TP=N,
   B = N, B > N, k = N, k + 1; percentiles (p50, p99); HTTP status codes after a word that names
   one ("answers 429", "the 429s", "HTTP 503", "503 Service Unavailable").
3. **Quoted with a source**: a line holding a parenthesis with `source:` and a date, e.g.
   "(16k tokens on a 128 GB host; source: inf2 users' reports, 2026-12)", or `(source: released config)`.

Anything else (a speed, a size, a count, a ratio) must be printed by a code cell or formatted by the
library (e.g. `nb.status_box`), where the run produces it.

Two rules close what the digit rule lets through:

4. **A config value quoted in code** (`` `head_dim=256` ``, allowed by rule 1) must be shown by the
   notebook: the name and the value together in a code cell or in an output of its executed copy
   (`docs/notebooks/`, the integrator's one fresh run), so a value the prose names and no cell shows
   fails here however it is spelled.
5. **A comparative of magnitude** ("several times faster", "an order of magnitude", "a fifth of
   its", "much larger", "goes flat") needs the figure behind it: its markdown cell says where the run
   prints it (a cell that prints, a table, a plot) or the line is quoted with a source and date.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

FENCE = re.compile(r"```.*?```", re.S)
CODE_SPAN = re.compile(r"`([^`\n]*)`")
LINK_TARGET = re.compile(r"\]\([^)]*\)|<[^>]+>")  # link targets and HTML tags (anchors) are not prose
SOURCED = re.compile(r"\([^()]*\bsources?:[^()]*\b20\d\d-\d\d[^()]*\)|\(source: released config\)")
ALLOWED = re.compile(
    r"""(?xi)
    \bgemma[- ]?[34]n?\b | \b(?:e2b|e4b|12b|31b|26b-a4b|26b|a4b)\b
    | \binf2(?:\.\d*x?large)?\b | \binferentia2\b | \btrn[12]\b
    | \b(?:bf16|fp32|fp16|int8|int32|int64|float64|float32)\b | \b0\d_[a-z0-9_]+\b
    | \b\d+\.\d+(?:\.\d+)+\b | \b20\d\d-\d\d(?:-\d\d)?\b
    | \b(?:torch|transformers|python|sdk|release|releases|neuronx-cc|ubuntu)\s\d+(?:\.\d+)+
    | ^\#+\s*\d+[a-z]?\. | ^\#\s0\d\b | \bsection\s\d+ | §\s?\d+ | ^\s*\d+\.\s
    | \btp\s?=\s?\d+\b | \b[Bk]\s?[=><]\s?\d+\b | \bk\s?\+\s?1\b | \bv[12]\b | \bx86-64\b | \barm64\b
    | \bp\d\d\b | \bray\s\d+(?:\.\d+)+ | \bgemma4lib\b
    | \b(?:http|answers?|gets?|get|returns?|why|with|the|a|its|one)\s\**[1-5]\d\d(?:s\b|\b) | \bstatus\s\d+\b
    | \b[1-5]\d\d\s(?:Too\sMany\sRequests|Service\sUnavailable|Bad\sRequest|Not\sFound)\b
    """
)
DIGITS = re.compile(r"\d[\d,.]*")
EXECUTED = ROOT / "docs" / "notebooks"
CONFIG_VALUE = re.compile(r"`(\w+)\s*=\s*(-?\d[\d_.]*)`")
COMPARATIVE = re.compile(
    r"""(?xi)
    \b(?:several|many|a\s+few)\s+times\b | \borders?\s+of\s+magnitude\b
    | \b(?:a|one)\s+(?:third|quarter|fifth|sixth|tenth)\s+of\s+(?:its|the|their)\b
    | \b(?:much|far)\s+(?:faster|slower|more|less|larger|smaller|cheaper|bigger)\b | \bgoes\s+flat\b
    """
)
PRINTED_HERE = re.compile(r"(?i)\bprint(?:s|ed)?\b|\btables?\b|\bplots?\b")


def unsourced_figures(markdown: str) -> list[tuple[str, str]]:
    """(figure, line) for every digit run in `markdown` that no rule above allows."""
    found = []
    for line in FENCE.sub(" ", markdown).splitlines():
        if SOURCED.search(line):
            continue
        prose = CODE_SPAN.sub(lambda m: m.group(0) if DIGITS.fullmatch(m.group(1).strip()) else " ", line)
        prose = ALLOWED.sub(" ", LINK_TARGET.sub("]", prose))
        found += [(m.group(), line.strip()) for m in DIGITS.finditer(prose)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_figure_in_the_prose_is_from_the_run_or_sourced(path):
    nb = nbformat.read(str(path), as_version=4)
    bad = [
        (i, figure, line)
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown"
        for figure, line in unsourced_figures(c.source)
    ]
    listed = "\n".join(f"  cell {i}: {figure!r} in {line[:110]!r}" for i, figure, line in bad[:20])
    assert not bad, (
        f"{path.name}: figures typed into the prose (print them from a cell, or quote them as "
        f"'(... source: who, YYYY-MM-DD)'; rules in tests/test_notebook_numbers.py):\n{listed}"
    )


def test_the_figure_check_can_fail():
    assert unsourced_figures("decode runs at 818 tok/s") == [("818", "decode runs at 818 tok/s")]
    assert unsourced_figures("a bare `818` in backticks is still a figure")[0][0] == "818"
    assert unsourced_figures("bandwidth 820 GB/s (source: AWS, 2026)")[0][0] == "820"  # a date is YYYY-MM
    assert unsourced_figures("E2B on `inf2.xlarge` at TP=1, `-O2`, torch 2.13 (source: field report, 2026-12-02)") == []
    assert unsourced_figures("## 3. Compile\n1. first\n```\nx = 42\n```") == []
    assert unsourced_figures("the server answers 429 at once; p99 latency") == []
    assert unsourced_figures("it served 429 tok/s")[0][0] == "429"  # a status code only after a word naming one


def shown_text(path: Path) -> str:
    """What a notebook shows a reader: its code cells (as committed and as executed) and every
    output of its executed copy in docs/notebooks."""
    shown = [c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    executed = EXECUTED / path.name
    if executed.exists():
        for cell in nbformat.read(str(executed), as_version=4).cells:
            if cell.cell_type != "code":
                continue
            shown.append(cell.source)
            for output in cell.get("outputs", []):
                shown.append(str(output.get("text", "")))
                shown += [str(value) for value in (output.get("data") or {}).values()]
    return "\n".join(shown)


def unshown_values(markdown: str, shown: str) -> list[str]:
    """Every `name=value` code span in `markdown` whose name and value no cell or output shows together."""
    missing = []
    for match in CONFIG_VALUE.finditer(markdown):
        name, value = match.groups()
        if not re.search(rf"\b{name}\b\W{{0,6}}(?:[^\n]{{0,40}}?\W)?{re.escape(value)}\b", shown):
            missing.append(match.group())
    return missing


def bare_comparatives(markdown: str) -> list[tuple[str, str]]:
    """(phrase, line) for every comparative of magnitude in a markdown cell that says nowhere where
    the run prints its figure, on a line without a dated source."""
    prose = FENCE.sub(" ", markdown)
    if PRINTED_HERE.search(CODE_SPAN.sub(" ", prose)):
        return []
    return [
        (m.group(), line.strip())
        for line in prose.splitlines()
        if not SOURCED.search(line)
        for m in COMPARATIVE.finditer(CODE_SPAN.sub(" ", line))
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_quoted_value_is_shown_and_every_comparative_printed(path):
    nb = nbformat.read(str(path), as_version=4)
    shown = shown_text(path)
    markdown = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    values = [(i, value) for i, text in markdown for value in unshown_values(text, shown)]
    assert not values, (
        f"{path.name}: config values quoted in the prose that no cell or output shows (print them, or drop "
        f"the value): " + ", ".join(f"cell {i}: {v}" for i, v in values)
    )
    vague = [(i, phrase, line) for i, text in markdown for phrase, line in bare_comparatives(text)]
    assert not vague, f"{path.name}: comparatives with no printed figure in their cell: " + "; ".join(
        f"cell {i}: {phrase!r} in {line[:100]!r}" for i, phrase, line in vague
    )


def test_the_shown_and_comparative_checks_can_fail():
    assert unshown_values("`head_dim=256` and `tp_degree=2`", "print(tp_degree)\ntp_degree: 2") == ["`head_dim=256`"]
    assert unshown_values("`head_dim=256`", "head_dim = 256") == []
    assert unshown_values("`head_dim=256`", "head_dim=2560") == ["`head_dim=256`"]
    assert bare_comparatives("selective decode runs several times faster than dense")[0][0] == "several times"
    assert bare_comparatives("throughput goes flat once clients outnumber rows")[0][0] == "goes flat"
    assert bare_comparatives("several times faster: the table below prints the ratio") == []
    assert bare_comparatives("a fifth of its rate (source: a report, 2026-12-01)") == []
