# The parts of 01_e2b.ipynb that are E2B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: variant --
e2b
# -- part: hub --
google/gemma-4-E2B-it
# -- part: tp --
1
# -- part: instance --
inf2.xlarge
# -- part: header --
# # Gemma-4 E2B: per-layer embeddings on the host, and layers that borrow their K/V
#
# E2B is the smallest of the five and the one whose architecture is hardest to port: per-layer
# embeddings (PLE) and cross-layer KV sharing are exactly what the vendor graph builders cannot
# express. **You will learn** why the PLE table stays on the host and costs nothing in accuracy,
# which layers own K/V buffers and which borrow them, and how one NeuronCore runs the port through
# NxD `ModelBuilder` (the field report's `torch_neuronx.trace` recipe stays selectable). Every answer
# is checked three ways: SEQ_MATCH, LOGITS_MATCH and coherence.
#
# ### Runs on
#
# | | `full` profile (inf2) | `smoke` profile (any CPU) |
# |---|---|---|
# | machine | `inf2.xlarge`: 1 Inferentia2 chip, 2 NeuronCores, 32 GiB HBM, 820 GB/s | any x86-64 or arm64 machine; two shared cores are enough |
# | TP degree | 1 (NxD ModelBuilder; the one-graph `torch_neuronx.trace` recipe is selectable) | 1 (this notebook has no tensor parallelism; `02_e4b` shows it) |
# | memory per core (computed, `python -m gemma4lib doctor`) | 4.2 GiB bf16 weights + 0.02 GiB K/V at 2,048 tokens + 2 GiB working allowance (unverified on inf2) = 6.3 of 16 GiB HBM | a few MB |
# | host RAM for the compile | ~28 GB estimated for ModelBuilder (computed: 3 × the text weights, the rule calibrated on the field report's 31B): more than the inf2.xlarge's 16 GiB, so compile on an inf2.8xlarge (same chip) and serve on the inf2.xlarge, or pick `neuron_recipe="trace"` (~14 GB, fits; the prompt then runs token by token) | under 2 GiB |
# | serving host RAM (computed, `python -m gemma4lib doctor`; unverified on inf2) | ~14.3 GB peak of 16.1 GB usable on the inf2.xlarge: the bf16 model 9.3 GB (host tables 5.5) + 4.6 GB at the peak step + 0.5 GB process; the logit check widens one module at a time, never a second model | under 2 GiB |
# | time per decode step | ~23 ms measured by the field report (44 tok/s, with its `torch_neuronx.trace` recipe); ≥ 10.4 ms computed from bandwidth ÷ bytes per step | ~1.2 ms measured (818 tok/s, smoke baseline of 2026-11-29, one thread of a shared 2-core CPU) |
# | software | Deep Learning AMI Neuron (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0, AOTInductor as the compiler |
# | model | `google/gemma-4-E2B-it` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: PLE + KV sharing (10 layers, 4 KV-shared) |
# -- part: parameters --
neuron_recipe = None  # full: None for NxD ModelBuilder (prompt in one device pass), or trace (one graph)
# -- part: settings --
    neuron_recipe=neuron_recipe,
# -- part: lesson --
# %% [markdown]
# ## What makes E2B different
#
# ### Per-layer embeddings (PLE), kept on the host
#
# Besides the usual word embedding, every token looks up a second, much larger table that holds a
# small vector **for each decoder layer** (256 numbers per layer in the released model), and each
# layer mixes its slice into the residual stream. The table is a lookup, not a matrix multiply, and
# in the released E2B it is half of all text parameters: on the accelerator it would spend most of a
# core's memory on rows read a handful at a time. The port computes `embed_tokens(ids)` and
# `get_per_layer_inputs(ids)` on the host (the cell above) and passes them as `inputs_embeds=` and
# `per_layer_inputs=`. The cell runs the reference both ways: the logits are bit-identical.
#
# "E2B" means about two billion parameters do matrix work; the PLE table is the rest. The
# transformers Gemma-4 code has no MatFormer fields (those belonged to Gemma 3n): nothing is sliced
# away at load time, so budget memory for what the device holds.

# %%
with torch.no_grad():  # the reference twice: from token ids, and from the host-side inputs above
    from_ids = model.lm(input_ids=prompt_tensor).logits
    from_host = model.lm(inputs_embeds=inputs_embeds, per_layer_inputs=per_layer_inputs).logits
diff = float((from_ids - from_host).abs().max())
demos["ple_on_host"] = {"max_abs_logit_diff": diff, "identical": diff == 0.0}
print(f"largest logit difference, ids vs host-side inputs: {diff}")
display(nb.ple_report(model))
nb.effective_size("e2b")

# %% [markdown]
# ### Layers that borrow their K/V
#
# The last `num_kv_shared_layers` layers compute no keys or values of their own: each reads the K/V
# of the last earlier layer of the same attention type (sliding or full). Only the producer layers
# need cache buffers. It traces without trouble: in transformers' forward the borrowed K/V is an
# ordinary data dependency. The cell works the layout out from the config, checks it against the
# library's, then shows the tiny model's and the released model's.

