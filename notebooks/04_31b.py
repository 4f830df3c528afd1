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
# # Gemma-4 31B: the dense giant, eight cores, and KV heads that must be copied
#
# The 31B is a plain dense decoder that happens to need eight NeuronCores. The two things to see
# here are why the recipe had to change to `ModelBuilder` at this size, and what TP=8 does to its
# four global KV heads. Its notebook also replays the field report's 31B bug: a chat prompt that
# both the device and the reference processed identically, and wrongly.
#
# ### Runs on
#
# | | `full` profile (inf2) | `smoke` profile (any CPU) |
# |---|---|---|
# | machine | `inf2.24xlarge`: 6 Inferentia2 chip(s), 12 NeuronCores, 192 GiB HBM, 4,920 GiB/s | any x86-64 or arm64 machine; two shared cores are enough |
# | TP degree | 8 (model_builder recipe) | 1 for the port; a CPU run with one process per rank shows TP |
# | memory per core (computed, `python -m gemma4lib doctor`) | 7.2 GiB bf16 weights + 0.14 GiB K/V at 2,048 tokens + 2 GiB working allowance (unverified on inf2) = 9.3 of 16 GiB HBM | a few MB |
# | host RAM for the compile | 384 GiB on the instance; ~184 GB estimated (3 x text weights (module + checkpoint + shards)); the field report's compile peaked at 182 GB of host RAM | under 2 GiB |
# | software | Deep Learning AMI Neuron (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0, AOTInductor as the compiler |
# | model | `google/gemma-4-31B-it` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: k_eq_v, 16 Q / 8 sliding / 2 global KV heads (6 layers) |

# %% [markdown]
# ## Parameters
#
# The next cell is the notebook's only input. It is tagged `parameters`, so
# [papermill](https://papermill.readthedocs.io) can replace any value from the command line; its
# defaults run the `smoke` profile on this machine's CPU. On an `inf2.24xlarge` with the Neuron SDK,
# the same notebook runs the real model:
#
# ```
# mkdir -p runs
# GEMMA4LIB_CACHE=$PWD/.cache/gemma4lib papermill notebooks/04_31b.ipynb runs/04_31b.ipynb --cwd notebooks \
#     -y "{profile: full, backend: neuron, tp_degree: 8,
#     checkpoint: google/gemma-4-31B-it, context_length: 1024, prefill_buckets: [128], tp_demo: 0}"
# ```
#
# Run it from the repository root and it writes only inside the repository, in gitignored folders:
# the executed notebook in `runs/`, the run record at `results_path` (`runs/notebooks/`, relative to
# `--cwd notebooks`, the folder the notebook runs in), and the compiled graphs in `.cache/gemma4lib`
# (without `GEMMA4LIB_CACHE` they go to `~/.cache/gemma4lib`).
#
# `python -m papermill_runs run --profile full` does the same for every notebook (the full profile's
# values live in `papermill_runs/profiles.json`). The Hugging Face token is read from `HF_TOKEN`
# in the environment; it is never a parameter, so it never lands in an executed notebook.

# %% tags=["parameters"]
variant = "31b"
profile = "smoke"  # "smoke": tiny model on CPU; "full": the real checkpoint on inf2
model = "auto"  # smoke: the tiny trained fixture; "random" for equality-only runs
checkpoint = None  # full: a hub id or local folder, e.g. "google/gemma-4-31B-it"
backend = "cpu"  # full: "neuron"
tp_degree = 1  # full: 8
weights = "bf16"  # "bf16"/"fp32": full precision; "int8": weight-only int8 linears and experts
prompt = "What is the capital of France?"
expect = "Paris"  # coherence: the answer must contain this
max_new_tokens = 32
context_length = 128  # the compiled K/V length
prefill_buckets = [64]  # compiled prompt lengths
ring_kv = True  # sliding layers keep only their window of K/V (a ring); False: full-length buffers
warmup = 1
iters = 3
threads = 1  # torch threads for the benchmark (recorded with it)
tp_demo = 4  # ranks in the CPU tensor-parallel demonstration (0: skip)
results_path = "../runs/notebooks/31b.json"
interactive = False  # True: show the chat box at the end (needs a live Jupyter front end)

