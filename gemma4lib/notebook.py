"""Helpers for the cookbook notebooks: each turns one stage of the port into something to look at.

The notebooks call the port's stages themselves (`gemma4lib.port`); what lives here is what a
notebook shows between them: tables of the model's special features, the arithmetic behind the
tensor-parallel layout, the three checks side by side (and the random-weights witness's), the
result record, the demonstrations of each variant's pitfall, and an optional chat widget.
Everything returns plain data or a `Table` (HTML in Jupyter, aligned text in logs and executed
notebooks read as text).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checks
from .artifacts import atomic_write_json
from .benchmarks.timing import BenchFigures
from .kv_layout import FULL, SLIDING, KVLayout
from .loading import LoadedModel, text_config
from .record import build_record
from .roofline import GB, GIB, INSTANCES, compare, measure_bandwidth
from .variants import VARIANTS, Variant, get_variant

BF16_BYTES = 2
HBM_PER_CORE_GIB = 16
# A hand-built prompt in Gemma 3's turn format: not Gemma-4 tokens (see `equality_is_not_enough`).
GEMMA3_STYLE_PROMPT = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


# ---- display ------------------------------------------------------------------------------------


@dataclass
class Table:
    """Rows of cells with a header; renders as HTML in Jupyter and as aligned text elsewhere."""

    columns: list[str]
    rows: list[list[Any]]
    title: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], title: str = "", key: str = "", value: str = "") -> Table:
        return cls([key or "", value or ""], [[k, v] for k, v in data.items()], title)

    @staticmethod
    def _cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, (list, tuple)) and len(value) > 24:
            return f"{list(value[:24])} … ({len(value)} items)"
        return str(value)

    def __str__(self) -> str:
        cells = [[self._cell(c) for c in row] for row in self.rows]
        widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(self.columns)]
        line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()  # noqa: E731
        out = ([self.title] if self.title else []) + [line(self.columns), line(["-" * w for w in widths])]
        return "\n".join(out + [line(r) for r in cells])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{html.escape(str(c))}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(self._cell(c))}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        caption = f"<caption style='text-align:left'><b>{html.escape(self.title)}</b></caption>" if self.title else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what a result record keeps of a demonstration)."""
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [
                [c if isinstance(c, (bool, int, float, str, type(None))) else self._cell(c) for c in row]
                for row in self.rows
            ],
        }

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(map(str, self.columns)) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self._cell(c).replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


def show_settings(settings: Any) -> Table:
    params = settings.parameters()
    keep = [
        "variant",
        "profile",
        "model_source",
        "checkpoint",
        "backend",
        "tp_degree",
        "prompt",
        "expect",
        "max_new_tokens",
        "context_length",
        "prefill_buckets",
        "decode_experts",
        "warmup",
        "iters",
        "seed",
    ]
    return Table.from_dict({k: params.get(k) for k in keep}, "port settings", "setting", "value")


def _tables_to_dicts(value: Any) -> Any:
    if isinstance(value, Table):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _tables_to_dicts(v) for k, v in value.items()}
    return value


