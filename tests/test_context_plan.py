"""The planned contexts (issue 48 item 4): per variant and inf2 instance, the longest context is the least
of the HBM bound (weights + ring K/V per core) and the compile host's (its keys' modules + the compiler's
assumed RAM), and the full profile's shapes are the plan's, so `papermill_runs/profiles.json`, the
notebooks' documented command and the README cannot drift from it. Nothing here compiles.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gemma4lab.inf2.context import compile_peak_at, context_plan, full_settings, largest_context, planned_buckets
from gemma4lib.inf2.compile_host import COMPILER_CALIBRATION, attention_macs, compile_keys, compiler_bytes_per_mac
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES
from gemma4lib.inf2.memory_plan import plan_core_memory, require_fit
from gemma4lib.inf2.serving_host import serving_host_plan
from gemma4lib.models.variants import VARIANTS
from gemma4lib.settings import PortSettings

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("context_length", "prefill_buckets", "context_buckets")


def _ram_gb(instance: str) -> float:
    return INSTANCES[instance].host_ram_gib * GIB / GB


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_planned_context_is_the_least_of_its_bounds_and_one_step_more_breaks_the_binding_one(name):
    v = VARIANTS[name]
    plan = context_plan(name, v.instance_type, v.tp_degree)
    assert 0 < plan.context <= v.released_context and plan.compile_host in INSTANCES
    assert plan_core_memory(name, v.tp_degree, instance=v.instance_type, context_length=plan.context).fits
    assert compile_peak_at(v, v.tp_degree, plan.context) <= _ram_gb(plan.compile_host)
    more = plan.context + 1024
    if plan.binding == "HBM":
        assert not plan_core_memory(name, v.tp_degree, instance=v.instance_type, context_length=more).fits
    elif plan.binding.startswith("compile RAM"):
        assert compile_peak_at(v, v.tp_degree, more) > _ram_gb(plan.compile_host)
        assert plan.device_context > plan.compile_context
    else:
        assert plan.binding == "released maximum" and plan.context == v.released_context


def test_the_compile_host_is_the_instance_unless_the_readme_names_a_larger_one():
    """E2B serves on an inf2.xlarge and compiles on an inf2.8xlarge (README's instance column); the
    others compile where they serve."""
    hosts = {name: context_plan(name, v.instance_type, v.tp_degree).compile_host for name, v in VARIANTS.items()}
    assert hosts == {name: "inf2.8xlarge" if name == "e2b" else v.instance_type for name, v in VARIANTS.items()}


def test_the_compiler_ram_is_calibrated_on_its_source_and_sums_the_keys_compiled_at_once():
    """The coefficient puts NxD Inference's 31B 8K context encoding at exactly the inf2.48xlarge's RAM
    (the largest the fact allows) and its 16K one above it; the least coefficient puts 16K at the RAM."""
    c = COMPILER_CALIBRATION
    ram = INSTANCES[c["instance"]].host_ram_gib * GIB
    at = {n: attention_macs(c["variant"], c["tp"], n, n, ring=False) for n in (c["fits"], c["fails"])}
    assert compiler_bytes_per_mac() * at[c["fits"]] == pytest.approx(ram)
    assert compiler_bytes_per_mac() * at[c["fails"]] > ram
    assert compiler_bytes_per_mac(least=True) * at[c["fails"]] == pytest.approx(ram)
    assert at[c["fails"]] == 4 * at[c["fits"]]  # a whole bucket attended in every layer: quadratic
    # a ring layer reads its window and the chunk, a global one the context: doubling the context adds
    # exactly the global layers' share again
    macs = {n: attention_macs("31b", 8, 512, n) for n in (32768, 65536)}
    assert 0 < macs[65536] - macs[32768] < macs[32768]


def test_the_planned_keys_are_the_graphs_the_builder_makes():
    """`compile_keys` lists (tokens, slots read) of exactly the graphs `device.build` makes for the same
    buckets (tiny random E2B: only the graph set is built, nothing compiles)."""
    from gemma4lib.device.build import device_graphs
    from gemma4lib.port import load_model

    settings = PortSettings(
        variant="e2b",
        model="random",
        backend="eager",
        context_length=128,
        prefill_buckets=(16, 64),
        context_buckets=(32,),
    )
    graphs = device_graphs(load_model(settings), settings)
    made = {(b, 128) for b in graphs.prefill} | {(1, 128)}
    for key in graphs.contexts:
        name, reads = key.split("@")
        made.add((int(name.removeprefix("prefill")) if name.startswith("prefill") else 1, int(reads)))
    listed = compile_keys(128, (16, 64), (32,))
    assert listed[0] == (1, 128) and len(listed) == len(graphs.prefill) + 1 + len(graphs.contexts)
    assert set(listed) == made


def test_the_full_profile_notebook_command_and_readme_are_the_plan():
    """profiles.json's full shapes per variant equal `full_settings` (the planned context rounded down to a
    power of two, its buckets); `PortSettings` accepts each; each notebook documents the same command; the
    README's family table prints the planned context of the row's own instance and TP."""
    profile = json.loads((ROOT / "papermill_runs" / "profiles.json").read_text())["full"]
    readme = (ROOT / "README.md").read_text()
    for name, v in VARIANTS.items():
        planned = full_settings(name)
        block = profile["variants"][name]
        assert {k: block[k] for k in SHAPES} == planned, name
        assert not set(SHAPES) & set(profile["common"]), "the shapes are per variant"
        context = planned["context_length"]
        assert context & (context - 1) == 0 and context <= context_plan(name, v.instance_type, v.tp_degree).context
        assert [planned["prefill_buckets"], planned["context_buckets"]] == list(map(list, planned_buckets(context)))
        s = PortSettings(variant=name, profile="full", backend="neuron", tp_degree=block["tp_degree"], **planned)
        assert (s.context_length, list(s.prefill_buckets), list(s.context_buckets)) == tuple(planned.values())
        # what `backends.preflight` plans before anything loads holds at these shapes too
        require_fit(name, v.tp_degree, instance=v.instance_type, context_length=context, ring=True)
        assert serving_host_plan(v, v.tp_degree, v.instance_type, context_length=context).fits, name
        stem = next(p for p in (ROOT / "notebooks").glob("0[1-5]_*.py") if p.stem.endswith(name.replace("-", "_")))
        command = ", ".join(f"{k}: {json.dumps(x)}" for k, x in planned.items())
        assert f"checkpoint: {v.hf_id}, {command}" in stem.read_text(), stem.name
        row = next(line for line in readme.splitlines() if line.startswith(f"| {v.name.upper()} | `google"))
        plan = context_plan(name, v.instance_type, v.tp_degree)
        assert f" | {plan.context:,} ({plan.binding.split(' on ')[0]}) | " in row, (name, plan)
        hopeful = context_plan(name, v.instance_type, v.tp_degree, least=True).context
        assert hopeful >= plan.context and f"{v.name.upper()} {hopeful:,}" in " ".join(readme.split()), name


def test_the_doctor_prints_the_bounds_the_assumption_and_the_full_profile(monkeypatch):
    from gemma4lab.tools.doctor import format_doctor, run_doctor

    monkeypatch.delenv("GEMMA4LIB_INSTANCE_TYPE", raising=False)
    text = format_doctor(run_doctor("31b"))
    longest = next(line for line in text.splitlines() if line.startswith("longest context per instance"))
    for instance in ("inf2.24xlarge", "inf2.48xlarge"):
        context, tp = largest_context("31b", instance)
        hopeful = context_plan("31b", instance, tp, least=True).context
        binding = context_plan("31b", instance, tp).binding
        assert f"{instance} {context:,} (TP={tp}, {binding}; {hopeful:,} at the least compiler RAM)" in longest
    assert "unverified" in longest
    assumed = next(line for line in text.splitlines() if line.startswith("compile-host bound"))
    assert f"{compiler_bytes_per_mac():.3f} B per attention" in assumed and "16K" in assumed
    full = full_settings("31b")
    shown = next(line for line in text.splitlines() if line.startswith("full profile:"))
    assert re.search(rf"context {full['context_length']:,}, prefill buckets \[128, 512\]", shown), shown


def test_the_warning_before_a_compile_counts_the_compilers_planned_ram():
    """The neuron backend hands the compiled context and buckets to `warn_low_host_ram`: E2B's full profile
    plans ~126 GB with the compiler on an inf2.8xlarge's 128 GiB (tight), where the host side alone is ~19 GB."""
    from gemma4lib.inf2.compile_ram import compile_ram_warning, estimate_compile_peak_gb

    ram = INSTANCES["inf2.8xlarge"].host_ram_gib * GIB
    settings = full_settings("e2b")
    full = estimate_compile_peak_gb("e2b", 1, **settings)
    assert full["peak_gb"] == pytest.approx(compile_peak_at(VARIANTS["e2b"], 1, settings["context_length"]), abs=0.05)
    assert "neuronx-cc" in full["basis"] and compile_ram_warning(full, ram).startswith("tight")
    assert compile_ram_warning(estimate_compile_peak_gb("e2b", 1), ram) is None