# %%
config = model.config
first_shared = config.num_hidden_layers - config.num_kv_shared_layers
last_of_type = {
    kind: max(i for i in range(first_shared) if config.layer_types[i] == kind) for kind in set(config.layer_types)
}
borrows_from = {i: last_of_type[config.layer_types[i]] for i in range(first_shared, config.num_hidden_layers)}
assert borrows_from == {lay.index: lay.producer for lay in model.layout.layers if not lay.owns_buffer}
print(f"layers {first_shared}..{config.num_hidden_layers - 1} borrow K/V: {borrows_from}")
display(nb.kv_sharing_report(model), nb.kv_sharing_real("e2b", context_length=2048))
plots.kv_layout(nb.real_layout("e2b"), "released E2B: who owns K/V, who borrows it")
# -- part: graph_note --
#
# For E2B the graph takes two host-side inputs: the scaled word embeddings and the PLE inputs, one
# 16-wide vector per layer per token in the tiny model (256-wide in the real one).
# -- part: compile_note --
# at TP=1, like the larger variants: one prefill key and one decode key over a single set of K/V
# states that stay on the NeuronCore, so a 128-token prompt is one device call (~10 ms computed from
# FLOP and byte counts, unverified; `docs/ROOFLINE.md`) rather than 128 decode steps (~3 s at the
# field report's 44 tok/s). The field report's own recipe, `torch_neuronx.trace` of the decode graph
# alone, is the cell before it (`neuron_recipe="trace"`): one graph that owns its K/V, no NxD, and a
# compile that fits the inf2.xlarge's host RAM; the prompt then goes through the decode graph one
# token at a time. Its arguments: `input_output_aliases` maps each K/V parameter to the output that
# carries its update (so the state stays on the device), `inline_weights_to_neff=False` keeps the
# weights out of the compiled NEFF, `compiler_args` are the decode flags below.
# -- part: neuron_trace --
# %%
if backend == "neuron" and s.neuron_recipe == "trace":  # inf2-only: the one-graph recipe, E2B at TP=1
    import tempfile

    from gemma4lib.backends.neuron import neuron_cache_key
    from gemma4lib.recipes import neuron_env
    from gemma4lib.recipes.common import DeviceStep, KVParamModule

    torch_neuronx = neuron_env.require("torch_neuronx", "the trace recipe")
    shape = GraphShape(1, 1, s.context_length, s.ring_kv)  # the decode graph only
    key, parts = neuron_cache_key(model, "trace", 1, {"decode": shape}, neuron_env.COMPILER_ARGS, decode.dtype)

    def build(folder):  # called by the cache, only on a miss
        graph = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, inplace=False)
        module = KVParamModule(graph).eval()  # the K/V buffers as parameters of the traced module
        traced = torch_neuronx.trace(
            module,
            module.example_inputs(),
            input_output_aliases=module.aliases(),  # {K/V parameter: index of the output that updates it}
            inline_weights_to_neff=False,  # the weights stay out of the NEFF
            compiler_workdir=tempfile.mkdtemp(prefix="gemma4lib-neuron-cc-"),
            compiler_args=neuron_env.compiler_args("decode"),
        )
        torch.jit.save(traced, str(folder / "model.pt"))
        return {"recipe": "trace", "tp": 1}

    began = time.perf_counter()
    entry = cache.get_or_build(key, build, describe={k: v for k, v in parts.items() if k != "config"})
    traced = torch.jit.load(str(entry.file("model.pt")))
    torch_neuronx.move_trace_to_device(traced, 0)  # the separated weights go to the core's HBM once
    step = DeviceStep(traced, 4)  # E2B's four inputs; the K/V live on the device
    # no prefill graph: the engine feeds the prompt through the decode graph, one token per call
    runtime = Engine.for_model(model, Steps(decode=step), batch=1, context_length=s.context_length, dtype=decode.dtype)
    compile_s = 0.0 if entry.hit else time.perf_counter() - began
    compiled = CompiledGraphs(runtime.steps, compile_s, [entry.hit], "neuron-trace", runtime=runtime)
# -- part: after_checks --
# -- part: plot_note --
# The released model's measured bar is the field report's 44 tok/s, measured with its
# `torch_neuronx.trace` recipe, not with the ModelBuilder recipe this notebook compiles by default.
# -- part: takeaways --
# - Keep the PLE table on the host: it is half of E2B's parameters and only ever indexed. Passing
#   `inputs_embeds` and `per_layer_inputs` gives bit-identical results.
# - KV sharing needs no special handling when the real forward is traced; only producer layers get
#   buffers (15 of 35 in the released model).
# - On inf2, compile with `ModelBuilder` at TP=1: a prefill key and a decode key over one set of K/V
#   states put the whole prompt on the device in one call. The one-graph trace teaches the aliasing
#   with nothing else in the way, and pays with one device step per prompt token.
# - Check SEQ_MATCH **and** the answer. The "gibberish" endpoint that started this work loaded a
#   real model and wired the PLE path and embedding scale wrongly: a text check catches that, an
#   equality check cannot.
