"""Write the five variant notebooks from one skeleton and each variant's own parts.

`notebooks/parts/skeleton.py` is the shared notebook (jupytext percent format) with `{{name}}`
placeholders; `notebooks/parts/NN_name.py` holds that variant's parts, each after a line
`# -- part: name --`. A placeholder alone on its line takes the whole part (its cells, or nothing);
one inside a line takes a one-line part. Every placeholder needs a part and every part a
placeholder, so a typo fails here instead of leaving text out. The output, `notebooks/NN_name.py`,
is committed with its `.ipynb` (jupytext `--update` keeps the cell ids); tests/test_notebooks.py
fails when running this again would change a committed file, the way transformers checks the
model files it generates from its modular ones.

    .venv/bin/python scripts/generate_notebooks.py          # write notebooks/0[1-5]_*.py and .ipynb
    .venv/bin/python scripts/generate_notebooks.py --check  # exit 1 when a committed file differs
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ROOT / "notebooks" / "parts"
SKELETON = PARTS / "skeleton.py"
PART_LINE = re.compile(r"^# -- part: (\w+) --\n", re.M)
WHOLE_LINE = re.compile(r"^\{\{(\w+)\}\}\n", re.M)
INLINE = re.compile(r"\{\{(\w+)\}\}")
# {{#full}} ... {{/full}} and {{#brief}} ... {{/brief}}: skeleton text for one form only. 01_e2b
# (`form: full`) teaches the shared path cell by cell; 02-05 (`form: brief`) run it "as in 01".
BLOCK = re.compile(r"^\{\{#(full|brief)\}\}\n(.*?)^\{\{/\1\}\}\n", re.S | re.M)
FORMS = ("full", "brief")
# The parts whose cells are the variant's lesson: tagged `lesson`, which tests/test_notebooks.py
# counts for the lesson's share of a brief notebook's lines.
LESSON_PARTS = ("lesson", "core_step", "after_compile", "after_checks", "neuron_trace")
CELL_HEADER = re.compile(r"^# %%( \[markdown\])?$", re.M)


def variant_stems() -> list[str]:
    return sorted(p.stem for p in PARTS.glob("0[1-9]_*.py"))


def read_parts(path: Path) -> dict[str, str]:
    """`name -> text` of every part in a variant's parts file (text before the first part is a comment)."""
    pieces = PART_LINE.split(path.read_text())
    return {name: body.strip("\n") for name, body in zip(pieces[1::2], pieces[2::2], strict=True)}


def render(stem: str) -> str:
    """The notebook source of `stem` (e.g. "01_e2b"): the skeleton with the variant's parts filled in."""
    parts, used = {"stem": stem, **read_parts(PARTS / f"{stem}.py")}, set()

    def part(match: re.Match, whole: bool) -> str:
        name = match.group(1)
        if name not in parts:
            raise SystemExit(f"notebooks/parts/{stem}.py has no part {name!r} (the skeleton asks for it)")
        used.add(name)
        text = parts[name]
        if not whole:
            if "\n" in text:
                raise SystemExit(f"part {name!r} of {stem} sits inside a line: it must be one line")
            return text
        if name in LESSON_PARTS:  # every cell of the part carries the `lesson` tag
            text = CELL_HEADER.sub(lambda c: f'# %%{c.group(1) or ""} tags=["lesson"]', text)
        return text + "\n" if text else ""

    form = parts.get("form", "")
    if form not in FORMS:
        raise SystemExit(f"notebooks/parts/{stem}.py: part 'form' must be one of {FORMS}, not {form!r}")
    used.add("form")
    skeleton = BLOCK.sub(lambda m: m.group(2) if m.group(1) == form else "", SKELETON.read_text())
    text = WHOLE_LINE.sub(lambda m: part(m, True), skeleton)
    text = INLINE.sub(lambda m: part(m, False), text)
    unused = sorted(set(parts) - used - {"stem"})  # the stem is given, not written in a parts file
    if unused:
        raise SystemExit(f"notebooks/parts/{stem}.py has parts the skeleton never uses: {unused}")
    return re.sub(r"\n{3,}(?=# %%)", "\n\n", text)  # an empty part leaves no gap between cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args(argv)
    stale = []
    for stem in variant_stems():
        target = ROOT / "notebooks" / f"{stem}.py"
        text = render(stem)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
            subprocess.run([sys.executable, "-m", "jupytext", "--update", "--to", "ipynb", str(target)], check=True)
    if args.check and stale:
        print(f"out of date: {stale}; run .venv/bin/python scripts/generate_notebooks.py", file=sys.stderr)
        return 1
    print(f"{'stale' if args.check else 'written'}: {stale or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
