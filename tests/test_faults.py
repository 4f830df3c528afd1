"""The fault lab (`gemma4lib.faults`): every field-report bug is caught, by the check the report
predicts.

Runs through the compiled CPU recipe, like `python -m gemma4lib faults`: the clean E2B graphs are
shared with the other tests through the artifact cache; the two device-side faults compile their
own (a fault changes the program, so it has its own cache key).
"""

import pytest

from gemma4lib.faults import FAULTS, run_fault_lab


@pytest.fixture(scope="module")
def lab():
    return run_fault_lab()


def test_clean_runs_pass_both_checks(lab):
    assert lab["clean_ok"], lab["clean"]
    assert all("Paris" in run["answer"] for run in lab["clean"])


@pytest.mark.parametrize("fault", [f.name for f in FAULTS])
def test_fault_is_caught_by_the_predicted_check(lab, fault):
    run = next(r for r in lab["faults"] if r["fault"] == fault)
    assert run["caught"], run
    if run["predicted_check"] == "coherence":
        # shared by device and reference: SEQ_MATCH passes on nonsense, only coherence sees it
        assert run["seq_match"] is True and run["coherent"] is False, run
    else:
        assert run["seq_match"] is False, run


def test_lab_verdict(lab):
    assert lab["ok"] and lab["all_as_predicted"]
