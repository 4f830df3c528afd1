# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   language_info:
#     name: python
# ---

# %% [markdown]
# # Gemma-4 on AWS Inferentia2: the family at a glance
#
# Five Gemma-4 text decoders, one accelerator, one way of porting them. This notebook is the map:
# what the five share, where they differ, how the porting recipe had to grow as the models did,
# the results of the last run, and why a port that reproduces its reference exactly can still be
# wrong. The other notebooks port one variant each, step by step; this one ports nothing.
#
# **It reads the other notebooks' records.** Each variant notebook ends by writing one JSON run
# record (its checks, timings, versions) into `runs/notebooks/`; the results section below loads
# the newest record of each variant from there (`results_dir`). Run the variant notebooks first,
# or let `python -m papermill_runs run --profile smoke` (the [smoke](#smoke) profile) run the seven others, then this one last. A variant that has not
# run yet is simply missing from the tables.
#
# | notebook | variant | instance | [TP](#tp) degree | recipe |
# |---|---|---|---|---|
# | [01_e2b.ipynb](01_e2b.ipynb) | E2B | `inf2.xlarge` | TP=1 | model_builder (trace selectable) |
# | [02_e4b.ipynb](02_e4b.ipynb) | E4B | `inf2.8xlarge` | TP=2 | model_builder |
# | [03_12b.ipynb](03_12b.ipynb) | 12B | `inf2.8xlarge` | TP=2 | model_builder |
# | [04_31b.ipynb](04_31b.ipynb) | 31B | `inf2.24xlarge` | TP=8 | model_builder |
# | [05_26b_a4b.ipynb](05_26b_a4b.ipynb) | 26B-A4B | `inf2.24xlarge` | TP=8 | model_builder |
#
# ### The course: what to read, in which order, and what each adds
#
# Read them in this order; each assumes the ones before it and explains only what is new, linking
# back for the rest.
#
# 1. **This notebook**: the family side by side, the glossary every other notebook links to, the
#    last run's results, and why a port that equals its reference can still be wrong.
# 1. **[01_e2b](01_e2b.ipynb)**, the whole port written out cell by cell, once for the family: the
#    host-side embeddings, the device graph and its K/V step checked by hand, `torch.export` and
#    AOTInductor here, and the inf2 calls (`torch_neuronx.trace`, NxD `ModelBuilder`); the engine's
#    admit, step and release; the three checks, the witness and the spread; "What the model sees"
#    (images), explained once: the other variant notebooks run their own image section and say only
#    what differs.
# 1. **[02_e4b](02_e4b.ipynb)** adds tensor parallelism: attention and MLP split by hand over two
#    ranks, the rank graph, and its inf2 compile at TP=2 (one KV head per rank, the K/V aliased).
# 1. **[03_12b](03_12b.ipynb)** adds k_eq_v, eager attention, a single global KV head copied on both
#    ranks at TP=2, and the image blocks of a model with no vision encoder.
# 1. **[04_31b](04_31b.ipynb)** adds TP=8 with the global layers' KV heads replicated, the compile
#    host a big model needs, and the family's bug that equality alone did not catch.
# 1. **[05_26b_a4b](05_26b_a4b.ipynb)** adds the mixture of experts: the router, static expert forms,
#    the expert split across ranks, a rank that must be a runtime tensor, and its inf2 rank module.
# 1. **[06_serving](06_serving.ipynb)** serves more than one token per weight read on the tiny E2B
#    (run on CPU here): a batch of different prompts, each row checked against its own reference, its keys on
#    neuron, and drafting with Gemma-4's own assistant, exact against greedy decoding. Its inf2
#    figures are computed, marked so, beside the [field report](#field-report)'s measured batch figures.
# 1. **[07_serve](07_serve.ipynb)** puts the same engine behind an OpenAI-compatible endpoint: rows
#    that requests join and leave between decode steps, the official `openai` client, concurrent
#    clients, and on inf2 a bundle compiled once on a compile host that Ray Serve replicas load
#    without compiling (that cell does not run here).
#
# Each variant notebook holds its inf2 compile cell in its section 3b, "On inf2".
#
# ### Runs on
#
# | | `full` profile | `smoke` profile |
# |---|---|---|
# | machine | `inf2.xlarge` to `inf2.24xlarge`, per variant (table above) | any CPU |
# | software | [Deep Learning AMI Neuron](#dlami) (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0 |
# | this notebook | reads the records the variant notebooks wrote, loads no released model, and runs "Why equality is not enough" on a tiny model on the CPU | the same: its records, and the same tiny model for that section |
#
# ### Before you start on inf2
#
# Everything a first day needs before the first cell runs is in the README's "Before you start on
# inf2": the instance and DLAMI per variant, accepting the model licence and exporting `HF_TOKEN`
# *before* JupyterLab starts (a kernel inherits its environment when it starts),
# `bash scripts/lab.sh --neuron` to open these notebooks on the Neuron venv's kernel without touching its
# torch or SDK packages, the disk and the time of each step (each marked computed, field report or
# unverified), and a troubleshooting table. `python -m gemma4lab doctor --variant e2b` ([`doctor`](#doctor)) prints the
# plan of both memories that decide a run: the NeuronCores' [HBM](#hbm) and the serving host's RAM (the
# model, the host tables, the weight shards at load time and the reference the checks run).

