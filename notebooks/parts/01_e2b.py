# The parts of 01_e2b.ipynb that are E2B's own; scripts/generate_notebooks.py fills them into skeleton.py.
# -- part: form --
full
# -- part: variant --
e2b
# -- part: hub --
google/gemma-4-E2B-it
# -- part: tp --
1
# -- part: full_shapes --
context_length: 8192, prefill_buckets: [128, 512], context_buckets: [2048]
# -- part: instance --
inf2.xlarge
# -- part: header --
# # Gemma-4 E2B: [per-layer embeddings](00_overview.ipynb#ple) on the host, and layers that borrow their K/V
#
# E2B is the smallest of the five and the one whose architecture is hardest to port: per-layer
# embeddings (PLE) and cross-layer [KV sharing](00_overview.ipynb#kv-sharing) are exactly what the vendor graph builders cannot
# express. **You will learn** why the PLE table stays on the host and costs nothing in accuracy,
# which layers own K/V buffers and which borrow them, and how one NeuronCore runs the port through
# [NxD](00_overview.ipynb#nxd) `ModelBuilder` (a one-graph `torch_neuronx.trace` recipe, the [field report](00_overview.ipynb#field-report)'s tool, stays selectable). Every answer
# is checked three ways: SEQ_MATCH, LOGITS_MATCH and coherence.
# -- part: tiny_model --
PLE + KV sharing (its shape: the model table in section 1)
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
# small vector **for each decoder layer** (the PLE table in the cell shows its width), and each
# layer mixes its slice into the residual stream. The table is a lookup, not a matrix multiply, and
# in the released E2B it is half of all text parameters: on the accelerator it would spend a large
# share of a core's memory (the table prints its size) on rows read a handful at a time. The port computes `embed_tokens(ids)` and
# `get_per_layer_inputs(ids)` on the host (the cell above) and passes them as `inputs_embeds=` and
# `per_layer_inputs=`. The cell runs the reference both ways: the logits are bit-identical.
#
# "E2B" means about two billion parameters do matrix work; the PLE table is the rest. The
# transformers Gemma-4 code has no [MatFormer](00_overview.ipynb#matformer) fields (those belonged to Gemma 3n): nothing is sliced
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
display(nb.kv_sharing_report(model), nb.kv_sharing_real("e2b"))  # at the plan's context
plots.kv_layout(nb.real_layout("e2b"), "released E2B: who owns K/V, who borrows it")
# -- part: graph_note --
#
# For E2B the graph takes two host-side inputs: the scaled word embeddings and the PLE inputs, one
# vector per layer per token (`per_layer_inputs`, whose shape the cell below prints).
# -- part: compile_note --
# at TP=1 here (the larger variants run it at TP=2 or TP=8), the same recipe as theirs: a prefill key per bucket and one decode key over a single set of K/V
# states that stay on the NeuronCore, so a whole prompt is one device call rather than one decode step
# per prompt token (`docs/ROOFLINE.md` computes both, unverified on inf2). The field report's author
# traced E2B with `torch_neuronx.trace`, a device prefill and a decode over on-device K/V. This
# project's trace recipe is the cell before it (`neuron_recipe="trace"`): the decode graph alone,
# because a second traced graph would hold its own copy of the K/V (one traced module's state is not
# another's); no NxD, and a smaller compile-host plan than ModelBuilder's (computed: `inf2.compile_host`),
# with the prompt going through the decode graph one token at a time. Its arguments: `input_output_aliases` maps each K/V parameter to the output that
# carries its update (so the state stays on the device), `inline_weights_to_neff=False` keeps the
# weights out of the compiled [NEFF](00_overview.ipynb#neff), `compiler_args` are the decode flags below.
# -- part: neuron_trace --
# %%
if on_inf2 and s.neuron_recipe == "trace":  # inf2-only: the one-graph recipe, E2B at TP=1
    from gemma4lib.backends.neuron import compiler_workdir, neuron_cache_key, own_directory
    from gemma4lib.recipes import cores, neuron_env
    from gemma4lib.recipes.common import DeviceStep, KVParamModule, index_dtype

    torch_neuronx = neuron_env.require("torch_neuronx", "the trace recipe")
    shape = GraphShape(1, 1, s.context_length, s.ring_kv)  # the decode graph only
    key, parts = neuron_cache_key(model, "trace", 1, {"decode": shape}, neuron_env.COMPILER_ARGS, decode.dtype)
    graph = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, inplace=False)
    module = KVParamModule(graph).eval()  # the K/V buffers as parameters of the traced module

    def build(folder):  # called by the cache, only on a miss
        with compiler_workdir() as workdir, own_directory():  # the backend's: fresh, removed on success
            traced = torch_neuronx.trace(
                module,
                module.example_inputs(),
                input_output_aliases=module.aliases(),  # {K/V parameter: index of the output that updates it}
                inline_weights_to_neff=False,  # the weights stay out of the NEFF
                compiler_workdir=workdir,
                compiler_args=neuron_env.compiler_args("decode"),
            )
            torch.jit.save(traced, str(folder / "model.pt"))
        return {"recipe": "trace", "tp": 1}

    began = time.perf_counter()
    need = model.param_count() * decode.dtype.itemsize  # the saved weights: checked against the free space first
    entry = cache.get_or_build(key, build, describe={k: v for k, v in parts.items() if k != "config"}, need_bytes=need)
    cores.check_free(0, 1, f"e2b (trace) from {entry.path}")  # an earlier run's model still on the core: refused
    with torch_neuronx.neuron_cores_context(start_nc=0, nc_count=1):  # loaded straight onto core 0
        traced = torch.jit.load(str(entry.file("model.pt")))
    torch_neuronx.move_trace_to_device(traced, 0)  # the separated weights go to the core's HBM once
    cores.claim(traced, 0, 1, f"e2b (trace) from {entry.path}")
    step = DeviceStep(  # E2B's four inputs; the K/V live on the device (they may follow the logits)
        traced, 4, model.config.vocab_size, aliases=len(module.kv), index_dtype=index_dtype(module.example_inputs())
    )
    # no prefill graph: the engine feeds the prompt through the decode graph, one token per call
    runtime = Engine.for_model(model, Steps(decode=step), batch=1, context_length=s.context_length, dtype=decode.dtype)
    compile_s = 0.0 if entry.hit else time.perf_counter() - began
    compiled = CompiledGraphs(runtime.steps, compile_s, [entry.hit], "neuron-trace", runtime=runtime)
    display(nb.describe_compile(compiled))