# ---- the family -----------------------------------------------------------------------------


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
                v.model_class.replace("ForConditionalGeneration", "…"),
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
        ["variant", "recipe", "TP", "instance", "instance has", "field report"],
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
    the compiler's scratch come on top: a core needs headroom, not just a fit)."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    b = device_bytes(v)
    capacity = HBM_PER_CORE_GIB * GIB / GB
    rows = []
    for tp in degrees:
        per_core = b["device_gb"] / tp
        supported = tp in v.supported_tp
        rows.append(
            [
                tp,
                f"{per_core:.1f} GB",
                f"{per_core / capacity:.0%}",
                "no" if per_core > capacity else "tight" if per_core > 0.75 * capacity else "yes",
                "yes" if supported else "no (heads/experts do not split)",
                "←" if tp == v.tp_degree else "",
            ]
        )
    return Table(
        ["TP", "weights per core", "of 16 GiB", "fits", "shardable", "field report"],
        rows,
        f"released {v.name.upper()}: {b['device_gb']:.1f} GB of bf16 weights on the device",
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


# ---- one model ------------------------------------------------------------------------------


def describe_model(model: LoadedModel) -> Table:
    c = model.config
    types = list(c.layer_types)
    return Table.from_dict(
        {
            "source": model.source,
            "class": type(model.lm).__name__,
            "dtype": str(next(model.lm.parameters()).dtype),
            "attention implementation": getattr(c, "_attn_implementation", None),
            "layers": f"{len(types)} ({types.count(SLIDING)} sliding, {types.count(FULL)} full)",
            "hidden / vocab": f"{c.hidden_size} / {c.vocab_size}",
            "Q heads": c.num_attention_heads,
            "sliding window": c.sliding_window,
            "final logit softcap": getattr(c, "final_logit_softcapping", None),
            "parameters": f"{model.param_count():,}",
            "tokenizer": type(model.tokenizer).__name__ if model.tokenizer is not None else "none (random weights)",
        },
        f"{model.variant.name}: what was loaded",
        "",
        "",
    )


def ple_report(model: LoadedModel) -> Table:
    """How big the per-layer-embedding table is, here and in the released model, and what keeping it
    on the host takes off the device."""
    text = model.text_model
    table = getattr(text, "embed_tokens_per_layer", None)
    here = table.weight.numel() if table is not None else 0
    total = model.param_count()
    real = model.variant.real_config
    rows = [
        [
            "this model",
            f"{tuple(table.weight.shape) if table is not None else '—'}",
            f"{here:,}",
            f"{total:,}",
            f"{here / total:.0%}" if total else "—",
        ]
    ]
    if real.get("hidden_size_per_layer_input"):
        n = 262_144 * real["num_hidden_layers"] * real["hidden_size_per_layer_input"]
        rows.append(
            [
                f"released {model.variant.name.upper()}",
                f"(262144, {real['num_hidden_layers']}×{real['hidden_size_per_layer_input']})",
                f"{n:,} ({n * BF16_BYTES / GB:.1f} GB bf16)",
                f"{real['params_text_b']}B",
                f"{real['ple_table_b'] / real['params_text_b']:.0%}",
            ]
        )
    return Table(
        ["model", "PLE table shape", "PLE parameters", "all text parameters", "share"],
        rows,
        "per-layer embeddings: looked up on the host, never compiled into the device graph",
    )


@torch.no_grad()
def ple_on_host_check(model: LoadedModel, ids: Sequence[int]) -> dict[str, Any]:
    """Run the reference twice: from token ids, and from embeddings + PLE inputs computed outside the
    model (what the host runtime does). The logits must be identical."""
    x = torch.as_tensor(list(ids))[None]
    text = model.text_model
    from_ids = model.lm(input_ids=x).logits
    kwargs = {"inputs_embeds": text.embed_tokens(x)}
    if getattr(model.config, "hidden_size_per_layer_input", 0):
        kwargs["per_layer_inputs"] = text.get_per_layer_inputs(x)
    from_host = model.lm(**kwargs).logits
    diff = float((from_ids - from_host).abs().max())
    return {
        "max_abs_logit_diff": diff,
        "identical": diff == 0.0,
        "host_inputs": {k: tuple(v.shape) for k, v in kwargs.items()},
    }


def kv_sharing_report(model_or_layout: LoadedModel | KVLayout) -> Table:
    """Every layer: attention type, KV heads, head_dim, and whose K/V buffer it reads."""
    layout = model_or_layout.layout if isinstance(model_or_layout, LoadedModel) else model_or_layout
    rows = [
        [
            lay.index,
            lay.layer_type.replace("_attention", ""),
            lay.kv_heads,
            lay.head_dim,
            "own buffer" if lay.owns_buffer else f"reads layer {lay.producer}",
            "yes" if lay.k_eq_v else "",
        ]
        for lay in layout.layers
    ]
    return Table(
        ["layer", "type", "KV heads", "head_dim", "K/V", "k_eq_v"],
        rows,
        f"{len(layout.producers)} of {len(layout.layers)} layers own a K/V buffer",
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


def kv_sharing_real(variant: Variant | str, context_length: int = 2048) -> Table:
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
            f"K/V buffers at {context_length} tokens, bf16": f"{sizes['producers_only_mb']:.0f} MiB",
            "the same if every layer had its own": f"{sizes['every_layer_mb']:.0f} MiB",
        },
        f"released {v.name.upper()}: KV sharing",
        "",
        "",
    )


def k_eq_v_report(model: LoadedModel) -> Table:
    """Which layers have a v_proj at all: on k_eq_v models the full-attention layers use K as V."""
    rows = []
    for i, layer in enumerate(model.text_model.layers):
        attn = layer.self_attn
        rows.append(
            [
                i,
                model.config.layer_types[i].replace("_attention", ""),
                tuple(attn.k_proj.weight.shape) if getattr(attn, "k_proj", None) is not None else "—",
                tuple(attn.v_proj.weight.shape) if getattr(attn, "v_proj", None) is not None else "none (V = K)",
            ]
        )
    return Table(["layer", "type", "k_proj", "v_proj"], rows, "attention_k_eq_v: full layers carry no v_proj")


