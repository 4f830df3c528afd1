# The parts of 05_26b_a4b.ipynb that are the 26B-A4B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: form --
brief
# -- part: variant --
26b-a4b
# -- part: hub --
google/gemma-4-26B-A4B-it
# -- part: tp --
8
# -- part: full_shapes --
context_length: 131072, prefill_buckets: [128, 512], context_buckets: [2048, 8192, 32768]
# -- part: instance --
inf2.24xlarge
# -- part: header --
# # Gemma-4 26B-A4B: a shared MLP beside many small experts, made static
#
# The [mixture-of-experts](00_overview.ipynb#moe) member: a dense MLP and routed experts side by side in every layer.
# (The released config's `num_experts` and `top_k_experts`: the bytes section prints both.)
# **You will learn** the router line by line, why the experts must be made static before anything
# can trace them, why "A4B" (about four billion active parameters) does not shrink the memory but can shrink the bytes a decode step
# reads, and the family's most instructive bug: a rank read at trace time. It runs at TP=8
# ([tensor parallelism](00_overview.ipynb#tp) over eight NeuronCores) through [NxD](00_overview.ipynb#nxd) `ModelBuilder`, each rank holding a slice of every expert.
# -- part: tiny_model --
a dense MLP beside routed experts
# -- part: parameters --
decode_experts = "selective"  # MoE decode: "selective" (the k routed experts) or "dense" (all)
tp_demo = 2  # ranks of the rank-graph run on CPU processes (0: skip)
# -- part: settings --
    decode_experts=decode_experts,
# -- part: lesson --
# %% [markdown]
# ## What makes the 26B-A4B different
#
# ### A shared MLP beside the experts, and the router
#
# Each layer runs a dense MLP and a mixture of experts **in parallel** on the same residual input,
# each with its own norms, and adds the results. The router normalises the hidden state, scales it,
# projects it to one logit per expert, takes a softmax over all experts, keeps the top-k, renormalises
# them and multiplies by a learnt per-expert scale. The cell does that line by line on one token of
# the tiny model (the last prompt token's embedding stands in for the residual a layer would pass it)
# and checks it picked the same experts with the same weights as the model's own router module.

# %%
layer = next(lay for lay in model.text_model.layers if getattr(lay, "router", None) is not None)
router, k = layer.router, model.config.top_k_experts
with torch.no_grad():
    h = inputs_embeds[0, -1:]  # [1, hidden]
    x = router.norm(h) * router.scale * router.scalar_root_size  # RMSNorm, learnt scale, × hidden^-0.5
    probs = torch.softmax(router.proj(x), dim=-1, dtype=torch.float32)  # one probability per expert
    weights, chosen = torch.topk(probs, k=k, dim=-1)  # keep the k best
    weights = weights / weights.sum(dim=-1, keepdim=True) * router.per_expert_scale[chosen]  # renormalise, scale
    _, their_weights, their_chosen = router(h)
assert torch.equal(chosen, their_chosen) and torch.allclose(weights, their_weights)
shown = ", ".join(f"{w:.3f}" for w in weights[0].tolist())
print(f"{model.config.num_experts} experts, top-{k}: chosen {chosen[0].tolist()}, weights {shown}")
nb.moe_report(model)

