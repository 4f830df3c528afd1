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
# # 06 — Serving more: batches and drafting on E2B
#
# Single-row decode reads every weight on the device to make one token, so its speed is set by
# memory bandwidth, not by arithmetic. This notebook teaches the two ways of getting more tokens
# out of each read. **Batches**: B conversations in one step read the weights once for B tokens.
# **Drafting**: Gemma-4's own small assistant guesses k tokens, and the target checks all of them
# in one step, which again reads the weights once. You will build both from the same device-graph
# design as `01_e2b`, check every token they produce against transformers' own greedy output, and
# measure what a CPU can and cannot show about their speed. The inf2 figures are computed from
# shapes, each one marked as computed. The [field report](00_overview.ipynb#field-report)'s figures are the only ones measured on inf2.
#
# Read `01_e2b` first: this notebook reuses its device graph, compile steps and the three checks
# (SEQ_MATCH, LOGITS_MATCH, coherence), and explains only what is new.
#
# ### Runs on
#
# | | [`smoke`](00_overview.ipynb#smoke) profile (any CPU) | inf2 |
# |---|---|---|
# | machine | any x86-64 or arm64 machine; two shared cores are enough | `inf2.xlarge` for E2B (the field report's instance; this notebook's inf2 figures are computed, never run there) |
# | model | the tiny trained E2B ([PLE](00_overview.ipynb#ple) + [KV sharing](00_overview.ipynb#kv-sharing)) and its tiny trained assistant (distilled against the target here; shapes and training: `gemma4lib/fixtures/PROVENANCE.json`) | `google/gemma-4-E2B-it` and `google/gemma-4-e2b-it-assistant` |
# | batches | compiled with [AOTInductor](00_overview.ipynb#aotinductor), run and checked here | `port(PortSettings(variant="e2b", backend="neuron", batch_size=4))`: ModelBuilder with batched example inputs, written against SDK 2.28, **never run on inf2** |
# | drafting | compiled with AOTInductor, run and checked here | `port(PortSettings(variant="e2b", backend="neuron", draft="assistant", draft_tokens=4))`: ModelBuilder keys `prefill<bucket>`, `verify` and `draft` over one set of device K/V states (`recipes/neuron_drafting.py`), written against SDK 2.28 and driven here by recording fakes only, **never run on inf2**; the trace recipe refuses |
# | time | a few minutes with a warm compile cache, plus the compile of each graph the first time (each compile cell prints its time) | — |
# | software | torch 2.13 (CPU), transformers 5.23.0 | Neuron SDK 2.28 (see `01_e2b`) |
#
# So this notebook runs the smoke profile only. `python -m papermill_runs run --profile smoke`
# runs it after the variant notebooks, and the full profile leaves it out.

# %% [markdown]
# ## Parameters
#
# The next cell is the notebook's only input, tagged `parameters` for papermill. `batch_size`
# prompts go through the batched graphs. `sweep_batches` are the batch sizes the benchmark times.
# `draft_tokens` is k, the number of tokens the assistant guesses before each verify step.

# %% tags=["parameters"]
variant = "e2b"
profile = "smoke"  # this notebook runs the tiny models on a CPU only (see Runs on)
model = "auto"  # the tiny trained fixture and its trained assistant
batch_size = 4  # four capital questions in one batch, not all of the same length
prompt = "What is the capital of France?"  # the drafting prompt
expect = "Paris"
max_new_tokens = 32
context_length = 192  # 01_e2b's shapes: its compiled batch-1 graphs serve the drafting comparison
prefill_buckets = [128]
ring_kv = True
draft_tokens = 4  # k drafts per verify step
sweep_batches = [1, 2, 4, 8]  # the batch sizes the benchmark times
sweep_new_tokens = 16
warmup = 1
iters = 3
threads = 1
results_path = "../runs/notebooks/serving.json"

# %% [markdown]
# ## Setup
#
# Two sets of settings, because the two features compile different graphs. `batch` asks for
# `batch_size` rows: its `batch_rows()` are four different capital questions, each with the
# capital it must contain. `drafted` asks for the assistant with k drafts per step. Both are
# checked before anything is loaded: a draft with no draft tokens, or a batch with more prompts than rows,
# fails here and says what to change.

# %%
import time

import torch
from IPython.display import display
from tqdm.auto import tqdm