else:
    print(f"skipped: backend={backend}" if not on_inf2 else f"skipped: neuron_recipe={s.neuron_recipe}")
# -- part: core_step --
# %% [markdown]
# ### The port's core, by hand: a decode step over explicit K/V
#
# Everything the port changes in transformers' forward is in the next cell, written out: a cache
# object whose `update` writes this step's keys and values into a fixed buffer at
# `position % slots` and returns the whole buffer (a full-attention layer's buffer holds every
# position; a sliding layer's is a [ring](00_overview.ipynb#ring) of `sliding_window` slots that wraps around), and one
# additive mask per attention type that says which slots count: written, not in the future, and for
# sliding layers inside the window. transformers' own layers do the rest (projections, norms, RoPE,
# KV sharing, the MLP). The cell runs the prompt through it one token at a time, longer than the
# window so the ring wraps, and asserts that every step's logits and every K/V buffer equal
# `DeviceGraph`'s (`gemma4lib/device/graph.py`, the graph that is compiled below). Without the
# mask, a ring's stale slots would be attended as if they were recent; without a tensor position,
# the compiled graph would serve one step only.

# %%
from gemma4lib.device.graph import index_tensor


class HandKV:  # the cache object transformers' attention writes to: fixed buffers, one pair per producer layer
    def __init__(self, buffers, position):
        self.buffers, self.position = buffers, position

    def update(self, k, v, layer_idx, *args, **kwargs):  # k, v [1, kv_heads, 1, head_dim]: this step's
        k_buf, v_buf = self.buffers[layer_idx]
        slot = self.position % k_buf.shape[2]  # a full-length buffer: slot = position; a sliding ring wraps
        k_buf[:, :, slot], v_buf[:, :, slot] = k[:, :, 0], v[:, :, 0]  # write first, in place ...
        return k_buf, v_buf  # ... then attend over every slot; the mask says which ones count