# %% [markdown]
# ### Static experts
#
# transformers' eager expert loop visits only the experts a batch happens to route to: a
# data-dependent Python loop that a tracer records for one routing and silently replays for every
# other. The port swaps in a static form: **dense** (every expert on every token, outputs weighted by
# the routed weights, zero for the rest; static shapes, and the experts split across ranks) or
# **selective** (gather the k routed experts' weights, then batched matmuls; reads only k experts per
# token). The cell first writes both forms out by hand on one [MoE](00_overview.ipynb#moe) layer of the tiny model (every
# expert weighted by a routing weight that is zero where the router did not pick it; or a loop over
# only the k picked experts) and asserts they equal `experts.StaticExperts` (the forms the graph
# compiles, `gemma4lib/device/experts.py`) and transformers' own expert module. Then it runs one
# decode step both ways against transformers' reference: same token, logits equal to rounding.
#
# Decode gathers the top-k: one token needs `top_k_experts` of the `num_experts`, and bytes are the
# whole cost of a decode step. On the benchmark's medium MoE model (a random-weight MoE of this
# architecture at medium width, big enough that a decode step is bound by bytes on a CPU) the two
# forms are timed by `python -m gemma4lab bench --suite cpu`; the README and `docs/ROOFLINE.md` quote a
# run's ratio (this notebook times neither on that model). Prefill stays dense: the gathered slices grow with tokens × k (a full prompt bucket of
# the real model gathers k slices for each of its tokens, more than the experts dense reads once) and the dense
# form splits cleanly across ranks. The choice is per phase (`mb.bucket_expert_forms`, the inf2 cell's
# `forms`): `decode_experts` in the parameters cell switches decode to dense.

# %%
import torch.nn.functional as F

from gemma4lib.device.experts import StaticExperts