from gemma4lib import checks
from gemma4lab import notebook as nb
from gemma4lib.backends import compile_cpu
from gemma4lib.backends.base import DeviceRun
from gemma4lab.benchmarks.batch import bench_batch_model
from gemma4lib.cache.artifacts import ArtifactCache
from gemma4lib.device.build import PREFILL_EXPERTS, GraphSet, device_graphs
from gemma4lib.device.experts import CPU_THREAD_FLOP_PER_BYTE
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lab.inf2.batch_roofline import batch_ceilings
from gemma4lab.inf2.mtp_roofline import draft_table
from gemma4lib.generation.drafters import AssistantDrafter
from gemma4lib.models.assistant import load_assistant
from gemma4lab.notebook import plots_batch, plots_draft
from gemma4lib.port import PortSettings, PromptRow, compile_graphs, eos_ids, load_model, prompt_ids
from gemma4lib.port import row_records, run_witness
from gemma4lib.record import build_record
from gemma4lib.reference import hf_assisted, reference_greedy
from gemma4lib.runtime import Engine, Request, Steps, bind_kv, encode_prompt
from gemma4lib.timing import benchmark, time_interleaved

torch.set_num_threads(threads)
started = time.perf_counter()
common = dict(variant=variant, profile=profile, model=model, max_new_tokens=max_new_tokens, warmup=warmup, iters=iters)
common.update(context_length=context_length, prefill_buckets=tuple(prefill_buckets), ring_kv=ring_kv)
batch = PortSettings(**common, batch_size=batch_size)
drafted = PortSettings(**common, prompt=prompt, expect=expect, draft="assistant", draft_tokens=draft_tokens)
nb.show_settings(batch)

# %% [markdown]
# ## 1. Load the target
#
# The same tiny trained E2B as `01_e2b`, trained here on a small chat corpus about capital cities
# so that it really answers. Both features serve this one model: its weights, its tokenizer and
# chat template, and its K/V layout. The batch and the assistant both depend on that layout.

# %%
model = load_model(batch)
eos = eos_ids(model)
cache, options = ArtifactCache(batch.cache_dir), compile_cpu.DEFAULT_COMPILER_OPTIONS
display(nb.describe_model(model))

# %% [markdown]
# ## 2. Batches: one weight read, B tokens
#
# ### Why a batch helps decode
#
# One decode step multiplies each weight matrix by one vector: two FLOPs per weight, read once.
# An accelerator does hundreds of FLOPs in the time one weight byte arrives from memory, so the
# step waits on memory and the arithmetic units sit idle. The [ceiling](00_overview.ipynb#roofline) is **bandwidth ÷ bytes per
# step**. Feed B rows instead, and the same matrices multiply B vectors. Each weight is still read
# once, and the arithmetic grows B-fold into the idle units. Total tok/s then grows almost B-fold,
# until the step becomes compute bound. What grows with B is the K/V: every row has its own
# buffers, read every step.
#
# The table is E2B's ceiling on an inf2.xlarge core, computed from the released model's shapes.
# Beside it are the figures the field report's author measured in a batch sweep of their E2B port
# (the trace recipe, device prefill and decode): the table's last column (source: the field report's
# author, inf2.xlarge, quoted 2026-12-02). Its single-row figure is a separate run from the one the
# field report's table gives for E2B (the status box of `01_e2b`), so the two differ a little. They show a
# falling share of the computed ceilings as B grows: the measured gain is real, and per-call overhead
# takes a growing share of each step.

# %%
ceilings = batch_ceilings(variant, (1, 2, 4, 8, 16, 32))
nb.batch_ceilings_table(ceilings)

# %% [markdown]
# ### The batched device graphs
#
# The same `DeviceGraph` as `01_e2b`, built with `GraphShape(batch=B, ...)`. Three things change
# with B > 1, because the rows are different prompts, not all of the same length:
#
# - `start` and `length` become one value per row (`[B]` tensors). Prompts are **right-padded**
#   to the [bucket](00_overview.ipynb#bucket): row b's tokens sit at positions `0 .. length[b] - 1`, and the padding is never
#   written to K/V and never attended to.
# - The masks are built per row from its own position. Each row's logits come from its own last
#   real token. Without that, a short row would read its padding as if it were its last token.
# - Each row has its own slots in every K/V buffer, the sliding layers' rings included.
#
# One change is for this CPU only. From B=4 on, one CPU thread's small-M matrix products are
# bound by arithmetic, not by bytes, and run at a fifth of its GEMM rate (measured in `docs/ROOFLINE.md`, "where a decode step's time goes"). So a decode graph built
# with `compute_balance=CPU_THREAD_FLOP_PER_BYTE` (what `port` passes for the `cpu` and `eager`
# backends) swaps its large fp32 linears (`device.packed_linear`: the size threshold is there) for
# [oneDNN](00_overview.ipynb#onednn)'s packed layout; on a medium-width model that made B=8 faster (`docs/ROOFLINE.md` quotes the run).
# The tiny model's linears are far smaller and sit in the caches, where oneDNN's per-call cost
# outweighs the layout, so the cell below prints `plain`. Graphs for XLA and inf2 are built
# without a balance, because there bytes decide, and they never pack.
#
# It is the same `DeviceGraph` as `01_e2b`'s: one row is simply B = 1, one code path for every batch.

