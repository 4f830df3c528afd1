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
# # Gemma-4 26B-A4B: a shared MLP beside 128 experts, made static
#
# The mixture-of-experts member: a dense MLP and 128 routed experts side by side in every layer.
# Its experts have to be made static before anything can trace them, its "4B active" does not
# shrink its memory, and its tensor-parallel form hid the family's most instructive bug: a rank
# read at trace time.
#
# ### Runs on
#
# | | `full` profile (inf2) | `smoke` profile (any CPU) |
# |---|---|---|
# | machine | `inf2.24xlarge`: 6 Inferentia2 chip(s), 12 NeuronCores, 192 GiB HBM, 4,920 GiB/s | any x86-64 or arm64 machine; two shared cores are enough |
# | TP degree | 8 (model_builder recipe) | 1 for the port; a CPU run with one process per rank shows TP |
# | memory per core (computed, `python -m gemma4lib doctor`) | 5.9 GiB bf16 weights + 0.04 GiB K/V at 2,048 tokens + 2 GiB working allowance (unverified on inf2) = 7.9 of 16 GiB HBM | a few MB |
# | host RAM for the compile | 384 GiB on the instance; ~151 GB estimated (3 x text weights (module + checkpoint + shards)); needs the same instance as the 31B although fewer parameters are active | under 2 GiB |
# | software | Deep Learning AMI Neuron (Ubuntu 24.04), venv `aws_neuronx_venv_pytorch_2_9_nxd_inference` (Python 3.12), Neuron SDK 2.28: torch-neuronx 2.9.0.2.12.22436, neuronx-cc 2.23.6484.0, neuronx-distributed 0.17.26814, libneuronxla 2.2.15515.0; + transformers 5.23.0 | torch 2.13 (CPU), transformers 5.23.0, AOTInductor as the compiler |
# | model | `google/gemma-4-26B-A4B-it` (bf16, gated: `HF_TOKEN` from the environment) | a tiny trained model of the same architecture: MoE with the parallel dense MLP, 16 experts top-4 (6 layers) |

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
# GEMMA4LIB_CACHE=$PWD/.cache/gemma4lib papermill notebooks/05_26b_a4b.ipynb runs/05_26b_a4b.ipynb --cwd notebooks \
#     -y "{profile: full, backend: neuron, tp_degree: 8,
#     checkpoint: google/gemma-4-26B-A4B-it, context_length: 1024, prefill_buckets: [128], tp_demo: 0}"
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
variant = "26b-a4b"
profile = "smoke"  # "smoke": tiny model on CPU; "full": the real checkpoint on inf2
model = "auto"  # smoke: the tiny trained fixture; "random" for equality-only runs
checkpoint = None  # full: a hub id or local folder, e.g. "google/gemma-4-26B-A4B-it"
backend = "cpu"  # full: "neuron"
tp_degree = 1  # full: 8
weights = "bf16"  # "bf16"/"fp32": full precision; "int8": weight-only int8 linears and experts
prompt = "What is the capital of France?"
expect = "Paris"  # coherence: the answer must contain this
max_new_tokens = 32
context_length = 128  # the compiled K/V length
prefill_buckets = [64]  # compiled prompt lengths
ring_kv = True  # sliding layers keep only their window of K/V (a ring); False: full-length buffers
decode_experts = "selective"  # MoE decode: "selective" (the k routed experts) or "dense" (all)
warmup = 1
iters = 3
threads = 1  # torch threads for the benchmark (recorded with it)
tp_demo = 2  # ranks in the CPU tensor-parallel demonstration (0: skip)
results_path = "../runs/notebooks/26b-a4b.json"
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
    decode_experts=decode_experts,
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
# ## What makes the 26B-A4B different
#
# ### A shared MLP beside the experts
#
# Each layer runs a dense MLP and a mixture of experts **in parallel** on the same residual input,
# each with its own norms, and adds the results. The router normalises the hidden state, scales it,
# projects it to one logit per expert, takes a softmax over all experts, keeps the top-k,
# renormalises them and multiplies by a learnt per-expert scale.

# %%
nb.moe_report(model)

# %% [markdown]
# The router, line by line, on one token of the tiny model (the last prompt token's embedding stands
# in for the residual a layer would pass it). The cell repeats transformers' arithmetic and checks
# that it picked the same experts with the same weights as the model's own router module.