# %% [markdown]
# ## Parameters
#
# `results_dir` is where the variant notebooks wrote their records (`papermill_runs` points it at
# its own output folder). The section "Why equality is not enough" uses `demo_variant`'s tiny model on the CPU in either
# profile (the full profile loads no released model here).

# %% tags=["parameters"]
profile = "smoke"
results_dir = "../runs/notebooks"  # where the variant notebooks wrote their JSON records
demo_variant = "e2b"  # tiny model used by the "equality is not enough" demonstration
prompt = "What is the capital of France?"
expect = "Paris"
threads = 1
results_path = "../runs/notebooks/overview.json"

# %%
import torch

from gemma4lab import notebook as nb
from gemma4lab.notebook import plots
from gemma4lib.models.variants import VARIANTS
from gemma4lib.port import PortSettings, compile_graphs, load_model

torch.set_num_threads(threads)

# %% [markdown]
# ## The family
#
# All five share a skeleton: one large vocabulary with the embedding tied to the LM head,
# embeddings scaled by √hidden, grouped-query attention with sliding-window layers between the
# global ones (five for each global one; four on E2B), a wider head on global layers than on sliding ones, and a final logit softcap
# (the same `vocab_size`, `head_dim`, `global_head_dim` and `final_logit_softcapping` in every
# released config: the next cell prints them from each). The differences are in the columns on the right: [PLE](#ple), [KV sharing](#kv-sharing)
# ("KV-shared"), [k_eq_v](#k-eq-v) and the [MoE](#moe) experts, each in the glossary below.

# %%
for v in VARIANTS.values():  # the released configs' shared values (the table's columns are where they differ)
    config, heads = nb.real_config(v), v.real_config
    print(
        f"{v.name}: vocab_size={config.vocab_size}, head_dim={heads['head_dim']}, global_head_dim="
        f"{heads['global_head_dim']}, final_logit_softcapping={config.final_logit_softcapping}"
    )
nb.family_table()

# %% [markdown]
# ## The shared serving shape
#
# Every port has the same moving parts, and so does every notebook:
#
# 1. **Host side**: tokenizer and chat template, word embeddings (and [PLE](#ple) inputs), greedy argmax,
#    the softcap only when sampling needs probabilities.
# 2. **Device side**: a prefill graph per prompt-length [bucket](#bucket) and one decode graph, both with
#    static shapes and explicit K/V buffers that live on the device between calls.
# 3. **Checks**, three of them: the device's tokens against transformers' greedy output on the
#    host (SEQ_MATCH; fp32 in the smoke profile, the checkpoint's bf16 on inf2), the device's logits
#    at every step against the reference's within its own numerical [spread](#spread) (LOGITS_MATCH), and the
#    answer against what a sensible answer contains (coherence).
#
# The device graph is written once, wraps transformers' own modules, and is compiled by whichever
# compiler the machine has: [AOTInductor](#aotinductor) on a CPU, the Neuron compiler on inf2. Re-implementing the
# decoder by hand would make the port drift from the reference it is checked against.
#
# ## Memory decides the hardware
#
# bf16 weights per NeuronCore at each variant's TP degree, against the HBM a core has. The hatched
# part of E2B's and E4B's bars is the [PLE](#ple) table, which stays on the host.

# %%
plots.memory_budget(nb.memory_rows())