# %%
rows = batch.batch_rows()  # (prompt, expected capital) per row
row_ids = [encode_prompt(model.tokenizer, question) for question, _ in rows]
prefill = {
    bucket: DeviceGraph(
        model.text_model,
        model.lm_head,
        model.layout,
        GraphShape(batch=batch_size, tokens=bucket, context_length=context_length, ring=ring_kv),
        expert_form=PREFILL_EXPERTS,
    )
    for bucket in prefill_buckets
}
decode = DeviceGraph(
    model.text_model,
    model.lm_head,
    model.layout,
    GraphShape(batch=batch_size, tokens=1, context_length=context_length, ring=ring_kv),
    compute_balance=CPU_THREAD_FLOP_PER_BYTE,  # built for one CPU thread: packs large linears from B=4
)
print("batched decode graph inputs:", [tuple(t.shape) for t in decode.example_inputs()][:4], "+ K/V buffers")
print("linears:", decode.linear_form)  # "plain" here: the tiny model's weights are below the packing size
graphs = GraphSet(prefill, decode, model.layout)
nb.describe_graphs(graphs)

# %% [markdown]
# ### Compile
#
# These are the three calls from `01_e2b`, in a function because both features compile with them:
# `torch.export.export` (non-strict, which keeps the in-place K/V writes), AOTInductor
# (`aoti_compile_and_package`, called only on a cache miss), then `aoti_load_package` plus
# `compile_cpu.load_weights` (the package holds no weights). A batch of B is a different program:
# it has its own cache key and is compiled the first time (the cell prints how long it took).


# %%
def compile_package(graph):
    """Export, compile on a cache miss, load, hand over the weights: one graph's callable step."""
    began = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(graph, graph.example_inputs(), strict=False)
    entry = compile_cpu.cache_package(
        graph,
        program,
        cache,
        options,
        lambda program, path: torch._inductor.aoti_compile_and_package(  # options copied: AOTI adds keys
            program, package_path=path, inductor_configs=dict(options)
        ),
    )
    runner = torch._inductor.aoti_load_package(str(entry.file(compile_cpu.PACKAGE)))
    compile_cpu.load_weights(runner, graph)
    compile_s = 0.0 if entry.hit else time.perf_counter() - began
    return compile_cpu.CompiledStep(runner, entry, compile_s, 0.0, {"key": entry.key})


steps = {name: compile_package(graph) for name, graph in tqdm(graphs.named().items(), desc="compile")}
kv = decode.new_kv()  # one set of batched K/V buffers: [batch, kv heads, slots, head_dim] per producer layer
runtime = Engine.for_model(  # the one generation engine, now with batch_size rows
    model,
    Steps({b: bind_kv(steps[f"prefill{b}"], kv) for b in prefill}, bind_kv(steps["decode"], kv)),
    batch=batch_size,
    context_length=context_length,
)
batch_artifacts = {name: str(step.entry.path) for name, step in steps.items()}
print(
    {
        str(name): "cache hit" if step.cache_hit else f"compiled in {step.compile_s:.0f} s"
        for name, step in steps.items()
    }
)

# %% [markdown]
# ### Generate the batch
#
# The same engine as `01_e2b`, with more rows. `generate_rows` admits every request in its own row
# (one prefill call for all of them, each row's own `length`), then each step feeds one token per
# live row at that row's own position. A row that emits an end token (the model's eos ids: `<eos>` or `<turn|>`) is finished: its tokens stop
# there, and from then on it is idle (`length == 0`: it writes no K/V), so the others go on alone.
# A server uses the same calls one row at a time: `admit` a request into a free row between
# steps, `release` it when it ends. The per-step logits of every row are kept for LOGITS_MATCH.

# %%
requests = [Request(ids, max_new_tokens, eos_token_ids=tuple(eos)) for ids in row_ids]
generation = runtime.generate_rows(requests, keep_logits=True)
for (question, _), row in zip(rows, generation.rows, strict=True):
    print(f"{question!r:42} ({len(row.prompt_ids)} tokens) -> {nb.answer_text(model, row.tokens)!r}")