def hand_masks(position, dtype):  # additive masks [1, 1, 1, slots], one per attention type
    masks = {}
    for kind in dict.fromkeys(model.config.layer_types):
        slots = model.layout.slots(kind, s.context_length, s.ring_kv)
        held = position - (position - torch.arange(slots)) % slots  # the position each slot holds (< 0: never written)
        allowed = (held >= 0) & (held <= position)  # causal, over what has been written
        if kind == "sliding_attention":
            allowed &= position - held < model.config.sliding_window  # and only the last window of it
        masks[kind] = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None, None]
    return masks


kv_hand, kv_graph = decode.new_kv(), decode.new_kv()  # two sets of zeroed buffers, in the graph's layout
buffers = {layer.index: (kv_hand[2 * i], kv_hand[2 * i + 1]) for i, layer in enumerate(model.layout.producers)}
with torch.no_grad():
    for position, token in enumerate(ids):  # the prompt as decode steps, one token each: every slot gets used
        token_ids = torch.tensor([[token]])
        embeds = text_model.embed_tokens(token_ids)
        ple = [text_model.get_per_layer_inputs(token_ids)] if has_ple else []
        hidden = text_model(  # transformers' own layers, with our cache and our masks
            inputs_embeds=embeds,
            per_layer_inputs=ple[0] if ple else None,
            position_ids=torch.tensor([[position]]),
            attention_mask=hand_masks(position, embeds.dtype),
            past_key_values=HandKV(buffers, position),
            use_cache=True,
        ).last_hidden_state
        by_hand = model.lm_head(hidden[:, -1]).float()  # raw logits: the softcap is left off, as in the graph
        by_graph = decode(embeds, *ple, index_tensor([position]), index_tensor([1]), *kv_graph)
        torch.testing.assert_close(by_hand, by_graph, rtol=1e-4, atol=1e-4)
for mine, theirs in zip(kv_hand, kv_graph, strict=True):
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
print(f"{len(ids)} decode steps by hand equal DeviceGraph's: logits at every step, and all {len(kv_hand)} K/V buffers")
slots = {kind: model.layout.slots(kind, s.context_length, s.ring_kv) for kind in set(config.layer_types)}
print(f"slots per buffer: {slots} (sliding: a ring of the window; full: the whole context)")
# -- part: after_compile --
# %% [markdown]
# ### 3c. Save and load: a compiled port that travels
#
# A compile is the slow, memory-hungry step (the first run here compiles every graph; the status box
# says what is known of it on inf2), and the compile host need not be the serving host. `export_bundle` writes the compiled entries for these settings (from the
# cache when it is warm: a copy) and a `manifest.json` saying what they were compiled for. A run
# with `PortSettings(artifacts=...)` loads from that folder and never compiles: anything that
# would need a new program (another variant, context, TP degree, torch version, ...) is a
# `BundleError` before the device is touched. The first cell does it on this CPU, into an **empty**
# cache, and checks the tokens against the port compiled above; the second is the inf2 version,
# which only exports on the compile host: the load happens on the serving host, in its own process.
# A bundle holds one set of settings: this one is a single-row port, so the endpoint of `07_serve`,
# which serves several rows at once, exports its own (`python -m gemma4lib export` with its `--batch`).

# %%
import dataclasses
import tempfile
from pathlib import Path

from gemma4lib.export import export_bundle
from gemma4lib.port import compile_graphs