# %%
layer = next(lay for lay in model.text_model.layers if getattr(lay, "router", None) is not None)
router, k = layer.router, model.config.top_k_experts
with torch.no_grad():
    h = inputs_embeds[0, -1:]  # [1, hidden]
    x = router.norm(h) * router.scale * router.scalar_root_size  # RMSNorm, learnt scale, × hidden^-0.5
    probs = torch.softmax(router.proj(x), dim=-1, dtype=torch.float32)  # one probability per expert
    weights, chosen = torch.topk(probs, k=k, dim=-1)  # keep the k best
    weights = weights / weights.sum(dim=-1, keepdim=True) * router.per_expert_scale[chosen]  # renormalise, scale
    _, their_weights, their_chosen = router(h)
assert torch.equal(chosen, their_chosen) and torch.allclose(weights, their_weights)
shown = ", ".join(f"{w:.3f}" for w in weights[0].tolist())
print(f"{model.config.num_experts} experts, top-{k}: chosen {chosen[0].tolist()}, weights {shown}")

# %% [markdown]
# ### Static experts
#
# transformers' eager expert loop visits only the experts a batch happens to route to: a
# data-dependent Python loop that a tracer records for one routing and silently replays for every
# other. The port swaps in a static form: **dense** (every expert on every token, outputs weighted
# by the routed weights, zero for the rest; static shapes, and the expert dimension splits across
# ranks) or **selective** (gather the k routed experts' weights, then batched matmuls; reads only k
# experts per token). The cell runs one decode step both ways against transformers' reference:
# same token, logits equal to rounding.
#
# Decode gathers the top-k: one token needs 8 of the 128 experts, and bytes are the whole cost of a
# decode step. On the benchmark's MoE medium model (`python -m gemma4lib bench --suite cpu`, figures
# in `docs/ROOFLINE.md`) selective decode ran 2.8x faster than dense. Prefill stays dense: the
# gathered slices grow with tokens x k (a 128-token bucket of the real model gathers 1,024 slices, 8x
# the 128 experts dense reads once) and the dense form splits cleanly across ranks. On a CPU with a
# 16-token prompt selective prefill measured faster too, which is why the choice is per phase and
# measured, not a rule. `decode_experts` in the parameters cell switches decode back to dense.

# %%
demos["expert_forms"] = nb.expert_forms_on_a_token(model, ids, s.context_length, max(s.prefill_buckets))
demos["expert_forms"]

# %% [markdown]
# ### "A4B" saves compute, not memory
#
# About 4B parameters are active per token, but any token may route to any expert, so all 128
# experts (22.8B parameters) stay resident. The 26B-A4B needs the same `inf2.24xlarge` and TP=8 as
# the 31B. What top-8 routing can save is bandwidth, if decode reads only the routed experts (the
# selective form), and under TP that depends on how the experts are split over the 8 ranks. With 16
# whole experts per rank, static shapes make every rank gather 8 slices per token whether routed
# there or not: 64 of the 128 experts are read, a ceiling of ~126 tok/s on `inf2.24xlarge`. The TP
# plan instead gives every rank a 1/8 slice of *every* expert (704 / 8 = 88 intermediate columns:
# gate/up column-sharded and down row-sharded per expert, one all-reduce), so the 8 slices a rank
# gathers are exactly its share of the 8 routed experts: 8 experts' bytes per token over all ranks,
# a ceiling of ~446 tok/s (`docs/ROOFLINE.md`; a bound from bytes, not yet measured on inf2). Each
# rank holds 1/8 of the expert bytes either way.

# %%
# Where "7.6 GB per decode step" comes from: the released model's expert weights, one expert's share,
# and what a token reads when only its k routed experts are fetched next to every other weight.
real, v = s.variant_spec.real_config, s.variant_spec
sizes = nb.device_bytes(v)
experts_gb = real["experts_b"] * 2  # bf16: 2 bytes a parameter, billions of parameters -> GB
per_expert_gb = experts_gb / real["num_experts"]
other_gb = sizes["device_gb"] - experts_gb  # attention, the shared dense MLPs, norms, router: read every step
step_gb = other_gb + real["top_k_experts"] * per_expert_gb
print(f"experts {experts_gb:.1f} GB, one expert {per_expert_gb:.3f} GB, everything else {other_gb:.1f} GB")
print(
    f"a decode step reads {other_gb:.1f} + {real['top_k_experts']} x {per_expert_gb:.3f} = {step_gb:.2f} GB "
    f"(library: {sizes['decode_read_gb']:.2f} GB), not all {sizes['device_gb']:.1f} GB"
)