# %% [markdown]
# ### Each row against its own reference
#
# A batch is correct only when every row is what that prompt gives alone. Each row gets its own
# reference: transformers' greedy `generate` of that prompt by itself, on the host. Each row also
# gets its own three checks: SEQ_MATCH on the tokens, LOGITS_MATCH at every generated position,
# and coherence (the row's own capital). A bug in per-row positions or masks usually shows up in
# the shorter rows only. A long row can look perfect while a short one reads padding.
#
# The **[witness](00_overview.ipynb#witness)** runs seeded random weights through the same batched recipe, with the witness
# prompt in every row. It has near-ties where the trained model has wide margins, so a small
# logit error turns into a different token there. Whether it runs the very programs compiled
# above depends on the compiler: Inductor can fold a few tiny weights (such as q/k norms) into a
# program, depending on the graph and its shapes, and where the witness's folded values differ it
# compiles programs of its own, by the same calls. So the batched graphs here can answer differently
# from `01_e2b`'s single-row graphs of the same seed. The cell prints which happened, from the two runs' artifacts.

# %%
judged = []
for ids, (_, capital), row in zip(row_ids, rows, generation.rows, strict=True):
    reference = reference_greedy(model.lm, ids, max_new_tokens, eos)
    report = checks.evaluate(
        model.lm, model.tokenizer, ids, row.tokens, reference, expect=capital, step_logits=row.step_logits
    )
    judged.append((report, reference))
batch_device_run = DeviceRun(generation.rows, compile_cpu.RECIPE, sum(step.compile_s for step in steps.values()))
prompts = [PromptRow(ids, capital, question) for ids, (question, capital) in zip(row_ids, rows, strict=True)]
batch_rows = row_records(prompts, judged, batch_device_run)
batch_ok = {key: all(r[key] for r in batch_rows) for key in ("seq_match", "logits_match", "coherent")}
print(f"SEQ_MATCH {batch_ok['seq_match']}  LOGITS_MATCH {batch_ok['logits_match']}  coherent {batch_ok['coherent']}")
witness = run_witness(batch, artifacts=batch_artifacts)  # the batched recipe, the witness prompt in every row
display(nb.batch_rows_table(batch_rows))
shared = witness.get("same_programs")  # the witness's artifacts against the ones compiled above
programs = {True: "the same compiled programs", False: "programs of its own (folded weights differ)"}.get(shared, "?")
print(f"witness (random weights, batched, every row): passed {witness['passed']}; it ran {programs}")

# %% [markdown]
# ## 3. Drafting with Gemma-4's own assistant
#
# ### Why verifying k + 1 tokens can cost about one decode step
#
# A batch needs B users. Drafting gets more than one token per weight read for **one**
# conversation. The target's forward over k + 1 tokens (the last token and k guesses) reads each
# weight once, like a prefill, and returns its own prediction at every one of those positions.
# On a bandwidth-bound device a dense model's verify costs about one decode step (the extra K/V and
# arithmetic are small at k = 4). A mixture of experts is the exception: k + 1 tokens route to more
# experts than one does, so its verify reads more expert bytes (the 26B-A4B row of the ceilings
# table below prints how many, against its plain step). Every guess that equals the target's own prediction is kept. The first that
# differs is replaced by the target's prediction, and the rest are thrown away. One verify step
# therefore emits between one and k + 1 tokens. Every kept token is the target's argmax given the tokens
# before it, so the output is exactly plain greedy decoding, whatever the guesses were.
# Only the speed depends on the assistant.
#
# ### The accept/reject loop, by hand
#
# The whole rule is a few lines. **Greedy**: walk the drafts while each equals the target's argmax
# at its position; emit the kept drafts and then the target's own token. **Sampling** (rejection
# sampling, for `temperature > 0`): draft `x` at position `i` was drawn from the assistant's `q`; keep
# it with probability `min(1, p(x) / q(x))` (the test `u · q(x) < p(x)`, no division), and at the
# first rejection draw the replacement from `max(0, p − q)` renormalised; if every draft survives,
# draw a bonus token from the target's last distribution. That residual is what makes the emitted
# tokens follow the target's distribution exactly, whatever `q` is. The cell runs both loops on random
# logits and distributions and asserts they give what the library's `generation/acceptance.py` gives,
# draw for draw from the same seeded generator.

# %%
from gemma4lib.generation.acceptance import greedy_verdict, verify_drafts


def greedy_accept(v_logits, drafts):  # v_logits [k + 1, vocab]: the verify step's rows
    predicted = v_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == predicted[n]:
        n += 1
    return n, predicted[: n + 1]  # the kept drafts are the target's own tokens, then one more of its own