# %% [markdown]
# ## Setup
#
# One thread for torch: the benchmark figures are recorded with their thread count, and on a
# shared machine more threads mostly measure the neighbours. `demos` collects what the
# demonstration cells find; it is saved in the run's record next to the metrics.

# %%
import time

import torch

from IPython.display import display

from gemma4lib import checks, notebook as nb
from gemma4lib.notebook import plots
from gemma4lib.device.build import PREFILL_EXPERTS
from gemma4lib.timing import benchmark
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.port import PortSettings, compile_graphs, eos_ids, load_model, prompt_ids
from gemma4lib.reference import logits_spread, reference_greedy, teacher_forced_logits

torch.set_num_threads(threads)
started = time.perf_counter()
demos = {}

# %% [markdown]
# `PortSettings` gathers every value a port depends on and checks them before anything is loaded:
# an unknown variant, profile or backend, or a TP degree whose heads do not split evenly, fails
# here with a message that says what to pick instead, not thirty minutes into a compile.

# %%
s = PortSettings(
    variant=variant,
    profile=profile,
    model=model,
    checkpoint=checkpoint,
    backend=backend,
    tp_degree=tp_degree,
    weights=weights,
    prompt=prompt,
    expect=expect,
    max_new_tokens=max_new_tokens,
    context_length=context_length,
    prefill_buckets=tuple(prefill_buckets),
    ring_kv=ring_kv,
    warmup=warmup,
    iters=iters,
)
nb.show_settings(s)

# %% [markdown]
# ## 1. Load the model
#
# The released checkpoint is a multimodal `*ForConditionalGeneration`. The port needs only its
# text decoder and the tied LM head, so the loader keeps `model.language_model` as a
# `*ForCausalLM`. That one module plays two roles from here on: it is the **reference**
# (transformers' own forward, run on the host in fp32) and the **source of the weights** that the
# device graph is built from. In the smoke profile it is the tiny trained fixture: same
# architecture, a few MB, trained on a small synthetic chat corpus so that it really answers the
# question.

# %%
model = load_model(s)
nb.describe_model(model)

# %% [markdown]
# The prompt goes through the tokenizer's own chat template. Gemma-4 marks turns with
# `<|turn>` and `<turn|>` (ids 105 and 106); a template written by hand is the classic way to
# feed the model a prompt it was never trained on.

# %%
ids = prompt_ids(model, s)
nb.show_prompt(model, ids)

# %% [markdown]
# ### The host side: embeddings looked up before the device
#
# The device never sees token ids. The host looks them up in transformers' own tables and hands the
# graph the result: `embed_tokens` is Gemma's scaled embedding (it multiplies by √hidden inside, so
# nothing is left to forget), and on the E models `get_per_layer_inputs` gives the per-layer
# embeddings (PLE), `[batch, tokens, layers, ple_dim]`. transformers' forward accepts both as
# `inputs_embeds=` and `per_layer_inputs=`. Keeping the lookups on the host keeps the 262,144-row
# tables off the device, where they would take memory and bandwidth for a few rows read per token.

# %%
prompt_tensor = torch.tensor([ids])
text_model = model.text_model  # transformers' Gemma-4 text model: embedding tables, layers, final norm
has_ple = getattr(text_model, "embed_tokens_per_layer", None) is not None
with torch.no_grad():
    inputs_embeds = text_model.embed_tokens(prompt_tensor)  # [1, tokens, hidden], already × √hidden
    per_layer_inputs = text_model.get_per_layer_inputs(prompt_tensor) if has_ple else None
{
    "inputs_embeds": tuple(inputs_embeds.shape),
    "per_layer_inputs": None if per_layer_inputs is None else tuple(per_layer_inputs.shape),
}

