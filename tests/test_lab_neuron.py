"""`scripts/lab.sh --neuron VENV` (issue 21): the project goes into the Neuron venv without touching
its torch or SDK packages, and a kernel named for the venv is registered.

The stand-in venv is real (`python -m venv`, its own site-packages and python) and cheap: it
"has" the SDK's torch and the SDK 2.28 packages as installed distributions (their metadata, no code),
and reaches this project's other dependencies through a `.pth` line to the test interpreter's
site-packages, so pip downloads nothing. A torch other than the CPU lane's 2.13 is what it must
keep. Runs in CI: ~20-40 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gemma4lab.tools import venv_pins
from gemma4lib.recipes import neuron_env

ROOT = Path(__file__).resolve().parent.parent
SDK_TORCH = neuron_env.SDK_CONSTRAINTS["torch"].removeprefix("==")  # the Neuron venv's torch, not the CPU lane's
STAND_IN = {
    "torch": SDK_TORCH,
    "torch-neuronx": neuron_env.SDK_PINS["torch-neuronx"][0],
    "torch-xla": neuron_env.SDK_CONSTRAINTS["torch-xla"].removeprefix("=="),
    "neuronx-cc": neuron_env.SDK_PINS["neuronx-cc"][0],
    "neuronx-distributed": neuron_env.SDK_PINS["neuronx-distributed"][0],
    "libneuronxla": neuron_env.SDK_PINS["libneuronxla"][0],
}


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _installed(name: str, version: str, site: Path, requires: tuple[str, ...] = ()) -> None:
    """An installed distribution as pip and importlib.metadata see one: its dist-info."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
    (info / "METADATA").write_text("".join(lines))
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")