def rejection_accept(p, q, drafts, generator):  # p [k + 1, vocab] target, q [k, vocab] drafter: probabilities
    p, q = p.double(), q.double()
    u = torch.rand(1, len(drafts), generator=generator, dtype=torch.float64)[0]  # one uniform per draft, drawn first
    for i, x in enumerate(drafts):
        if not u[i] * q[i, x] < p[i, x]:  # rejected: P(keep) = min(1, p(x) / q(x))
            residual = (p[i] - q[i]).clamp(min=0)  # the target's mass the drafter under-proposed
            replacement = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return i, drafts[:i] + [int(replacement)]
    return len(drafts), drafts + [int(torch.multinomial(p[-1] / p[-1].sum(), 1, generator=generator))]  # bonus


cases = torch.Generator().manual_seed(0)
for case in range(200):
    k, vocab = 1 + case % draft_tokens, 12
    v_logits = torch.randn(k + 1, vocab, generator=cases)
    agree = torch.rand(k, generator=cases) < 0.6  # drafts that often equal the argmax, as a good drafter's do
    drafts = torch.where(agree, v_logits[:k].argmax(-1), torch.randint(vocab, (k,), generator=cases)).tolist()
    assert greedy_accept(v_logits, drafts) == greedy_verdict(v_logits, drafts)
    p = torch.softmax(v_logits, -1)
    q = torch.softmax(v_logits[:k] + torch.randn(k, vocab, generator=cases), -1)  # a drafter close to the target
    ours = rejection_accept(p, q, drafts, torch.Generator().manual_seed(case))
    library = verify_drafts(p, q, drafts, torch.Generator().manual_seed(case))
    assert ours == (library.accepted, library.tokens), (case, ours, library)
print("greedy and rejection loops by hand equal generation/acceptance.py on 200 random verify steps")

# %% [markdown]
# ### How the assistant reads the target's K/V
#
# Gemma-4's assistant (`Gemma4AssistantForCausalLM`) has **no K/V of its own**. Each of its
# layers attends over the K/V of the target's last K/V-producing layer of the same attention type
# (sliding or full), the buffers the target's graphs already hold. Its input is
# `pre_projection(concat(target embedding, target last hidden state))` of the last token. It
# drafts all k tokens from that token's position, feeding back its own token and projected
# hidden state. On the device this means the draft graph only *reads* the target's K/V buffers,
# so nothing extra has to be stored or moved.
#
# The cell loads the tiny assistant, trained here against the tiny target, and shows which
# target layers it reads. It also shows that none of its layers has a key or value projection.

# %%
assistant = load_assistant(model, drafted)
kv_projections = [n for n, _ in assistant.model.named_parameters() if ".k_proj." in n or ".v_proj." in n]
producers = [layer.index for layer in model.layout.producers]
print(f"assistant: {assistant.source}, {sum(p.numel() for p in assistant.model.parameters()):,} parameters")
print(f"target layers that own K/V buffers: {producers}; the assistant reads {assistant.read_layers}")
print(f"key/value projections in the assistant: {kv_projections or 'none'}")

# %% [markdown]
# ### The draft, verify and prefill graphs
#
# With `draft="assistant"` in the settings, `device_graphs` builds three graphs over **one** K/V
# layout (the same `DeviceGraph`, asked for other outputs, plus the assistant's):
#
# - **prefill**: as in `01_e2b`, but it also returns the last hidden state, the assistant's input;
# - **verify**: the target over k + 1 tokens at `start`, returning logits and hidden states for
#   every position. It is a short prefill at an offset;
# - **draft**: one assistant step over the target's K/V, from a constant position.
#
# A verify writes the K/V of all k + 1 tokens, including the guesses that are then rejected. The
# target never reads those stale slots: the next verify starts at the first rejected position and
# overwrites them before it attends. The draft graph masks every slot that is not yet committed.
# The sliding layers' rings need **window + k + 1** slots, so that a rejected token never
# overwrites history that a mask still admits (the argument is in `docs/DRAFTING.md`).
#
# ### Compile
#
# The same three calls per graph (`compile_package` above). Each graph has its own cache key. The
# engine gets the verify step instead of a decode step, the draft step, and a drafter: the
# `AssistantDrafter` runs the draft graph k times per round for every live row.

# %%
draft_graphs = device_graphs(model, drafted, compute_balance=CPU_THREAD_FLOP_PER_BYTE, assistant=assistant)
for name, graph in draft_graphs.named().items():
    print(f"{name:9} {type(graph).__name__:12} {graph.shape.tokens} token(s)")
