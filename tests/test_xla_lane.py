"""The XLA lane (issue 8): every tiny variant's prefill + decode graphs through torch_xla on CPU.

Runs in the lane's environment (``scripts/setup_xla_env.sh``)::

    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest tests/test_xla_lane.py

In an environment without torch_xla (the main venv) only the pure-Python checks run; the rest skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from gemma4lib.backends import xla as xla_backend
from gemma4lib.backends.xla import hlo_op_counts

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
VARIANT_NAMES = ("e2b", "e4b", "12b", "31b", "26b-a4b")
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def xla_lane():
    """torch_xla on the CPU client, with the fast XLA:CPU compile flags, set before first use."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    xla_backend.use_fast_cpu_compile()
    pytest.importorskip("torch_xla")
    from gemma4lib.backends import xla_check
    return xla_check


def test_module_imports_without_torch_xla():
    # the import above worked; in the main venv torch_xla is absent and that is fine
    assert xla_backend.xla_available() == HAS_XLA


def test_hlo_op_counts_parses_instructions_and_tuples():
    text = """HloModule m
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}
ENTRY %main (p0: f32[2,3]) -> (f32[2], f32[2,3]) {
  %p0 = f32[2,3]{1,0} parameter(0)
  %c = f32[] constant(0)
  %r = f32[2]{0} reduce(f32[2,3]{1,0} %p0, f32[] %c), dimensions={1}, to_apply=%add
  ROOT %t = (f32[2]{0}, /*index=1*/f32[2,3]{1,0}) tuple(f32[2]{0} %r, f32[2,3]{1,0} %p0)
}
"""
    counts = hlo_op_counts(text)
    assert counts == {"parameter": 3, "add": 1, "constant": 1, "reduce": 1, "tuple": 1, "total": 7}


def test_session_rejects_inplace_graphs():
    from torch import nn

    graph = nn.Linear(2, 2)
    graph.inplace = True
    with pytest.raises(ValueError, match="inplace=False"):
        xla_backend.XLASession({"decode": graph})


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_variant_on_xla(xla_lane, variant, tmp_path):
    result = xla_lane.run_variant(variant, decode_steps=DECODE_STEPS, hlo_dir=tmp_path)
    assert result["seq_match"], (result["tokens"], result["reference"])
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    # one compilation, one traced graph per graph shape; one execution per step (no graph break)
    assert result["xla_compilations"] == {"prefill": 1, "decode": 1}
    assert result["xla_graph_hashes"] == {"prefill": 1, "decode": 1}
    assert result["xla_steps"] == {"prefill": 1, "decode": DECODE_STEPS}
    assert result["xla_executions"] == result["xla_steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.0.hlo.txt", "prefill.0.hlo.txt"]
    for phase in ("prefill", "decode"):
        ops = result["hlo_op_counts"][phase]
        assert ops["dot"] > 0 and ops["parameter"] > 0 and ops["total"] > 1000


def test_ring_buffers_on_xla(xla_lane):
    """Sliding layers as ring buffers (the prompt is longer than the window; decode wraps)."""
    result = xla_lane.run_variant("e2b", decode_steps=DECODE_STEPS, ring=True)
    assert xla_lane.passed(result), result


def test_shape_leak_is_caught_by_the_compile_count(xla_lane):
    """A Python-int position baked into the trace: a new graph and a compilation for every token."""
    steps = 3
    result = xla_lane.run_variant("12b", decode_steps=steps, context_length=48, leaky=True)
    assert result["seq_match"]  # the numbers are right; only the graph count gives it away
    assert result["xla_compilations"]["decode"] == steps
    assert result["xla_graph_hashes"]["decode"] == steps
    assert not result["one_compile_per_shape"]
    assert result["xla_fallback_ops"].get("aten::_local_scalar_dense", 0) >= steps  # the int() read
