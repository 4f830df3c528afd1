# The parts of 04_31b.ipynb that are the 31B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: form --
brief
# -- part: variant --
31b
# -- part: hub --
google/gemma-4-31B-it
# -- part: tp --
8
# -- part: full_shapes --
context_length: 32768, prefill_buckets: [128, 512], context_buckets: [2048, 8192]
# -- part: instance --
inf2.24xlarge
# -- part: header --
# # Gemma-4 31B: the dense giant, eight cores, and KV heads that must be copied
#
# The 31B is a plain dense decoder that happens to need eight NeuronCores. **You will learn** why the
# recipe had to change to `ModelBuilder` at this size, what the compile costs in host RAM, and what
# [tensor parallelism](00_overview.ipynb#tp) at TP=8 does to its four global KV heads (each is copied onto two ranks). The notebook also replays
# the [field report](00_overview.ipynb#field-report)'s 31B bug: a chat prompt that the device and the reference both processed
# identically, and wrongly.
# -- part: tiny_model --
more KV heads on sliding than on global layers
# -- part: parameters --
tp_demo = 4  # ranks of the rank-graph run on CPU processes (0: skip)
# -- part: settings --
# -- part: lesson --
# %% [markdown]
# ## What makes the 31B different
#
# Architecturally it is the simplest of the five: no [PLE](00_overview.ipynb#ple), no [KV sharing](00_overview.ipynb#kv-sharing), no experts. The hard part is
# size. Its bf16 weights do not fit fewer than eight NeuronCores with room for K/V (the table below,
# computed from the plan, unverified on inf2), so the 31B needs an `inf2.24xlarge` and TP=8, as the
# field report ran it. The hand-driven [TP](00_overview.ipynb#tp) recipe that carried E4B in the field
# report (its `tp_alias`, every rank traced on the same host; read here as [NxD](00_overview.ipynb#nxd)'s `parallel_model_trace`, which the report does not name)
# ran out of host memory at this size, and serialising its result deadlocked. NxD `ModelBuilder`
# compiles one rank in one process and shards the weights per rank, which is what scales. Its compile
# holds the host model and, while it writes the shards, the NxD-arranged checkpoint: about two copies
# of the weights. The cell prints the plan step by step (`inf2.compile_host`), then the
# [field report](00_overview.ipynb#field-report)'s measured peak beside it: two figures for one
# compile, and they differ for two reasons the cell spells out.
#
# - **What the plan counts**: this process, the host model, both keys' modules at one rank's shard
#   size, and the NxD checkpoint, which this port's loader builds lazily, only when
#   `shard_checkpoint` asks for it, with one rank's file being written at a time.
# - **What it leaves out**: the Neuron compiler's own RAM (`neuronx-cc` compiling each key's [HLO](00_overview.ipynb#hlo),
#   never measured here; a measured peak includes it, the plan does not), and anything a different
#   port holds. The field report's port built its
#   checkpoint eagerly, beside the module and every rank's shard: about three copies of the
#   weights, which is the old estimate the cell prints, and which matched its measured peak.
#
# So the plan is a floor for this recipe (computed, unverified on inf2), the field report's figure a
# measurement of another port; sizing the compile host for the larger one is the cautious choice
# (a judgement from these two figures; no compile here has run on inf2). Plan the
# compile host from these, not from the serving instance: ModelBuilder never needs the weights on a
# NeuronCore to compile.

# %%
from gemma4lib.inf2.compile_host import compile_host_plan
from gemma4lib.inf2.memory_plan import COMPILE_CALIBRATION

display(nb.tp_fit("31b"))  # bf16 weights per core at each TP degree, against a core's HBM
compile_plan = compile_host_plan("31b", 8)  # what the compile host holds at each step (GB, computed)
for step, gb in compile_plan.steps.items():
    held = compile_plan.base_gb + compile_plan.model_gb + gb
    print(f"{step}: ~{held:.0f} GB = process + host model {compile_plan.model_gb:.0f} + this step {gb:.0f}")