@torch.no_grad()
def attention_implementations_agree(
    model: LoadedModel, ids: Sequence[int], implementations: Sequence[str] = ("eager", "sdpa")
) -> Table:
    """The same weights under each attention implementation: logits and greedy token on the prompt.

    On CPU they agree to rounding, which is the point: choosing eager attention for the 12B is a
    question of what the Neuron compiler can fit, not of numerics."""
    x = torch.as_tensor(list(ids))[None]
    before = model.config._attn_implementation
    outputs = {}
    try:
        for impl in implementations:
            model.lm.set_attn_implementation(impl)
            outputs[impl] = model.lm(input_ids=x).logits[0, -1].float()
    finally:
        model.lm.set_attn_implementation(before)
    base = outputs[implementations[0]]
    rows = [[impl, int(out.argmax()), f"{float((out - base).abs().max()):.2e}"] for impl, out in outputs.items()]
    return Table(
        ["attention", "greedy next token", f"max |logit - {implementations[0]}|"],
        rows,
        f"attention implementation (the model is set to {before!r})",
    )


# ---- tensor parallelism -----------------------------------------------------------------------


def tp_plan(variant: Variant | str, tp: int | None = None, config: Any = None) -> Any:
    """The sharding plan of the released config (or `config`) at `tp` (default: the variant's)."""
    from .tp import make_plan

    v = variant if isinstance(variant, Variant) else get_variant(variant)
    return make_plan(config if config is not None else real_config(v), tp or v.tp_degree, v)


def kv_heads_under_tp(
    variant: Variant | str, tp: int | None = None, config: Any = None, context_length: int = 2048
) -> Table:
    """Per attention type: how Q and KV heads land on ranks, and what each rank's K/V cache costs.

    When a layer has fewer KV heads than ranks the heads cannot be split; each rank instead keeps a
    copy of the one KV head its Q heads read (GQA: KV head = Q head // (Q heads / KV heads))."""
    plan = tp_plan(variant, tp, config)
    rows = []
    for kind, a in plan.describe()["attention"].items():
        group = a["q_heads"] // a["kv_heads"]
        copies = plan.tp * a["kv_heads_per_rank"] / a["kv_heads"]
        per_token = 2 * a["kv_heads_per_rank"] * a["head_dim"] * BF16_BYTES
        kv = per_token * context_length
        kv_text = f"{kv / 2**20:.1f} MiB" if kv >= 2**20 else f"{kv / 2**10:.1f} KiB"
        rows.append(
            [
                kind.replace("_attention", ""),
                a["q_heads"],
                a["kv_heads"],
                group,
                f"{a['q_heads']} / {plan.tp} = {a['q_heads_per_rank']}",
                a["kv_mode"],
                a["kv_heads_per_rank"],
                f"{copies:g}×",
                str(a["kv_heads_by_rank"]),
                kv_text,
            ]
        )
    return Table(
        [
            "layers",
            "Q heads",
            "KV heads",
            "Q per KV",
            "Q heads per rank",
            "KV mode",
            "KV heads per rank",
            "copies of each KV head",
            "KV head(s) on rank 0..N-1",
            f"K/V per layer per rank @{context_length}",
        ],
        rows,
        f"{plan.variant or 'model'} at TP={plan.tp}",
    )


def tp_cpu_run(
    model: LoadedModel,
    ids: Sequence[int],
    tp: int,
    max_new_tokens: int,
    context_length: int,
    prefill_len: int,
    **kwargs: Any,
) -> dict[str, Any]:
    """Every rank of a TP plan run on CPU with real collectives (gloo), checked against the reference;
    the answer text is added (cut at the first end-of-turn token)."""
    from .port import eos_ids
    from .tp import run_tp_port

    result = run_tp_port(model, tp, list(ids), max_new_tokens, context_length, prefill_len, **kwargs)
    # the ranks decode without stopping (every token is compared); the answer is the first turn
    stop = set(eos_ids(model))
    result["answer"] = answer_text(model, until_stop(result["tokens"], stop))
    result["reference_answer"] = answer_text(model, until_stop(result.get("reference_tokens") or [], stop))
    return result


def until_stop(tokens: Sequence[int], stop: Iterable[int]) -> list[int]:
    """`tokens` up to and including the first stop token."""
    stop = set(stop)
    out = []
    for token in tokens:
        out.append(token)
        if token in stop:
            break
    return out