experts = next(layer.experts for layer in text_model.layers if getattr(layer, "experts", None) is not None)
E, k, n = experts.num_experts, model.config.top_k_experts, 3  # experts, routed per token, tokens
seed = torch.Generator().manual_seed(0)
with torch.no_grad():
    x = torch.randn(n, model.config.hidden_size, generator=seed)
    top_w, top_i = torch.softmax(torch.randn(n, E, generator=seed), -1).topk(k, dim=-1)  # a router's output

    def expert(e, h):  # expert e's MLP: gate and up in one product [2I, H], the activation, down [H, I]
        gate, up = F.linear(h, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])

    routed = torch.zeros(n, E).scatter(1, top_i, top_w)  # [n, E]: the routing weight, zero where not routed
    dense = sum(routed[:, e : e + 1] * expert(e, x) for e in range(E))  # every expert on every token: static
    selective = torch.stack([sum(top_w[t, j] * expert(int(top_i[t, j]), x[t]) for j in range(k)) for t in range(n)])
    torch.testing.assert_close(dense, selective, rtol=1e-4, atol=1e-5)  # the same math, two read patterns
    for form, ours in (("dense", dense), ("selective", selective)):
        torch.testing.assert_close(StaticExperts(experts, form)(x, top_i, top_w), ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(experts(x, top_i, top_w), dense, rtol=1e-4, atol=1e-5)  # transformers' own
print(f"by hand: {E} experts, top-{k}, {n} tokens; dense and selective equal experts.StaticExperts and transformers'")
demos["expert_forms"] = nb.expert_forms_on_a_token(model, ids, s.context_length, max(s.prefill_buckets))
demos["expert_forms"]

# %% [markdown]
# ### "A4B" saves compute, not memory, and the split decides the bytes
#
# Only a few billion parameters are active per token, but any token may route to any expert, so every
# expert stays resident: the field report runs the 26B-A4B on the same `inf2.24xlarge` at TP=8 as the
# 31B (its weights would fit at TP=4, the table shows, computed and unverified on inf2; four cores
# need an `inf2.24xlarge` anyway). What top-k
# routing can save is bandwidth, if decode reads only the routed experts, and under [TP](00_overview.ipynb#tp) that depends on
# how the experts are shared by the ranks. The cell first derives the bytes one decode step reads from
# the released config, then asks the roofline for one decode step at TP=8 on `inf2.24xlarge` ([ring](00_overview.ipynb#ring)
# K/V, selective experts) under both splits; the figures are in its table:
#
# - **whole experts per rank** (the field report's split, `expert_split="experts"`; its port computed
#   every expert densely, so the selective ceiling printed below is this cookbook's, not the report's): static shapes
#   make every rank gather k slices from its own experts whatever the router chose, so up to TP × k
#   experts' bytes are read per token;
# - **a slice of every expert per rank** (a TP-th of each expert's intermediate columns; this port's
#   default): the k slices a rank gathers are its share of the k routed experts, so the whole step
#   reads what one device would.
#
# Both are bounds from bytes, not measured on inf2. Each rank holds a TP-th of the expert bytes either way.

# %%
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT
from gemma4lab.inf2.roofline import compare

real, v = s.variant_spec.real_config, s.variant_spec
sizes = nb.device_bytes(v)
experts_gb = real["experts_b"] * 2  # bf16: 2 bytes a parameter, billions of parameters -> GB
per_expert_gb, other_gb = experts_gb / real["num_experts"], sizes["device_gb"] - experts_gb
step_gb = other_gb + real["top_k_experts"] * per_expert_gb  # everything else is read every step
print(f"released: num_experts={real['num_experts']}, top_k_experts={real['top_k_experts']}")
print(f"experts {experts_gb:.1f} GB, one expert {per_expert_gb:.3f} GB, everything else {other_gb:.1f} GB")
print(f"a decode step reads {other_gb:.1f} + {real['top_k_experts']} x {per_expert_gb:.3f} = {step_gb:.2f} GB")
print(f"(library: {sizes['decode_read_gb']:.2f} GB), not all {sizes['device_gb']:.1f} GB")
for split in ("experts", "intermediate"):
    row = compare(
        None, v.name, device=v.instance_type, cores=v.tp_degree, context_length=DEFAULT_CONTEXT, ring=True,
        experts="selective", expert_split=split,
    )  # fmt: skip
    print(
        f"{split:>12} split: {row['bytes_per_step']['total'] / 1e6:>9,.0f} MB per step, "
        f"ceiling {row['ceiling_tok_s']:,.0f} tok/s on {v.instance_type} at {DEFAULT_CONTEXT:,} tokens (the plan's)"
    )
display(nb.tp_fit("26b-a4b"), nb.kv_heads_under_tp("26b-a4b", 8))

# %% [markdown]
# ### The rank must be a runtime value
#
# When each rank holds whole experts, it must pick the matching columns of the routing weights. In
# the field report that slice was chosen with a rank read while tracing: a Python integer, baked into
# the single-rank `ModelBuilder` trace as a constant, so every rank weighted its experts with the first rank's routing
# weights. Device output was empty while the CPU and the unit tests were fine. The library reads the
# rank from an int32 tensor that each rank loads with its weights; in the default split (a slice of
# every expert per rank) the expert math never reads the rank at all.
#
# The first cell shows the bug on its own, in a few lines of torch: read the rank as a Python number
# while tracing (`int(rank)`) and the tracer records the number it saw as a constant (it warns, and
# carries on: the cell prints how many warnings it gave); keep it a tensor and the slice stays part
# of the program. The second
# runs the sharded model (default split) and the baked-rank bug (whole experts per rank) as CPU rank
# processes (the full profile skips it: `tp_demo: 0`).

# %%
import warnings

ranks, n_experts = tp_demo or 2, model.config.num_experts
per_rank = n_experts // ranks
routing = torch.arange(2.0 * n_experts).reshape(2, n_experts)  # two tokens' weights, one column per expert


def my_columns_baked(weights, rank):  # the field report's form: the rank becomes a Python int
    start = int(rank) * per_rank
    return weights[:, start : start + per_rank]


def my_columns_runtime(weights, rank):  # the rank stays data: one program serves every rank
    return weights.index_select(-1, rank * per_rank + torch.arange(per_rank))


traced, tracer_warnings = {}, {}
for f in (my_columns_baked, my_columns_runtime):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced[f.__name__] = torch.jit.trace(f, (routing, torch.tensor(0)))
    tracer_warnings[f.__name__] = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
last = torch.tensor(ranks - 1)
for name, program in traced.items():
    right = torch.equal(program(routing, last), routing[:, (ranks - 1) * per_rank : ranks * per_rank])
    got = "its own experts' weights" if right else "rank 0's experts' weights, baked in"
    print(f"{name}: traced at rank 0, run as rank {ranks - 1}: {got}")
print("tracer warnings per function:", {name: len(found) for name, found in tracer_warnings.items()})
print("the first:", tracer_warnings["my_columns_baked"][0].message)

# %%
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo, with_baked_rank=True)
    display(demos["tp_cpu"])

