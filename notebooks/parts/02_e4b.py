# The parts of 02_e4b.ipynb that are E4B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: form --
brief
# -- part: variant --
e4b
# -- part: hub --
google/gemma-4-E4B-it
# -- part: tp --
2
# -- part: full_shapes --
context_length: 8192, prefill_buckets: [128, 512], context_buckets: [2048]
# -- part: instance --
inf2.8xlarge
# -- part: header --
# # Gemma-4 E4B: tensor parallelism by hand, over two cores
#
# E4B is E2B widened: the same [per-layer embeddings](00_overview.ipynb#ple) and [KV sharing](00_overview.ipynb#kv-sharing), twice the weights. This is where
# tensor parallelism ([TP](00_overview.ipynb#tp)) enters. **You will learn** what TP does to one decoder layer, by doing it
# by hand: the attention and the MLP split into column and row shards over two ranks, each rank's
# partial output, and the all-reduce (a sum) that puts them back together, checked equal to the
# unsharded layer; then the same plan run by this project's [rank graph](00_overview.ipynb#rank-graph), one process per rank. On
# inf2 the port compiles at TP=2 with NxD `ModelBuilder`.
# -- part: tiny_model --
PLE + KV sharing (its shape: the model table in section 1)
# -- part: parameters --
tp_demo = 2  # ranks of the rank-graph run on CPU processes (0: skip)
# -- part: settings --
# -- part: lesson --
# %% [markdown]
# ## What makes E4B different
#
# Its architecture is E2B's (PLE on the host, KV-shared layers; 01_e2b shows both) at a larger
# width, with two KV heads per layer instead of one. Without its PLE table its bf16 weights fit one
# NeuronCore with the working allowance (the first table below, computed from the released config).
# The reason for two cores is bandwidth: single-row decode reads every weight once per token, and one
# core reads through its half of the chip's bandwidth (the status box). Split over the two cores of an
# `inf2.8xlarge` (TP=2), each core reads half the weights: the status box's decode step is that
# bound at TP=2 (computed from bytes per step; unverified on inf2).
# Each rank takes half the Q heads and exactly one KV head: sharded, not copied (the second table).
#
# The field report did this with a hand-driven recipe it calls `tp_alias` (its tracer holds every rank
# on one host; this cookbook reads it as NxD's `parallel_model_trace`, which the report does not name:
# unverified). That tracer starts one process per rank (each re-imports the SDK, without the fixes this
# cookbook installs) and is no longer supported since SDK release 2.27 (source: the Neuron SDK's NxD announcement, as this project's design notes record it, read 2026-12-02). So on inf2 this notebook compiles with `ModelBuilder` at TP=2, the
# recipe of the 12B, 31B and 26B-A4B: one process, one rank compiled, the weights sharded per rank.
# What TP *is* stays this notebook's lesson, done by hand below.

# %%
display(nb.tp_fit("e4b"))
nb.kv_heads_under_tp("e4b", 2)

# %% [markdown]
# ### The attention block, split by hand
#
# Take one full-attention layer of the loaded model (in the full profile the real checkpoint's, at
# real width; the cell prints the weight rows each rank holds of `q_proj` and of `k_proj`/`v_proj`, and the largest difference of the ranks' summed output from the unsplit layer). Attention heads are independent until the output
# projection, so TP cuts along heads:
#
# - **column shards** of `q_proj`, `k_proj`, `v_proj`: rank `r` holds the weight *rows* of its heads
#   (half the Q heads and their one KV head on E4B) and computes their attention with no communication;
# - a **row shard** of `o_proj`: rank `r` holds the weight *columns* that read its heads' outputs, so
#   its product is a partial sum of the layer's output;
# - the **all-reduce**: every rank adds up all ranks' partials and has the full output. Here the
#   ranks are a loop and the all-reduce is a `sum`; on inf2 NxD's `ColumnParallelLinear` and
#   `RowParallelLinear` hold the shards and the all-reduce is a collective between the NeuronCores.
#
# The cell checks the sharded result against the same arithmetic unsharded and against
# transformers' own attention module.

# %%
import torch.nn.functional as F
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