# %% [markdown]
# ## What makes the 31B different
#
# Architecturally it is the simplest of the five: no PLE, no KV sharing, no experts. The hard part
# is size. About 61 GB of bf16 weights do not fit fewer than eight 16 GiB cores with room for K/V,
# so the 31B needs an `inf2.24xlarge` and TP=8. The hand-driven TP recipe that carried E4B builds
# every rank in one process; at this size it ran out of memory (and serialising it deadlocked).
# NxD `ModelBuilder` compiles one rank and shards the weights per rank, which is what scales.

# %%
nb.tp_fit("31b")

# %% [markdown]
# ### KV heads under TP=8: replicated, not sharded
#
# The sliding layers have 16 KV heads: two per rank, a clean split. The 10 full-attention layers
# have only 4 KV heads for 32 Q heads (8 Q heads per KV head). At TP=8 each rank owns 4 Q heads,
# all of which read the same KV head (Q head `q` reads KV head `q // 8`), so rank `r` keeps a copy
# of KV head `r // 2`: every global KV head lives on two ranks. The table works it out from the
# released config.

# %%
# The arithmetic, from the released config: rank r owns Q heads r*q_per_rank .. (r+1)*q_per_rank - 1,
# and Q head q reads KV head q // q_per_kv. Whatever KV heads those are, rank r must hold.
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
# The tiny 31B keeps the proportions (16 Q heads; 8 sliding and 2 global KV heads), so at TP=4 its
# global heads must be replicated as well:

# %%
nb.kv_heads_under_tp("31b", tp_demo or 4, config=model.config)

# %% [markdown]
# And run, one process per rank, each rank holding only its shard and its copies of the global KV
# heads:

# %%
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo)
    display(demos["tp_cpu"])

# %% [markdown]
# ## 2. Build the device graph
#
# The device graph is transformers' own decoder forward with three things changed: the K/V cache
# is a set of explicit, fixed-size buffers written at a position that arrives as a tensor (so one
# compiled decode graph serves every step), the attention masks are built from that position and
# passed in, and the embedding tables stay outside (their lookups happen on the host). The final
# logit softcap is left off: `30·tanh(x/30)` is monotonic, so greedy argmax does not need it.
#
# Without the explicit buffers the stock static cache branches on a Python integer, and the graph
# would be valid for a single position only.

# %%
# One prefill graph per compiled prompt length (bucket) and one decode graph (one token), all
# wrapping the model's own modules: nothing is copied, the compiled program gets the weights at load.
prefill = {
    bucket: DeviceGraph(
        model.text_model,
        model.lm_head,
        model.layout,  # which layers own a K/V buffer, with how many heads and what head_dim
        GraphShape(batch=1, tokens=bucket, context_length=s.context_length, ring=s.ring_kv),
        expert_form=PREFILL_EXPERTS,  # MoE only: prefill computes every expert
        weights=s.weights,  # "int8": the linears held as int8 with per-channel scales
    )
    for bucket in s.prefill_buckets
}
decode = DeviceGraph(
    model.text_model,
    model.lm_head,
    model.layout,
    GraphShape(batch=1, tokens=1, context_length=s.context_length, ring=s.ring_kv),
    expert_form=s.decode_experts,
    weights=s.weights,
)
example = decode.example_inputs()  # what a compiler traces with
print("decode graph inputs:", [tuple(t.shape) for t in example])
nb.describe_graphs(prefill, decode)

