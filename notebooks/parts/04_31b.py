# The parts of 04_31b.ipynb that are the 31B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: variant --
31b
# -- part: hub --
google/gemma-4-31B-it
# -- part: tp --
8
# -- part: instance --
inf2.24xlarge
# -- part: header --
# # Gemma-4 31B: the dense giant, eight cores, and KV heads that must be copied
#
# The 31B is a plain dense decoder that happens to need eight NeuronCores. **You will learn** why the
# recipe had to change to `ModelBuilder` at this size, what the compile costs in host RAM, and what
# TP=8 does to its four global KV heads (each is copied onto two ranks). The notebook also replays
# the field report's 31B bug: a chat prompt that the device and the reference both processed
# identically, and wrongly.
#
# ### Runs on
#
# The `smoke` profile runs on any x86-64 or arm64 CPU (two shared cores are enough); the `full`
# profile on the inf2 instance in the status box below, whose every figure the library computes from
# its plans or quotes from the field report, and which the record cell fills in with this run's own.
#
# | | `full` profile (inf2) | `smoke` profile (any CPU) |
# |---|---|---|
# | software | Deep Learning AMI Neuron (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0, AOTInductor as the compiler |
# | model | `google/gemma-4-31B-it` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: more KV heads on sliding than on global layers |
# -- part: parameters --
tp_demo = 4  # ranks of the rank-graph run on CPU processes (0: skip)
# -- part: settings --
# -- part: lesson --
# %% [markdown]
# ## What makes the 31B different
#
# Architecturally it is the simplest of the five: no PLE, no KV sharing, no experts. The hard part is
# size. Its bf16 weights do not fit fewer than eight NeuronCores with room for K/V (the table below), so the
# 31B needs an `inf2.24xlarge` and TP=8. The hand-driven TP recipe that carried E4B in the field
# report (NxD's `parallel_model_trace`, one process per rank, every process tracing on the same host)
# ran out of host memory at this size, and serialising its result deadlocked. NxD `ModelBuilder`
# compiles one rank in one process and shards the weights per rank, which is what scales. Its compile
# holds the host model and, while it writes the shards, the NxD-arranged checkpoint: about two copies
# of the weights (planned and field-reported peaks: the status box).

# %%
nb.tp_fit("31b")

# %% [markdown]
# ### KV heads under TP=8: replicated, not sharded
#
# The sliding layers have twice as many KV heads as ranks: two per rank, a clean split. The
# full-attention layers have only half as many KV heads as ranks (`num_global_key_value_heads=4`,
# `num_attention_heads=32`: eight Q heads per KV head). At TP=8 each rank owns four Q heads, all of
# which read the same KV head (Q head `q` reads KV head `q // 8`), so rank `r` keeps a copy of KV head
# `r // 2`: every global KV head lives on two ranks. The cell works it out from the released config
# and checks it against the library's TP plan.

# %%
real, tp = s.variant_spec.real_config, s.variant_spec.tp_degree
q_heads, kv_heads = real["num_attention_heads"], real["num_global_key_value_heads"]
q_per_kv, q_per_rank = q_heads // kv_heads, q_heads // tp
kv_on_rank = [sorted({q // q_per_kv for q in range(r * q_per_rank, (r + 1) * q_per_rank)}) for r in range(tp)]
print(f"{q_heads} Q heads, {kv_heads} global KV heads, TP={tp}: global KV head(s) held by each rank {kv_on_rank}")
demos["kv_heads_tp8"] = nb.kv_heads_under_tp("31b", 8)
table = demos["kv_heads_tp8"]
by_rank = {row[0]: dict(zip(table.columns, row, strict=True))["KV head(s) on rank 0..N-1"] for row in table.rows}
assert by_rank["full"] == str(kv_on_rank)  # the library's TP plan agrees with the arithmetic
demos["kv_heads_tp8"]

# %% [markdown]
# The tiny 31B keeps the proportions (more sliding than global KV heads), so at TP=4 its
# global heads are replicated as well. The cell shows its plan, then runs the rank graph for real on
# CPU: `tp_demo` processes, each holding only its shard and its copies of the global KV heads (the
# full profile skips the run: `tp_demo: 0`).

# %%
display(nb.kv_heads_under_tp("31b", tp_demo or 4, config=model.config))
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo)
    display(demos["tp_cpu"])
# -- part: graph_note --
# -- part: compile_note --
# at TP=8: one rank compiled (the rank graph with NxD's parallel layers, each global KV head copied on
# two ranks), the weights sharded per rank, the rank number a runtime tensor, and the decode graph
# the priority model whose weight layout the compiler optimises. The calls and each argument:
# -- part: neuron_trace --
# -- part: core_step --
# -- part: after_checks --
# %% [markdown]
# ### The 31B's bug, replayed: SEQ_MATCH on nonsense
#
# In the field report a chat prompt for the 31B was written by hand in Gemma 3's format,
# `<start_of_turn>user ...`. Gemma-4 has no such token: the tokenizer splits each marker into ordinary
# pieces, the model reads noise and answers noise. The device still matched the CPU reference token
# for token, because both processed the same wrong input. The compiled graphs from above run both
# prompts (the hand-built one is about three times longer, and still fits the compiled bucket):

# %%
demos["equality_is_not_enough"] = nb.equality_is_not_enough(model, compiled.runtime, s)
demos["equality_is_not_enough"]
# -- part: plot_note --
# The field report gives no decode figure for the 31B (prefill only), so its bar is the computed
# ceiling alone.
# -- part: takeaways --
# - Scale, not architecture, is the 31B's problem: eight cores, a long compile, a large host.
# - Reach for the compile-one-rank recipe (`ModelBuilder`) before the per-rank tracer runs the host
#   out of memory.
# - Fewer KV heads than ranks means replication: each global KV head sits on two of eight ranks.
# - Build prompts with the tokenizer's chat template. `SEQ_MATCH True` on nonsense is the signature
#   of an input problem, and only the coherence check reports it.