def tp_demo(
    model: LoadedModel,
    ids: Sequence[int],
    settings: Any,
    tp: int,
    prefill: str = "graph",
    with_baked_rank: bool = False,
) -> Table:
    """The sharded model run on CPU at `tp` ranks (and, with `with_baked_rank`, the same run with the
    rank read at trace time, the 26B's bug), as one table."""
    common = dict(
        max_new_tokens=settings.max_new_tokens,
        context_length=settings.context_length,
        prefill_len=max(settings.prefill_buckets),
    )
    runs = {
        "sharded" + (" (CPU-seeded prefill)" if prefill == "cpu-seeded" else ""): tp_cpu_run(
            model, ids, tp, prefill=prefill, **common
        )
    }
    if with_baked_rank:
        runs["rank baked in at trace time"] = tp_cpu_run(model, ids, tp, prefill=prefill, baked_rank=True, **common)
    return tp_runs_table(runs, settings.expect)


def tp_runs_table(runs: Mapping[str, Mapping[str, Any]], expect: str | None = "Paris") -> Table:
    rows = []
    for name, r in runs.items():
        coherent = None if r.get("answer") is None or not expect else expect.lower() in r["answer"].lower()
        rows.append(
            [
                name,
                r.get("tp"),
                r.get("seq_match"),
                r.get("ranks_agree"),
                coherent,
                r.get("first_divergence"),
                r.get("answer"),
            ]
        )
    return Table(
        ["run", "TP", "SEQ_MATCH", "ranks agree", "coherent", "first divergence", "answer"],
        rows,
        "tensor-parallel runs on CPU (one process per rank, gloo collectives)",
    )


# ---- MoE ------------------------------------------------------------------------------------


def moe_report(model: LoadedModel) -> Table:
    """The MoE block of the first layer, piece by piece, and the released model's expert budget."""
    layer = next(lay for lay in model.text_model.layers if getattr(lay, "experts", None) is not None)
    c = model.config
    experts = layer.experts
    rows = [
        [
            "router",
            f"RMSNorm → scale → proj {tuple(layer.router.proj.weight.shape)} → softmax over "
            f"{c.num_experts} → top-{c.top_k_experts} → renormalise → per-expert scale",
        ],
        [
            "shared dense MLP",
            f"gate/up {tuple(layer.mlp.gate_proj.weight.shape)}, down "
            f"{tuple(layer.mlp.down_proj.weight.shape)}: runs on every token, in parallel",
        ],
        [
            "experts (fused)",
            f"gate_up_proj {tuple(experts.gate_up_proj.shape)}, down_proj {tuple(experts.down_proj.shape)}",
        ],
        [
            "extra norms",
            ", ".join(
                n
                for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
                if hasattr(layer, n)
            ),
        ],
        ["experts implementation", getattr(c, "_experts_implementation", None) or "default"],
    ]
    real = model.variant.real_config
    b = device_bytes(model.variant)
    rows.append(
        [
            f"released {model.variant.name.upper()}",
            f"{real['num_experts']} experts, top-{real['top_k_experts']}: "
            f"expert weights {real['experts_b']}B params "
            f"({_gb(real['experts_b']):.1f} GB bf16) all resident; a token reads "
            f"{real['top_k_experts']}/{real['num_experts']} of them → {b['decode_read_gb']:.1f} GB per decode "
            f"step instead of {b['device_gb']:.1f} GB",
        ]
    )
    return Table(["part", "what it is"], rows, "the MoE block: a shared MLP and routed experts side by side")


