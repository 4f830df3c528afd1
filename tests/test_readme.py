"""The README's copy-paste snippets run as written (people copy them into their own code)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, capsys):
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "port(" in SNIPPETS[index]:
        assert printed.split()[:3] == ["True"] * 3, printed  # seq_match, logits_match, coherent
        assert "Paris" in printed
