"""The inf2 environment as data: one venv named everywhere, a Python that can host the pins, and a
resolver check that fails when a pin would break the venv (needs PyPI, as CI has)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from gemma4lib.recipes import neuron_env

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("check_inf2_resolves", ROOT / "scripts" / "check_inf2_resolves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requires_python_admits_the_inf2_venv_and_refuses_3_10():
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert spec.contains(neuron_env.INF2_PYTHON)
    assert not spec.contains("3.10")  # the Ubuntu 22.04 DLAMI venvs: transformers 5.23.0 refuses them


def test_one_venv_is_named_everywhere():
    readme = (ROOT / "README.md").read_text()
    assert neuron_env.DLAMI_VENV in readme and neuron_env.DLAMI in readme
    assert "source /opt/aws_neuronx_venv_pytorch_2_8" not in readme
    for notebook in sorted((ROOT / "notebooks").glob("0[1-5]_*.ipynb")):
        text = notebook.read_text()
        assert neuron_env.DLAMI_VENV in text, notebook.name
        assert "pytorch_2_8" not in text, notebook.name
    assert neuron_env.DLAMI_VENV in neuron_env.how_to_get("torch-neuronx")


def test_transformers_pin_refuses_the_python_3_10_venv():
    """The finding this environment fixes: transformers 5.23.0 cannot go into a Python 3.10 venv."""
    script = _script()
    with pytest.raises(script.DoesNotResolve, match="3.10"):
        script.resolve([f"transformers=={neuron_env.TRANSFORMERS_PIN}"], python="3.10", extra=("--no-deps",))
    assert script.resolve([f"transformers=={neuron_env.TRANSFORMERS_PIN}"], extra=("--no-deps",)) == {
        "transformers": neuron_env.TRANSFORMERS_PIN
    }


def test_the_check_reads_every_runtime_dependency_and_the_sdk_constraints():
    reqs = _script().requirements()
    assert f"transformers=={neuron_env.TRANSFORMERS_PIN}" in reqs
    assert neuron_env.SDK_CONSTRAINTS["torch"].startswith("==")
    assert f"torch{neuron_env.SDK_CONSTRAINTS['torch']}" in reqs and any(r.startswith("papermill") for r in reqs)
    assert not any(r.startswith("torch==2.13") for r in reqs)  # the CPU build never goes to inf2