# %% [markdown]
# ## The recipe escalates with the model
#
# Each step was forced by a model that the previous step could not carry:
#
# 1. `torch_neuronx.trace` of the real forward on one core (the field report's E2B): proves PLE
#    and [KV sharing](#kv-sharing) compile at all. The field report traced a device prefill and a
#    decode over on-device K/V. This cookbook's own trace recipe, still selectable for E2B
#    (`neuron_recipe="trace"`), traces the decode graph alone, so the prompt goes through it one
#    token at a time; E2B's default is now the third step, at TP=1.
# 2. Hand-driven tensor parallelism with aliased on-device K/V and a
#    [CPU-seeded prefill](#cpu-seeded-prefill) (the field report's E4B): two cores. Its per-rank
#    tracer ran out of memory at 31B (the field report), and NxD's per-rank tracer
#    `parallel_model_trace` (the report does not name its tracer; read here as this one, unverified) is unsupported since SDK release 2.27 (source: the Neuron SDK's NxD announcement, as this project's design notes record it, read 2026-12-02),
#    so this cookbook teaches it on CPU and compiles E4B with the third step on inf2.
# 3. [NxD](#nxd) `ModelBuilder` (every variant; E2B at TP=1): a prefill graph and a decode graph over one
#    set of K/V states, one rank compiled and the weights sharded per rank. It carried the field
#    report's 31B at TP=8 and, with static experts and a runtime rank, its [MoE](#moe); this
#    cookbook's plan for every variant, never run on inf2 here.

# %%
nb.recipe_table()

# %% [markdown]
# ## The last run
#
# The newest record each variant notebook wrote to `results_dir` (this notebook measures none of
# it): the checks (the "witness" columns are the [witness](#witness)'s), and the benchmark figures. In
# the smoke profile these are tiny models on a CPU; the bar colour says whether every check passed.
# The compile column is the text graphs' (prefill and decode); each notebook's status box also counts
# its image section's graphs and the witness's, so its compile figure can be the larger.

# %%
results = nb.load_results(results_dir)
nb.results_table(results)

# %%
plots.checks_grid(results)

# %%
plots.family_metrics(results)

# %% [markdown]
# ## Why equality is not enough
#
# SEQ_MATCH compares the device with a reference that runs the same input through the same
# weights. Anything wrong *before* that point (the prompt, the embedding scale, the PLE wiring)
# is wrong in both, and they still agree. The field report met this in every port; the 31B's
# version was a chat prompt written by hand in Gemma 3's format. Here it is on a tiny model, with
# the graphs run eagerly (no compile) so the cell is quick: the correct template and the
# hand-built one both pass SEQ_MATCH, and only the coherence check tells them apart.

# %%
demo = PortSettings(variant=demo_variant, backend="eager", prompt=prompt, expect=expect, max_new_tokens=16)
demo_model = load_model(demo)
demo_graphs = compile_graphs(demo_model, demo)
equality_demo = nb.equality_is_not_enough(demo_model, demo_graphs.runtime, demo)
equality_demo

# %% [markdown]
# The overview records what it showed, so a headless run keeps it with the variant records.

# %%
overview = {
    "notebook": "00_overview",
    "kind": "overview",
    "profile": profile,
    "variants_found": sorted(results),
    "equality_demo": equality_demo.to_dict(),
}
nb.save_record(results_path, overview)
overview["variants_found"]

# %% [markdown]
# ## Four things to keep
#
# 1. Trace the real forward. What breaks vendor graph builders (KV sharing, routing) often traces
#    as ordinary data flow.
# 2. Let the recipe grow with the model, and move to compile-one-rank before the all-ranks
#    approach runs out of memory.
# 3. "Effective" and "active" sizes describe compute. Memory has to hold everything.
# 4. Equal to the reference is necessary and not sufficient: always check the answer too.