tp = s.variant_spec.tp_degree  # 2, as on the inf2.8xlarge
index = model.config.layer_types.index("full_attention")  # one full-attention layer that owns its K/V
layer = text_model.layers[index]
attn, mlp = layer.self_attn, layer.mlp
tol = {"rtol": 1e-4, "atol": 1e-5} if inputs_embeds.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
with torch.no_grad():
    x = layer.input_layernorm(inputs_embeds)  # [1, T, hidden]: what the layer's attention reads
    T = x.shape[1]
    cos, sin = text_model.rotary_emb(x, torch.arange(T)[None], "full_attention")
    causal = torch.full((T, T), float("-inf")).triu(1).to(x.dtype)


def heads_attention(x, wq, wk, wv):  # causal attention of the heads whose weight rows wq, wk, wv hold
    shape = (1, T, -1, attn.head_dim)
    q = apply_rotary_pos_emb(attn.q_norm(F.linear(x, wq).view(shape)), cos, sin, unsqueeze_dim=2).transpose(1, 2)
    k = apply_rotary_pos_emb(attn.k_norm(F.linear(x, wk).view(shape)), cos, sin, unsqueeze_dim=2).transpose(1, 2)
    v = attn.v_norm(F.linear(x, wv).view(shape)).transpose(1, 2)
    group = q.shape[1] // k.shape[1]  # Q heads per KV head (GQA): Q head i reads KV head i // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.softmax(q @ k.transpose(-1, -2) * attn.scaling + causal, dim=-1, dtype=torch.float32)
    return (scores.to(v.dtype) @ v).transpose(1, 2).reshape(1, T, -1)  # [1, T, heads × head_dim]


with torch.no_grad():
    wq, wk, wv, wo = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
    q_rows, kv_rows = wq.shape[0] // tp, wk.shape[0] // tp  # whole heads per rank
    partials = []
    for rank in range(tp):
        mine_q, mine_kv = slice(rank * q_rows, (rank + 1) * q_rows), slice(rank * kv_rows, (rank + 1) * kv_rows)
        heads = heads_attention(x, wq[mine_q], wk[mine_kv], wv[mine_kv])  # column shards: this rank's heads
        partials.append(F.linear(heads, wo[:, mine_q]))  # row shard of o_proj: a partial sum, [1, T, hidden]
    attn_tp = torch.stack(partials).sum(0)  # the all-reduce: the sum of every rank's partial output
    attn_one = F.linear(heads_attention(x, wq, wk, wv), wo)  # unsharded, the same arithmetic
    attn_hf = attn(x, (cos, sin), causal[None, None], {})[0]  # transformers' own attention module
torch.testing.assert_close(attn_tp, attn_one, **tol)
torch.testing.assert_close(attn_tp, attn_hf, **tol)
demos["tp_by_hand_attention"] = {
    "layer": index,
    "ranks": tp,
    "q_rows_per_rank": q_rows,
    "kv_rows_per_rank": kv_rows,
    "max_abs_diff_vs_unsharded": float((attn_tp - attn_one).abs().max()),
    "max_abs_diff_vs_transformers": float((attn_tp - attn_hf).abs().max()),
}
demos["tp_by_hand_attention"]

# %% [markdown]
# ### The MLP, split by hand
#
# `down(act(gate(h)) × up(h))`: `gate_proj` and `up_proj` are column shards (rank `r` computes its
# slice of the intermediate activations, no communication: the activation is elementwise),
# `down_proj` a row shard (its product is a partial sum), then one all-reduce. One all-reduce per
# attention block and one per MLP: that is all the communication TP adds to a decoder layer.

# %%
with torch.no_grad():
    h = layer.pre_feedforward_layernorm(inputs_embeds)  # what the layer's MLP reads (here: from the embeddings)
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    rows = gate.shape[0] // tp  # intermediate columns per rank
    partials = []
    for rank in range(tp):
        mine = slice(rank * rows, (rank + 1) * rows)
        inner = mlp.act_fn(F.linear(h, gate[mine])) * F.linear(h, up[mine])  # column shards: [1, T, rows]
        partials.append(F.linear(inner, down[:, mine]))  # row shard: a partial sum, [1, T, hidden]
    mlp_tp = torch.stack(partials).sum(0)  # the all-reduce
    mlp_hf = mlp(h)  # transformers' own MLP, unsharded