if not on_inf2:
    bundle = Path(tempfile.mkdtemp(prefix="gemma4lib-bundle-")) / s.variant  # a folder to ship, not the cache
    export_bundle(s, bundle)  # this port's compiled entries + manifest.json
    empty_cache = tempfile.mkdtemp(prefix="gemma4lib-empty-cache-")  # nothing in it to hit
    served = compile_graphs(model, dataclasses.replace(s, artifacts=str(bundle), cache_dir=empty_cache))
    print(f"from the bundle into an empty cache: compile {served.compile_s:.1f} s; the bundle holds "
          f"{sorted(p.name for p in bundle.iterdir())}")  # fmt: skip
    stop = eos_ids(model)
    same = served.runtime.generate(ids, s.max_new_tokens, eos_token_ids=stop).tokens
    assert same == runtime.generate(ids, s.max_new_tokens, eos_token_ids=stop).tokens
    print("the bundle's port answers as the one compiled above: the same tokens")
    del served  # its packages stay loaded while referenced
else:
    print(f"skipped: backend={backend}")

# %%
if on_inf2:  # inf2-only, on the compile host (an inf2.8xlarge: the compile's host RAM, the status box)
    export_bundle(s, "bundles/e2b")  # ModelBuilder's model.pt (its NEFFs) + one weight shard per rank
    # Copy bundles/e2b to the serving host (an inf2.xlarge). There another process loads it, never compiling:
    #     compile_graphs(load_model(s), dataclasses.replace(s, artifacts="bundles/e2b"))
    # or `python -m gemma4lib serve --artifacts bundles/e2b ...`, which 07_serve runs (its `artifacts`).
    # Not here: this process's model already holds the cores, and a second load would be refused.
    print("exported bundles/e2b: load it on the serving host (07_serve's `artifacts`)")
else:
    print(f"skipped: backend={backend}")
# -- part: after_checks --
# -- part: image_note --
# The E2B's vision part is an encoder: transformers' `Gemma4VisionModel` embeds each patch (with
# a position embedding of where it sat), runs transformer layers over all of them, and its pooler
# averages each block of patches into one soft token (the fixture's processor: `patch_size=4`,
# `pooling_kernel_size=2`, printed below; a released processor's own values are larger);
# `Gemma4MultimodalEmbedder` then projects
# every soft token to the decoder's width. The vision graph is those two modules at a fixed patch
# budget (`max_soft_tokens` x pooling² patch slots), one image per call; the padding slots are
# computed and dropped on the host.
# On an E model the prompt also has [PLE](00_overview.ipynb#ple), in two halves: the per-layer token
# rows at the soft tokens' positions are the pad token's (transformers does the same), while the
# other half, a projection of the input embeddings, sees the soft tokens themselves.
# The fixture's config leaves `use_bidirectional_attention` unset, so the masks below are causal over
# the image too.
# -- part: clip --
"capital_of_france.wav"
# -- part: audio_note --
# The E2B's audio part is an encoder: transformers' `Gemma4AudioModel`, a conformer. Two strided
# convolutions each halve the number of mel frames, so one soft token stands for four frames; conformer
# blocks attend over chunks of the clip, and `embed_audio` projects every soft token to the decoder's
# width. The audio graph is those modules at a fixed shape (one clip per call, its frames padded to the
# longest clip's as transformers pads them). As for images, the per-layer ([PLE](00_overview.ipynb#ple))
# token rows at the soft tokens' positions are the pad token's.
# -- part: plot_note --
# The released model's measured bar is the field report's decode figure (the status box), measured with its
# `torch_neuronx.trace` recipe, not with the ModelBuilder recipe this notebook compiles by default.
# -- part: takeaways --
# - Keep the PLE table on the host: it is half of E2B's parameters and only ever indexed. Passing
#   `inputs_embeds` and `per_layer_inputs` gives bit-identical results.
# - KV sharing needs no special handling when the real forward is traced; only producer layers get
#   buffers (the released model's count: the KV-sharing table in the lesson).
# - On inf2, this cookbook's plan is `ModelBuilder` at TP=1 (written, never run on inf2): a prefill key
#   per bucket and a decode key over one set of K/V states put the whole prompt on the device in one call. The one-graph trace teaches the aliasing
#   with nothing else in the way, and pays with one device step per prompt token.
# - Check SEQ_MATCH **and** the answer. The endpoint that started this work (the [field report](00_overview.ipynb#field-report)'s
#   starting point, which answered in gibberish) loaded a real model and wired the PLE path and embedding scale wrongly: a text check catches that, an
#   equality check cannot.