print("sliding ring slots:", draft_graphs.layout.slots("sliding_attention", context_length, ring_kv))
draft_steps = {name: compile_package(graph) for name, graph in tqdm(draft_graphs.named().items(), desc="compile")}
draft_kv = draft_graphs.new_kv()  # the rings have window + k + 1 slots: a layout of its own
drafted_runtime = Engine.for_model(
    model,
    Steps(
        {b: bind_kv(draft_steps[f"prefill{b}"], draft_kv) for b in draft_graphs.prefill},
        verify=bind_kv(draft_steps["verify"], draft_kv),
        draft=bind_kv(draft_steps["draft"], draft_kv),
    ),
    batch=1,
    context_length=context_length,
    draft_tokens=draft_tokens,
    drafter=AssistantDrafter(),
)
draft_artifacts = {name: str(step.entry.path) for name, step in draft_steps.items()}
print({n: "cache hit" if s.cache_hit else f"compiled in {s.compile_s:.0f} s" for n, s in draft_steps.items()})

# %% [markdown]
# ### Generate with drafts
#
# Each round: k draft-graph calls from the last token, one verify of `[last token, drafts…]`,
# then the host keeps the drafts up to the first disagreement plus the target's own next token.
# `accepted` counts the drafts kept at each verify step, and `emitted` the tokens kept (one more than `accepted`,
# cut at an end token or the token budget). `accepted_per_step`, despite its name, is the mean of
# `emitted`: tokens per verify step, the figure drafting's speed depends on.
#
# ### Exact: plain greedy, and transformers' assisted generate
#
# The same three checks as every port. SEQ_MATCH compares with the target's plain greedy tokens
# (the same reference as `01_e2b`). LOGITS_MATCH compares at every kept token: the verify row
# that chose it against the reference's logits at that position. Coherence asks whether the answer
# says Paris. Then one more: transformers' own `generate(assistant_model=...)`, run with the same
# assistant, must give the same tokens. Its acceptance can differ from ours, because its
# assistant also sees some rejected drafts' stale K/V while ours masks them. The tokens cannot
# differ.

# %%
ids = prompt_ids(model, drafted)
draft_run = drafted_runtime.generate(ids, max_new_tokens, eos_token_ids=eos, keep_logits=True)
print(f"answer: {nb.answer_text(model, draft_run.tokens)!r}")
print(f"{len(draft_run.tokens)} tokens in {len(draft_run.emitted)} verify steps: drafts accepted {draft_run.accepted}")
print(f"mean tokens per verify step: {draft_run.accepted_per_step:.2f} (plain decode: 1; the prefill gives the first)")
reference = reference_greedy(model.lm, ids, max_new_tokens, eos)
draft_report = checks.evaluate(
    model.lm, model.tokenizer, ids, draft_run.tokens, reference, expect=expect, step_logits=draft_run.step_logits
)
hf_tokens, hf_steps = hf_assisted(model.lm, assistant.model, ids, max_new_tokens, eos)
print(f"SEQ_MATCH {draft_report.seq_match}  LOGITS_MATCH {draft_report.logits_match}  coherent {draft_report.coherent}")
print(draft_report.logits.explain())
print(f"equal to transformers' assisted generate: {hf_tokens == draft_run.tokens} ({hf_steps} verify steps there)")
nb.side_by_side(draft_report, draft_run.tokens, reference)

# %% [markdown]
# ## 4. Benchmark
#
# ### Total decode tok/s against B, on this CPU
#
# `bench_batch_model` times this project's batched decode graphs and Hugging Face `generate` at
# each B. They run on the same random prompts of different lengths, interleaved, one thread, with
# eos off so every row decodes the same number of tokens. Every row is checked against its own
# reference at every B. The machine's bandwidth is measured before and after, so a run where the
# neighbours changed the machine can be recognised. B=4 reuses the graphs compiled above. Each
# other B is a new decode graph (compiled the first time).
#
# **What the tiny model shows and what it does not.** Its weights are a few MB and stay in the
# CPU's caches. A step is bound by per-call overhead, not by bandwidth: the mechanism is one call,
# one weight read, B tokens, so on a quiet machine total tok/s grows with B. On this shared CPU the
# line need not be smooth (small B can come out slower in total than B=1 when a neighbour takes the
# core, and the sweep's bandwidth flag says whether one did): read this run's table rather than
# assume. (An earlier version of the batched decode wrote its K/V with a `scatter`, which had
# Inductor copy every whole K/V buffer each step; `python -m gemma4lab.benchmarks.profile_decode`
# found it, docs/ROOFLINE.md tells it, and the decode now writes in place with an `index_put`.) The tiny model does not show where a real
# model's gain ends (the compute bound, the K/V per row), or any inf2 figure. The ceilings above
# are computed for that, and the field report's points are measured. The plot below keeps them
# apart: this CPU's measurements on one axis, the released E2B on inf2 on the other.
#
# In the table, "GB/s drawn" is the weight and K/V bytes a step reads times steps per second: the
# memory bandwidth the decode would need if bytes were its whole cost. Beside the machine's measured
# stream bandwidth it says how far a step is from being bound by memory (on the tiny model, far).

