"""The suite's targets: what a report must show for each issue's fix (ratios within one run)."""

from __future__ import annotations

from typing import Any

from ..models.variants import VARIANTS


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated from the figures (None = not measured in this run)."""
    targets = []

    def add(name: str, value: float | None, threshold: float):
        targets.append(
            {
                "target": name,
                "value": value,
                "threshold": threshold,
                "met": None if value is None else value >= threshold,
            }
        )

    models = {m["name"]: m for m in report.get("models", [])}
    for name, m in models.items():
        if name in VARIANTS:
            add(f"{name} tiny: gemma4lib decode / HF eager >= 5", m["speedup_vs_hf_eager"].get("gemma4lib"), 5.0)
    if "medium-dense" in models:
        m = models["medium-dense"]
        add("medium-dense: gemma4lib decode / HF eager >= 1.15", m["speedup_vs_hf_eager"].get("gemma4lib"), 1.15)
        add("medium-dense: roofline_fraction >= 0.85", m["roofline_fraction"].get("gemma4lib"), 0.85)
    ring = report.get("ring_kv")
    if ring:
        key = next((k for k in ring if k.startswith("ring_tok_s_")), None)
        add(f"medium-dense: {key} >= 0.9", ring.get(key), 0.9)
    experts = report.get("experts")
    if experts:
        add("medium-moe: selective / dense decode >= 2", experts.get("selective_over_dense_decode"), 2.0)
    for batch in report.get("batch") or ():
        if batch["model"] == "medium-dense":
            add("medium-dense: batch speedup_b8_over_b1 >= 5", batch.get("speedup_b8_over_b1"), 5.0)
            add("medium-dense: batched decode / HF generate >= 1.2 at every B", batch.get("min_over_hf"), 1.2)
    return targets
