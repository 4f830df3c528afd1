"""What the variant notebooks show beside their own code: tables of PLE, KV producers, k_eq_v and KV
heads under TP, the MoE block and its expert forms, prompts that pass SEQ_MATCH on nonsense, the
witness, and the measured decode against its ceiling. The steps a learner copies (host embeddings,
PLE on the host, the router, the checks) are code in the notebooks' cells, not functions here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .. import checks
from ..device.kv_layout import FULL, SLIDING, KVLayout
from ..inf2.bandwidth import measure_bandwidth
from ..inf2.roofline import GB, compare
from ..models.loading import LoadedModel
from ..models.variants import Variant, get_variant
from ..timing import BenchFigures
from .display import Table, answer_text
from .family import _gb, device_bytes, real_config
from .formatting import readable_tokens

BF16_BYTES = 2
# A hand-built prompt in Gemma 3's turn format: not Gemma-4 tokens (see `equality_is_not_enough`).
GEMMA3_STYLE_PROMPT = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


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


def tp_plan(variant: Variant | str, tp: int | None = None, config: Any = None) -> Any:
    """The sharding plan of the released config (or `config`) at `tp` (default: the variant's)."""
    from ..tp import make_plan

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
    from ..port import eos_ids
    from ..tp import run_tp_port

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
    from ..device.graph import DeviceGraph, GraphShape
    from ..runtime import HostRuntime

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
    from ..runtime import softcap

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


def gemma3_style_ids(model: LoadedModel, prompt: str) -> list[int]:
    """The 31B's bug: a chat prompt written by hand in Gemma 3's turn format. Gemma-4 has no such
    tokens, so each marker is split into ordinary pieces."""
    return list(model.tokenizer(GEMMA3_STYLE_PROMPT.format(prompt=prompt))["input_ids"])


def equality_is_not_enough(model: LoadedModel, runtime: Any, settings: Any) -> Table:
    """The same question through the real chat template and through a hand-built Gemma-3-style one,
    each run on the device graph and on the reference. Both prompts give SEQ_MATCH; only one answer
    makes sense."""
    from ..port import eos_ids
    from ..reference import reference_greedy

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
    from ..port import prompt_ids

    for label, ids in (
        ("tokenizer's chat template", prompt_ids(model, settings)),
        ("hand-built <start_of_turn> prompt", gemma3_style_ids(model, settings.prompt)),
    ):
        n = min(settings.max_new_tokens, runtime.context_length - len(ids))
        device = runtime.generate(ids, n, eos_token_ids=eos).tokens
        reference = reference_greedy(model.lm, ids, n, eos)
        report = checks.evaluate(model.lm, model.tokenizer, ids, device, reference, expect=settings.expect)
        shown = readable_tokens(model.tokenizer, until_stop(device, eos))
        rows.append([label, len(ids), report.seq_match, report.coherent, report.answer, shown])
    return Table(
        ["prompt", "prompt tokens", "SEQ_MATCH", "coherent", "device answer", "device tokens, one by one"],
        rows,
        "device == reference proves the compiler faithful, not the input right",
        "The second answer is nonsense by design: <start_of_turn> is not a Gemma-4 token, so the model never "
        "sees a turn. Cells like ⟨E2⟩ are single bytes of a character the model never finished.",
    )


def run_witness(settings: Any, compiled: Any = None) -> dict[str, Any]:
    """The random-weights witness of this port (`port.run_witness`): the same variant, shapes and
    compiled programs with seeded random weights, checked for SEQ_MATCH and LOGITS_MATCH. With
    the trained run's `compiled` graphs it also says whether it ran the very same artifacts."""
    from ..port import run_witness as _run

    artifacts = (getattr(compiled, "info", None) or {}).get("artifacts")
    return _run(settings, artifacts=artifacts)


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
    source = "field report" if v.field_report.decode_tok_s is not None else "computed ceiling only"
    released["label"] = f"released {v.name.upper()}, {v.instance_type} TP={v.tp_degree} ({source})"
    if v.field_report.decode_tok_s is None:
        released["note"] = "no decode tok/s measured: no inf2 here, and the field report gives prefill only"
    row["released_inf2"] = released
    return row