# %%
sweep = bench_batch_model(
    f"tiny-trained {variant}",
    model,
    batch_sizes=tuple(sweep_batches),
    context_length=context_length,
    new_tokens=sweep_new_tokens,
    warmup=warmup,
    iters=iters,
    bandwidth_mb=256,
    cache=cache,
)
batch_figures = benchmark(runtime, [Request(ids, max_new_tokens) for ids in row_ids], warmup, iters)  # eos off
display(nb.batch_sweep_table(sweep))
print(f"total tok/s at B=8 over B=1: {sweep['speedup_b8_over_b1']:.2f}" if sweep["speedup_b8_over_b1"] else "")

# %% [markdown]
# ### Decode with and without drafts, on this CPU
#
# The drafted runtime against the plain single-row graphs (`01_e2b`'s programs, from the cache).
# Both decode `max_new_tokens` tokens with eos ignored, so they emit the same number. After the
# answer, the tiny model babbles text it never saw in training, and its assistant guesses that
# worse, so acceptance here is lower than in the answer above.
#
# **Why a tiny model cannot show the inf2 speed-up.** Drafting saves weight reads, and a tiny
# model's steps are not bound by weight reads. Each call costs about the same fixed overhead,
# whether it is a draft step, a verify of k + 1 tokens or a decode of one. A round is k + 1 calls for
# `accepted_per_step` tokens, so on this CPU drafting is expected to be *slower*. On inf2 the
# ratio of bytes decides instead, and the table in section 5 computes that.