# %% [markdown]
# ### How long a context fits on one core
#
# The experts make the 26B-A4B's weights large, but its attention is that of a much smaller model:
# few layers, two global KV heads, [k_eq_v](00_overview.ipynb#k-eq-v) on the full-attention layers. So its K/V per
# token per core is small, and the weight shard, not the K/V, sets how many cores it needs.
#
# The table plans one core at each context up to the released maximum (`nb.context_plan`); the loop
# asks `largest_context`, per inf2 size, for the longest context whose K/V still fits beside the
# weights and whose compile fits the compile host's RAM, at a TP degree whose host side the instance's RAM
# holds (its serving-host plan), and prints what HBM alone allows and which bound binds (`context_plan`).
# All are computed from the released config and unverified on inf2; the compiler's own RAM, which grows
# with the compiled length, is an assumed law on one published failure (README, the family table's note).

# %%
from gemma4lab.inf2.context import context_plan, largest_context

demos["contexts"] = nb.context_plan(variant)  # one core at its TP on its own instance (GiB, computed)
display(demos["contexts"])
for instance in ("inf2.24xlarge", "inf2.48xlarge"):
    context, tp = largest_context(variant, instance)  # at the fewest cores that reach it
    bound = context_plan(variant, instance, tp) if context else None
    print(
        f"{instance}: longest context {context:,} tokens, at TP={tp} (HBM alone: {bound.device_context:,}; "
        f"bound: {bound.binding})"
        if bound
        else f"{instance}: none fits"
    )
# -- part: graph_note --
# The experts are swapped for a static form here: prefill always computes all experts and masks them
# to the routed top-k; decode uses `decode_experts`.
# -- part: compile_note --
# at TP=8: one rank compiled (the [rank graph](00_overview.ipynb#rank-graph) with NxD's parallel layers, each rank a TP-th slice of
# every expert), the weights sharded per rank, the rank number a runtime tensor, and the decode graph
# (selective experts) the priority model whose weight layout the compiler optimises.
# -- part: neuron_plan --
    plan = make_plan(model.config, tp, model.variant)  # the expert split: a TP-th of every expert's columns per rank
