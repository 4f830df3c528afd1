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

from gemma4lib.recipes import neuron_env, venv_pins

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


def _installed(name: str, version: str, site: Path) -> None:
    """An installed distribution as pip and importlib.metadata see one: its dist-info."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")


def make_stand_in(folder: Path, pins: dict[str, str]) -> Path:
    venv = folder / "aws_neuronx_venv_stand_in"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _site_packages(venv)
    for name, version in pins.items():
        _installed(name, version, site)
    (site / "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _versions(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "gemma4lib.recipes.venv_pins"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return dict(line.split("==") for line in out.stdout.split())


def test_lab_installs_into_the_neuron_venv_and_keeps_its_pins(tmp_path):
    venv = make_stand_in(tmp_path, STAND_IN)
    before = _versions(venv)
    assert {k: before[k] for k in STAND_IN} == STAND_IN and "numpy" in before
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONPATH": ""}
    out = subprocess.run(
        ["bash", "scripts/lab.sh", "--neuron", str(venv), "--no-start"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _versions(venv) == before  # the venv's torch and the SDK set untouched
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