# %% [markdown]
# ## 3. Compile
#
# In the smoke profile the compiler is PyTorch's own: `torch.export` (non-strict: strict mode
# silently drops the in-place K/V updates) and AOTInductor, which writes a loadable package per
# graph. The packages go into an artifact cache keyed by everything that changes the program, so
# a second run loads them in a second instead of compiling again.
#
# On inf2 this variant goes through NxD `ModelBuilder`: one rank is compiled, the weights are
# sharded per rank from a checkpoint loader, the rank number is a runtime tensor, and the decode
# graph is the priority model whose weight layout the compiler optimises.
#
# The first cell below shows the CPU compiler's three steps as the library runs them:
# `export_graph` (non-strict `torch.export`), `package_program` (AOTInductor compiles the program
# and writes a `.pt2` package, only on a cache miss) and `load_package` (loads it and hands it the
# weights, which the package does not hold). The second shows the inf2 recipe's own lines, marked
# `# inf2-only` where they need the Neuron SDK; on a CPU it only builds what the compiler would
# receive. Both are copies of the library's functions that a test keeps equal to them. The third
# compiles with whichever the `backend` parameter picks.
#
# The compiled packages and NEFFs go to `~/.cache/gemma4lib` by default, shared by every notebook and
# run on the machine; set `GEMMA4LIB_CACHE` (before starting Jupyter or papermill) to keep them
# elsewhere, for example inside the repository's gitignored `.cache/` folder.

# %%
# The CPU compiler. These functions are gemma4lib.backends.compile_cpu's own lines, copied here to be read
# (tests/test_notebooks.py fails if a copy and the library differ):
# library: gemma4lib.backends.compile_cpu
import torch

from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, load_weights


def export_graph(graph):
    with torch.no_grad():
        return torch.export.export(graph, graph.example_inputs(), strict=False)


def package_program(program, package_path, options):
    return torch._inductor.aoti_compile_and_package(program, package_path=package_path, inductor_configs=options)


def load_package(package_path, graph):
    runner = torch._inductor.aoti_load_package(package_path)
    load_weights(runner, graph)
    return runner


if backend == "cpu":  # what AOTInductor receives, and what the artifact cache is keyed by (a few seconds)
    program = export_graph(decode)
    kv_writes = [n for n in program.graph.nodes if n.op == "call_function" and "copy_" in str(n.target)]
    print(f"exported decode graph: {len(program.graph.nodes)} nodes, {len(kv_writes)} in-place K/V writes kept")
    print("AOTInductor options:", DEFAULT_COMPILER_OPTIONS)

# %%
# The inf2 compile, NxD ModelBuilder: gemma4lib.recipes.neuron_model_builder's own lines (a test keeps
# the copies equal). Defining them runs anywhere; the lines marked inf2-only need the Neuron SDK.
# library: gemma4lib.recipes.neuron_model_builder
import json
from pathlib import Path

import torch

from gemma4lib.recipes import neuron_env
from gemma4lib.recipes.common import graph_example_inputs
from gemma4lib.recipes.neuron_model_builder import (
    PRIORITY,
    PURPOSE,
    RECIPE,
    SHARD_FILE,
    _instance_class,
    bucket_expert_forms,
    bucket_shapes,
    nxd_checkpoint,
)
from gemma4lib.tp.plan import make_plan