@torch.no_grad()
def expert_forms_on_a_token(model: LoadedModel, ids: Sequence[int], context_length: int, bucket: int) -> Table:
    """Prefill the prompt, then run ONE decode step three ways on copies of the same K/V: transformers'
    eager reference, all-experts-dense (masked to the top-k), and selective (gather the top-k). Same
    token, logits equal to rounding."""
    from .graph import DeviceGraph, GraphShape
    from .runtime import HostRuntime

    layout = model.layout
    prefill = DeviceGraph(model.text_model, model.lm_head, layout, GraphShape(1, bucket, context_length))
    graphs = {
        form: DeviceGraph(model.text_model, model.lm_head, layout, GraphShape(1, 1, context_length), expert_form=form)
        for form in ("dense", "selective")
    }
    kv = prefill.new_kv()
    runtime = HostRuntime(model, {bucket: prefill}, graphs["dense"], kv, context_length)
    n = len(ids)
    inputs = runtime.embed(torch.as_tensor(list(ids))[None], pad_to=bucket)
    first = int(prefill(*inputs, torch.tensor([0]), torch.tensor([n]), *kv)[0].argmax())
    step = runtime.embed(torch.tensor([[first]]))
    logits = {
        form: graph(*step, torch.tensor([n]), torch.tensor([1]), *[t.clone() for t in kv])[0]
        for form, graph in graphs.items()
    }
    # transformers' own eager MoE on the full sequence (prompt + first token) as the reference
    ref = model.lm(input_ids=torch.as_tensor(list(ids) + [first])[None]).logits[0, -1].float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    from .runtime import softcap

    rows = []
    for form, out in logits.items():
        rows.append(
            [
                form,
                int(out.argmax()),
                f"{float((softcap(out, cap) - ref).abs().max()):.2e}",
                f"{float((out - logits['dense']).abs().max()):.2e}",
            ]
        )
    rows.append(["transformers eager (reference)", int(ref.argmax()), "0", "—"])
    return Table(
        ["expert form", "next token", "max |softcapped logit - reference|", "max |logit - dense|"],
        rows,
        f"one decode step after token {first} ({answer_text(model, [first])!r})",
    )


# ---- prompts --------------------------------------------------------------------------------


def show_prompt(model: LoadedModel, ids: Sequence[int]) -> Table:
    rendered = model.tokenizer.decode(list(ids)) if model.tokenizer is not None else None
    return Table.from_dict(
        {"tokens": len(ids), "ids": list(ids), "rendered": rendered},
        "the prompt, through the tokenizer's own chat template",
        "",
        "",
    )


def gemma3_style_ids(model: LoadedModel, prompt: str) -> list[int]:
    """The 31B's bug: a chat prompt written by hand in Gemma 3's turn format. Gemma-4 has no such
    tokens, so each marker is split into ordinary pieces."""
    return list(model.tokenizer(GEMMA3_STYLE_PROMPT.format(prompt=prompt))["input_ids"])


def equality_is_not_enough(model: LoadedModel, runtime: Any, settings: Any) -> Table:
    """The same question through the real chat template and through a hand-built Gemma-3-style one,
    each run on the device graph and on the reference. Both prompts give SEQ_MATCH; only one answer
    makes sense."""
    from .port import eos_ids
    from .reference import reference_greedy

    if model.tokenizer is None:
        return Table(
            ["note"],
            [
                [
                    "random weights have no tokenizer and no meaningful answer: this demonstration "
                    "needs the trained fixture (or a real checkpoint)"
                ]
            ],
            "skipped",
        )
    eos = eos_ids(model)
    rows = []
    from .port import prompt_ids

    for label, ids in (
        ("tokenizer's chat template", prompt_ids(model, settings)),
        ("hand-built <start_of_turn> prompt", gemma3_style_ids(model, settings.prompt)),
    ):
        n = min(settings.max_new_tokens, runtime.context_length - len(ids))
        device = runtime.generate(ids, n, eos_token_ids=eos).tokens
        reference = reference_greedy(model.lm, ids, n, eos)
        report = checks.evaluate(model.lm, model.tokenizer, ids, device, reference, expect=settings.expect)
        answer = report.answer
        rows.append([label, len(ids), report.seq_match, report.coherent, answer])
    return Table(
        ["prompt", "prompt tokens", "SEQ_MATCH", "coherent", "device answer"],
        rows,
        "device == reference proves the compiler faithful, not the input right",
    )


# ---- graphs and compile ------------------------------------------------------------------------


def describe_graphs(prefill: Mapping[int, Any], decode: Any) -> Table:
    """The graphs the compiler gets: their static shapes, their inputs, and the K/V buffers they share."""
    rows = []
    for name, graph in [*((f"prefill[{b}]", g) for b, g in prefill.items()), ("decode", decode)]:
        inputs = graph.example_inputs()
        n_kv = 2 * len(graph.layout.producers)
        head = [tuple(t.shape) for t in inputs[: len(inputs) - n_kv]]
        kv_bytes = sum(t.numel() * t.element_size() for t in inputs[len(inputs) - n_kv :])
        rows.append(
            [
                name,
                graph.shape.tokens,
                graph.shape.context_length,
                str(head),
                n_kv,
                f"{kv_bytes / 2**10:.1f} KiB",
                graph.expert_form
                if any(getattr(lay, "experts", None) is not None for lay in graph.model.layers)
                else "—",
                getattr(graph.model, "embed_tokens_per_layer", None) is None,
            ]
        )
    return Table(
        [
            "graph",
            "tokens",
            "context",
            "inputs (embeds, [PLE], start, length)",
            "K/V tensors",
            "K/V bytes",
            "experts",
            "no embedding tables inside",
        ],
        rows,
        "the device graphs (static shapes)",
    )


