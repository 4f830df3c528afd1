"""What makes each variant different, shown: the model at a glance, PLE, KV producers, k_eq_v,
the attention implementations side by side, the MoE block and its expert forms on one token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gemma4lab.inf2.roofline import GB
from gemma4lab.notebook.display import Table, answer_text
from gemma4lab.notebook.family import BF16_BYTES, _gb, device_bytes
from gemma4lib.device.kv_layout import FULL, SLIDING, KVLayout
from gemma4lib.models.loading import LoadedModel


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
    from gemma4lib.device.embedder import HostEmbedder
    from gemma4lib.device.graph import DeviceGraph, GraphShape, index_tensor

    layout = model.layout
    prefill = DeviceGraph(model.text_model, model.lm_head, layout, GraphShape(1, bucket, context_length))
    graphs = {
        form: DeviceGraph(model.text_model, model.lm_head, layout, GraphShape(1, 1, context_length), expert_form=form)
        for form in ("dense", "selective")
    }
    kv = prefill.new_kv()
    embedder = HostEmbedder.from_text_model(model.text_model)
    n = len(ids)
    inputs = embedder.inputs(torch.as_tensor(list(ids))[None], pad_to=bucket, dtype=prefill.dtype)
    first = int(prefill(*inputs, index_tensor([0]), index_tensor([n]), *kv)[0].argmax())
    step = embedder.inputs(torch.tensor([[first]]), dtype=prefill.dtype)
    logits = {
        form: graph(*step, index_tensor([n]), index_tensor([1]), *[t.clone() for t in kv])[0]
        for form, graph in graphs.items()
    }
    # transformers' own eager MoE on the full sequence (prompt + first token) as the reference
    ref = model.lm(input_ids=torch.as_tensor(list(ids) + [first])[None]).logits[0, -1].float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    from gemma4lib.runtime import softcap

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