def compile_model_builder(
    loaded,
    tp,
    out_dir,
    *,
    context_length,
    prefill_len,
    ring=False,
    dtype=torch.bfloat16,
    compiler_workdir=None,
    decode_experts="dense",
    expert_split=None,
    weights="bf16",
):
    model_builder, GraphInstance = _instance_class()
    forms = bucket_expert_forms(decode_experts)
    plan = make_plan(loaded.config, tp, loaded.variant, expert_split=expert_split)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(compiler_workdir or out / "compiler_workdir")  # ModelBuilder.trace() wipes it: never share
    checkpoint = nxd_checkpoint(loaded, plan, dtype, weights)
    # The builder's constructor and `add` are inf2-only too; tests drive them through a recording fake.
    builder = model_builder.ModelBuilder(  # inf2-only
        router=None, tp_degree=tp, checkpoint_loader=lambda: dict(checkpoint), compiler_workdir=str(workdir)
    )
    for key, shape in bucket_shapes(context_length, prefill_len, ring).items():
        builder.add(  # inf2-only
            key=key,
            model_instance=GraphInstance(loaded.config, plan, shape, dtype, forms[key], weights),
            example_inputs=[graph_example_inputs(loaded.config, shape, dtype)],
            compiler_args=neuron_env.COMPILER_ARGS[shape.phase],
            priority_model_idx=PRIORITY[key],
        )
    traced = builder.trace(initialize_model_weights=False)  # inf2-only
    torch.jit.save(traced, str(out / "model.pt"))  # inf2-only
    builder.shard_checkpoint(serialize_path=str(out / "weights"))  # inf2-only
    manifest = {
        "recipe": RECIPE,
        "variant": loaded.variant.name,
        "tp": tp,
        "context_length": context_length,
        "prefill_len": prefill_len,
        "ring": ring,
        "dtype": str(dtype),
        "expert_forms": forms,
        "expert_split": plan.expert_split,
        "weights": weights,
        "plan": plan.describe(),
        "compiler_args": neuron_env.COMPILER_ARGS,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def load_model_builder(out_dir, tp=None, start_rank=0):
    neuron_env.require("torch_neuronx", PURPOSE)
    neuron_env.require("neuronx_distributed", PURPOSE)
    from safetensors.torch import load_file

    out = Path(out_dir)
    tp = tp or json.loads((out / "manifest.json").read_text())["tp"]
    traced = torch.jit.load(str(out / "model.pt"))  # inf2-only
    weights = [load_file(str(out / "weights" / SHARD_FILE.format(rank=r))) for r in range(start_rank, start_rank + tp)]
    traced.nxd_model.initialize(weights, torch.tensor([start_rank], dtype=torch.int32))  # inf2-only
    return traced


# The two keys ModelBuilder compiles (decode first: it is the priority model whose weight layout
# the compiler optimises), and each key's expert form; shown here without compiling.
{
    key: (shape, bucket_expert_forms(s.decode_experts)[key])
    for key, shape in bucket_shapes(s.context_length, max(s.prefill_buckets), s.ring_kv).items()
}

# %%
if backend == "neuron":
    # inf2: compile_model_builder and load_model_builder above; the artifact is cached like the CPU packages,
    # then wrapped in the same host runtime.
    # Neuron builds its own graph form (K/V as aliased parameters) from the model.
    compiled = compile_graphs(model, s, progress=True)
elif tp_degree == 1:
    # CPU: the graphs built above; export_graph -> package_program (only on a cache miss) -> load_package
    # for each, then the host runtime over the compiled steps and one shared set of K/V buffers.
    compiled = compile_graphs(model, s, graphs=(prefill, decode), progress=True)
else:
    compiled = compile_graphs(model, s, progress=True)  # CPU at TP > 1: one process per rank (gloo)
nb.describe_compile(compiled)

# %% [markdown]
# ## 4. Generate on the device
#
# This is the whole serving loop. The host embeds the prompt and runs the smallest prefill graph
# that holds it: one call fills the K/V buffers for every prompt position and returns the logits of
# the last one. Then the decode graph runs once per new token, at the next position, until
# `<eos>`/`<turn|>` or `max_new_tokens`. The position and the prompt length are tensors, not Python
# numbers: that is what lets one compiled decode graph serve every step. The raw logits of every
# step are kept for the logit check. `runtime.generate` (used by the benchmark and the chat box) is
# this loop with timing and sampling added.

# %%
runtime, eos = compiled.runtime, eos_ids(model)
bucket = runtime.check_fits(ids, s.max_new_tokens)  # the smallest compiled prompt length that holds the prompt
one = torch.tensor([1])
tokens, step_logits = [], []
with torch.no_grad():
    # prefill: the whole prompt at once, zero-padded to the bucket; writes K/V at positions 0..n-1
    inputs = runtime.embed(torch.tensor([ids]), pad_to=bucket)  # [inputs_embeds(, per_layer_inputs)]
    logits = runtime.prefill[bucket](*inputs, torch.tensor([0]), torch.tensor([len(ids)]), *runtime.kv)[0]
    while True:
        step_logits.append(logits.float().clone())  # kept for LOGITS_MATCH
        tokens.append(int(logits.argmax()))  # greedy: the softcap is monotonic, argmax does not need it
        if len(tokens) == s.max_new_tokens or tokens[-1] in eos:
            break
        # decode: the last token at the next position; the graph writes its K/V into the buffers
        position = torch.tensor([len(ids) + len(tokens) - 1])
        logits = runtime.decode(*runtime.embed(torch.tensor([[tokens[-1]]])), position, one, *runtime.kv)[0]
step_logits = torch.stack(step_logits)
nb.answer_text(model, tokens)

# %% [markdown]
# ## 5. The reference
#
# The same prompt through transformers' `generate` on the host in fp32, greedy, same stop tokens.

# %%
reference = reference_greedy(model.lm, ids, s.max_new_tokens, eos_ids(model))
nb.answer_text(model, reference)

# %% [markdown]
# ## 6. SEQ_MATCH, LOGITS_MATCH and coherence, side by side
#
# Three checks, because none implies the others. **SEQ_MATCH** (the device's tokens equal the
# reference's, one for one) shows the compiled graph is faithful to transformers' forward, as far
# as tokens can show it: this model answers with margins of several logits, so an error of 0.1 in
# every logit leaves every token alone. **LOGITS_MATCH** compares the device's logits at every
# generated position, prefill and each decode step, with the reference's logits for the same
# tokens (one forward over prompt + device tokens), within a tolerance taken from the reference's
# own rounding on that sequence: 8 × the largest difference between the reference and a float64
# copy of itself, never below 1e-5. **Coherence** (the answer contains "Paris") shows that what
# both of them computed is right. A fault upstream of both, like a mangled chat prompt or wrong PLE
# inputs, passes both equality checks and fails only the last.

# %%
# LOGITS_MATCH: the reference's logits for the very tokens the device chose (one teacher-forced
# forward over prompt + device tokens), and how far the reference moves when run in float64.
ref_logits = teacher_forced_logits(model.lm, ids, tokens)
spread, precise = logits_spread(model.lm, ids, tokens, ref_logits)
cap = model.config.final_logit_softcapping  # the graph leaves it off; the comparison applies it
logits_check = checks.compare_logits(step_logits, ref_logits, spread, cap, len(ids), precise)
# coherence: the answer must contain `expect` (only a model with a tokenizer has an answer to read)
coherence = checks.expect_substring(s.expect) if s.expect and model.tokenizer is not None else None
answer, reference_answer = checks.answer_text(model.tokenizer, tokens), checks.answer_text(model.tokenizer, reference)
report = checks.run_checks(tokens, reference, answer, reference_answer, coherence, logits_check)  # + SEQ_MATCH
print(f"SEQ_MATCH {report.seq_match}  LOGITS_MATCH {report.logits_match}  coherent {report.coherent}")
print(logits_check.explain())
nb.side_by_side(report, tokens, reference)

# %% [markdown]
# ### The witness
#
# The same compiled programs also run a seeded random-weights model of this architecture (the
# weights are handed to the compiled program at load time; the buffers the compiler folds in,
# such as `layer_scalar`, hold the same values in both tiny models). Random weights have near-ties
# where the trained model has margins of several logits, so any logit error turns into another
# token: the witness's SEQ_MATCH and LOGITS_MATCH are the sensitive checks, the trained model's
# coherence the meaningful one. It runs in the smoke profile.

# %%
witness = nb.run_witness(s, compiled) if s.wants_witness else None
nb.witness_table(witness)

# %% [markdown]
# ### The 31B's bug, replayed: SEQ_MATCH on nonsense
#
# In the field report a chat prompt for the 31B was written by hand in Gemma 3's format,
# `<start_of_turn>user ...`. Gemma-4 has no such token: the tokenizer splits each marker into
# ordinary pieces, the model reads noise, and answers noise. The device still matched the CPU
# reference token for token, because both processed the same wrong input. The compiled graphs
# from above run both prompts (the hand-built one is about three times longer, and still fits the
# 64-token prefill bucket):

# %%
demos["equality_is_not_enough"] = nb.equality_is_not_enough(model, compiled.runtime, s)
demos["equality_is_not_enough"]

# %% [markdown]
# ## 7. Benchmark
#
# Median prefill latency and decode throughput over `iters` full generations after `warmup`
# untimed ones.
#
# Batch-1 decode does almost no arithmetic per byte: every step reads each device weight and
# every K/V buffer once, so no implementation can beat *bandwidth ÷ bytes per step*. That ceiling
# is how to judge a decode figure. Here it is computed from this model's shapes and the forms it was
# compiled with (ring or full-length K/V, selective or dense experts), over the bandwidth of the
# machine that ran it: measured a moment ago on a CPU, the HBM of the cores in use on inf2. The
# right-hand column does the same for the released model on its inf2 instance, next to the field
# report's figure. A tiny model on a CPU sits far below its ceiling: its few MB of weights stay in
# cache and a fixed per-step cost dominates. Compare smoke figures with earlier smoke runs
# (papermill_runs does), never with inf2.

# %%
figures = benchmark(compiled.runtime, ids, s.max_new_tokens, s.warmup, s.iters)
ceiling = nb.measured_vs_ceiling(model, s, figures)
nb.bench_table(figures, s, ceiling)

# %% [markdown]
# ## 8. Record
#
# One JSON file per run: settings, the three checks (and the witness's), tokens, timings, the K/V
# layout, package versions, git commit and machine, plus what the demonstrations found. It is
# written atomically to `results_path`; `papermill_runs` collects these files and compares them
# with the baselines.

# %%
result = nb.record(
    s,
    model,
    ids,
    compiled,
    tokens,
    reference,
    report,
    figures,
    results_path,
    started,
    extra={"demos": demos, "roofline": ceiling},
    witness=witness,
)
nb.record_summary(result)

# %% [markdown]
# ## 9. Plots
#
# Token by token, device over reference (green where equal); every timed benchmark run; and
# decode against its ceiling, this run's and the released model's on inf2.

# %%
plots.token_match(result, model)

# %%
plots.bench_runs(result)

# %%
plots.measured_vs_ceiling([ceiling, ceiling["released_inf2"]])

# %% [markdown]
# ## 10. Chat (optional)
#
# With `interactive = True` and a live Jupyter front end this cell shows a text box that sends
# your question through the compiled graphs. Run headless (papermill, CI) it does nothing.
#
# In the smoke profile the model is the tiny trained fixture: it was trained on a few hundred short
# chats about capital cities and knows nothing else. Ask it for the capital of a country ("What is
# the capital of Japan?"); anything else gets a confident capital or nonsense back. That is the
# fixture's limit, not the port's: the full profile's real checkpoint answers like the released model.

# %%
if interactive:
    display(nb.chat(compiled.runtime, model, s))

# %% [markdown]
# ## Takeaways
#
# - Scale, not architecture, is the 31B's problem: eight cores, a long compile, a large host.
# - Reach for the compile-one-rank recipe (`ModelBuilder`) before the all-ranks-in-one-process one
#   runs out of memory.
# - Fewer KV heads than ranks means replication: each global KV head sits on two of eight ranks.
# - Build prompts with the tokenizer's chat template. `SEQ_MATCH True` on nonsense is the signature
#   of an input problem, and only the coherence check reports it.
#
# To run the real thing, see the parameters cell: `profile="full"`, `backend="neuron"`,
# `tp_degree=8`, and a checkpoint. Everything above runs unchanged.