print(f"peak ~{compile_plan.peak_gb:.0f} GB at {compile_plan.peak_step!r}: computed, without the compiler's own RAM")
field = COMPILE_CALIBRATION  # the field report's measured compile peak, with its own (eager) port
eager = compile_plan.base_gb + 3 * compile_plan.model_gb  # module + an eager checkpoint + every shard
measured, plan_gb = field["measured_peak_gb"], compile_plan.peak_gb
print(f"{field['source']}, TP={field['tp']}: ~{measured:.0f} GB measured on inf2; this recipe's plan ~{plan_gb:.0f} GB")
share = measured / eager  # how close the three-copy estimate came
print(f"  three copies of the weights (module, eager checkpoint, shards): ~{eager:.0f} GB, {share:.0%} of it measured")
held = compile_plan.rank_gb + compile_plan.written_gb  # what the lazy recipe holds instead of every shard
print(f"  the plan holds one rank's module and file (~{held:.0f} GB) where that port held every rank's shard")
print(f"  (~{compile_plan.model_gb:.0f} GB): the ~{eager - plan_gb:.0f} GB between them. Neither counts the compiler's")
print("  own RAM; a measured peak includes what it held at that moment (unverified on inf2)")

# %% [markdown]
# ### KV heads under TP=8: replicated, not sharded
#
# The sliding layers have twice as many KV heads as ranks: two per rank, a clean split. The
# full-attention layers have only half as many KV heads as ranks (the released config's
# `num_global_key_value_heads` and `num_attention_heads`, which the cell prints: eight Q heads per KV head). At TP=8 each rank owns four Q heads, all of
# which read the same KV head (Q head `q` reads KV head `q // 8`), so rank `r` keeps a copy of KV head
# `r // 2`: every global KV head lives on two ranks. The cell works it out from the released config
# and checks it against the library's TP plan. On inf2 the copies are made before NxD sees the
# weights: the checkpoint the loader hands `ModelBuilder` already holds each copied head once per
# rank (`nxd_checkpoint`), so NxD's plain contiguous split gives every rank the head it reads.

