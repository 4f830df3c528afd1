"""Facts about the five released variants, computed from their configs: the family table, the
recipes, bytes on the device, effective size, and how the weights fit NeuronCores at each TP degree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gemma4lab.inf2.roofline import GB, GIB, INSTANCES
from gemma4lab.notebook.display import Table
from gemma4lib.device.kv_layout import FULL, KVLayout
from gemma4lib.inf2.hardware import HBM_PER_CORE_GIB
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT, WORKING_ALLOWANCE_GIB, plan_core_memory, rank_weight_bytes
from gemma4lib.models.loading import text_config
from gemma4lib.models.variants import VARIANTS, Variant, get_variant

BF16_BYTES = 2
PLAN_NOTE = " (the plan's context)"  # DEFAULT_CONTEXT: what the status box plans the inf2 figures at


def _gb(params_b: float | None) -> float | None:
    return None if params_b is None else params_b * BF16_BYTES


def real_config(variant: Variant | str):
    """The released text config of a variant, built locally (no download, no weights)."""
    return text_config(variant if isinstance(variant, Variant) else get_variant(variant), "real")


def real_layout(variant: Variant | str) -> KVLayout:
    return KVLayout.from_config(real_config(variant))


def family_table() -> Table:
    """The five variants side by side: what is shared and what differs (released configs)."""
    rows = []
    for v in VARIANTS.values():
        c = v.real_config
        layout = real_layout(v)
        rows.append(
            [
                v.name,
                c["hidden_size"],
                f"{c['num_hidden_layers']} ({sum(t == FULL for t in c['layer_types'])} full)",
                c["num_attention_heads"],
                f"{c['num_key_value_heads']} / {c['num_global_key_value_heads']}",
                "yes" if c.get("hidden_size_per_layer_input") else "—",
                f"{len(layout.consumers)} layers" if layout.consumers else "—",
                "yes" if c.get("attention_k_eq_v") else "—",
                f"{c['num_experts']} / top-{c['top_k_experts']}" if c.get("enable_moe_block") else "—",
                c["params_text_b"],
                v.model_class,
            ]
        )
    return Table(
        [
            "variant",
            "hidden",
            "layers",
            "Q heads",
            "KV heads sliding / full",
            "PLE",
            "KV-shared",
            "k_eq_v",
            "experts",
            "params (B, text)",
            "class",
        ],
        rows,
        "the family (released text configs)",
    )


def recipe_table() -> Table:
    """Which inf2 recipe carries which variant, on what, and what the field report measured."""
    rows = []
    for v in VARIANTS.values():
        inst = INSTANCES[v.instance_type]
        cores, host = inst.neuron_cores, inst.host_ram_gib
        reported = (
            f"~{v.field_report.decode_tok_s:.0f} tok/s decode"
            if v.field_report.decode_tok_s
            else f"prefill ~{v.field_report.prefill_ms:.0f} ms"
        )
        rows.append([v.name, v.recipe, v.tp_degree, v.instance_type, f"{cores} cores, {host} GiB host RAM", reported])
    return Table(
        ["variant", "inf2 recipe", "TP", "instance", "instance has", "field report"],
        rows,
        "the recipe escalates with the model",
    )


def device_bytes(variant: Variant | str) -> dict[str, float]:
    """bf16 weight bytes (GB): the whole text model, the part that stays on the host, the part on device,
    and what one decode step reads (routed experts only for the MoE's selective form)."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    c = v.real_config
    total = _gb(c["params_text_b"])
    host = _gb(c.get("ple_table_b") or 0.0)
    device = total - host  # the word embeddings are tied to the lm_head, so they stay on the device
    read = device
    if c.get("enable_moe_block"):
        experts = _gb(c["experts_b"])
        read = device - experts + experts * c["top_k_experts"] / c["num_experts"]
    return {"total_gb": total, "host_gb": host, "device_gb": device, "decode_read_gb": read}


def effective_size(variant: Variant | str) -> Table:
    """What "E2B"/"E4B" count: the text parameters without the per-layer-embedding table.

    The transformers Gemma-4 code has no MatFormer fields (that was Gemma 3n), so nothing is nested or
    sliced at load time; the "effective" size is an accounting of which weights do matrix work."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    c = v.real_config
    b = device_bytes(v)
    return Table.from_dict(
        {
            "text parameters": f"{c['params_text_b']}B ({b['total_gb']:.1f} GB bf16)",
            "PLE table (a lookup, no matmul)": (
                f"{c.get('ple_table_b', 0)}B ({b['host_gb']:.1f} GB bf16): kept on the host"
            ),
            '"effective" parameters': f"{c['params_text_b'] - c.get('ple_table_b', 0):.2f}B",
            "weights the device holds": f"{b['device_gb']:.1f} GB",
        },
        f"released {v.name.upper()}: effective size",
        "",
        "",
    )


def tp_fit(variant: Variant | str, degrees: Sequence[int] = (1, 2, 4, 8)) -> Table:
    """bf16 weight bytes per NeuronCore at each TP degree against a core's 16 GiB (K/V, activations and
    the compiler's scratch come on top: a core needs headroom, not just a fit). "shardable" is the
    recipe's own list of degrees (`Variant.supported_tp`), not a rule about heads: TP plans replicate
    KV heads where a degree exceeds them, so a degree off the list is untried, not impossible.

    GiB only, the unit of the status box's "memory per NeuronCore" row and of a core's HBM (the
    notebooks' weight totals are in GB: one unit per figure, so no total is printed twice): at a
    degree the recipe supports the figure is one rank's shard as the TP plan cuts it
    (`memory_plan.rank_weight_bytes`, the very number the status box prints: norms, the tied LM
    head's replicated parts and copied KV heads included); at any other degree there is no plan, so
    it is the device weights ÷ TP, marked "≈"."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    b = device_bytes(v)
    rows = []
    for tp in degrees:
        supported = tp in v.supported_tp
        per_core = rank_weight_bytes(v, tp) / GIB if supported else b["device_gb"] * GB / GIB / tp
        rows.append(
            [
                tp,
                f"{per_core:.1f} GiB" if supported else f"≈ {per_core:.1f} GiB (÷ TP, no plan)",
                f"{per_core / HBM_PER_CORE_GIB:.0%}",
                "no"
                if per_core > HBM_PER_CORE_GIB
                else f"no, with {WORKING_ALLOWANCE_GIB:.0f} GiB working"
                if per_core + WORKING_ALLOWANCE_GIB > HBM_PER_CORE_GIB
                else "tight"
                if per_core > 0.75 * HBM_PER_CORE_GIB
                else "yes",  # fmt: skip
                "yes" if supported else "no (not a degree this recipe supports)",
                "←" if tp == v.tp_degree else "",
            ]
        )
    return Table(
        ["TP", "weights per core", "of 16 GiB", "fits", "shardable", "field report"],
        rows,
        f"released {v.name.upper()}: bf16 device weights per NeuronCore at each TP degree",
    )


def context_plan(variant: Variant | str, contexts: Sequence[int] = (8192, 32768, 131072, 262144)) -> Table:
    """What one NeuronCore holds at each context on the variant's own instance and TP degree (bf16,
    sliding layers as rings, batch 1; `memory_plan.plan_core_memory`, computed, unverified on inf2),
    up to the released maximum: the weights stay, the K/V grows with the context."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    rows = []
    for context in (c for c in contexts if c <= v.released_context):
        plan = plan_core_memory(v, v.tp_degree, context_length=context)
        kv, total = plan.kv_gib, plan.total_gib
        rows.append([f"{context:,}", f"{plan.weights_gib:.2f}", f"{kv:.2f}", f"{total:.1f} of {plan.capacity_gib:.0f}",
                     "yes" if total <= plan.capacity_gib else "no"])  # fmt: skip
    return Table(
        [
            "context",
            "weights per core (GiB)",
            "K/V per core (GiB)",
            f"with {WORKING_ALLOWANCE_GIB:.0f} GiB working",
            "fits",
        ],
        rows,
        f"{v.name.upper()} at TP={v.tp_degree} on an {v.instance_type}: one NeuronCore by context (computed)",
    )


def memory_rows() -> list[dict[str, Any]]:
    rows = []
    for v in VARIANTS.values():
        b = device_bytes(v)
        rows.append(
            {
                "variant": v.name,
                "tp": v.tp_degree,
                "device_gb_per_core": b["device_gb"] / v.tp_degree,
                "host_gb": b["host_gb"] / v.tp_degree if b["host_gb"] else 0.0,
                "capacity_gb": HBM_PER_CORE_GIB * GIB / GB,
            }
        )
    return rows


def kv_sharing_real(variant: Variant | str, context_length: int = DEFAULT_CONTEXT) -> Table:
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    layout = real_layout(v)
    sizes = kv_cache_bytes(layout, context_length)
    by_type = {}
    for lay in layout.consumers:
        by_type.setdefault(lay.layer_type.replace("_attention", ""), set()).add(lay.producer)
    return Table.from_dict(
        {
            "layers": len(layout.layers),
            "layers with their own K/V": len(layout.producers),
            "KV-shared layers": f"{len(layout.consumers)} (read "
            f"{', '.join(f'{t} → {sorted(p)}' for t, p in by_type.items())})",
            f"K/V buffers at {context_length:,} tokens{PLAN_NOTE if context_length == DEFAULT_CONTEXT else ''}, bf16, "
            "full length (no ring)": (f"{sizes['producers_only_mb']:.0f} MiB"),
            "the same if every layer had its own": f"{sizes['every_layer_mb']:.0f} MiB",
        },
        f"released {v.name.upper()}: KV sharing",
        "",
        "",
    )


def kv_cache_bytes(
    layout: KVLayout, context_length: int, dtype_bytes: int = BF16_BYTES, ring: bool = False
) -> dict[str, float]:
    """K/V buffer bytes for producers only (what the port allocates) and for every layer (a cache that
    ignored sharing), batch 1."""
    return {
        "producers_only_mb": layout.buffer_bytes(context_length, ring, dtype_bytes) / 2**20,
        "every_layer_mb": layout.buffer_bytes(context_length, ring, dtype_bytes, every_layer=True) / 2**20,
    }


BF16_BYTES = 2