def make_stand_in(folder: Path, pins: dict[str, str], requires: dict[str, tuple[str, ...]] | None = None) -> Path:
    venv = folder / "aws_neuronx_venv_stand_in"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _site_packages(venv)
    for name, version in pins.items():
        _installed(name, version, site, (requires or {}).get(name, ()))
    (site / "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _versions(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "gemma4lab.tools.venv_pins"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return dict(line.split("==") for line in out.stdout.split())


# NxD Inference as the DLAMI venv has it: its own transformers pin (4.x), which `pip check` reports
# once this project's transformers 5 is in; the one conflict lab.sh accepts.
NXDI = {"neuronx-distributed-inference": "0.8.0"}
NXDI_REQUIRES = {"neuronx-distributed-inference": ("transformers==4.57.*",)}
# a package of the venv that no SDK pin names: the whole venv is protected, not a list of eight
OTHER = {"aws-neuronx-tools-stand-in": "2.28.0"}


def _lab(venv: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONPATH": ""}
    return subprocess.run(
        ["bash", "scripts/lab.sh", "--neuron", str(venv), "--no-start"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_lab_installs_into_the_neuron_venv_and_keeps_its_pins(tmp_path):
    venv = make_stand_in(tmp_path, {**STAND_IN, **NXDI, **OTHER}, NXDI_REQUIRES)
    before = _versions(venv)
    assert {k: before[k] for k in {**STAND_IN, **OTHER}} == {**STAND_IN, **OTHER} and "numpy" in before
    assert len(before) > len(venv_pins.PROTECTED) + 20  # the whole venv, pip freeze's list
    assert not set(before) & set(venv_pins.MUTABLE)  # the four the project must change are left free
    out = _lab(venv)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = _versions(venv)
    assert {k: after.get(k) for k in before} == before  # every pre-installed package at its version
    assert f"torch=={SDK_TORCH}" in out.stdout and "[lab] ready" in out.stdout
    spec = venv / "share" / "jupyter" / "kernels" / f"gemma4lib-{venv.name}" / "kernel.json"
    kernel = json.loads(spec.read_text())
    assert kernel["argv"][0] == str(venv / "bin" / "python") and venv.name in kernel["display_name"]
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import gemma4lib.settings, sys; print(gemma4lib.settings.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert where.returncode == 0 and where.stdout.startswith(str(ROOT)), where.stderr[-2000:]


def test_a_too_old_setuptools_is_refused_with_what_to_do(tmp_path):
    """`--no-build-isolation` builds with the venv's setuptools; the project's `license = "..."`
    needs >= 77 (pyproject.toml [build-system]): refused before pip runs, saying how to upgrade it."""
    venv = make_stand_in(tmp_path, {**STAND_IN, "setuptools": "70.0.0"})
    before = _versions(venv)
    out = _lab(venv, timeout=120)
    assert out.returncode != 0
    assert "has setuptools 70.0.0" in out.stderr and "pip install 'setuptools>=77'" in out.stderr
    assert "run lab.sh again" in out.stderr and "installing gemma4lib" not in out.stdout
    assert _versions(venv) == before


def test_pip_check_accepts_only_nxd_inferences_transformers_pin():
    ours, theirs = neuron_env.TRANSFORMERS_PIN, neuron_env.SDK_CONSTRAINTS["torch"].removeprefix("==")
    nxdi = "neuronx-distributed-inference 0.8.0 has requirement transformers==4.57.*"
    known = f"{nxdi}, but you have transformers {ours}."
    assert venv_pins.pip_check_problems(known + "\n") == []
    assert venv_pins.pip_check_problems("No broken requirements found.\n") == []
    other = f"torch-neuronx {STAND_IN['torch-neuronx']} has requirement torch=={theirs}, but you have torch 0.0.1."
    assert venv_pins.pip_check_problems(f"{known}\n{other}\n") == [other]
    run = [sys.executable, "-m", "gemma4lab.tools.venv_pins", "--check-pip"]
    out = subprocess.run(run, input=f"{known}\n{other}\n", capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and other in out.stderr and known not in out.stderr


def test_lab_fails_on_a_broken_requirement_of_the_venv(tmp_path):
    """`pip check` after the install: anything but NxD Inference's transformers pin fails the lab."""
    requires = {"neuronx-cc": ("numpy==1.0.0",)}  # a requirement the venv does not meet
    venv = make_stand_in(tmp_path, STAND_IN, requires)
    out = _lab(venv)
    assert out.returncode != 0 and "has requirement numpy==1.0.0" in out.stderr, out.stderr[-3000:]
    assert "broken requirements other than NxD Inference's transformers pin" in out.stderr


def test_a_venv_without_the_neuron_sdk_is_refused(tmp_path):
    venv = make_stand_in(tmp_path, {"torch": SDK_TORCH})
    out = subprocess.run(
        ["bash", "scripts/lab.sh", "--neuron", str(venv), "--no-start"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
        timeout=120,
    )
    assert out.returncode != 0 and "no torch-neuronx: not a Neuron venv" in out.stderr


def test_constraints_are_the_venvs_own_versions():
    pins = venv_pins.installed_pins()
    assert pins["numpy"] == __import__("numpy").__version__
    frozen = venv_pins.frozen_pins()
    assert frozen["numpy"] == pins["numpy"] and "pytest" in frozen and "transformers" not in frozen
    assert venv_pins.changed({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "1"}) == ["b 2 -> 3"]
    assert venv_pins.constraints_text({"torch": "9.8.7", "numpy": "1.2.3"}) == "numpy==1.2.3\ntorch==9.8.7\n"
    assert set(neuron_env.SDK_PINS) <= set(venv_pins.PROTECTED)
    assert set(neuron_env.SDK_CONSTRAINTS) <= set(venv_pins.PROTECTED)


def test_lab_finds_the_dlami_venv_where_neuron_env_names_it():
    script = (ROOT / "scripts" / "lab.sh").read_text()
    assert f'GEMMA4LIB_DLAMI_VENV:-{neuron_env.DLAMI_VENV_PATH}}}"' in script


@pytest.mark.parametrize("flag", ["--help"])
def test_lab_help_names_the_neuron_mode(flag):
    out = subprocess.run(["bash", "scripts/lab.sh", flag], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--neuron" in out.stdout and "--no-start" in out.stdout