# %%
real, tp = s.variant_spec.real_config, s.variant_spec.tp_degree
q_heads, kv_heads = real["num_attention_heads"], real["num_global_key_value_heads"]
q_per_kv, q_per_rank = q_heads // kv_heads, q_heads // tp
kv_on_rank = [sorted({q // q_per_kv for q in range(r * q_per_rank, (r + 1) * q_per_rank)}) for r in range(tp)]
print(f"num_attention_heads={q_heads}, num_global_key_value_heads={kv_heads}, TP={tp}:",
      f"global KV head(s) held by each rank {kv_on_rank}")  # fmt: skip
demos["kv_heads_tp8"] = nb.kv_heads_under_tp("31b", 8)
table = demos["kv_heads_tp8"]
by_rank = {row[0]: dict(zip(table.columns, row, strict=True))["KV head(s) on rank 0..N-1"] for row in table.rows}
assert by_rank["full"] == str(kv_on_rank)  # the library's TP plan agrees with the arithmetic
demos["kv_heads_tp8"]

# %% [markdown]
# The tiny 31B keeps the proportions (more sliding than global KV heads), so at TP=4 its
# global heads are replicated as well. The cell first does one full-attention layer's TP by hand,
# with the function `03_12b` prints (`nb.sharded_attention_by_hand`): each rank takes its Q heads (a
# column shard of `q_proj`), keeps a **whole copy** of the one KV head they read (the values come
# from the same `k_proj`: [k_eq_v](00_overview.ipynb#k-eq-v); a layer with a `v_proj` would take them from there), attends, and
# multiplies by its columns of `o_proj` (a row shard); the sum of the ranks' partials (the
# all-reduce) must equal transformers' attention. Then it shows the library's plan and runs the [rank graph](00_overview.ipynb#rank-graph) for real on CPU: `tp_demo`
# processes, each holding only its shard and its copies of the global KV heads (the full profile
# skips the run: `tp_demo: 0`).

# %%
rank_tp = tp_demo or 4  # the tiny model's TP degree (the released 31B: 8)
hand = nb.sharded_attention_by_hand(text_model, inputs_embeds, rank_tp)  # as in 03_12b, which prints its source
tol = {"rtol": 1e-4, "atol": 1e-5} if inputs_embeds.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
torch.testing.assert_close(hand["attn_tp"], hand["attn_hf"], **tol)  # the all-reduced shards = transformers'
assert all(len(ranks) == max(1, rank_tp // hand["kv_heads"]) for ranks in hand["copies"].values())
print(f"layer {hand['layer']} at TP={rank_tp}: {hand['q_heads']} Q heads, {hand['kv_heads']} KV head(s), values from")
print(f"{hand['values_from']}; the ranks holding each KV head: {hand['copies']}: equal to transformers' attention")
display(nb.kv_heads_under_tp("31b", rank_tp, config=model.config))
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo)
    display(demos["tp_cpu"])

# %% [markdown]
# ### How long a context fits on one core, and what the copied heads cost
#
# The copies above cost memory: each global KV head lives on more than one rank, so every core holds
# a whole head's K/V for each full-attention layer, where a split without copies would leave it a
# share of the heads. The cell's last lines measure that in the plan itself: past the sliding
# window the rings stop growing, so what grows between two contexts is the full-attention layers'
# K/V; it prints their part of a core's K/V at the longest context and what it would be without copies.
# HBM alone gives both inf2 sizes the same figure: the recipe's TP degrees stop at eight
# (`supported_tp`), so the larger instance adds cores to run more replicas, not room on each core; its
# larger host RAM does let a longer context compile.
#
# The table plans one core at each context up to the released maximum (`nb.context_plan`); the loop
# asks `largest_context`, per inf2 size, for the longest context whose K/V still fits beside the
# weights and whose compile fits the compile host's RAM, at a TP degree whose host side the instance's RAM
# holds (its serving-host plan), and prints what HBM alone allows and which bound binds (`context_plan`).
# All are computed from the released config and unverified on inf2; the compiler's own RAM, which grows
# with the compiled length, is an assumed law on one published failure (README, the family table's note).

# %%
from gemma4lib.inf2.memory_plan import plan_core_memory
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
longest, ctx_tp = largest_context(variant, s.variant_spec.instance_type)
kv = {c: plan_core_memory(variant, ctx_tp, context_length=c).kv_gib for c in (longest // 2, longest)}
global_gib = 2 * (kv[longest] - kv[longest // 2])  # what grows past the window: the full-attention layers
copies = ctx_tp // kv_heads  # ranks holding each global KV head
share = global_gib / kv[longest]
print(f"at {longest:,} tokens the full-attention layers hold {global_gib:.2f} GiB", end=" ")
print(f"of the core's {kv[longest]:.2f} GiB of K/V ({share:.0%})")
print(f"each global KV head sits on {copies} ranks: without copies they would hold {global_gib / copies:.2f} GiB")
demos["full_attention_kv"] = {"context": longest, "gib": global_gib, "of_gib": kv[longest], "copies_per_head": copies}
# -- part: graph_note --
# -- part: compile_note --
# at TP=8: one rank compiled (the rank graph with NxD's parallel layers, each global KV head copied on
# two ranks), the weights sharded per rank, the rank number a runtime tensor, and the decode graph
# the priority model whose weight layout the compiler optimises.
# -- part: neuron_plan --
    plan = make_plan(model.config, tp, model.variant)  # 31B at TP=8: 4 global KV heads, each copied on two ranks
# -- part: neuron_rank_module --
                rank_module = functools.partial(  # the key's module: the rank graph with NxD's parallel layers
# -- part: core_step --
# -- part: after_compile --
# %% [markdown]
# ### Replicated KV heads in the rank graph's shapes
#
# The graph ModelBuilder compiles is not `decode` but the **rank graph**: the same forward with
# its linears cut to one rank's shard (`tp.rank_graph`, built from the config alone on the meta
# device, as NxD builds it once for every rank). The cell builds the tiny 31B's at the TP degree
# of the CPU run above and compares its K/V buffers and `k_proj` shards with the one-device
# graph's, layer by layer: the sliding layers' KV heads are divided among the ranks; the full
# layers, with fewer KV heads than ranks, keep one whole head per rank, so each head exists on
# several ranks: KV heads per rank × TP is more than the device's, and so is the K/V they hold.

#
# Last, one rank's module, the one the inf2 cell above hands NxD for the decode key
# (`mb.rank_module`), built here with the CPU twins of NxD's layers: each rank-local layer beside
# the NxD layer in its place on inf2 (`ColumnParallelLinear`, `RowParallelLinear`, `SPMDRank`), and
# the K/V parameters it aliases to its outputs (`KeyInstance.get()`'s second value).
# %%
from gemma4lib.tp.plan import make_plan
from gemma4lib.recipes import neuron_model_builder as mb
from gemma4lib.tp.rank_graph import CpuParallelFactory

rank_tp = tp_demo or 4  # the tiny model's TP degree; the released 31B's is 8
plan = make_plan(model.config, rank_tp, model.variant)
# the decode key's module as the inf2 cell hands it to NxD, with the CPU twins of NxD's layers
one_rank = mb.rank_module(model.config, plan, decode.shape, torch.float32, CpuParallelFactory(rank_tp))
rank_graph = one_rank.graph  # what ModelBuilder compiles once, for every rank
rows = []
for one, mine in zip(decode.layout.producers, rank_graph.layout.producers, strict=True):
    attn = rank_graph.model.layers[one.index].self_attn
    mode = plan.attention(one.index).kv_mode
    k_proj = tuple(attn.k_proj.weight.shape)
    rows.append([one.index, one.layer_type, mode, one.kv_heads, mine.kv_heads, k_proj])
    assert (mode == "replicate") == (mine.kv_heads * rank_tp > one.kv_heads)  # copies only where heads < ranks
assert any(row[2] == "replicate" for row in rows)  # the tiny 31B's full layers, as the released one's at TP=8
columns = ["layer", "type", "KV mode", "KV heads, one device", "KV heads per rank", "k_proj shard"]
display(nb.Table(columns, rows, f"the rank graph at TP={rank_tp} against the one-device graph"))
full = next(kv.index for kv in decode.layout.producers if kv.layer_type == "full_attention")
display(nb.rank_module_table(one_rank, layers=(0, full)))  # one rank's layers: here, and NxD's on inf2
# -- part: after_checks --
# %% [markdown]
# ### The 31B's bug, replayed: SEQ_MATCH on nonsense
#
# In the field report a chat prompt for the 31B was written by hand in Gemma 3's format,
# `<start_of_turn>user ...`. Gemma-4 has no such token: the tokenizer splits each marker into ordinary
# pieces, the model reads noise and answers noise. The device still matched the CPU reference token
# for token, because both processed the same wrong input. The compiled graphs from above run both
# prompts (the hand-built one is longer, and still fits the compiled bucket). First the two prompts
# as the tokenizer sees them: the template's starts with the real turn token, the hand-built one
# with the pieces of a marker the vocabulary does not have.

# %%
hand_built = nb.gemma3_style_ids(model, s.prompt)  # Gemma 3's "<start_of_turn>user\n..." written by hand
turn = model.tokenizer.convert_tokens_to_ids("<|turn>")  # Gemma-4's real turn token
print(f"chat template: {len(ids)} tokens, {model.tokenizer.convert_ids_to_tokens(ids[:3])} ...")
print(f"hand-built:    {len(hand_built)} tokens, {model.tokenizer.convert_ids_to_tokens(hand_built[:6])} ...")
assert turn in ids and turn not in hand_built  # the model never sees a turn in the hand-built prompt
demos["equality_is_not_enough"] = nb.equality_is_not_enough(model, compiled.runtime, s)
demos["equality_is_not_enough"]
# -- part: image_note --
# The 31B's vision part is the encoder `01_e2b` describes (transformers' `Gemma4VisionModel`,
# its pooler, then `Gemma4MultimodalEmbedder`), at the fixture's patch sizes, printed below.
# The fixture's config leaves `use_bidirectional_attention` unset, so the masks below are causal over
# the image. vLLM's Gemma-4 support reports that the released 31B config sets it to "vision", as
# the 12B's does (unverified here). The port reads the config: on cpu, eager and xla at TP=1 such a
# config gets the 12B's image blocks (`03_12b`); the gloo ranks and the neuron decoder keys do not
# take them yet, and refuse it once the loaded config is known, rather than run causal.
# -- part: clip --
None
# -- part: audio_note --
# The 31B has no audio part: its config's `audio_config` is null. `PortSettings(variant="31b",
# audio=[...])` is refused before anything loads, naming the variants that hear (e2b, e4b, 12b), so
# this section skips.
# -- part: plot_note --
# The field report gives no decode figure for the 31B (prefill only), so its bar is the computed
# ceiling alone.
# -- part: takeaways --
# - Scale, not architecture, is the 31B's problem: eight cores, a long compile, a large host.
# - Reach for the compile-one-rank recipe (`ModelBuilder`) before the per-rank tracer runs the host
#   out of memory.
# - Fewer KV heads than ranks means replication: each global KV head sits on two of eight ranks.
#   It shows in what is compiled: the rank graph's full layers keep one whole KV head and a `k_proj`
#   shard of one head's rows on every rank (more than a TP-th of the K/V), and the by-hand sum over
#   ranks equals transformers' attention only with those copies.
# - Plan the compile host from the step-by-step plan, not from the serving instance: the compile
#   needs the host model and the sharded checkpoint at once, never a NeuronCore.
# - Build prompts with the tokenizer's chat template. `SEQ_MATCH True` on nonsense is the signature
#   of an input problem, and only the coherence check reports it.
# - The witness runs the same compiled programs when only weights differ (its "same compiled programs"
#   row); either way it is checked against its own reference.