def describe_compile(compiled: Any) -> Table:
    hits = list(compiled.cache_hits or [])
    return Table.from_dict(
        {
            "recipe": compiled.recipe,
            "compile seconds (this call)": round(float(compiled.compile_s), 2),
            "graphs loaded from the artifact cache": f"{sum(hits)} of {len(hits)}" if hits else "—",
            "artifacts": compiled.info.get("artifacts", "—"),
        },
        "compile",
        "",
        "",
    )


# ---- checks, benchmark, record --------------------------------------------------------------


def answer_text(model: LoadedModel, tokens: Sequence[int]) -> str | None:
    return checks.answer_text(model.tokenizer, tokens)


def _tokens(device: Any) -> list[int]:
    """Tokens of a `runtime.Generation` or a plain token list."""
    return list(getattr(device, "tokens", device))


def check(
    model: LoadedModel,
    settings: Any,
    device: Any,
    reference_tokens: Sequence[int],
    prompt_ids: Sequence[int] | None = None,
) -> checks.CheckReport:
    """SEQ_MATCH, LOGITS_MATCH and coherence of one device run.

    `device` is the `Generation` from `runtime.generate(..., keep_logits=True)` (its per-step
    logits make LOGITS_MATCH possible) or, for SEQ_MATCH and coherence only, a token list."""
    step_logits = getattr(device, "step_logits", None)
    prompt = prompt_ids if prompt_ids is not None else getattr(device, "prompt_ids", None)
    return checks.evaluate(
        model.lm,
        model.tokenizer,
        prompt or [],
        _tokens(device),
        reference_tokens,
        expect=settings.expect,
        step_logits=step_logits if prompt is not None else None,
    )


def _logits_cells(logits: checks.LogitsCheck | None) -> list[str]:
    if logits is None:
        return ["not checked (no per-step logits: generate with keep_logits=True)", ""]
    worst = "prefill" if logits.worst_position == 0 else f"decode step {logits.worst_position}"
    return [
        f"{logits.passed}: max |Δ| {logits.max_err:.3g} (at {worst}) "
        f"{'<=' if logits.passed else '>'} {logits.tolerance:.3g}",
        f"tolerance = max({logits.factor:g} × the reference's own spread {logits.spread:.3g} "
        f"[vs a {logits.precise_dtype} copy], {logits.floor:g})",
    ]


def side_by_side(report: checks.CheckReport, device_tokens: Any = (), reference_tokens: Sequence[int] = ()) -> Table:
    """The three checks in one table: the device's answer next to the reference's, SEQ_MATCH,
    LOGITS_MATCH (every generated position, with the tolerance it was held to) and coherence."""
    rows = [
        ["answer", report.answer, report.reference_answer],
        ["tokens", _tokens(device_tokens), list(reference_tokens)],
        [
            "SEQ_MATCH (tokens equal)",
            report.seq_match,
            "" if report.first_mismatch is None else f"first mismatch at token {report.first_mismatch}",
        ],
        ["LOGITS_MATCH (logits at every position)", *_logits_cells(report.logits)],
        [
            "coherent" + (f" ({report.coherence_rule})" if report.coherence_rule else ""),
            "not checked (random weights)" if report.coherent is None else report.coherent,
            "",
        ],
    ]
    return Table(
        ["", "device", "reference (host fp32)"],
        rows,
        "PASS"
        if report.passed and report.coherent is not None
        else "PASS (equality only)"
        if report.passed
        else "FAIL",
    )


def run_witness(settings: Any, compiled: Any = None) -> dict[str, Any]:
    """The random-weights witness of this port (`port.run_witness`): the same variant, shapes and
    compiled programs with seeded random weights, checked for SEQ_MATCH and LOGITS_MATCH. With
    the trained run's `compiled` graphs it also says whether it ran the very same artifacts."""
    from .port import run_witness as _run

    artifacts = (getattr(compiled, "info", None) or {}).get("artifacts")
    return _run(settings, artifacts=artifacts)