# %% [markdown]
# Under TP the split decides what is read. The cell asks the roofline for the bytes of one decode step
# at TP=8 on `inf2.24xlarge` (2,048 context, ring K/V, selective experts) for both ways of sharing the
# experts. With whole experts per rank, each of the 8 ranks gathers k = 8 expert slices from its own
# 16 experts whatever the router chose (static shapes), so 64 experts' worth of bytes are read per
# token: the old figure of about 27,880 MB per step. With a slice of every expert per rank, the 8
# slices a rank gathers are its 1/8 of the 8 routed experts, and the whole step reads about what one
# device would: about 7,900 MB (7.65 GB of weights + the K/V).

# %%
from gemma4lib.inf2.roofline import compare

for split in ("experts", "intermediate"):
    row = compare(
        None,
        v.name,
        device=v.instance_type,
        cores=v.tp_degree,
        context_length=2048,
        ring=True,
        experts="selective",
        expert_split=split,
    )
    print(
        f"{split:>12} split: {row['bytes_per_step']['total'] / 1e6:>9,.0f} MB per step, "
        f"ceiling {row['ceiling_tok_s']:,.0f} tok/s on {v.instance_type}"
    )

# %%
nb.tp_fit("26b-a4b")

# %%
nb.kv_heads_under_tp("26b-a4b", 8)

# %% [markdown]
# ### The rank must be a runtime value
#
# When each rank holds whole experts (the field report's form, still available as
# `expert_split="experts"`), it must pick the matching columns of the routing weights. In the field
# report that slice was chosen with a rank read while tracing: a Python integer, baked into the
# single-rank `ModelBuilder` trace as 0, so every rank weighted its experts with rank 0's routing
# weights. Device output was empty while the CPU and the unit tests were fine. In that form the
# library reads the rank from an int32 tensor that each rank loads with its weights; in the default
# form (a slice of every expert per rank) the expert math never reads the rank at all. The cell runs
# the sharded model (default form) and the baked-rank bug (whole experts per rank) on CPU:
#
# First the bug on its own, in a few lines of torch. Each rank of a whole-experts split keeps the
# routing weights of its own experts: columns `rank * E/ranks` onward. Read the rank as a Python
# number while tracing (`int(rank)`) and the tracer records the number it saw, rank 0, as a constant
# (it warns, once, and carries on); keep it a tensor and the slice stays part of the program.

# %%
import warnings

ranks, n_experts = tp_demo or 2, model.config.num_experts
per_rank = n_experts // ranks
routing = torch.arange(2.0 * n_experts).reshape(2, n_experts)  # two tokens' weights, one column per expert


def my_columns_baked(weights, rank):  # the field report's form: the rank becomes a Python int
    start = int(rank) * per_rank
    return weights[:, start : start + per_rank]


def my_columns_runtime(weights, rank):  # the rank stays data: one program serves every rank
    return weights.index_select(-1, rank * per_rank + torch.arange(per_rank))


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    traced = {
        f.__name__: torch.jit.trace(f, (routing, torch.tensor(0))) for f in (my_columns_baked, my_columns_runtime)
    }
last = torch.tensor(ranks - 1)
for name, program in traced.items():
    right = torch.equal(program(routing, last), routing[:, (ranks - 1) * per_rank : ranks * per_rank])
    got = "its own experts' weights" if right else "rank 0's experts' weights, baked in"
    print(f"{name}: traced at rank 0, run as rank {ranks - 1}: {got}")
tracer_warnings = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
print(f"{len(tracer_warnings)} tracer warning(s), all from my_columns_baked: {tracer_warnings[0].message}")

# %%
if tp_demo:
    demos["tp_cpu"] = nb.tp_demo(model, ids, s, tp_demo, with_baked_rank=True)
    display(demos["tp_cpu"])

# %% [markdown]
# ## 2. Build the device graph
#
# The device graph is transformers' own decoder forward with three things changed: the K/V cache
# is a set of explicit, fixed-size buffers written at a position that arrives as a tensor (so one
# compiled decode graph serves every step), the attention masks are built from that position and
# passed in, and the embedding tables stay outside (their lookups happen on the host). The final
# logit softcap is left off: `30·tanh(x/30)` is monotonic, so greedy argmax does not need it. The
# experts are swapped for a static form here: prefill always computes all experts and masks them
# to the routed top-k; decode uses `decode_experts`.
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
# - The MoE block is a shared MLP plus routed experts; both run on every layer.
# - Replace the data-dependent expert loop with a static form; dense and selective agree with the
#   reference on every token.
# - All experts stay resident: "A4B" is a compute figure, not a memory one.
# - Anything rank-dependent inside a traced SPMD graph must come from a runtime tensor. A rank
#   read while tracing is the same constant on every rank.
#
# To run the real thing, see the parameters cell: `profile="full"`, `backend="neuron"`,
# `tp_degree=8`, and a checkpoint. Everything above runs unchanged.
