"""The repository keeps its own rules: every pin written once, the test script's marker default,
the test session's cache. Cheap checks of files and scripts, no model anywhere."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gemma4lib import environment
from gemma4lib.recipes import neuron_env

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _files() -> list[Path]:
    """Tracked files and new ones git does not ignore (what a commit would carry)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the pin check reads the files git would commit")
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


def _version_pattern(version: str) -> re.Pattern:
    # 2.9.0 but not 2.9.0.2.12.22436 (torch-neuronx) nor 12.9.0
    return re.compile(rf"(?<![\d.]){re.escape(version)}(?!\.?\d)")


def _python_literals(path: Path) -> list[str]:
    """Every string constant of a module except docstrings (prose), f-string parts included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _shell_code(path: Path) -> list[str]:
    """The lines of a shell script without their comments (a `#` at the start or after a blank)."""
    return [re.split(r"(?:^|\s)#", line, maxsplit=1)[0] for line in path.read_text().splitlines()]


def _pins() -> dict[str, str]:
    """Exact pins and the one file each may be written in."""
    pins = {environment.TRANSFORMERS_PIN: "pyproject.toml"}
    for name in ("torch", "torch-xla"):
        spec = neuron_env.SDK_CONSTRAINTS[name]
        assert spec.startswith("=="), (name, spec)
        pins[spec.removeprefix("==")] = "gemma4lib/recipes/neuron_env.py"
    return pins


def hard_coded_pins(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file: version' for every pin written in code or a script outside its one source. Prose
    (Markdown, notebooks, comments, docstrings) and records (JSON results, provenance) may name it."""
    found = []
    for version, source in _pins().items():
        pattern = _version_pattern(version)
        for path in files:
            rel = path.relative_to(root).as_posix()
            if rel == source or rel.startswith("notebooks/parts/"):
                continue  # the parts are templates: the notebooks generated from them are checked
            if path.suffix == ".py":
                texts = _python_literals(path)
            elif path.suffix == ".sh" or rel == ".ci/run":
                texts = _shell_code(path)
            elif path.suffix in (".toml", ".yml", ".yaml", ".cfg", ".txt", ".ini"):
                texts = [line.split("#", 1)[0] for line in path.read_text().splitlines()]
            else:
                continue
            found += [f"{rel}: {version}" for text in texts if pattern.search(text)]
    return found


def test_transformers_pin_is_read_from_pyproject():
    deps = PYPROJECT["project"]["dependencies"]
    assert f"transformers=={environment.TRANSFORMERS_PIN}" in deps


def test_no_pin_is_copied_into_code_or_scripts():
    assert hard_coded_pins(_files()) == []


def test_the_pin_check_finds_a_copy(tmp_path):
    """The check itself can fail: a copied pin in a string, a shell line or a yml is found; the
    same version in a comment or a docstring is not."""
    pin = environment.TRANSFORMERS_PIN
    torch_pin = neuron_env.SDK_CONSTRAINTS["torch"].removeprefix("==")
    (tmp_path / "a.py").write_text(f'"""Needs {pin}."""\n# {pin}\nPIN = "{pin}"\n')
    (tmp_path / "b.py").write_text(f'"""Needs {pin}."""\nx = f"torch=={{x}}.{torch_pin}.1"  # {torch_pin}\n')
    (tmp_path / "c.sh").write_text(f"# torch {torch_pin}\npip install torch=={torch_pin}  # again\n")
    (tmp_path / "d.yml").write_text(f"- transformers=={pin}\n")
    found = hard_coded_pins(sorted(tmp_path.iterdir()), tmp_path)
    assert sorted(found) == sorted([f"a.py: {pin}", f"c.sh: {torch_pin}", f"d.yml: {pin}"])


