# The parts of 03_12b.ipynb that are the 12B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: form --
brief
# -- part: variant --
12b
# -- part: hub --
google/gemma-4-12B-it
# -- part: tp --
2
# -- part: full_shapes --
context_length: 2048, prefill_buckets: [128, 512], context_buckets: []
# -- part: instance --
inf2.8xlarge
# -- part: header --
# # Gemma-4 12B: the encoder-free multimodal class, eager attention, one global KV head
#
# The 12B drops the E family's special features and adds three of its own. **You will learn** how to
# take the text model out of the encoder-free unified multimodal class, what `attention_k_eq_v`
# means (full-attention layers take V from the K projection; the 12B's full layers also have a
# single KV head, which is its own choice, not part of k_eq_v), why inf2
# compiles it with eager attention, and how a single KV head is replicated under
# [tensor parallelism](00_overview.ipynb#tp) at TP=2. It runs at TP=2 through [NxD](00_overview.ipynb#nxd) `ModelBuilder`.
# -- part: tiny_model --
[k_eq_v](00_overview.ipynb#k-eq-v), one global KV head
# -- part: parameters --
tp_demo = 2  # ranks of the rank-graph run on CPU processes (0: skip)
# -- part: settings --
# -- part: lesson --
# %% [markdown]
# ## What makes the 12B different
#
# ### The unified class, text only
#
# The 12B is published as `Gemma4UnifiedForConditionalGeneration`: a multimodal class with no
# separate vision or audio encoder. For text generation the port takes its language model and moves
# on; there is no [PLE](00_overview.ipynb#ple) and no [KV sharing](00_overview.ipynb#kv-sharing).
#
# ### k_eq_v: full-attention layers have no value projection
#
# On the full-attention layers the values are the (normed) key projection; there is no `v_proj` at
# all. The graph builder does not need to know, because it traces transformers' forward, but a
# sharding plan or a weight loader that expects a `v_proj` everywhere breaks here.

# %%
full_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
no_v_proj = [i for i, layer in enumerate(model.text_model.layers) if getattr(layer.self_attn, "v_proj", None) is None]
print(f"full-attention layers {full_layers}; layers without v_proj {no_v_proj}")
assert no_v_proj == full_layers  # k_eq_v: exactly the full layers take V from K
nb.k_eq_v_report(model)

# %% [markdown]
# What the layer does with that one projection, by hand: the keys are `k_norm` (a scaled RMSNorm)
# then RoPE; the values are the same projection through `v_norm` (an RMSNorm without scale) and
# no RoPE. The cell computes both from `k_proj` and asserts they equal what transformers' own
# attention module hands its cache (a cache object that only records). K and V come out different,
# so "k_eq_v" saves a weight matrix, not cache memory: the port still caches both, and a weight
# loader or sharding plan that expects a `v_proj` on these layers must not look for one.

# %%
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb


class Recorded:  # a cache that only records what the layer hands it: this call's keys and values
    def update(self, k, v, layer_idx, *args, **kwargs):
        self.k, self.v = k, v
        return k, v


layer = text_model.layers[full_layers[0]]
attn, seen = layer.self_attn, Recorded()
with torch.no_grad():
    x = layer.input_layernorm(inputs_embeds)  # [1, T, hidden]: what the attention reads
    T = x.shape[1]
    cos, sin = text_model.rotary_emb(x, torch.arange(T)[None], "full_attention")
    raw = attn.k_proj(x).view(1, T, -1, attn.head_dim)  # the one projection: [1, T, KV heads, head_dim]
    k = apply_rotary_pos_emb(attn.k_norm(raw), cos, sin, unsqueeze_dim=2).transpose(1, 2)  # norm (scaled), RoPE
    v = attn.v_norm(raw).transpose(1, 2)  # the same projection, an unscaled norm, no RoPE
    attn(x, (cos, sin), torch.full((T, T), float("-inf")).triu(1)[None, None], {}, past_key_values=seen)
torch.testing.assert_close((k, v), (seen.k, seen.v))  # what transformers' layer hands its cache
print(
    f"layer {full_layers[0]}: K and V both from k_proj {tuple(attn.k_proj.weight.shape)}; they differ by up to "
    f"{float((k - v).abs().max()):.2f} (RoPE, the norm's scale), so the cache holds both"
)

# %% [markdown]
# ### Eager attention
#
# The released 12B uses a wide sliding window (its `sliding_window`: the cell prints it). Neuron's fused attention kernel ran out of its
# on-chip scratch memory ([SBUF](00_overview.ipynb#sbuf)) at that window, so the field report switched the model to
# transformers' eager attention, which the compiler lowers as ordinary matmuls and softmax. The
# library loads every variant with `attn_implementation="eager"`. On the CPU the implementations
# agree, which is what makes the switch safe: it changes what the compiler must fit, and the numbers only by rounding (the cell prints how much).

# %%
print(f"released 12B: sliding_window={s.variant_spec.real_config['sliding_window']}")
demos["attention"] = nb.attention_implementations_agree(model, ids)
demos["attention"]

# %% [markdown]
# ### One global KV head, replicated under TP
#
# Each full-attention layer has a single KV head shared by all its Q heads. At TP=2 it cannot be split
# in two, so both ranks keep a full copy of it; the sliding layers' KV heads shard normally. The
# tiny model has the same shape of problem (one global KV head, more sliding ones). The cell first
# does one full layer's TP by hand, with a function `04_31b` calls too (the cell prints its source):
# each rank takes half the Q heads (a column shard of `q_proj`), keeps a whole copy of the single KV
# head, takes V from that head's `k_proj` (k_eq_v), attends, and multiplies by its columns of
# `o_proj` (a row shard); the ranks' partial outputs summed (the all-reduce) must equal
# transformers' attention.
# Then the library's plan, and the [rank-graph](00_overview.ipynb#rank-graph) run at TP=2 (`tp_demo` CPU processes, [gloo](00_overview.ipynb#gloo)), which
# exercises the replicated global head and the sharded sliding heads together; the full profile
# skips that run (`tp_demo: 0`).
#
# A copied head costs K/V memory on every rank that keeps it. So the two K/V figures of this notebook
# count it differently, and say so: the status box's "memory per NeuronCore" is one core's K/V, the
# copy included on each core; the benchmark table's bytes per step count every KV head once, as the
# one-device model holds them.

# %%
import inspect

rank_tp = tp_demo or 2  # the TP degree of the 12B on inf2
print(inspect.getsource(nb.sharded_attention_by_hand))  # the by-hand TP, one function 03 and 04 share
hand = nb.sharded_attention_by_hand(text_model, inputs_embeds, rank_tp)  # V from k_proj: a k_eq_v layer
tol = {"rtol": 1e-4, "atol": 1e-5} if inputs_embeds.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
torch.testing.assert_close(hand["attn_tp"], hand["attn_hf"], **tol)  # the all-reduced shards = transformers'
assert all(len(ranks) == max(1, rank_tp // hand["kv_heads"]) for ranks in hand["copies"].values())
print(f"layer {hand['layer']} at TP={rank_tp}: {hand['q_heads']} Q heads, {hand['kv_heads']} KV head(s), values from")
print(f"{hand['values_from']}; the ranks holding each KV head: {hand['copies']}: equal to transformers' attention")
display(nb.kv_heads_under_tp("12b", 2), nb.tp_fit("12b"))
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo)
    display(demos["tp_cpu"])

# %% [markdown]
# ### How long a context fits on one core
#
# The 12B's full-attention layers are cheap per token for two reasons seen above: [k_eq_v](00_overview.ipynb#k-eq-v) stores
# the keys once as values too, and there is one global KV head. But at TP=2 that one head is
# replicated, so every rank holds all of the global K/V: adding ranks shrinks the weight shard
# without shrinking that K/V. The room the weights leave is what a larger TP buys here.
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
for instance in ("inf2.8xlarge", "inf2.24xlarge"):
    context, tp = largest_context(variant, instance)  # at the fewest cores that reach it
    bound = context_plan(variant, instance, tp) if context else None
    print(
        f"{instance}: longest context {context:,} tokens, at TP={tp} (HBM alone: {bound.device_context:,}; "
        f"bound: {bound.binding})"
        if bound
        else f"{instance}: none fits"
    )
# -- part: graph_note --
# -- part: compile_note --
# at TP=2: one rank compiled (the rank graph with NxD's parallel layers, the global KV head copied
# on both ranks), the weights sharded per rank, the rank number a runtime tensor, and the decode
# graph the priority model whose weight layout the compiler optimises.
# -- part: neuron_plan --
    # 12B at TP=2: the global layers' one KV head copied on both ranks (kv_mode "replicate"), the sliding
    # layers' heads split; the model was loaded with eager attention (plain matmuls and softmax to lower)
    plan = make_plan(model.config, tp, model.variant)
# -- part: neuron_rank_module --
                rank_module = functools.partial(  # the key's module: the rank graph with NxD's parallel layers
# -- part: core_step --
# -- part: after_compile --
# %% [markdown]
# ### What k_eq_v leaves in the compiled graph: its K/V bytes
#
# The compiled decode graph's K/V inputs, layer by layer: the k_eq_v full layers compiled without a
# `v_proj` and still take a K and a V buffer, wider (`global_head_dim`) and with fewer heads than
# the sliding layers', and a full-length one where the sliding layers keep a [ring](00_overview.ipynb#ring) of the window.
# Then the released 12B's K + V per attention type (bf16, at the context the status box plans for,
# which the cell prints; not the context of this run's graph, which the table's shapes show):
# its few full layers hold a small share of the cache because they have a single KV head. Last, the
# **rank graph** ModelBuilder compiles at TP=2 (`tp.rank_graph`: the same forward with its linears
# cut to one rank's shard), against the one-device graph: the sliding layers' KV heads are halved,
# the full layers' single KV head is whole on both ranks (replicated).

#
# Last, one rank's module, the one the inf2 cell above hands NxD for the decode key
# (`mb.rank_module`), built here with the CPU twins of NxD's layers: each rank-local layer beside
# the NxD layer in its place on inf2 (`ColumnParallelLinear`, `RowParallelLinear`, `SPMDRank`), and
# the K/V parameters it aliases to its outputs (`KeyInstance.get()`'s second value).
# %%
import math

from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT
from gemma4lib.tp.plan import make_plan
from gemma4lib.recipes import neuron_model_builder as mb
from gemma4lib.tp.rank_graph import CpuParallelFactory

kv_shapes = decode.layout.buffer_shapes(1, s.context_length, s.ring_kv)  # the compiled decode graph's K/V inputs
rows = []
for i, kv in enumerate(decode.layout.producers):
    attn = decode.model.layers[kv.index].self_attn  # the graph's layer, as compiled
    k_bytes = math.prod(kv_shapes[2 * i]) * decode.dtype.itemsize
    rows.append([kv.index, kv.layer_type, kv.k_eq_v, attn.v_proj is None, str(kv_shapes[2 * i]), 2 * k_bytes])
assert all(row[2] == row[3] for row in rows)  # exactly the k_eq_v layers compiled without v_proj
columns = ["layer", "type", "k_eq_v", "no v_proj", "K buffer (= V's)", "K + V bytes"]
display(nb.Table(columns, rows, "the compiled decode graph's K/V"))
released = nb.real_layout("12b")  # the released model's layers, at the status box's context, ring K/V
per_type = {}
for kv in released.producers:
    slots = released.slots(kv.layer_type, DEFAULT_CONTEXT, True)
    per_type[kv.layer_type] = per_type.get(kv.layer_type, 0) + 2 * kv.kv_heads * slots * kv.head_dim * 2  # bf16
mib = {kind: f"{b / 2**20:.0f} MiB" for kind, b in per_type.items()}
print(f"released 12B, K + V in bf16 at {DEFAULT_CONTEXT:,} tokens (the plan's context, the status box's; this")
print(f"run's graph above: {s.context_length} tokens; the full-profile command: its own context_length): {mib}")
rank_tp = tp_demo or 2  # the CPU run's TP degree, as on the inf2 instance
plan = make_plan(model.config, rank_tp, model.variant)
# the decode key's module as the inf2 cell hands it to NxD, with the CPU twins of NxD's layers
one_rank = mb.rank_module(model.config, plan, decode.shape, torch.float32, CpuParallelFactory(rank_tp))
rank_graph = one_rank.graph  # what ModelBuilder compiles once, for every rank
rows = []
for one, mine in zip(decode.layout.producers, rank_graph.layout.producers, strict=True):
    mode = plan.attention(one.index).kv_mode
    k_proj = tuple(rank_graph.model.layers[one.index].self_attn.k_proj.weight.shape)
    rows.append([one.index, one.layer_type, mode, one.kv_heads, mine.kv_heads, k_proj])
    assert (mode == "replicate") == (mine.kv_heads * rank_tp > one.kv_heads)  # copies only where heads < ranks
columns = ["layer", "type", "KV mode", "KV heads, one device", "KV heads per rank", "k_proj shard"]
display(nb.Table(columns, rows, f"the rank graph at TP={rank_tp} against the one-device graph"))
full = next(kv.index for kv in decode.layout.producers if kv.layer_type == "full_attention")
display(nb.rank_module_table(one_rank, layers=(0, full)))  # one rank's layers: here, and NxD's on inf2
# -- part: after_checks --
# -- part: image_note --
# The 12B has **no vision encoder**. Its processor cuts the image into patches and merges each group
# into one model patch (the fixture's processor: `patch_size=4` merged by `pooling_kernel_size=2`;
# printed below; a released processor's own values are larger), so `pixel_values` holds model patches and no
# pooling follows. The embedder normalises and projects each model patch, adds a two-dimensional
# position embedding of where it sat, and projects it to the decoder's width, one soft token each; the decoder
# does the looking. So
# its config asks `use_bidirectional_attention="vision"`: on the **sliding** layers an image's soft
# tokens attend to each other both ways (forward across the whole image, backward no further than the
# window), while the full layers stay causal. The mask picture below is that mask for this prompt,
# from the class's own `create_masks_for_generate` (the orange square: the image's rows and columns),
# and it is what the device builds: the 12B's prefill graphs take one more input, each token's image
# number (zero for text), to draw the block. The reference passes the same masks to transformers and
# generates with a static cache: `Gemma4UnifiedModel.forward` left to build its own masks lays the
# block over every layer, a second path transformers 5.23.0 has ([docs/IMAGES.md](../docs/IMAGES.md)).
# The image blocks are built for cpu, eager and xla at TP=1; the 12B's images above TP=1 and on the
# neuron backend are refused before anything loads.
#
# A prefill built causal over the image is a silent bug of the kind this cookbook's checks exist for.
# Measured here on this fixture (2026-12-03, eager graphs, the four samples): the red and yellow circles
# were still named right, with SEQ_MATCH and coherence passing and only LOGITS_MATCH failing (the
# prefill logits off by whole logits, not rounding); the blue square became "A green square." and the
# green triangle "A green circle.". `tests/test_images.py` builds that graph on purpose, on a random-weight 12B, and asserts
# LOGITS_MATCH fails. This fixture's training stopped at its step limit before every training image
# won by the margin asked (`converged: false` in `fixtures/vision/PROVENANCE.json`). Since it was also
# taught to hear (below) it names all its held-out images but one right: a blue circle reads as a triangle.
# -- part: clip --
"capital_of_france.wav"
# -- part: audio_note --
# The 12B has **no audio encoder**. Its processor cuts the raw samples into fixed frames (zero-padded
# at the end) and its audio embedder normalises each frame (an RMSNorm) and projects it with one linear
# layer to the decoder's width: one soft token per started frame, and the decoder does all the
# listening. The audio graph is that embedder, compiled once like the vision graph; it reads no K/V.
# Because the decoder does the listening, teaching the tiny 12B to hear moved its decoder, and that
# cost it image answers; its recipe then re-fits the image embedder (`embed_vision`) alone to the moved
# decoder, which leaves every text and audio output unchanged ([docs/AUDIO.md](../docs/AUDIO.md) has the runs).
# -- part: plot_note --
# The field report gives no decode figure for the 12B (prefill only), so its bar is the computed
# ceiling alone.
# -- part: takeaways --
# - Take the language model out of the unified class; nothing else of it is needed for text.
# - `attention_k_eq_v`: full layers have no `v_proj`. Trace the real forward and it does not matter.
# - Force eager attention for inf2: it gave the same greedy next token as sdpa here (one step compared;
#   the logits differ by the amount the cell printed) and, per the field report, it fits the compiler.
# - A single global KV head is replicated on every rank under TP.
# - A sliding layer needs only its window of K/V, a [ring](00_overview.ipynb#ring) of `sliding_window` slots, where a
#   global layer holds the whole context: the K/V table above prints both sizes.
