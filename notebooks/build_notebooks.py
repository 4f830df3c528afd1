"""Generate the cookbook notebooks from one script, so their skeleton stays identical.

    python notebooks/build_notebooks.py          # (re)write notebooks/*.ipynb
    python notebooks/build_notebooks.py --check  # exit 1 if a committed notebook differs from what this writes

Every notebook is written with outputs stripped, deterministic cell ids, and one kernelspec
(`python3`). Edit the prose and cells here, never in the .ipynb files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gemma4lib.memory_plan import plan_core_memory  # noqa: E402
from gemma4lib.recipes.neuron_env import DLAMI, DLAMI_VENV, INF2_PYTHON, NEURON_SDK_RELEASE, SDK_PINS, TRANSFORMERS_PIN  # noqa: E402
from gemma4lib.roofline import INSTANCES  # noqa: E402
from gemma4lib.variants import VARIANTS  # noqa: E402

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
LANGUAGE_INFO = {"name": "python"}

# notebook file -> variant (None for the overview); the order is the run order's reverse for 00
NOTEBOOKS = {
    "00_overview.ipynb": None,
    "01_e2b.ipynb": "e2b",
    "02_e4b.ipynb": "e4b",
    "03_12b.ipynb": "12b",
    "04_31b.ipynb": "31b",
    "05_26b_a4b.ipynb": "26b-a4b",
}
TITLES = {
    "e2b": "E2B: per-layer embeddings on the host, and layers that borrow their K/V",
    "e4b": "E4B: the same tricks at twice the size, split over two cores",
    "12b": "12B: the encoder-free multimodal class, eager attention, one global KV head",
    "31b": "31B: the dense giant, eight cores, and KV heads that must be copied",
    "26b-a4b": "26B-A4B: a shared MLP beside 128 experts, made static",
}
SMOKE_MODEL = {
    "e2b": "PLE + KV sharing (10 layers, 4 KV-shared)",
    "e4b": "PLE + KV sharing (12 layers, 5 KV-shared)",
    "12b": "k_eq_v, 1 global KV head, eager attention (6 layers)",
    "31b": "k_eq_v, 16 Q / 8 sliding / 2 global KV heads (6 layers)",
    "26b-a4b": "MoE with the parallel dense MLP, 16 experts top-4 (6 layers)",
}
HOST_RAM_NOTE = {
    "31b": "the field report's compile peaked at 182 GB of host RAM",
    "26b-a4b": "needs the same instance as the 31B although fewer parameters are active",
}
TP_DEMO = {"e2b": 0, "e4b": 2, "12b": 2, "31b": 4, "26b-a4b": 2}


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str, tags: list[str] | None = None):
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = tags
    return cell


# ---- shared blocks ------------------------------------------------------------------------------


def sdk_line() -> str:
    pins = ", ".join(f"{name} {versions[0]}" for name, versions in SDK_PINS.items())
    return (
        f"{DLAMI}, venv `{DLAMI_VENV}` (Python {INF2_PYTHON}), Neuron SDK {NEURON_SDK_RELEASE}: {pins}; "
        f"+ transformers {TRANSFORMERS_PIN}"
    )


def runs_on(name: str) -> str:
    v = VARIANTS[name]
    inst = INSTANCES[v.instance_type]
    chips, cores, host_ram, hbm, bandwidth = (
        inst.chips,
        inst.neuron_cores,
        inst.host_ram_gib,
        inst.hbm_gib,
        inst.hbm_gib_s,
    )
    plan = plan_core_memory(v, context_length=2048)
    host_note = HOST_RAM_NOTE.get(name, "the model is loaded in bf16 on the host before it is compiled")
    return f"""
### Runs on

| | `full` profile (inf2) | `smoke` profile (any CPU) |
|---|---|---|
| machine | `{v.instance_type}`: {chips} Inferentia2 chip(s), {cores} NeuronCores, {hbm} GiB HBM, {bandwidth:,.0f} GiB/s | any x86-64 or arm64 machine; two shared cores are enough |
| TP degree | {v.tp_degree} ({v.recipe} recipe) | 1 for the port; a CPU run with one process per rank shows TP |
| memory per core (computed, `python -m gemma4lib doctor`) | {plan.weights_gib:.1f} GiB bf16 weights + {plan.kv_gib:.2f} GiB K/V at 2,048 tokens + {plan.working_gib:.0f} GiB working allowance (unverified on inf2) = {plan.total_gib:.1f} of 16 GiB HBM | a few MB |
| host RAM for the compile | {host_ram} GiB on the instance; ~{plan.compile_peak_gb:.0f} GB estimated ({plan.compile_basis}); {host_note} | under 2 GiB |
| software | {sdk_line()} | torch 2.13 (CPU), transformers {TRANSFORMERS_PIN}, AOTInductor as the compiler |
| model | `{v.hf_id}` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: {SMOKE_MODEL[name]} |
"""


def parameters_cell(name: str, extra: str = "") -> object:
    v = VARIANTS[name]
    context, buckets = 128, "[64]"  # the library's smoke shapes: the artifact cache is shared with its tests
    experts = (
        'decode_experts = "selective"  # MoE decode: "selective" (the k routed experts) or "dense" (all)\n'
        if v.is_moe
        else ""
    )
    tp_demo = (
        f"tp_demo = {TP_DEMO[name]}  # ranks in the CPU tensor-parallel demonstration (0: skip)\n"
        if TP_DEMO[name]
        else ""
    )
    return code(
        f"""