def test_the_xla_lane_installs_the_pins_it_reads():
    """scripts/setup_xla_env.sh reads its pins (pyproject.toml, neuron_env.SDK_CONSTRAINTS) instead
    of copying them; --print-pins shows what it would install."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_xla_env.sh"), "--print-pins"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
    )
    reqs = done.stdout.split()
    project = PYPROJECT["project"]
    assert reqs[:2] == [
        f"torch{neuron_env.SDK_CONSTRAINTS['torch']}",
        f"torch-xla{neuron_env.SDK_CONSTRAINTS['torch-xla']}",
    ]
    assert reqs[2:] == project["dependencies"] + [
        r for r in project["optional-dependencies"]["test"] if r.startswith("pytest")
    ]


# ---- scripts/run_tests.sh: the marker default and the cache ---------------------------------------


def _run_tests_sh(tmp_path: Path, *args: str, cache: str | None = None) -> list[str]:
    """Run scripts/run_tests.sh against a stand-in venv whose `python` records what it was given:
    [GEMMA4LIB_CACHE, *argv]. setup_env.sh finds the venv present; whatever it asks that python
    to do is recorded and overwritten by the last call, the script's pytest."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    record = tmp_path / "record"
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$GEMMA4LIB_CACHE\" \"$@\" > '{record}'\n")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GEMMA4LIB_CACHE"}
    env["GEMMA4LIB_VENV"] = str(venv)
    if cache is not None:
        env["GEMMA4LIB_CACHE"] = cache
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_tests.sh"), *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return record.read_text().split("\0")[:-1]


TWO_WORKERS = ["-n", "2", "--dist", "loadfile"]  # run_tests.sh's default: pytest-xdist, a file per worker


@pytest.mark.parametrize(
    "args,pytest_args",
    [
        ((), [*TWO_WORKERS, "-m", "not slow"]),
        (("-q",), [*TWO_WORKERS, "-m", "not slow", "-q"]),
        (("-q", "-ra", "tests/test_readme.py"), [*TWO_WORKERS, "-m", "not slow", "-q", "-ra", "tests/test_readme.py"]),
        (("-q", "-m", "slow"), [*TWO_WORKERS, "-q", "-m", "slow"]),
        (("-mslow",), [*TWO_WORKERS, "-mslow"]),
        (("-m", "slow or not slow", "-x"), [*TWO_WORKERS, "-m", "slow or not slow", "-x"]),
        (("-n", "0", "-q"), ["-m", "not slow", "-n", "0", "-q"]),
    ],
)
def test_run_tests_keeps_slow_out_unless_markers_are_chosen(tmp_path, args, pytest_args):
    cache, *argv = _run_tests_sh(tmp_path, *args)
    assert argv == ["-m", "pytest", *pytest_args]
    assert cache == str(ROOT / ".cache" / "gemma4lib-tests")


def test_run_tests_keeps_a_cache_the_caller_chose(tmp_path):
    cache, *argv = _run_tests_sh(tmp_path, "-q", cache=str(tmp_path / "mine"))
    assert cache == str(tmp_path / "mine") and argv[-1] == "-q"


def test_the_test_cache_is_in_the_gitignored_folder():
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".cache/gemma4lib-tests/x"])
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.returncode == 0, ".cache/ must be gitignored: run_tests.sh keeps compiled graphs there"


def test_this_session_never_uses_the_users_cache():
    """tests/conftest.py: a temporary cache for the session, or the one the caller named."""
    import conftest

    from gemma4lib.cache.artifacts import default_cache_dir

    chosen = os.environ.get("GEMMA4LIB_CACHE")
    assert chosen and default_cache_dir() == Path(chosen)
    if conftest._SESSION_CACHE is not None:  # no folder named by the caller: a temporary one, never the user's
        assert chosen == conftest._SESSION_CACHE
        assert default_cache_dir() != Path.home() / ".cache" / "gemma4lib"


# ---- no warning a newcomer must puzzle over ----------------------------------------------------------


def test_a_papermill_kernel_starts_without_the_tcp_warning(tmp_path):
    """papermill_runs runs its kernels over IPC: ipykernel's "running over TCP without encryption"
    warning (printed by the kernel process itself, hence the subprocess) never appears."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    folder = tmp_path / "nbs"
    folder.mkdir()
    notebook = new_notebook(cells=[new_code_cell("print('ok', 6 * 7)")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, str(folder / "tiny.ipynb"))
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom papermill_runs import run\n"
        "tmp = Path(sys.argv[1])\n"
        "with run.patched_environ(run.kernel_environment(run.kernelspec_dir(tmp / 'jupyter'))):\n"
        "    outcome = run.execute('tiny', 'tiny.ipynb', tmp / 'out', {}, 120, notebook_dir=tmp / 'nbs')\n"
        "print(json.dumps({'status': outcome['status'], 'error': outcome.get('error')}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert '"status": "ok"' in done.stdout, done.stdout + done.stderr
    assert "ok 42" in (tmp_path / "out" / "notebooks" / "tiny.ipynb").read_text()
    output = done.stdout + done.stderr + (tmp_path / "out" / "logs" / "tiny.log").read_text()
    assert "without encryption" not in output and "WARNING" not in output, output
