"""The suite's targets: what a report must show for each issue's fix (ratios within one run)."""

from __future__ import annotations

from typing import Any

from gemma4lib.models.variants import VARIANTS


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated from the figures (None = not measured in this run)."""
    targets = []

    def add(name: str, value: float | None, threshold: float, at_most: bool = False):
        met = None if value is None else (value <= threshold if at_most else value >= threshold)
        targets.append({"target": name, "value": value, "threshold": threshold, "met": met})

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
    mtp = report.get("mtp") or {}
    if "medium-dense" in (mtp.get("oracle_speedup") or {}):
        add("medium-dense: oracle drafter speed-up at k = 4 >= 3", mtp["oracle_speedup"]["medium-dense"].get("4"), 3.0)
        wrong = mtp["always_wrong_speedup"]["medium-dense"].get("4")
        add("medium-dense: always-wrong drafter speed-up at k = 4 >= 0.7", wrong, 0.7)
        verify = mtp["verify_over_step"]["medium-dense"].get("4")
        add("medium-dense: verify of 5 tokens / one decode step <= 1.3", verify, 1.3, at_most=True)
    for name, by_k in (mtp.get("prompt_lookup_speedup") or {}).items():
        for k, value in by_k.items():
            add(f"{name}: prompt-lookup speed-up (k = {k}, repeat-the-input prompts) >= 1.5", value, 1.5)
    context = report.get("context")
    if context:
        name = context["model"]
        add(
            f"{name}: decode step / bytes-bound time <= 1.2 at every context",
            context.get("max_over_bytes_bound"),
            1.2,
            True,
        )
        for ours in context["ttft"]["ours"]:
            add(f"{name}: TTFT HF sdpa / ours >= 1.5 ({ours['label']})", ours["ttft_hf_over_ours"], 1.5)
    return targets