def witness_table(witness: Mapping[str, Any] | None) -> Table:
    """The witness's checks: a random model has near-ties where the trained one has margins of
    several logits, so a logit error the trained run absorbs changes the witness's tokens."""
    if not witness:
        return Table(
            ["note"], [["no witness for this run (it runs in smoke runs of a trained fixture)"]], "witness: skipped"
        )
    rows = [
        [
            "model",
            witness.get("model_source"),
            f"seed {witness.get('seed')}, {witness.get('prompt_tokens')} prompt tokens, "
            f"{witness.get('new_tokens')} generated",
        ],
        [
            "smallest top-1 − top-2 reference margin",
            f"{witness.get('reference_min_margin') or 0:.3g}",
            "the trained model's margins are several logits",
        ],
        [
            "SEQ_MATCH",
            witness.get("seq_match"),
            "" if witness.get("first_mismatch") is None else f"first mismatch at token {witness.get('first_mismatch')}",
        ],
        ["LOGITS_MATCH", witness.get("logits_match"), witness.get("logits_explain") or ""],
        ["same compiled programs as the trained run", witness.get("same_programs", "—"), ""],
    ]
    return Table(["", "witness", ""], rows, "witness: PASS" if witness.get("passed") else "witness: FAIL")


def measured_vs_ceiling(model: LoadedModel, settings: Any, figures: BenchFigures) -> dict[str, Any]:
    """This run's decode tok/s against the bandwidth ceiling of the machine it ran on.

    Batch-1 decode reads every device weight and K/V buffer once per token, so
    bandwidth / bytes-per-step caps it. On CPU the bandwidth is measured now (streaming read and
    GEMV over a buffer far past the caches, with the benchmark's thread count); on inf2 it is the
    HBM bandwidth of the `tp_degree` NeuronCores the recipe uses. The bytes come from the loaded
    model's shapes and the compiled K/V form (ring or full length) and expert form."""
    v = settings.variant_spec
    experts = settings.decode_experts if v.is_moe else "dense"
    common = dict(context_length=settings.context_length, ring=settings.ring_kv, experts=experts)
    if settings.backend == "neuron":
        row = compare(figures.decode_tok_s, model, device=v.instance_type, cores=settings.tp_degree, **common)
    else:
        bandwidth = measure_bandwidth(size_mb=256, threads=figures.threads)
        row = compare(
            figures.decode_tok_s, model, device="cpu", bandwidth_bytes_s=bandwidth["bandwidth_bytes_s"], **common
        )
        row["bandwidth"] = bandwidth
    row["label"] = f"this run ({settings.profile})"
    released = compare(
        v.field_report.decode_tok_s,
        v.name,
        device=v.instance_type,
        cores=v.tp_degree,
        context_length=2048,
        ring=True,
        experts="selective" if v.is_moe else "dense",
    )
    released["label"] = f"released {v.name.upper()}, {v.instance_type} TP={v.tp_degree} (field report)"
    row["released_inf2"] = released
    return row


def bench_table(figures: BenchFigures, settings: Any, ceiling: Mapping[str, Any]) -> Table:
    """Median timings next to the bandwidth ceiling here and, for the released model, on inf2."""
    v = settings.variant_spec
    released = ceiling["released_inf2"]

    def roof(row: Mapping[str, Any], source: str) -> str:
        b = row["bytes_per_step"]
        return (
            f"{row['ceiling_tok_s']:,.0f} tok/s = {row['bandwidth_gb_s']:.1f} GB/s ({source}) / "
            f"{b['total'] / 1e6:,.1f} MB per step ({b['weights'] / 1e6:,.1f} weights + {b['kv'] / 1e6:,.1f} K/V)"
        )

    rows = [
        [
            "prefill (median ms)",
            f"{figures.prefill_ms:.3f}",
            f"~{v.field_report.prefill_ms:.0f} ms (field report)" if v.field_report.prefill_ms else "—",
        ],
        [
            "decode (median tok/s)",
            f"{figures.decode_tok_s:.1f}",
            f"~{v.field_report.decode_tok_s:.0f} tok/s (field report)" if v.field_report.decode_tok_s else "—",
        ],
        [
            "decode ceiling (bandwidth / bytes per step)",
            roof(ceiling, "HBM of the cores in use" if settings.backend == "neuron" else "measured now"),
            roof(released, "HBM"),
        ],
        [
            "fraction of the ceiling reached",
            f"{ceiling['roofline_fraction']:.0%}",
            f"{released['roofline_fraction']:.0%} (field report)" if released["roofline_fraction"] else "—",
        ],
        ["timed runs / warm-up / threads", f"{figures.iters} / {figures.warmup} / {figures.threads}", ""],
    ]
    title = (
        "benchmark"
        if settings.profile != "smoke"
        else "benchmark (a tiny model on a CPU: compare with earlier smoke runs, not with inf2)"
    )
    return Table(
        [
            "",
            f"this run ({settings.profile}, {settings.backend})",
            f"released model on {v.instance_type}, TP={v.tp_degree}, 2,048 context",
        ],
        rows,
        title,
    )