# %% [markdown]
# ## Glossary
#
# The terms the notebooks use, each defined once here; the notebooks link here at first use.
#
# - <a id="witness"></a>**witness**: a seeded random-weights model of the variant's architecture run
#   through the same recipe as the trained model (smoke profile only). Random weights have near-ties
#   between the top logits where a trained model has wide margins, so any numerical error in the
#   port larger than the closest gap flips a token: the witness's SEQ_MATCH is the check such an
#   error trips. Its LOGITS_MATCH is only as tight as the random model's own [spread](#spread),
#   which can be wider than that gap (the witness table prints both).
# - <a id="field-report"></a>**field report**: the earlier hands-on port of all five variants to
#   inf2 that this cookbook turns into runnable notebooks; its figures are the only inf2
#   measurements quoted here (appendix below).
# - <a id="spread"></a>**spread**: how far the host reference's own logits move when the same forward
#   runs in float64; LOGITS_MATCH allows the device a fixed multiple of it (with a floor), so the
#   tolerance follows the model's own rounding instead of a constant.
# - <a id="bucket"></a>**bucket**: a prompt length a prefill graph is compiled for (`prefill_buckets`).
#   A prompt runs in the smallest bucket that holds it, right-padded; a longer one runs in chunks of the
#   largest, each over the K/V written before it, up to `context_length` (a longer context: a new compile).
# - <a id="ring"></a>**ring**: a sliding-window layer's K/V buffer of only `sliding_window` slots,
#   written at `position % slots`, so old entries are overwritten as the window moves (`ring_kv`).
#   The masks say which slots hold positions inside the window.
# - <a id="neff"></a>**NEFF**: the Neuron Executable File Format, what the Neuron compiler
#   (`neuronx-cc`) produces from a traced graph and the runtime loads onto NeuronCores; the compiled
#   half of a `ModelBuilder` artifact (`model.pt`), beside the weight shards.
# - <a id="sbuf"></a>**SBUF**: a NeuronCore's on-chip state buffer (scratch memory next to the
#   compute engines). Fused attention kernels keep their tiles there; the 12B's wide sliding window
#   did not fit, hence eager attention (`03_12b`).
# - <a id="priority-model-idx"></a>**`priority_model_idx`**: the `ModelBuilder.add` argument that
#   names the key whose needs set the weights' on-device layout when several keys share the weights;
#   the cookbook gives it to decode, the step that reads every weight per token.
# - <a id="tp"></a>**TP** (tensor parallelism): each layer's weights split across NeuronCores (ranks);
#   column shards need no communication, row shards end in an all-reduce.
# - <a id="rank-graph"></a>**rank graph**: the graph one TP rank runs, the same forward with its
#   linears cut to the rank's shard (`tp.rank_graph`); ModelBuilder compiles it once for every rank.
# - <a id="roofline"></a>**ceiling** (roofline): bandwidth ÷ bytes read per decode step, the fastest
#   any implementation of single-row decode can go on that memory; computed, never measured.
# - <a id="smoke"></a>**smoke / full profile**: the tiny trained model on any CPU (what ran here), or
#   the released checkpoint on inf2 (never run by this project). `papermill_runs`' smoke profile runs
#   all eight notebooks; its full profile runs this one and the five variant notebooks, not
#   `06_serving` or `07_serve`, which it runs on CPU only (their inf2 cells run by hand on an instance).
# - <a id="cpu-seeded-prefill"></a>**CPU-seeded prefill**: the prompt's prefill run by the unsharded
#   model on the host, each TP rank then starting its decode from its slice of that K/V; the field
#   report's E4B recipe did this, and `02_e4b`'s CPU run of the rank graph does it too.
# - <a id="hlo"></a>**HLO**: XLA's High Level Operations, the graph form a traced PyTorch program
#   takes on its way to the Neuron compiler (`ModelBuilder.trace()` writes one `.hlo` file per key
#   and rank before `neuronx-cc` turns it into a [NEFF](#neff)).
# - <a id="nxd"></a>**NxD** (NeuronX Distributed): the Neuron SDK's library for sharded models;
#   its `ModelBuilder` compiles one rank's graph and loads the weight shards per rank.
# - <a id="hbm"></a>**HBM**: the high-bandwidth memory beside each NeuronCore that holds the weights
#   and K/V; its bandwidth is what a decode step's ceiling divides by.
# - <a id="gqa"></a>**GQA** (grouped-query attention): several query heads read one KV head, so a
#   model has fewer KV heads than Q heads, and TP runs out of KV heads to split before Q heads.
# - <a id="gloo"></a>**gloo**: PyTorch's CPU collective backend; here it runs the TP ranks as CPU
#   processes with real all-reduces, the stand-in for inf2's collectives.
# - <a id="spmd"></a>**SPMD**: one program, many ranks; every rank runs the same compiled graph and
#   learns which shard it is from data (its rank), not from a constant baked into the program.
# - <a id="matformer"></a>**MatFormer**: Gemma 3n's nesting of a smaller model inside a larger one.
#   transformers' Gemma-4 code has no MatFormer fields: the "E" in E2B and E4B ("effective") counts
#   the parameters without the PLE table, and nothing in the port depends on it.
# - <a id="ple"></a>**PLE** (per-layer embeddings): E2B's and E4B's second embedding table, one
#   small vector per token *and layer* (`embed_tokens_per_layer`, through `get_per_layer_inputs`),
#   which each decoder layer gates and projects into its residual stream. The table is large and
#   read one row per token, so the port looks it up on the host and passes `per_layer_inputs=`.
# - <a id="kv-sharing"></a>**KV sharing**: the last `num_kv_shared_layers` layers of E2B and E4B have
#   no K/V projections and read the K/V of the last earlier layer of the same attention type, so only
#   the producer layers need K/V buffers.
# - <a id="k-eq-v"></a>**k_eq_v** (`attention_k_eq_v`): on the 12B, 31B and 26B-A4B the
#   full-attention layers have no `v_proj`; their values are the key projection through an unscaled
#   norm without RoPE. K and V still differ, so both are cached: it saves a weight, not K/V memory.
# - <a id="moe"></a>**MoE** (mixture of experts): the 26B-A4B's layers route each token to a few of
#   many expert MLPs (top-k of the router's scores) beside a dense MLP on the same residual; all
#   experts stay resident. The port's prefill computes every expert (the dense form, masked to the
#   top-k); its decode computes only the routed ones (`05_26b_a4b`).
# - <a id="aotinductor"></a>**AOTInductor**: PyTorch's ahead-of-time compiler: a `torch.export`
#   program compiled to a C++ shared library in a `.pt2` package, loaded without Python tracing; the
#   CPU compiler of this cookbook, where inf2 uses the Neuron compiler.
# - <a id="dlami"></a>**DLAMI** (Deep Learning AMI): AWS's machine images with the Neuron SDK and its
#   virtual environments installed; the inf2 runs start from the Neuron DLAMI of SDK 2.28.
# - <a id="onednn"></a>**oneDNN**: Intel's library of CPU kernels that PyTorch's CPU matrix products
#   call; its packed weight layout speeds up small-batch products on CPU (`device.packed_linear`).
# - <a id="ttft"></a>**TTFT** (time to first token): from sending a request to its first text; it
#   holds the wait in the queue and the prompt's prefill.
# - <a id="doctor"></a>**`doctor`**: `python -m gemma4lab doctor`, which reports what this machine or
#   inf2 host can run (RAM, venv, SDK pieces) and the memory plan for a variant before you start.
#
# ## Appendix: the field report
#
# What the field report is, as far as this cookbook relies on it (source: the field report, an
# AWS Builder Center article by the port's author, undated; read and quoted 2026-12-02):
#
# - **What**: all five variants ported by hand to inf2, each answering "The capital of France is
#   Paris." with device tokens equal to a CPU fp32 reference (SEQ_MATCH).
# - **Recipes**: `torch_neuronx.trace` on one core (E2B), hand-driven TP with a per-rank tracer
#   (E4B; the report does not name it, read here as NxD's `parallel_model_trace`: unverified), NxD `ModelBuilder` (12B, 31B, 26B-A4B; the MoE with all experts computed densely).
# - **Software**: the DLAMI venv `aws_neuronx_venv_pytorch_2_8_nxd_inference` with transformers 5.13.0
#   and a `transformers.utils.fx` shim; the exact Neuron SDK release is not stated.
# - **Measured on inf2** (each variant's status box quotes its own): decode speed for E2B and E4B,
#   prefill latency for the 12B, 31B and 26B-A4B, a compile time and a compile-host peak for the 31B,
#   and a batch sweep for E2B (`06_serving`). Nothing else in these notebooks was measured on inf2.
# - **Its bugs**: a hand-built Gemma 3 chat prompt (replayed in `04_31b`), a rank read at trace time
#   in the MoE (replayed in `05_26b_a4b`), a wrongly wired PLE path behind a public endpoint (`01_e2b`
#   shows the right wiring; `python -m gemma4lab faults` replays the wrong one and names the check
#   that catches it).