# %%
plain = compile_graphs(model, PortSettings(**common)).runtime  # batch 1: 01_e2b's graphs
runs = time_interleaved(  # the two take turns, so load from neighbours hits both alike
    {
        "with_draft": lambda: drafted_runtime.generate(ids, max_new_tokens),
        "without_draft": lambda: plain.generate(ids, max_new_tokens),
    },
    warmup,
    iters,
)
with_draft, without_draft = runs["with_draft"], runs["without_draft"]
timed = drafted_runtime.generate(ids, max_new_tokens)  # eos off: the run the timings are of
tok_s_with, tok_s_without = sorted(with_draft)[len(with_draft) // 2], sorted(without_draft)[len(without_draft) // 2]
print(f"decode {tok_s_with:,.0f} tok/s with drafts, {tok_s_without:,.0f} without: {tok_s_with / tok_s_without:.2f}x")
print(f"mean tokens per verify step over {max_new_tokens} tokens (eos off): {timed.accepted_per_step:.2f}")

# %% [markdown]
# ## 5. On inf2: what drafting could do (computed, unverified)
#
# The drafted ceiling is `tokens per verify step × bandwidth ÷ (verify bytes + k × assistant
# bytes)`, against the plain `bandwidth ÷ step bytes`. The tokens per verify step used are the
# benchmark's (the longest drafted run here, eos off), from the tiny assistant, not the short
# answer's few verify steps. A released assistant's acceptance
# on real text is not measured here, so the speed-up column says what *this* acceptance would
# give. `break-even` is the acceptance at which drafting starts to pay. The assistant's bytes
# come from an assumed shape (no released assistant config is available offline), and the
# overhead of k + 1 graph calls per round is left out. Every figure is **computed and
# unverified on inf2** (`gemma4lib/inf2/mtp_roofline.py`).

# %%
effect = draft_table({variant: timed.accepted_per_step}, draft_tokens)  # the longest drafted run's acceptance
nb.draft_effect_table(effect)

# %% [markdown]
# ## 6. Record
#
# One JSON document per run, built by the library's `build_record` (the builder `port()` uses).
# Its `seq_match`, `logits_match` and `coherent` are true only when every batch row's and the
# drafted run's are. It keeps `rows` (one entry per batch row), the drafting fields
# (`accepted_per_step`, `drafts_accepted`, `hf_assisted_match`, decode tok/s with and without
# drafts, `speedup_with_draft`), the CPU sweep and the computed inf2 tables. `decode_tok_s` is
# the batch's total over the batch run above (its prompts and token count, not the sweep's: the
# two totals differ). `papermill_runs` judges it against its baseline, like the variant notebooks'.

# %%
report0, reference0 = judged[0]
every_step = [*steps.values(), *draft_steps.values()]
device_run = DeviceRun(
    generation.rows,
    compile_cpu.RECIPE,
    sum(step.compile_s for step in every_step),
    cache_hits=[step.cache_hit for step in every_step],
    prefill_ms=batch_figures.prefill_ms,
    decode_tok_s=batch_figures.decode_tok_s,
    details={"artifacts": {**batch_artifacts, **draft_artifacts}},
)
result = build_record(
    batch,
    model,
    row_ids[0],
    device_run,
    report0,
    reference0,
    started=started,
    witness=witness,
    extra={
        "kind": "serving",
        "notebook": "06_serving",
        "batch_size": batch_size,
        "rows": batch_rows,
        "decode_tok_s_per_row": batch_figures.decode_tok_s / len(row_ids),
        "batch_bench": batch_figures.to_dict(),
        "batch_sweep": sweep,
        "speedup_b8_over_b1": sweep["speedup_b8_over_b1"],
        "inf2_batch_ceilings": ceilings,
        "draft": drafted.draft,
        "draft_tokens": draft_tokens,
        "draft_prompt": prompt,
        "draft_tokens_out": draft_run.tokens,
        "draft_answer": draft_report.answer,
        "draft_seq_match": draft_report.seq_match,
        "draft_logits_match": draft_report.logits_match,
        "draft_coherent": draft_report.coherent,
        "accepted_per_step": draft_run.accepted_per_step,
        "drafts_accepted": draft_run.accepted,
        "verify_steps": len(draft_run.emitted),
        "hf_assisted_tokens": hf_tokens,
        "hf_assisted_match": hf_tokens == draft_run.tokens,
        "hf_accepted_per_step": (len(hf_tokens) - 1) / hf_steps if hf_steps else None,
        "decode_tok_s_with_draft": tok_s_with,
        "decode_tok_s_without_draft": tok_s_without,
        "speedup_with_draft": tok_s_with / tok_s_without,
        "decode_tok_s_runs_draft": {"with_draft": with_draft, "without_draft": without_draft},
        "bench_accepted_per_step": timed.accepted_per_step,
        "inf2_draft_effect": effect,
        "seq_match": batch_ok["seq_match"] and draft_report.seq_match,
        "logits_match": batch_ok["logits_match"] and draft_report.logits_match,
        "coherent": batch_ok["coherent"] and draft_report.coherent,
    },
)
nb.save_record(results_path, result)
print("failed checks:", result["failed_checks"] or "none")
nb.record_summary(result)

# %% [markdown]
# ## 7. Plots
#
# Total decode tok/s against B on two axes, each line divided by its own tok/s at B = 1 (which its
# legend entry prints), so a line's height is what the batch bought over one row, on a linear scale:
# on the left this CPU's measured figures (this project's graphs and HF `generate`) with the line
# `B × (B = 1)` (B rows for the cost of one) for scale; on the right
# E2B's inf2 ceiling (**computed, unverified**) and the field report's points (**measured on inf2
# by its author**, not by this project). Then the drafts the target kept at each verify step of the timed run (eos off):
# high while the answer is one the assistant was distilled on, lower once the tiny model babbles.

# %%
display(
    plots_batch.tok_s_vs_batch(measured=sweep, computed=ceilings, title="E2B: total decode tok/s against batch size")
)
plots_draft.drafts_accepted(timed.accepted, timed.drafted, timed.emitted, f"tiny E2B + assistant, k = {draft_tokens}")

# %% [markdown]
# ## Takeaways
#
# - Single-row decode is bandwidth bound. A batch of B reads the weights once for B tokens, so total
#   tok/s grows with B until compute or the per-row K/V catches up; the field report measured that
#   growth on inf2 (section 2's table).
# - A batch of different prompts needs per-row positions, lengths, masks and K/V slots. Check
#   every row against its own single-row reference: a bug in the short rows hides behind a perfect
#   first row.
# - Drafting gets several tokens per weight read for one conversation. The verify of k + 1 tokens
#   reads the weights once (a dense model: about one decode step's bytes; the [MoE](00_overview.ipynb#moe) more, the table
#   says how much), the output is exactly greedy whatever the drafts, and only the
#   speed depends on the assistant. Gemma-4's assistant reads the target's own K/V, so it adds no
#   K/V state.
# - Tiny models on a CPU show the mechanics (exactness, acceptance, B tokens per call). The speed
#   on inf2 is decided by bytes, which this notebook computes and marks as computed.