variant = "{name}"
profile = "smoke"  # "smoke": tiny model on CPU; "full": the real checkpoint on inf2
model = "auto"  # smoke: the tiny trained fixture; "random" for equality-only runs
checkpoint = None  # full: a hub id or local folder, e.g. "{v.hf_id}"
backend = "cpu"  # full: "neuron"
tp_degree = 1  # full: {v.tp_degree}
prompt = "What is the capital of France?"
expect = "Paris"  # coherence: the answer must contain this
max_new_tokens = 32
context_length = {context}  # the compiled K/V length
prefill_buckets = {buckets}  # compiled prompt lengths
ring_kv = True  # sliding layers keep only their window of K/V (a ring); False: full-length buffers
{experts}warmup = 1
iters = 3
threads = 1  # torch threads for the benchmark (recorded with it)
{tp_demo}results_path = "../runs/notebooks/{name}.json"
interactive = False  # True: show the chat box at the end (needs a live Jupyter front end)
"""
        + extra,
        tags=["parameters"],
    )


def parameters_intro(name: str) -> object:
    v = VARIANTS[name]
    tp_off = ", tp_demo: 0" if TP_DEMO[name] else ""
    return md(f"""
## Parameters

The next cell is the notebook's only input. It is tagged `parameters`, so
[papermill](https://papermill.readthedocs.io) can replace any value from the command line; its
defaults run the `smoke` profile on this machine's CPU. On an `{v.instance_type}` with the Neuron SDK,
the same notebook runs the real model:

```
papermill notebooks/{notebook_file(name)} out.ipynb -y "{{profile: full, backend: neuron, tp_degree: {v.tp_degree},
    checkpoint: {v.hf_id}, context_length: 1024, prefill_buckets: [128]{tp_off}}}"
```

`python -m papermill_runs run --profile full` does the same for every notebook (the full profile's
values live in `papermill_runs/profiles.json`). The Hugging Face token is read from `HF_TOKEN`
in the environment; it is never a parameter, so it never lands in an executed notebook.
""")


def notebook_file(name: str) -> str:
    return next(f for f, v in NOTEBOOKS.items() if v == name)


SETUP_MD = md("""
## Setup

One thread for torch: the benchmark figures are recorded with their thread count, and on a
shared machine more threads mostly measure the neighbours. `demos` collects what the
demonstration cells find; it is saved in the run's record next to the metrics.
""")

SETUP_CODE = code("""
%matplotlib inline
import time

import torch

from gemma4lib import notebook as nb, plots
from gemma4lib.benchmarks.timing import benchmark
from gemma4lib.port import PortSettings, build_graphs, compile_graphs, eos_ids, load_model, prompt_ids
from gemma4lib.reference import reference_greedy

torch.set_num_threads(threads)
started = time.perf_counter()
demos = {}
""")


def settings_cells(name: str) -> list:
    experts = "decode_experts=decode_experts, " if VARIANTS[name].is_moe else ""
    return [
        md("""
`PortSettings` gathers every value a port depends on and checks them before anything is loaded:
an unknown variant, profile or backend, or a TP degree whose heads do not split evenly, fails
here with a message that says what to pick instead, not thirty minutes into a compile.
"""),
        code(f"""
s = PortSettings(variant=variant, profile=profile, model=model, checkpoint=checkpoint, backend=backend,
                 tp_degree=tp_degree, prompt=prompt, expect=expect, max_new_tokens=max_new_tokens,
                 context_length=context_length, prefill_buckets=tuple(prefill_buckets), ring_kv=ring_kv,
                 {experts}warmup=warmup, iters=iters)
nb.show_settings(s)
"""),
    ]


def load_cells(name: str) -> list:
    v = VARIANTS[name]
    unified = (
        (
            "The 12B ships as `Gemma4UnifiedForConditionalGeneration`, the multimodal class without "
            "separate vision or audio encoders; its text decoder is taken out the same way. "
        )
        if v.unified
        else ""
    )
    return [
        md(f"""
## 1. Load the model

The released checkpoint is a multimodal `*ForConditionalGeneration`. The port needs only its
text decoder and the tied LM head, so the loader keeps `model.language_model` as a
`*ForCausalLM`. {unified}That one module plays two roles from here on: it is the **reference**
(transformers' own forward, run on the host in fp32) and the **source of the weights** that the
device graph is built from. In the smoke profile it is the tiny trained fixture: same
architecture, a few MB, trained on a small synthetic chat corpus so that it really answers the
question.
"""),
        code("""
model = load_model(s)
nb.describe_model(model)
"""),
        md("""
The prompt goes through the tokenizer's own chat template. Gemma-4 marks turns with
`<|turn>` and `<turn|>` (ids 105 and 106); a template written by hand is the classic way to
feed the model a prompt it was never trained on.
"""),
        code("""
ids = prompt_ids(model, s)
nb.show_prompt(model, ids)
"""),
    ]


def graph_cells(name: str) -> list:
    v = VARIANTS[name]
    extra = {
        "e2b": " For E2B there are two host-side inputs: the scaled word embeddings and the PLE inputs, "
        "one 16-wide vector per layer per token in the tiny model (256-wide in the real one).",
        "e4b": " As for E2B, the PLE inputs arrive as a graph input computed on the host.",
        "26b-a4b": " The experts are swapped for a static form here: prefill always computes all experts "
        "and masks them to the routed top-k; decode uses `decode_experts`.",
    }.get(name, "")
    recipe_note = {
        "trace": "On inf2, E2B's recipe hands these graphs to `torch_neuronx.trace` on one NeuronCore, with "
        "the K/V buffers held as parameters and aliased to the outputs that update them.",
        "model_builder": "On inf2 this variant goes through NxD `ModelBuilder`: one rank is compiled, the "
        "weights are sharded per rank from a checkpoint loader, the rank number is a "
        "runtime tensor, and the decode graph is the priority model whose weight layout "
        "the compiler optimises.",
    }[v.recipe]
    return [
        md(f"""
## 2. Build the device graph

The device graph is transformers' own decoder forward with three things changed: the K/V cache
is a set of explicit, fixed-size buffers written at a position that arrives as a tensor (so one
compiled decode graph serves every step), the attention masks are built from that position and
passed in, and the embedding tables stay outside (their lookups happen on the host). The final
logit softcap is left off: `30·tanh(x/30)` is monotonic, so greedy argmax does not need it.{extra}

Without the explicit buffers the stock static cache branches on a Python integer, and the graph
would be valid for a single position only.
"""),
        code("""
prefill, decode = build_graphs(model, s)
nb.describe_graphs(prefill, decode)
"""),
        md(f"""
## 3. Compile

In the smoke profile the compiler is PyTorch's own: `torch.export` (non-strict: strict mode
silently drops the in-place K/V updates) and AOTInductor, which writes a loadable package per
graph. The packages go into an artifact cache keyed by everything that changes the program, so
a second run loads them in a second instead of compiling again. {recipe_note}
"""),
        code("""
compiled = compile_graphs(model, s, progress=True)  # each backend builds the graph form its compiler needs
nb.describe_compile(compiled)
"""),
    ]


def check_cells() -> list:
    return [
        md("""
## 4. Generate on the device

The host runtime embeds the prompt, runs the smallest prefill bucket that fits, then loops the
decode graph one token at a time with greedy argmax until `<eos>`/`<turn|>` or `max_new_tokens`.
`keep_logits=True` also keeps the raw logits of every step, for the logit check below.
"""),
        code("""
generation = compiled.runtime.generate(ids, s.max_new_tokens, eos_token_ids=eos_ids(model),
                                       keep_logits=True)
nb.answer_text(model, generation.tokens)
"""),
        md("""
## 5. The reference

The same prompt through transformers' `generate` on the host in fp32, greedy, same stop tokens.
"""),
        code("""
reference = reference_greedy(model.lm, ids, s.max_new_tokens, eos_ids(model))
nb.answer_text(model, reference)
"""),
        md("""
## 6. SEQ_MATCH, LOGITS_MATCH and coherence, side by side

Three checks, because none implies the others. **SEQ_MATCH** (the device's tokens equal the
reference's, one for one) shows the compiled graph is faithful to transformers' forward, as far
as tokens can show it: this model answers with margins of several logits, so an error of 0.1 in
every logit leaves every token alone. **LOGITS_MATCH** compares the device's logits at every
generated position, prefill and each decode step, with the reference's logits for the same
tokens (one forward over prompt + device tokens), within a tolerance taken from the reference's
own rounding on that sequence: 8 × the largest difference between the reference and a float64
copy of itself, never below 1e-5. **Coherence** (the answer contains "Paris") shows that what
both of them computed is right. A fault upstream of both, like a mangled chat prompt or wrong PLE
inputs, passes both equality checks and fails only the last.
"""),
        code("""
report = nb.check(model, s, generation, reference)
nb.side_by_side(report, generation.tokens, reference)
"""),
        md("""
### The witness

The same compiled programs also run a seeded random-weights model of this architecture (the
weights are handed to the compiled program at load time; the buffers the compiler folds in,
such as `layer_scalar`, hold the same values in both tiny models). Random weights have near-ties
where the trained model has margins of several logits, so any logit error turns into another
token: the witness's SEQ_MATCH and LOGITS_MATCH are the sensitive checks, the trained model's
coherence the meaningful one. It runs in the smoke profile.
"""),
        code("""
witness = nb.run_witness(s, compiled) if s.wants_witness else None
nb.witness_table(witness)
"""),
    ]


def bench_record_cells(name: str) -> list:
    return [
        md("""
## 7. Benchmark

Median prefill latency and decode throughput over `iters` full generations after `warmup`
untimed ones.

Batch-1 decode does almost no arithmetic per byte: every step reads each device weight and
every K/V buffer once, so no implementation can beat *bandwidth ÷ bytes per step*. That ceiling
is how to judge a decode figure. Here it is computed from this model's shapes and the forms it was
compiled with (ring or full-length K/V, selective or dense experts), over the bandwidth of the
machine that ran it: measured a moment ago on a CPU, the HBM of the cores in use on inf2. The
right-hand column does the same for the released model on its inf2 instance, next to the field
report's figure. A tiny model on a CPU sits far below its ceiling: its few MB of weights stay in
cache and a fixed per-step cost dominates. Compare smoke figures with earlier smoke runs
(papermill_runs does), never with inf2.
"""),
        code("""
figures = benchmark(compiled.runtime, ids, s.max_new_tokens, s.warmup, s.iters)
ceiling = nb.measured_vs_ceiling(model, s, figures)
nb.bench_table(figures, s, ceiling)
"""),
        md("""
## 8. Record

One JSON file per run: settings, the three checks (and the witness's), tokens, timings, the K/V
layout, package versions, git commit and machine, plus what the demonstrations found. It is
written atomically to `results_path`; `papermill_runs` collects these files and compares them
with the baselines.
"""),
        code("""
result = nb.record(s, model, ids, compiled, generation.tokens, reference, report, figures, results_path,
                   started, extra={"demos": demos, "roofline": ceiling}, witness=witness)
{k: result.get(k) for k in ("variant", "compiler", "seq_match", "logits_match", "coherent",
                            "checks_passed", "prefill_ms", "decode_tok_s", "compile_s")}
"""),
        md("""
## 9. Plots

Token by token, device over reference (green where equal); every timed benchmark run; and
decode against its ceiling, this run's and the released model's on inf2.
"""),
        code("""
plots.token_match(result)
"""),
        code("""
plots.bench_runs(result)
"""),
        code("""
plots.measured_vs_ceiling([ceiling, ceiling["released_inf2"]])
"""),
        md("""
## 10. Chat (optional)

With `interactive = True` and a live Jupyter front end this cell shows a text box that sends
your question through the compiled graphs. Run headless (papermill, CI) it does nothing.
"""),
        code("""
if interactive:
    display(nb.chat(compiled.runtime, model, s))
"""),
    ]


def tp_demo_cells(name: str, intro: str, prefill: str = "graph", baked_rank: bool = False) -> list:
    args = (f', prefill="{prefill}"' if prefill != "graph" else "") + (", with_baked_rank=True" if baked_rank else "")
    return [
        md(intro),
        code(f"""
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo{args})
    display(demos["tp_cpu"])
"""),
    ]


# ---- per-variant features -------------------------------------------------------------------------


def features_e2b() -> list:
    return [
        md("""
## What makes E2B different

### Per-layer embeddings (PLE), kept on the host

Besides the usual word embedding, every token looks up a second, much larger table that holds a
small vector **for each decoder layer** (256 numbers per layer in the released model). Each layer
mixes its slice into the residual stream. The table is a lookup, not a matrix multiply, and in the
released E2B it is half of all text parameters: shipping it to the accelerator would spend most
of a core's memory on rows that are read a handful at a time.
"""),
        code("""
nb.ple_report(model)
"""),
        md("""
transformers lets the caller compute both inputs outside the model (`embed_tokens(ids)` and
`get_per_layer_inputs(ids)`) and pass them as `inputs_embeds=` and `per_layer_inputs=`. The port
does exactly that on the host. The cell below runs the reference both ways and compares the
logits: they are bit-identical, so moving the lookup costs nothing in accuracy.
"""),
        code("""
demos["ple_on_host"] = nb.ple_on_host_check(model, ids)
demos["ple_on_host"]
"""),
        md("""
### "Effective" size is an accounting, not a smaller model

"E2B" means about two billion parameters do matrix work; the PLE table is the rest. The
transformers Gemma-4 code has no MatFormer fields (those belonged to Gemma 3n), so nothing is
sliced away at load time. Budget memory for what the device actually holds.
"""),
        code("""
nb.effective_size("e2b")
"""),
        md("""
### Layers that borrow their K/V

The last layers of E2B compute no keys or values of their own: each reads the K/V of the last
earlier layer of the same attention type (sliding or full). Only the producer layers need cache
buffers. This is the feature the vendor graph builders cannot express, yet it traces without
trouble: in transformers' forward the borrowed K/V is an ordinary data dependency. Here is the
tiny model's layout, then the same arithmetic for the released model.
"""),
        code("""
nb.kv_sharing_report(model)
"""),
        code("""
plots.kv_layout(model.layout)
"""),
        code("""
nb.kv_sharing_real("e2b", context_length=2048)
"""),
        code("""
plots.kv_layout(nb.real_layout("e2b"), "released E2B: who owns K/V, who borrows it")
"""),
    ]


def features_e4b() -> list:
    return [
        md("""
## What makes E4B different

E4B has E2B's architecture at a larger width: per-layer embeddings, KV-shared layers, and 2 KV
heads per layer instead of 1. The PLE table is again kept on the host.
"""),
        code("""
nb.ple_report(model)
"""),
        code("""
demos["ple_on_host"] = nb.ple_on_host_check(model, ids)
demos["ple_on_host"]
"""),
        md("""
The KV-sharing consumers read the buffers of the last non-shared sliding and full layers
(22 and 23 in the released model).
"""),
        code("""
nb.kv_sharing_report(model)
"""),
        code("""
nb.kv_sharing_real("e4b", context_length=2048)
"""),
        code("""
plots.kv_layout(nb.real_layout("e4b"), "released E4B: who owns K/V, who borrows it")
"""),
        md("""
### Why two cores, and what happens to the KV heads

Without its PLE table E4B still holds about 9.3 GB of bf16 weights, more than half of one 16 GiB
core before any K/V or compiler scratch space, and decode would read all of it through one core's
share of the HBM bandwidth. The field report split it over the two cores of an `inf2.8xlarge`
(TP=2) with a hand-driven tensor-parallel recipe: half the weights per core, twice the bandwidth. With 8 Q heads and 2 KV heads per
layer, each rank takes 4 Q heads and exactly one KV head, so the KV heads are sharded, not copied.

That hand-driven recipe traced every rank with NxD's `parallel_model_trace`, which the Neuron SDK
no longer supports since release 2.27 (it starts one process per rank, and each of them re-imports
the SDK without the fixes this cookbook installs). So on inf2 this notebook compiles E4B with NxD
`ModelBuilder` at TP=2, the same recipe as the 12B, 31B and 26B-A4B: one process, prefill and
decode on the device over one set of K/V states. Hand-driven TP stays what this notebook *teaches*,
on the CPU below, because there every step of it is visible.
"""),
        code("""
nb.tp_fit("e4b")
"""),
        code("""
nb.kv_heads_under_tp("e4b", 2)
"""),
    ] + tp_demo_cells(
        "e4b",
        """
The same sharding plan, run for real on CPU: one process per rank, each holding only its shard,
talking through gloo collectives. Like the E4B recipe on inf2, the prompt is prefilled by the
unsharded model on the host and every rank starts decoding from its slice of that K/V
("CPU-seeded prefill"). The tokens must equal the reference's.
""",
        prefill="cpu-seeded",
    )


def features_12b() -> list:
    return [
        md("""
## What makes the 12B different

### The unified class, text only

The 12B is published as `Gemma4UnifiedForConditionalGeneration`: a multimodal class with no
separate vision or audio encoder. For text generation the port takes its language model and
moves on; there is no PLE and no KV sharing.

### k_eq_v: full-attention layers have no value projection

On the full-attention layers the values are the (normed) key projection; there is no `v_proj`
at all. The graph builder does not need to know, because it traces transformers' forward, but a
sharding plan or a weight loader that expects a `v_proj` everywhere breaks here.
"""),
        code("""
nb.k_eq_v_report(model)
"""),
        md("""
### Eager attention

The released 12B uses a 1024-token sliding window. Neuron's fused attention kernel ran out of
its on-chip scratch memory (SBUF) at that window, so the field report switched the model to
transformers' eager attention, which the compiler lowers as ordinary matmuls and softmax. The
library loads every variant with `attn_implementation="eager"`. On the CPU the implementations
agree, which is what makes the switch safe: it changes what the compiler must fit, not the
numbers.
"""),
        code("""
demos["attention"] = nb.attention_implementations_agree(model, ids)
demos["attention"]
"""),
        md("""
### One global KV head

Each full-attention layer has a single KV head shared by all 16 Q heads. At TP=2 it cannot be
split in two, so both ranks keep a full copy of it; the sliding layers' 8 KV heads shard normally.
"""),
        code("""
nb.kv_heads_under_tp("12b", 2)
"""),
        code("""
nb.tp_fit("12b")
"""),
    ] + tp_demo_cells(
        "12b",
        """
The tiny model has the same shape of problem (1 global KV head, 2 sliding ones), so a CPU run at
TP=2 exercises the replicated global head and the sharded sliding heads together:
""",
    )


def features_31b() -> list:
    return [
        md("""
## What makes the 31B different

Architecturally it is the simplest of the five: no PLE, no KV sharing, no experts. The hard part
is size. About 61 GB of bf16 weights do not fit fewer than eight 16 GiB cores with room for K/V,
so the 31B needs an `inf2.24xlarge` and TP=8. The hand-driven TP recipe that carried E4B builds
every rank in one process; at this size it ran out of memory (and serialising it deadlocked).
NxD `ModelBuilder` compiles one rank and shards the weights per rank, which is what scales.
"""),
        code("""
nb.tp_fit("31b")
"""),
        md("""
### KV heads under TP=8: replicated, not sharded

The sliding layers have 16 KV heads: two per rank, a clean split. The 10 full-attention layers
have only 4 KV heads for 32 Q heads (8 Q heads per KV head). At TP=8 each rank owns 4 Q heads,
all of which read the same KV head (Q head `q` reads KV head `q // 8`), so rank `r` keeps a copy
of KV head `r // 2`: every global KV head lives on two ranks. The table works it out from the
released config.
"""),
        code("""
demos["kv_heads_tp8"] = nb.kv_heads_under_tp("31b", 8)
demos["kv_heads_tp8"]
"""),
        md("""
The tiny 31B keeps the proportions (16 Q heads; 8 sliding and 2 global KV heads), so at TP=4 its
global heads must be replicated as well:
"""),
        code("""
nb.kv_heads_under_tp("31b", tp_demo or 4, config=model.config)
"""),
    ] + tp_demo_cells(
        "31b",
        """
And run, one process per rank, each rank holding only its shard and its copies of the global KV
heads:
""",
    )


def features_26b() -> list:
    return [
        md("""
## What makes the 26B-A4B different

### A shared MLP beside the experts

Each layer runs a dense MLP and a mixture of experts **in parallel** on the same residual input,
each with its own norms, and adds the results. The router normalises the hidden state, scales it,
projects it to one logit per expert, takes a softmax over all experts, keeps the top-k,
renormalises them and multiplies by a learnt per-expert scale.
"""),
        code("""
nb.moe_report(model)
"""),
        md("""
### Static experts

transformers' eager expert loop visits only the experts a batch happens to route to: a
data-dependent Python loop that a tracer records for one routing and silently replays for every
other. The port swaps in a static form: **dense** (every expert on every token, outputs weighted
by the routed weights, zero for the rest; static shapes, and the expert dimension splits across
ranks) or **selective** (gather the k routed experts' weights, then batched matmuls; reads only k
experts per token). The cell runs one decode step both ways against transformers' reference:
same token, logits equal to rounding.

Decode gathers the top-k: one token needs 8 of the 128 experts, and bytes are the whole cost of a
decode step. On the benchmark's MoE medium model (`python -m gemma4lib bench --suite cpu`, figures
in `docs/ROOFLINE.md`) selective decode ran 2.8x faster than dense. Prefill stays dense: the
gathered slices grow with tokens x k (a 128-token bucket of the real model gathers 1,024 slices, 8x
the 128 experts dense reads once) and the dense form splits cleanly across ranks. On a CPU with a
16-token prompt selective prefill measured faster too, which is why the choice is per phase and
measured, not a rule. `decode_experts` in the parameters cell switches decode back to dense.
"""),
        code("""
demos["expert_forms"] = nb.expert_forms_on_a_token(model, ids, s.context_length, max(s.prefill_buckets))
demos["expert_forms"]
"""),
        md("""
### "A4B" saves compute, not memory

About 4B parameters are active per token, but any token may route to any expert, so all 128
experts (22.8B parameters) stay resident. The 26B-A4B needs the same `inf2.24xlarge` and TP=8 as
the 31B. What top-8 routing can save is bandwidth, if decode reads only the routed experts (the
selective form), and under TP that depends on how the experts are split over the 8 ranks. With 16
whole experts per rank, static shapes make every rank gather 8 slices per token whether routed
there or not: 64 of the 128 experts are read, a ceiling of ~126 tok/s on `inf2.24xlarge`. The TP
plan instead gives every rank a 1/8 slice of *every* expert (704 / 8 = 88 intermediate columns:
gate/up column-sharded and down row-sharded per expert, one all-reduce), so the 8 slices a rank
gathers are exactly its share of the 8 routed experts: 8 experts' bytes per token over all ranks,
a ceiling of ~446 tok/s (`docs/ROOFLINE.md`; a bound from bytes, not yet measured on inf2). Each
rank holds 1/8 of the expert bytes either way.
"""),
        code("""
nb.tp_fit("26b-a4b")
"""),
        code("""
nb.kv_heads_under_tp("26b-a4b", 8)
"""),
    ] + tp_demo_cells(
        "26b-a4b",
        """
### The rank must be a runtime value

When each rank holds whole experts (the field report's form, still available as
`expert_split="experts"`), it must pick the matching columns of the routing weights. In the field
report that slice was chosen with a rank read while tracing: a Python integer, baked into the
single-rank `ModelBuilder` trace as 0, so every rank weighted its experts with rank 0's routing
weights. Device output was empty while the CPU and the unit tests were fine. In that form the
library reads the rank from an int32 tensor that each rank loads with its weights; in the default
form (a slice of every expert per rank) the expert math never reads the rank at all. The cell runs
the sharded model (default form) and the baked-rank bug (whole experts per rank) on CPU:
""",
        baked_rank=True,
    )


FEATURES = {"e2b": features_e2b, "e4b": features_e4b, "12b": features_12b, "31b": features_31b, "26b-a4b": features_26b}

INTRO = {
    "e2b": """
E2B is the smallest of the five and the one where the architecture is hardest to port: two of
its features, per-layer embeddings and cross-layer KV sharing, are exactly what the vendor graph
builders cannot express. This notebook ports it the way the field report did on one NeuronCore,
by tracing transformers' real forward, and checks the result two ways.
""",
    "e4b": """
E4B is E2B widened: the same per-layer embeddings and KV sharing, twice the weights. It no
longer fits comfortably on one NeuronCore, so this is where tensor parallelism enters, and with it
the question of how the KV heads are split.
""",
    "12b": """
The 12B drops the E-family's special features and adds three of its own: it is published in the
encoder-free unified multimodal class, its full-attention layers take V from the K projection
(`attention_k_eq_v`) and have a single KV head, and on inf2 it only compiles with eager
attention. It runs at TP=2 through NxD `ModelBuilder`.
""",
    "31b": """
The 31B is a plain dense decoder that happens to need eight NeuronCores. The two things to see
here are why the recipe had to change to `ModelBuilder` at this size, and what TP=8 does to its
four global KV heads. Its notebook also replays the field report's 31B bug: a chat prompt that
both the device and the reference processed identically, and wrongly.
""",
    "26b-a4b": """
The mixture-of-experts member: a dense MLP and 128 routed experts side by side in every layer.
Its experts have to be made static before anything can trace them, its "4B active" does not
shrink its memory, and its tensor-parallel form hid the family's most instructive bug: a rank
read at trace time.
""",
}

TAKEAWAYS = {
    "e2b": """
## Takeaways

- Keep the PLE table on the host: it is half of E2B's parameters and it is only ever indexed.
  Passing `inputs_embeds` and `per_layer_inputs` gives bit-identical results.
- KV sharing needs no special handling when the real forward is traced; only producer layers
  get buffers (15 of 35 in the released model).
- Check SEQ_MATCH **and** the answer. The original "gibberish" endpoint that started this work
  loaded a real model and wired the PLE path and embedding scale wrongly: a text check catches
  that, an equality check cannot.
""",
    "e4b": """
## Takeaways

- E4B is E2B at twice the size: the same host-side PLE and KV sharing, now over two cores.
- With 2 KV heads and TP=2 each rank holds exactly one KV head: GQA splits cleanly here. It will
  not for the 12B, 31B and 26B-A4B global layers.
- Hand-driven TP is the clearest way to see tensor parallelism; on inf2 E4B compiles with
  `ModelBuilder` like the bigger variants, because the per-rank tracer it needed is no longer
  supported (SDK 2.27+) and ran out of memory at 31B (see `04_31b`).
""",
    "12b": """
## Takeaways

- Take the language model out of the unified class; nothing else of it is needed for text.
- `attention_k_eq_v`: full layers have no `v_proj`. Trace the real forward and it does not matter.
- Force eager attention for inf2: it is numerically the same and it fits the compiler.
- A single global KV head is replicated on every rank under TP.
""",
    "31b": """
## Takeaways

- Scale, not architecture, is the 31B's problem: eight cores, a long compile, a large host.
- Reach for the compile-one-rank recipe (`ModelBuilder`) before the all-ranks-in-one-process one
  runs out of memory.
- Fewer KV heads than ranks means replication: each global KV head sits on two of eight ranks.
- Build prompts with the tokenizer's chat template. `SEQ_MATCH True` on nonsense is the signature
  of an input problem, and only the coherence check reports it.
""",
    "26b-a4b": """
## Takeaways

- The MoE block is a shared MLP plus routed experts; both run on every layer.
- Replace the data-dependent expert loop with a static form; dense and selective agree with the
  reference on every token.
- All experts stay resident: "A4B" is a compute figure, not a memory one.
- Anything rank-dependent inside a traced SPMD graph must come from a runtime tensor. A rank
  read while tracing is the same constant on every rank.
""",
}


def variant_notebook(name: str):
    v = VARIANTS[name]
    cells = [
        md(f"# Gemma-4 {TITLES[name]}\n" + INTRO[name] + runs_on(name)),
        parameters_intro(name),
        parameters_cell(name),
        SETUP_MD,
        SETUP_CODE,
        *settings_cells(name),
        *load_cells(name),
        *FEATURES[name](),
        *graph_cells(name),
        *check_cells(),
    ]
    if name == "31b":
        cells += [
            md("""
### The 31B's bug, replayed: SEQ_MATCH on nonsense

In the field report a chat prompt for the 31B was written by hand in Gemma 3's format,
`<start_of_turn>user ...`. Gemma-4 has no such token: the tokenizer splits each marker into
ordinary pieces, the model reads noise, and answers noise. The device still matched the CPU
reference token for token, because both processed the same wrong input. The compiled graphs
from above run both prompts (the hand-built one is about three times longer, and still fits the
64-token prefill bucket):
"""),
            code("""
demos["equality_is_not_enough"] = nb.equality_is_not_enough(model, compiled.runtime, s)
demos["equality_is_not_enough"]
"""),
        ]
    cells += bench_record_cells(name)
    cells.append(
        md(
            TAKEAWAYS[name]
            + f"""
To run the real thing, see the parameters cell: `profile="full"`, `backend="neuron"`,
`tp_degree={v.tp_degree}`, and a checkpoint. Everything above runs unchanged.
"""
        )
    )
    return cells


# ---- overview -----------------------------------------------------------------------------------


def overview_cells() -> list:
    rows = "\n".join(
        f"| [{f}]({f}) | {v.upper()} | `{VARIANTS[v].instance_type}` | {VARIANTS[v].tp_degree} | {VARIANTS[v].recipe} |"
        for f, v in NOTEBOOKS.items()
        if v
    )
    return [
        md(f"""
# Gemma-4 on AWS Inferentia2: the family at a glance

Five Gemma-4 text decoders, one accelerator, one way of porting them. This notebook is the map:
what the five share, where they differ, how the porting recipe had to grow as the models did,
the results of the last run, and why a port that reproduces its reference exactly can still be
wrong. The other notebooks port one variant each, step by step.

| notebook | variant | instance | TP | recipe |
|---|---|---|---|---|
{rows}

### Runs on

| | `full` profile | `smoke` profile |
|---|---|---|
| machine | `inf2.xlarge` to `inf2.24xlarge`, per variant (table above) | any CPU |
| software | {sdk_line()} | torch 2.13 (CPU), transformers {TRANSFORMERS_PIN} |
| this notebook | reads the records the variant notebooks wrote; loads no large model | same, plus a tiny model for the last section |
"""),
        md("""
## Parameters

`results_dir` is where the variant notebooks wrote their records (`papermill_runs` points it at
its own output folder). The last section uses `demo_variant`'s tiny model on the CPU, whatever the
profile.
"""),
        code(
            """
profile = "smoke"
results_dir = "../runs/notebooks"  # where the variant notebooks wrote their JSON records
demo_variant = "e2b"  # tiny model used by the "equality is not enough" demonstration
prompt = "What is the capital of France?"
expect = "Paris"
threads = 1
results_path = "../runs/notebooks/overview.json"
""",
            tags=["parameters"],
        ),
        code("""
%matplotlib inline
import torch

from gemma4lib import notebook as nb, plots
from gemma4lib.port import PortSettings, compile_graphs, load_model

torch.set_num_threads(threads)
"""),
        md("""
## The family

All five share a skeleton: a 262,144-token vocabulary with the embedding tied to the LM head,
embeddings scaled by √hidden, grouped-query attention with five sliding-window layers for each
global one, head_dim 256 on sliding layers and 512 on global ones, and a final logit softcap of
30. The differences are in the columns on the right.
"""),
        code("""
nb.family_table()
"""),
        md("""
## The shared serving shape

Every port has the same moving parts, and so does every notebook:

1. **Host side**: tokenizer and chat template, word embeddings (and PLE inputs), greedy argmax,
   the softcap only when sampling needs probabilities.
2. **Device side**: a prefill graph per prompt-length bucket and one decode graph, both with
   static shapes and explicit K/V buffers that live on the device between calls.
3. **Checks**: the device's tokens against transformers' greedy output on the host in fp32
   (SEQ_MATCH), and the answer against what a sensible answer contains (coherence).

The device graph is written once, wraps transformers' own modules, and is compiled by whichever
compiler the machine has: AOTInductor on a CPU, the Neuron compiler on inf2. Re-implementing the
decoder by hand would make the port drift from the reference it is checked against.

## Memory decides the hardware

bf16 weights per NeuronCore at each variant's TP degree, against the 16 GiB a core has. E2B's
hatched part is the PLE table, which stays on the host.
"""),
        code("""
plots.memory_budget(nb.memory_rows())
"""),
        md("""
## The recipe escalates with the model

Each step was forced by a model that the previous step could not carry:

1. `torch_neuronx.trace` of the real forward on one core (E2B): proves PLE and KV sharing
   compile at all.
2. Hand-driven tensor parallelism with aliased on-device K/V and a CPU-seeded prefill (the field
   report's E4B): two cores. Its per-rank tracer ran out of memory at 31B and is unsupported since
   SDK 2.27, so this cookbook teaches it on CPU and compiles E4B with step 3 on inf2.
3. NxD `ModelBuilder` (E4B, 12B, 31B, 26B-A4B): compile one rank, shard the weights per rank. This
   is what carries the 31B at TP=8 and, with static experts and a runtime rank, the MoE.
"""),
        code("""
nb.recipe_table()
"""),
        md("""
## The last run

The newest record of each variant in `results_dir`: the checks, and the benchmark figures. In
the smoke profile these are tiny models on a CPU; the bar colour says whether every check passed.
"""),
        code("""
results = nb.load_results(results_dir)
nb.results_table(results)
"""),
        code("""
plots.checks_grid(results)
"""),
        code("""
plots.family_metrics(results)
"""),
        md("""
## Why equality is not enough

SEQ_MATCH compares the device with a reference that runs the same input through the same
weights. Anything wrong *before* that point (the prompt, the embedding scale, the PLE wiring)
is wrong in both, and they still agree. The field report met this in every port; the 31B's
version was a chat prompt written by hand in Gemma 3's format. Here it is on a tiny model, with
the graphs run eagerly (no compile) so the cell is quick: the correct template and the
hand-built one both pass SEQ_MATCH, and only the coherence check tells them apart.
"""),
        code("""
demo = PortSettings(variant=demo_variant, backend="eager", prompt=prompt, expect=expect, max_new_tokens=16)
demo_model = load_model(demo)
demo_graphs = compile_graphs(demo_model, demo)
equality_demo = nb.equality_is_not_enough(demo_model, demo_graphs.runtime, demo)
equality_demo
"""),
        md("""
The overview records what it showed, so a headless run keeps it with the variant records.
"""),
        code("""
overview = {"notebook": "00_overview", "kind": "overview", "profile": profile,
            "variants_found": sorted(results), "equality_demo": equality_demo.to_dict()}
nb.save_record(results_path, overview)
overview["variants_found"]
"""),
        md("""
## Four things to keep

1. Trace the real forward. What breaks vendor graph builders (KV sharing, routing) often traces
   as ordinary data flow.
2. Let the recipe grow with the model, and move to compile-one-rank before the all-ranks
   approach runs out of memory.
3. "Effective" and "active" sizes describe compute. Memory has to hold everything.
4. Equal to the reference is necessary and not sufficient: always check the answer too.
"""),
    ]


# ---- writing ----------------------------------------------------------------------------------


def build(name: str | None):
    nb = new_notebook(cells=overview_cells() if name is None else variant_notebook(name))
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": dict(LANGUAGE_INFO)}
    stem = "00_overview" if name is None else notebook_file(name)[:-6]
    for i, cell in enumerate(nb.cells):
        cell.id = f"{stem.replace('_', '-')}-{i:02d}"
    nbformat.validate(nb)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + ("" if nbformat.writes(nb).endswith("\n") else "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for file, name in NOTEBOOKS.items():
        text = render(build(name))
        path = HERE / file
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(file)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print("out of date (run python notebooks/build_notebooks.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
