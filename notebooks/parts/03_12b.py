# The parts of 03_12b.ipynb that are the 12B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: variant --
12b
# -- part: hub --
google/gemma-4-12B-it
# -- part: tp --
2
# -- part: instance --
inf2.8xlarge
# -- part: header --
# # Gemma-4 12B: the encoder-free multimodal class, eager attention, one global KV head
#
# The 12B drops the E family's special features and adds three of its own. **You will learn** how to
# take the text model out of the encoder-free unified multimodal class, what `attention_k_eq_v`
# means (full-attention layers take V from the K projection and have a single KV head), why inf2
# compiles it with eager attention, and how a single KV head is replicated under TP=2. It runs at
# TP=2 through NxD `ModelBuilder`.
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
# | model | `google/gemma-4-12B-it` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: k_eq_v, one global KV head |
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
# on; there is no PLE and no KV sharing.
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
# ### Eager attention
#
# The released 12B uses a wide sliding window (`sliding_window=1024`). Neuron's fused attention kernel ran out of its
# on-chip scratch memory (SBUF) at that window, so the field report switched the model to
# transformers' eager attention, which the compiler lowers as ordinary matmuls and softmax. The
# library loads every variant with `attn_implementation="eager"`. On the CPU the implementations
# agree, which is what makes the switch safe: it changes what the compiler must fit, not the numbers.

# %%
demos["attention"] = nb.attention_implementations_agree(model, ids)
demos["attention"]

# %% [markdown]
# ### One global KV head, replicated under TP
#
# Each full-attention layer has a single KV head shared by all its Q heads. At TP=2 it cannot be split
# in two, so both ranks keep a full copy of it; the sliding layers' KV heads shard normally. The
# tiny model has the same shape of problem (one global KV head, more sliding ones), so the rank-graph run
# at TP=2 (`tp_demo` CPU processes, gloo) exercises the replicated global head and the sharded
# sliding heads together; the full profile skips that run (`tp_demo: 0`).

# %%
display(nb.kv_heads_under_tp("12b", 2), nb.tp_fit("12b"))
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo)
    display(demos["tp_cpu"])
# -- part: graph_note --
# -- part: compile_note --
# at TP=2: one rank compiled (the rank graph with NxD's parallel layers, the global KV head copied
# on both ranks), the weights sharded per rank, the rank number a runtime tensor, and the decode
# graph the priority model whose weight layout the compiler optimises. The calls and each argument:
# -- part: neuron_trace --
# -- part: core_step --
# -- part: after_checks --
# -- part: plot_note --
# The field report gives no decode figure for the 12B (prefill only), so its bar is the computed
# ceiling alone.
# -- part: takeaways --
# - Take the language model out of the unified class; nothing else of it is needed for text.
# - `attention_k_eq_v`: full layers have no `v_proj`. Trace the real forward and it does not matter.
# - Force eager attention for inf2: it is numerically the same and it fits the compiler.
# - A single global KV head is replicated on every rank under TP.