def record(
    settings: Any,
    model: LoadedModel,
    ids: Sequence[int],
    compiled: Any,
    device_tokens: Any,
    reference_tokens: Sequence[int],
    report: checks.CheckReport,
    figures: BenchFigures,
    results_path: str | Path | None,
    started: float | None = None,
    extra: Mapping[str, Any] | None = None,
    witness: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's record (`record.build_record`, the builder `port()` uses too), written atomically
    to `results_path` (JSON) when given; `extra` (the notebook's demonstrations) rides along."""
    from .port import prefill_logits_error

    figures_run = {
        "tokens": _tokens(device_tokens),
        "recipe": compiled.recipe,
        "compile_s": compiled.compile_s,
        "cache_hits": compiled.cache_hits,
        "prefill_logits_max_abs_diff": prefill_logits_error(model, compiled.runtime, ids),
        "bench": figures.to_dict(),
        "prefill_ms": figures.prefill_ms,
        "decode_tok_s": figures.decode_tok_s,
        **dict(compiled.info),
        **(compiled.report() if callable(getattr(compiled, "report", None)) else {}),
    }
    result = build_record(
        settings,
        model,
        list(ids),
        figures_run,
        report,
        list(reference_tokens),
        started=started,
        witness=witness,
        extra=_tables_to_dicts(dict(extra or {})),
    )
    if results_path:
        result["result_file"] = str(Path(results_path))
        atomic_write_json(Path(results_path), result)
    return result


def save_record(path: str | Path | None, data: Mapping[str, Any]) -> Path | None:
    """Write a JSON record atomically (nothing when `path` is empty)."""
    if not path:
        return None
    atomic_write_json(Path(path), _tables_to_dicts(dict(data)))
    return Path(path)


def load_results(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The newest result JSON per variant found in `folder` (empty when there is none)."""
    found: dict[str, tuple[float, dict[str, Any]]] = {}
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        name = data.get("variant") if isinstance(data, dict) else None
        if name in VARIANTS and (name not in found or path.stat().st_mtime >= found[name][0]):
            found[name] = (path.stat().st_mtime, data)
    return {name: found[name][1] for name in VARIANTS if name in found}


def results_table(results: Mapping[str, Mapping[str, Any]]) -> Table:
    rows = [
        [
            r.get("variant"),
            r.get("recipe"),
            r.get("tp_degree"),
            r.get("seq_match"),
            r.get("logits_match"),
            r.get("coherent"),
            (r.get("witness") or {}).get("passed"),
            r.get("compile_s"),
            r.get("prefill_ms"),
            r.get("decode_tok_s"),
            r.get("answer"),
        ]
        for r in results.values()
    ]
    return Table(
        [
            "variant",
            "recipe",
            "TP",
            "seq_match",
            "logits_match",
            "coherent",
            "witness",
            "compile s",
            "prefill ms",
            "decode tok/s",
            "answer",
        ],
        rows,
        "the last recorded run of each variant"
        if rows
        else "no results recorded yet: run the variant notebooks (or `python -m papermill_runs run`) first",
    )


# ---- interactive --------------------------------------------------------------------------------


def chat(runtime: Any, model: LoadedModel, settings: Any):
    """A small chat box (ipywidgets) over the compiled runtime: type a question, read the streamed answer.
    Returns the widget; the notebooks only build it when `interactive` is True."""
    import ipywidgets as widgets

    from .port import eos_ids
    from .runtime import encode_prompt

    box = widgets.Text(placeholder=settings.prompt, description="you:", layout=widgets.Layout(width="70%"))
    button = widgets.Button(description="ask")
    out = widgets.Output()

    def ask(_):
        question = box.value or settings.prompt
        ids = encode_prompt(model.tokenizer, question)
        pieces: list[int] = []
        with out:
            out.clear_output()
            print(f"you: {question}")
            n = min(settings.max_new_tokens, runtime.context_length - len(ids))
            runtime.generate(ids, n, eos_token_ids=eos_ids(model), on_token=pieces.append)
            print(f"model: {answer_text(model, pieces)}")

    button.on_click(ask)
    return widgets.VBox([widgets.HBox([box, button]), out])