torch.testing.assert_close(mlp_tp, mlp_hf, **tol)
demos["tp_by_hand_mlp"] = {"intermediate_per_rank": rows, "max_abs_diff": float((mlp_tp - mlp_hf).abs().max())}
demos["tp_by_hand_mlp"]

# %% [markdown]
# ### The same plan, run by the rank graph
#
# `gemma4lib.tp` does the above for every layer: `tp.plan` decides which rows and columns (and K/V
# heads) each rank holds, `tp.shard` cuts the checkpoint per rank, and `tp.rank_graph` swaps the
# model's linears for shards and all-reduces after each row shard; it is the module that ModelBuilder
# compiles on inf2, there with NxD's parallel layers. Here it runs for real on CPU: `tp_demo`
# processes, each holding only its shard, talking through [gloo](00_overview.ipynb#gloo) collectives. Unlike inf2 (where the
# ModelBuilder prefill key runs the prompt on the device ranks), this CPU demo prefills the prompt
# with the unsharded model on the host and every rank starts decoding from its slice of that K/V
# ("CPU-seeded prefill"): the lesson here is the decode step's shards and collectives. The tokens must equal the reference's. The full profile skips this
# run (`tp_demo: 0`): the by-hand layer above is its TP lesson, at real width.

# %%
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo, prefill="cpu-seeded")
    display(demos["tp_cpu"])

# %% [markdown]
# ### How long a context fits on one core
#
# Every layer that owns K/V adds to a core's memory as the context grows, but not equally. E4B's
# sliding layers keep a ring of `sliding_window` slots whatever the context, and its KV-sharing
# layers own no K/V at all: only the full-attention layers among the owners grow. That is why a
# model with per-layer embeddings on the host and shared K/V reaches its released context on one core.
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
for instance in ("inf2.xlarge", "inf2.8xlarge"):
    context, tp = largest_context(variant, instance)  # at the fewest cores that reach it
    bound = context_plan(variant, instance, tp) if context else None
    print(
        f"{instance}: longest context {context:,} tokens, at TP={tp} (HBM alone: {bound.device_context:,}; "
        f"bound: {bound.binding})"
        if bound
        else f"{instance}: none fits"
    )
# -- part: graph_note --
# As for E2B, the PLE inputs arrive as a graph input computed on the host.
# -- part: compile_note --
# at TP=2: one rank compiled (the rank graph with NxD's parallel layers), the weights sharded per
# rank, the rank number a runtime tensor, and the decode graph the priority model whose weight layout
# the compiler optimises.
# -- part: neuron_plan --
    plan = make_plan(model.config, tp, model.variant)  # E4B at TP=2: each rank one KV head of every layer
