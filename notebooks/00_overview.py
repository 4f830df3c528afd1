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
# or let `python -m papermill_runs run --profile smoke` run all seven in order. A variant that has not
# run yet is simply missing from the tables.
#
# | notebook | variant | instance | TP degree | recipe |
# |---|---|---|---|---|
# | [01_e2b.ipynb](01_e2b.ipynb) | E2B | `inf2.xlarge` | TP=1 | model_builder (trace selectable) |
# | [02_e4b.ipynb](02_e4b.ipynb) | E4B | `inf2.8xlarge` | TP=2 | model_builder |
# | [03_12b.ipynb](03_12b.ipynb) | 12B | `inf2.8xlarge` | TP=2 | model_builder |
# | [04_31b.ipynb](04_31b.ipynb) | 31B | `inf2.24xlarge` | TP=8 | model_builder |
# | [05_26b_a4b.ipynb](05_26b_a4b.ipynb) | 26B-A4B | `inf2.24xlarge` | TP=8 | model_builder |
#
# Then [06_serving.ipynb](06_serving.ipynb) serves more than one token per weight read on the tiny
# E2B (CPU only): a batch of different prompts, each row checked against its own reference, and
# drafting with Gemma-4's own assistant, exact against greedy decoding. Its inf2 figures are
# computed, marked so, beside the field report's measured batch figures.
#
# ### Runs on
#
# | | `full` profile | `smoke` profile |
# |---|---|---|
# | machine | `inf2.xlarge` to `inf2.24xlarge`, per variant (table above) | any CPU |
# | software | Deep Learning AMI Neuron (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0 |
# | this notebook | reads the records the variant notebooks wrote; loads no large model | same, plus a tiny model for the last section |
#
# ### Before you start on inf2
#
# Everything a first day needs before the first cell runs is in the README's "Before you start on
# inf2": the instance and DLAMI per variant, accepting the model licence and exporting `HF_TOKEN`
# *before* JupyterLab starts (a kernel inherits its environment when it starts),
# `bash scripts/lab.sh --neuron` to open these notebooks on the Neuron venv's kernel without touching its
# torch or SDK packages, the disk and the time of each step (each marked computed, field report or
# unverified), and a troubleshooting table. `python -m gemma4lib doctor --variant e2b` prints the
# plan of both memories that decide a run: the NeuronCores' HBM and the serving host's RAM (the
# model, the host tables, the weight shards at load time and the reference the checks run).

# %% [markdown]
# ## Parameters
#
# `results_dir` is where the variant notebooks wrote their records (`papermill_runs` points it at
# its own output folder). The last section uses `demo_variant`'s tiny model on the CPU, whatever the
# profile.

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

from gemma4lib import notebook as nb
from gemma4lib.notebook import plots
from gemma4lib.port import PortSettings, compile_graphs, load_model

torch.set_num_threads(threads)

# %% [markdown]
# ## The family
#
# All five share a skeleton: one large vocabulary with the embedding tied to the LM head,
# embeddings scaled by √hidden, grouped-query attention with five sliding-window layers for each
# global one, a wider head on global layers than on sliding ones, and a final logit softcap
# (`vocab_size=262144`, `head_dim=256`, `global_head_dim=512`, `final_logit_softcapping=30.0` in every
# released config). The differences are in the columns on the right.

# %%
nb.family_table()

# %% [markdown]
# ## The shared serving shape
#
# Every port has the same moving parts, and so does every notebook:
#
# 1. **Host side**: tokenizer and chat template, word embeddings (and PLE inputs), greedy argmax,
#    the softcap only when sampling needs probabilities.
# 2. **Device side**: a prefill graph per prompt-length bucket and one decode graph, both with
#    static shapes and explicit K/V buffers that live on the device between calls.
# 3. **Checks**, three of them: the device's tokens against transformers' greedy output on the
#    host (SEQ_MATCH; fp32 in the smoke profile, the checkpoint's bf16 on inf2), the device's logits
#    at every step against the reference's within its own numerical spread (LOGITS_MATCH), and the
#    answer against what a sensible answer contains (coherence).
#
# The device graph is written once, wraps transformers' own modules, and is compiled by whichever
# compiler the machine has: AOTInductor on a CPU, the Neuron compiler on inf2. Re-implementing the
# decoder by hand would make the port drift from the reference it is checked against.
#
# ## Memory decides the hardware
#
# bf16 weights per NeuronCore at each variant's TP degree, against the HBM a core has. E2B's
# hatched part is the PLE table, which stays on the host.

# %%
plots.memory_budget(nb.memory_rows())

# %% [markdown]
# ## The recipe escalates with the model
#
# Each step was forced by a model that the previous step could not carry:
#
# 1. `torch_neuronx.trace` of the real forward on one core (the field report's E2B): proves PLE
#    and KV sharing compile at all. It compiles one graph, so the prompt goes through the decode
#    graph one token at a time; it stays selectable for E2B (`neuron_recipe="trace"`), whose default
#    is now the third step, at TP=1.
# 2. Hand-driven tensor parallelism with aliased on-device K/V and a CPU-seeded prefill (the field
#    report's E4B): two cores. Its per-rank tracer ran out of memory at 31B and is unsupported since
#    SDK release 2.27, so this cookbook teaches it on CPU and compiles E4B with the third step on inf2.
# 3. NxD `ModelBuilder` (every variant; E2B at TP=1): a prefill graph and a decode graph over one
#    set of K/V states, one rank compiled and the weights sharded per rank. This is what carries the
#    31B at TP=8 and, with static experts and a runtime rank, the MoE.

# %%
nb.recipe_table()

# %% [markdown]
# ## The last run
#
# The newest record each variant notebook wrote to `results_dir` (this notebook measures none of
# it): the checks, and the benchmark figures. In
# the smoke profile these are tiny models on a CPU; the bar colour says whether every check passed.

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