# -- part: neuron_rank_module --
                # the key's module, built by NxD on each rank: the rank graph whose linears are NxD's
                # ColumnParallelLinear (q/k/v, gate/up, the experts' gate_up: rows cut) and
                # RowParallelLinear(input_is_parallel=True) (o, down, the experts' down: columns cut, one
                # all-reduce), and SPMDRank, the rank as a tensor each rank loads with its shard
                rank_module = functools.partial(  # (mb.NxDParallelFactory makes those layers: rank_module's default)
# -- part: core_step --
# -- part: after_compile --
# %% [markdown]
# ### The expert split in the rank graph's bytes
#
# The rank graph (`tp.rank_graph`: the graph ModelBuilder compiles once for every rank) of the tiny
# model, built for both expert splits at the TP degree of the CPU run above, selective decode. Each
# rank holds the same expert bytes under both; what differs is what one decode token reads. Under
# `experts` a rank holds whole experts and gathers k of its own whatever the router chose, so the
# ranks together read TP × k experts; under `intermediate` a rank holds a slice of every expert and
# gathers its slice of the k routed ones, so together they read k experts, what one device would.
#
# Each is one rank's module, the one the inf2 cell above hands NxD for the decode key
# (`mb.rank_module`), built here with the CPU twins of NxD's layers. The last table lists the
# default split's first layer: each rank-local layer beside the NxD layer in its place on inf2 (the
# experts' `gate_up` a `ColumnParallelLinear`, their `down` a `RowParallelLinear`, the rank an
# `SPMDRank`), and the K/V parameters the module aliases to its outputs (`KeyInstance.get()`'s second value).

# %%
from gemma4lib.recipes import neuron_model_builder as mb
from gemma4lib.tp.plan import make_plan
from gemma4lib.tp.rank_graph import CpuParallelFactory

rank_tp, top_k, read = tp_demo or 2, model.config.top_k_experts, {}
rows, modules = [], {}
for split in ("intermediate", "experts"):
    plan = make_plan(model.config, rank_tp, model.variant, expert_split=split)
    # the decode key's module as the inf2 cell hands it to NxD (selective experts), with CPU twins of NxD's layers
    one_rank = mb.rank_module(
        model.config, plan, decode.shape, torch.float32, CpuParallelFactory(rank_tp), expert_form="selective"
    )
    rank_graph, modules[split] = one_rank.graph, one_rank
    experts = next(layer.experts for layer in rank_graph.model.layers if getattr(layer, "experts", None) is not None)
    held = sum(p.numel() * p.element_size() for p in experts.parameters())  # this rank's expert bytes
    per_expert = held // experts.local  # one held expert's bytes (under `intermediate`: this rank's slice)
    read[split] = rank_tp * top_k * per_expert  # all ranks, one token: each gathers k of what it holds
    rows.append([split, experts.local, experts.intermediate, held, top_k * per_expert, read[split]])
assert read["experts"] == rank_tp * read["intermediate"]  # whole experts per rank read TP times the bytes
columns = ["split", "experts per rank", "columns of each", "bytes held per rank", "read per rank", "read, all ranks"]
display(nb.Table(columns, rows, f"one MoE layer of the rank graph, TP={rank_tp}, one decode token"))
display(nb.rank_module_table(modules["intermediate"]))  # the default split's layer 0: here, and NxD's on inf2
# -- part: after_checks --
# -- part: image_note --
# The 26B-A4B's vision part is the encoder `01_e2b` describes (transformers' `Gemma4VisionModel`,
# its pooler, then `Gemma4MultimodalEmbedder`), at the fixture's patch sizes, printed below.
# The soft tokens then go through the MoE decoder like any token: the router picks their experts.
# The fixture's config leaves `use_bidirectional_attention` unset, so the masks below are causal over
# the image. vLLM's Gemma-4 support reports that the released 26B-A4B config sets it to "vision", as
# the 12B's does (unverified here). The port reads the config: on cpu, eager and xla at TP=1 such a
# config gets the 12B's image blocks (`03_12b`); the gloo ranks and the neuron decoder keys do not
# take them yet, and refuse it once the loaded config is known, rather than run causal.
# -- part: clip --
None
# -- part: audio_note --
# The 26B-A4B has no audio part: its config's `audio_config` is null. `PortSettings(variant="26b-a4b",
# audio=[...])` is refused before anything loads, naming the variants that hear (e2b, e4b, 12b), so
# this section skips.
# -- part: plot_note --
# The field report gives no decode figure for the 26B-A4B (prefill only), so its bar is the computed
# ceiling alone.
# -- part: takeaways --
# - The MoE block is a shared MLP plus routed experts; both run on every layer.
# - Replace the data-dependent expert loop with a static form; dense and selective agree with the
#   reference at the decode step the table shows, and the run's checks hold every generated token.
# - All experts stay resident: "A4B" is a compute figure, not a memory one; a slice of every expert
#   per rank makes selective decode read only the routed experts' bytes.
# - Anything rank-dependent inside a traced [SPMD](00_overview.ipynb#spmd) graph must come from a runtime tensor. A rank read
#   while tracing is the same constant on every rank.