# -- part: neuron_rank_module --
                rank_module = functools.partial(  # the key's module: the rank graph with NxD's parallel layers
# -- part: core_step --
# -- part: after_compile --
# %% [markdown]
# ### The split in the rank graph's shapes
#
# On inf2 ModelBuilder compiles the **rank graph**: the forward above with its linears cut to one
# rank's shard (`tp.rank_graph`, built from the config alone, once for every rank). The cell builds
# the tiny E4B's at TP=2 and compares it with the one-device decode graph layer by layer: each rank
# holds exactly half the KV heads of every layer, and its `k_proj` shard half the rows. Nothing is
# copied (compare `04_31b`, where the global KV heads are).

#
# Last, one rank's module, the one the inf2 cell above hands NxD for the decode key
# (`mb.rank_module`), built here with the CPU twins of NxD's layers: each rank-local layer beside
# the NxD layer in its place on inf2 (`ColumnParallelLinear`, `RowParallelLinear`, `SPMDRank`), and
# the K/V parameters it aliases to its outputs (`KeyInstance.get()`'s second value).
# %%
from gemma4lib.tp.plan import make_plan
from gemma4lib.recipes import neuron_model_builder as mb
from gemma4lib.tp.rank_graph import CpuParallelFactory

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
    assert mode == "shard" and mine.kv_heads * rank_tp == one.kv_heads  # E4B: every KV head on one rank
columns = ["layer", "type", "KV mode", "KV heads, one device", "KV heads per rank", "k_proj shard"]
display(nb.Table(columns, rows, f"the rank graph at TP={rank_tp} against the one-device graph"))
full = next(kv.index for kv in decode.layout.producers if kv.layer_type == "full_attention")
display(nb.rank_module_table(one_rank, layers=(0, full)))  # one rank's layers: here, and NxD's on inf2
# -- part: after_checks --
# %%
import copy

from gemma4lib.port import prompt_rows, witness_settings

if witness:  # why the random E4B's spread (its LOGITS_MATCH tolerance above) is so wide: measure it
    w = witness_settings(s)  # the witness's own model and prompt, rerun on the host in fp32 and float64
    w_model = load_model(w)
    w_ids = prompt_rows(w_model, w, vary=False)[0].ids
    seq = torch.tensor([[*w_ids, *witness["reference_tokens"][:-1]]])  # teacher-forced, as the spread is
    with torch.no_grad():
        fp32 = w_model.lm(seq, attention_mask=torch.ones_like(seq), output_hidden_states=True)
        fp64 = copy.deepcopy(w_model.lm).double()(seq, attention_mask=torch.ones_like(seq), output_hidden_states=True)
    pairs = zip(fp32.hidden_states[1:], fp64.hidden_states[1:], strict=True)  # after each layer
    drift = [float((a.double() - b).abs().max()) for a, b in pairs]  # the last: through the final norm
    per_layer = (drift[-2] / drift[0]) ** (1 / (len(drift) - 2))
    logits = fp64.logits[0, len(w_ids) - 1 :]
    print(f"max |logit| of the witness's reference: {float(logits.abs().max()):.3g}: not large logits")
    print(f"fp32 - float64 after each of its {len(drift)} layers (the last through the final norm): "
          f"{', '.join(f'{d:.1e}' for d in drift)}")  # fmt: skip
    copy_spread = float((fp32.logits[0, len(w_ids) - 1 :].double() - logits).abs().max())
    print(f"rounding grows ~{per_layer:.2f}x per layer through the random layers, so the logits' spread is "
          f"{copy_spread:.3g} by this deep copy, {witness['logits_spread']:.3g} by the library's one-module-at-a-time "
          f"upcast (the measurement is right), against the trained E4B's {report.logits.spread:.3g}")  # fmt: skip
# -- part: image_note --
# The E4B's vision part is the encoder `01_e2b` describes (transformers' `Gemma4VisionModel`,
# its pooler, then `Gemma4MultimodalEmbedder`), at the fixture's patch sizes, printed below.
# As on the E2B, the PLE token rows at the soft tokens' positions are the pad token's (the projection
# half sees the soft tokens), and the masks stay causal over the image: the fixture's config leaves
# `use_bidirectional_attention` unset.
# -- part: clip --
"capital_of_france.wav"
# -- part: audio_note --
# The E4B's audio part is the E2B's kind of encoder: the conformer `Gemma4AudioModel` (two strided
# convolutions, so one soft token per four mel frames, then conformer blocks over chunks of the clip) and
# `embed_audio`, which projects each soft token to the decoder's width. The audio graph is those modules
# at a fixed shape, compiled once like the vision graph, and it reads no K/V. The tiny E4B fixture
# learnt to hear from synthesized speech ([docs/AUDIO.md](../docs/AUDIO.md) has its training record,
# including the runs that were not shipped because they cost an image answer).
# -- part: plot_note --
# The released model's measured bar is the field report's decode figure (the status box), measured with its hand-driven
# TP recipe (`tp_alias`), not with the ModelBuilder recipe this notebook compiles.
# -- part: takeaways --
# - TP cuts a decoder layer along heads (attention) and intermediate columns (MLP): column shards
#   need no communication, each row shard ends in an all-reduce, two per layer.
# - With two KV heads and TP=2 each rank holds exactly one KV head: [GQA](00_overview.ipynb#gqa) splits cleanly here. It will
#   not for the 12B, 31B and 26B-A4B global layers (replication, `03_12b`, `04_31b`).
# - E4B fits one core and two cores are for bandwidth, by the plan (computed, unverified on inf2). On inf2 it compiles with `ModelBuilder` like the
#   bigger variants, because the per-rank tracer of the field report (read here as `parallel_model_trace`, which
#   the report does not name: unverified) is unsupported since SDK release 2.27 (the NxD announcement, above) and ran out of host memory at 31B (the field report; `04_31b`).
