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
# # 07 — Serve it: an OpenAI-compatible endpoint over E2B's compiled graphs
#
# The notebooks so far end with a model that answers one prompt at a time in a kernel. An
# application wants an endpoint: an HTTP address that speaks the API every client library already
# speaks (OpenAI's), serves many users at once, refuses politely when it is full, and can be
# scaled out to more than one accelerator. This notebook starts that endpoint on the tiny trained
# E2B (`python -m gemma4lib serve`), talks to it with the official `openai` client, puts it under
# growing numbers of concurrent clients and measures what continuous batching buys, runs an agent's
# tool loop, a thought and a structured reply through it, then shows the inf2 route: one compiled
# bundle, several Ray Serve replicas loading it.
#
# Read `06_serving` first: the endpoint runs the batched graphs built there, through the same
# engine (`runtime.Engine`), and explains only what a server adds on top.
#
# ### Runs on
#
# | | [`smoke`](00_overview.ipynb#smoke) profile (any CPU) | inf2 |
# |---|---|---|
# | machine | any x86-64 or arm64 machine; two shared cores are enough | `inf2.xlarge` per E2B replica, compiled on an `inf2.8xlarge` (the plan's choice, computed and unverified on inf2: see `01_e2b`) |
# | model | the tiny trained E2B, batched graphs compiled with [AOTInductor](00_overview.ipynb#aotinductor) (06_serving's, from the cache) | `google/gemma-4-E2B-it`, ModelBuilder's [NEFFs](00_overview.ipynb#neff) from an exported bundle |
# | server | `python -m gemma4lib serve` as a child process on 127.0.0.1, stopped with SIGTERM at the end | the same command, or `serve --ray` with one replica per NeuronCore group |
# | Ray Serve | skipped here (the last section prints `skipped: backend=cpu`; the Ray route is tested on CPU by `tests/test_server_ray.py`) | `deploy(...)` of the bundle, each replica reserving `neuron_cores` = its [TP](00_overview.ipynb#tp) degree: written against SDK 2.28, **never run on inf2** |
# | time | printed by the last code cell (`wall_s`); the graphs come from the compile cache when 06_serving ran first, else each is compiled once | — |
# | software | torch 2.13 (CPU), transformers 5.23.0, FastAPI + uvicorn, `openai`, Ray 2.60 | Neuron SDK 2.28 (see `01_e2b`) |
#
# `python -m papermill_runs run --profile smoke` runs it after 06_serving; the full profile leaves
# it out. On inf2, run it by hand on a serving instance with `backend = "neuron"`, `profile = "full"`
# and `artifacts` naming the bundle a compile host exported (section 7).

# %% [markdown]
# ## Parameters
#
# The next cell is the notebook's only input, tagged `parameters` for papermill. `batch_size` is
# the number of rows the server's graphs are compiled for, `max_queue` how many requests may wait
# for a row before the server answers 429, `client_levels` the numbers of concurrent clients the
# load test tries, each client sending `requests_per_client` requests one after another.

# %% tags=["parameters"]
variant = "e2b"
profile = "smoke"  # the tiny trained E2B on a CPU; "full" on inf2 (see Runs on)
backend = "cpu"  # "neuron" on inf2: the last section then deploys the bundle with Ray Serve
checkpoint = None  # the full profile's hub id (google/gemma-4-E2B-it)
batch_size = 4  # rows: requests decoded together in one step
context_length = 192  # 06_serving's shapes: its batch graphs are this server's compiles
prefill_buckets = [128]
prompt = "What is the capital of France?"
expect = "Paris"
max_tokens = 24  # each request's completion budget
think_tokens = 48  # a thinking request's budget: the thought and the answer after it (inf2: room for a long thought)
max_queue = 8  # requests waiting for a row; one more gets 429
burst = 24  # requests sent at once to fill the queue
client_levels = [1, 2, 4, 8]  # concurrent streaming clients
requests_per_client = 2
level_timeout_s = 120.0  # a load level that takes longer fails (every load here stops by itself)
start_timeout_s = 600.0
replicas = 2  # inf2: Ray Serve replicas, each loading the bundle (E2B: one per inf2.xlarge of the Ray cluster)
artifacts = None  # inf2: the bundle folder `export` wrote on the compile host (section 7), loaded, never compiled
threads = 1
results_path = "../runs/notebooks/serve.json"

# %% [markdown]
# ## Setup
#
# `settings` are the port's own settings for the graphs the server runs; the server is started
# with the same values on its command line, and checks them again before it loads anything. The
# table shows only those fields: the prompt, the sampling and the benchmark fields of
# `PortSettings` belong to the variant notebooks and play no part here (each request brings its
# own prompt and `max_tokens`).

# %%
import asyncio
import collections
import dataclasses
import json
import time

import httpx
import jsonschema
from IPython.display import display
from openai import BadRequestError, OpenAI

from gemma4lab import notebook as nb
from gemma4lib.models.corpus import COUNTRIES
from gemma4lab.notebook import plots_serve
from gemma4lib.cli import serving_defaults
from gemma4lib.port import PortSettings
from gemma4lab.serving.load import run_async, run_load
from gemma4lib.server.metrics import RATE_WINDOW_S
from gemma4lab.serving.process import ServerProcess

started = time.perf_counter()
# serving_defaults: what `serve` adds to the port's settings (row_prefill on where the backend can)
settings = PortSettings(
    **serving_defaults(
        dict(
            variant=variant,
            profile=profile,
            backend=backend,
            checkpoint=checkpoint,
            batch_size=batch_size,
            context_length=context_length,
            prefill_buckets=tuple(prefill_buckets),
            artifacts=artifacts,
        )
    )
)
nb.show_settings(
    settings,
    fields=(
        "variant",
        "profile",
        "model_source",
        "checkpoint",
        "backend",
        "batch_size",
        "context_length",
        "prefill_buckets",
        "row_prefill",
    ),
)  # what the server is started with
on_inf2 = settings.backend_row.device_bound  # the backend's facts: Neuron's runs on inf2 (the last section)
if on_inf2 and not artifacts:  # a serving instance never compiles (section 7): it loads the compile host's bundle
    raise ValueError("on inf2 set artifacts= to the bundle `python -m gemma4lib export` wrote on the compile host")

# %% [markdown]
# ## 1. Why continuous batching, and what a row is
#
# `06_serving` explains why one decode step over B rows can cost less than B steps over a single
# row: the step reads every weight once either way (its sweep prints what this machine gave). A **row** is one of the B slots the graphs
# are compiled for: its own K/V buffers, its own position and length, its own sampling. A
# request lives in one row from its prefill to its last token.
#
# A batch that starts together and waits until its slowest row ends wastes rows: a short answer
# leaves its row idle while a long one goes on, and a request that arrives mid-batch waits for
# the whole batch. **Continuous batching** schedules per step instead. The server's scheduler
# thread owns the engine and loops: free the rows whose requests ended (eos, a stop string,
# `max_tokens`, a client that hung up), prefill waiting requests into the free rows
# (`engine.admit`, the other rows untouched), run one `engine.step()` over every live row, and
# hand each row's new text to its request's stream. Requests join and leave between steps, so
# the rows stay full while there is work. It is the same engine the port runs, so a greedy reply
# equals the one `port` gives for the same prompt.
#
# Joining has a cost the other rows feel: while a request prefills, nobody decodes. A prefill graph
# compiled for B rows has a fixed shape, so prefilling one joining row through it costs as much as
# prefilling all B. That is why `serve` also compiles each prefill bucket for a single row
# (`row_prefill`, on by default on the CPU backends): the engine runs it over one row's slice of the
# batched K/V buffers (a view, so the graph's in-place write lands in that row and no other), and
# uses it whenever at most half the rows join at once. Those single-row programs are the ones `port`
# compiles for a single prompt, so on a warm cache they cost nothing to build. On inf2 the K/V live on the
# device as state a graph takes whole, so the Neuron backend joins rows through the B-row prefill
# (computed reasoning, unverified on inf2; the README's serving section has the measured CPU figures).

# %% [markdown]
# ## 2. Start the server
#
# `ServerProcess` runs `python -m gemma4lib serve` as a child process, bound to 127.0.0.1 on a free
# port, and returns once `GET /health` answers: the engine is loaded and its graphs are ready. Here,
# on a CPU, the server compiles them itself (from the compile cache when an earlier run compiled
# these shapes, else now: `compile_s` in the table the next cell prints says which). On inf2 it does
# not compile: `artifacts` names the bundle a compile host exported (section 7), and the server
# loads it (`--artifacts`), as every replica does.
# The wait it prints is mostly the child's start (Python, torch and transformers imported, the model
# loaded); the table's `load_s` is the graphs' part of it. A child process rather than a thread, so that the server's threads never wait for this kernel's;
# the same command is what you would run in a terminal. It stops itself at the end of this notebook (SIGTERM), and dies with the kernel if the
# kernel dies first.

# %%
port_args = ["--variant", variant, "--profile", profile, "--backend", backend, "--batch", str(batch_size)]
port_args += ["--context-length", str(context_length), "--prefill-buckets", ",".join(map(str, prefill_buckets))]
port_args += ["--row-prefill" if settings.row_prefill else "--no-row-prefill"]
port_args += ["--checkpoint", checkpoint] if checkpoint else []  # what the graphs are: `export` takes the same
args = port_args + ["--max-queue", str(max_queue), "--threads", str(threads)]
args += ["--artifacts", artifacts] if artifacts else []  # inf2: load the compile host's bundle, never compile
server = ServerProcess(args).start(start_timeout_s)
print("$", " ".join(server.command[1:]))
health = server.health()
print(f"answering on {server.url}/v1 after {server.ready_s:.1f} s (its log: {server.log_path})")
display(nb.Table.from_dict(health, "GET /health", "field", "value"))

# %% [markdown]
# ## 3. The official `openai` client, plain and streamed
#
# Any OpenAI client talks to it: point `base_url` at the server, and name the model by the variant
# (or its hub id, `GET /v1/models`). The messages go through the model's own chat template on the
# server. A request without `temperature` is greedy here (the port's default, unlike OpenAI's).
#
# With `stream=True` the reply arrives as server-sent events, one chunk per piece of settled text.
# Both calls run the same greedy decode, and the server builds the plain reply by joining the
# deltas it would have streamed, so the two texts must be equal.

# %%
client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
print("models:", [m.id for m in client.models.list().data])
question = [{"role": "user", "content": prompt}]
plain = client.chat.completions.create(model=variant, messages=question, max_tokens=max_tokens)
answer = plain.choices[0].message.content
pieces = []
for chunk in client.chat.completions.create(model=variant, messages=question, max_tokens=max_tokens, stream=True):
    pieces.extend(choice.delta.content for choice in chunk.choices if choice.delta.content)
streamed = "".join(pieces)
usage = plain.usage
finish = plain.choices[0].finish_reason
print(f"plain:    {answer!r} (finish {finish}, {usage.prompt_tokens} + {usage.completion_tokens} tokens)")
print(f"streamed: {streamed!r} ({len(pieces)} chunks)")
print(f"the same text: {streamed == answer}; it says {expect!r}: {expect in answer}")

# %% [markdown]
# ### Errors in OpenAI's shape, and why 429
#
# A request the compiled graphs cannot hold is refused before it takes a row: here the prompt plus
# `max_tokens` is longer than the compiled context, and the client raises `BadRequestError` with
# OpenAI's error body (`message`, `type`, `param`, `code`).
#
# The queue in front of the rows is bounded. A server that queued without limit would accept work
# it cannot finish in any useful time: every request behind the queue waits for all the ones in
# it, and a client that gave up long ago still holds its place. So past `max_queue` waiting
# requests the server answers **429 Too Many Requests** at once, with `Retry-After` saying when to
# come back: the client (or a load balancer in front of several servers) can retry, or go
# elsewhere, instead of hanging. The cell sends `burst` requests at the same moment: the rows
# take some, the queue some, and the rest get 429. Rows plus queue is what the burst is sure to
# have served, not a cap on it: a short reply frees its row while the burst is still arriving, and
# the next request takes that row, so more requests than that can be answered with success.
#
# **What else it refuses.** An endpoint on a network meets clients it cannot trust, so every limit
# is checked before any work and named in the 400 (OpenAI's shape, `param` the field to fix): a body
# over `--max-body-mb` gets 413 before it is parsed; too many messages, more stop strings than
# OpenAI's four or an over-long one, too many image parts (any, on a server without `--vision`, before
# one is decoded), a prompt longer than the context (a longer one than the largest prefill bucket runs
# in chunks of it), more completions
# prompts than the queue holds (a 400: a 429 would be retried forever), a lone surrogate character, and a
# `temperature` above zero but too small for the sampler to compute. A field the server does not
# implement (`logit_bias`, `suffix`, the penalties, ...) is refused by name, never accepted in silence
# with a reply the client did not ask for.
# `GET /v1/models` gives the two lengths a request can really use: `max_prompt_tokens` (the context,
# less the draft tokens a drafting server keeps free) and `max_model_len` (prompt plus new tokens). Tokenizing and image decoding run on a
# small worker pool, so one large request never stalls another client's stream, and a fault in one
# row's sampler fails that request alone while the other rows go on with unchanged tokens.
#
# **Control tokens stay text.** A user who types `<|turn>system` or `<eos>` inside a message sends
# those characters, not a forged turn: the chat template's own markers (and the image tokens the
# server inserts) are the only control tokens, and an ordinary prompt gets exactly the ids it always
# did. `--allow-control-tokens` parses them again, for trusted clients only; completions prompts keep
# theirs, since there the client writes the whole prompt.

# %%
try:
    client.chat.completions.create(model=variant, messages=question, max_tokens=context_length)
    too_long = None  # accepted: the check in the record fails
except BadRequestError as exc:
    too_long = exc
print(f"{too_long.status_code}: {too_long.body}" if too_long else "accepted: no 400")


async def send_at_once(n):
    body = {"model": variant, "messages": question, "max_tokens": max_tokens}
    async with httpx.AsyncClient(base_url=server.url, timeout=level_timeout_s) as http:
        return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(n)))


responses = run_async(lambda: send_at_once(burst))
statuses = collections.Counter(r.status_code for r in responses)
refused = [r for r in responses if r.status_code == 429]
print(f"{burst} requests at once: {dict(sorted(statuses.items()))} (rows {batch_size}, queue {max_queue})")
if refused:
    print(f"429 Retry-After {refused[0].headers['retry-after']} s: {refused[0].json()['error']['message']}")

# %% [markdown]
# ## 4. N concurrent clients
#
# `run_load` runs each level of `client_levels` in turn: N clients of the official `openai` async
# client, each sending `requests_per_client` streamed greedy requests one after another (each a
# different capital question), bounded in number and in time (`level_timeout_s`). Before the
# levels it asks every question alone, with nothing else on the server: under load each reply
# must equal that one (`mixed` counts those that do not; a row that read another row's K/V would
# show here). Per level: whether every request completed, the [time to first token](00_overview.ipynb#ttft) (p50 and p99,
# from sending the request to its first text), and the total tokens per second over the level's
# wall time.
#
# What to look for: while there are fewer clients than rows, each new client can fill an idle row of
# a step that runs anyway; whether total tokens/s rises with it depends on how often the rows are
# really full at once (short replies leave rows idle between requests). Once the clients
# outnumber the rows, requests wait in the queue and their time to first token includes the wait.
# Each admission runs a prefill while the other rows pause (the single-row prefill when few join,
# the B-row one when many do), and with more clients than rows there is an admission every time a
# row frees: those pauses can cost more than the extra rows give. The replies here end at eos
# after a few tokens, so admissions weigh more than they would for longer answers. This is a small model on a shared CPU, where these levels move from run to
# run: read the table of this run for what happened here, not as a rule for inf2.

# %%
prompts = [f"What is the capital of {country}?" for country, _ in COUNTRIES[:16]]
levels = run_load(
    server.url,
    variant,
    prompts,
    client_levels,
    requests_per_client=requests_per_client,
    max_tokens=max_tokens,
    timeout_s=level_timeout_s,
)
display(nb.load_levels_table(levels))
one = levels[0]
for level in levels[1:]:
    print(
        f"{level.clients} clients: {level.tokens_per_s / one.tokens_per_s:.2f}x one client's tokens/s, TTFT p50 ",
        end="",
    )
    print(f"{level.ttft_p50_s * 1000:.0f} ms against {one.ttft_p50_s * 1000:.0f} ms")

# %% [markdown]
# ### What the server counted
#
# `GET /metrics` is Prometheus' text format: the queue depth and rows in use now, the tokens
# generated, requests by finish reason, HTTP responses by status (the 429s of the burst are
# there), and histograms of the time to first token and the time between tokens. A Prometheus
# server scrapes it; here the cell prints the totals.
#
# Its `gemma4lib_tokens_per_second` is not the load table's tok/s, and should not be: the gauge is
# the server's tokens over a sliding window that ends when the gauge is read (here, after the load
# has ended, so the window holds idle time too and the figure falls as it slides past the last
# level), while the table's tok/s is the tokens the clients received over each level's own wall
# time. The cell prints the window and both figures from their sources: the gauge, and the load
# table's levels taken together (their tokens over their summed wall time). The server's token
# counter is a third figure, a total: it also counts the replies of section 3, the burst, and the
# questions `run_load` asked alone before its levels.

# %%
metrics = httpx.get(server.url + "/metrics", timeout=10).text
for line in metrics.splitlines():
    if line.startswith("gemma4lib_") and "_bucket" not in line and "_created" not in line:
        print(line)
values = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("gemma4lib_")}
level_tokens, level_wall = sum(level.tokens for level in levels), sum(level.wall_s for level in levels)
gauge = values["gemma4lib_tokens_per_second"]
print(f"\ngauge (server, the last {RATE_WINDOW_S:g} s before this read): {gauge:.1f} tok/s")
together = level_tokens / level_wall
print(f"load levels together ({level_tokens} tokens over {level_wall:.2f} s of levels): {together:.0f} tok/s")
print(f"token counter: {values['gemma4lib_generated_tokens_total']:.0f} in all, the levels' {level_tokens} among them")

# %% [markdown]
# ## 5. Plots
#
# Left, the time to first token against the number of clients (p50 and p99). Right, the total
# tokens per second, with the line perfect batching would follow: N × one client up to the
# server's rows, flat from there (a client beyond the rows waits for a free row; it adds no row).

# %%
title = f"tiny {variant} endpoint, {batch_size} rows, on this CPU"
plots_serve.latency_and_throughput(levels, title, batch_rows=batch_size)

# %% [markdown]
# ## 5b. An agent's tool loop, a thought and a structured reply
#
# An agent asks the model which function to call, runs it itself, and sends the result back as a
# `role: "tool"` message for the final answer. The request declares the function with a JSON schema
# for its arguments, and `tool_choice` naming it forces the call: the server opens the reply with
# Gemma-4's call marker and a grammar holds the name to the declared one and the arguments to Gemma-4's
# object syntax, so the call always parses, whatever the model would rather write. The reply's
# `tool_calls` carry it (an id, the name, the arguments as JSON text). The grammar does not hold the
# arguments to the declared schema, so the agent checks them before it runs anything (here with
# `jsonschema`) and sends an error back as the tool's result when they do not validate.
#
# The tiny E2B was taught this (`gemma4lab.training.tools`; its run is recorded in the fixtures'
# `PROVENANCE.json`): among declarations whose names, descriptions and order vary, it calls
# `get_capital` or `get_weather` with the country or city it was asked about, and after the tool's
# turn it answers with the result, copying it piece by piece, even a name it never saw. Its chat
# template declares tools, so the server takes them (a model whose template declares none gets a 400
# naming `tools`). The record checks that the final reply is the tool's result in the fixture's words.

# %%
tools_started = time.perf_counter()
capitals = dict(COUNTRIES[:4])  # the countries the tool knows: a short declaration fits the context


def get_capital(country: str) -> str:
    """The tool the agent runs itself, on the arguments the model wrote."""
    return capitals.get(country, "unknown")


parameters = {"type": "object", "properties": {"country": {"enum": sorted(capitals)}}, "required": ["country"]}
parameters["additionalProperties"] = False
tool = {"type": "function", "function": {"name": "get_capital", "description": "A country's capital city."}}
tool["function"]["parameters"] = parameters
first = client.chat.completions.create(
    model=variant,
    messages=question,
    tools=[tool],
    tool_choice={"type": "function", "function": {"name": "get_capital"}},
    max_tokens=32,  # the call is 26 tokens here; the declaration (141 with the question) and this fit the 192
)
(tool_call,) = first.choices[0].message.tool_calls
print(json.dumps(tool_call.model_dump(), indent=1))  # the raw call: id, type, function name and arguments
name, arguments, call_id = tool_call.function.name, tool_call.function.arguments, tool_call.id
said = first.choices[0].message.model_dump(exclude_none=True)  # the assistant's turn, its call in it
call_args = json.loads(arguments)
call_valid = name == "get_capital" and jsonschema.Draft202012Validator(parameters).is_valid(call_args)
print(f"the call names get_capital and its arguments validate: {call_valid}")
tool_result = get_capital(**call_args) if call_valid else f"error: {arguments} does not match the declaration"
print(f"ran {name}({call_args}) locally -> {tool_result!r}")
loop = question + [said, {"role": "tool", "tool_call_id": call_id, "content": tool_result}]
final = client.chat.completions.create(model=variant, messages=loop, max_tokens=max_tokens)
tool_final = final.choices[0].message.content
print(f"final reply: {tool_final!r} (finish {final.choices[0].finish_reason})")

# %% [markdown]
# **Thinking.** Gemma-4 can think before it answers: `<|think|>` in the system turn switches it on, and
# the thought comes back in its own channel, `<|channel>thought\n…<channel|>`, before the reply. The
# server renders the switch when the request asks for it with vLLM's spelling,
# `chat_template_kwargs: {"enable_thinking": true}` (the `openai` client sends it in `extra_body`), and
# parses the channel out: the thought arrives as `reasoning_content` (a streamed reply sends it as
# deltas of that field), never mixed into `content`. The thought spends the same `max_tokens`, so the
# request leaves room for it (`think_tokens`). The tiny E2B was taught a one-line thought that says
# what it will do next; the real Gemma-4 thinks at length, so on inf2 give `think_tokens` room for a
# real thought. The record checks that the thought came back apart from an answer that still says
# `expect`.

# %%
thinking = client.chat.completions.create(
    model=variant,
    messages=question,
    max_tokens=think_tokens,
    extra_body={"chat_template_kwargs": {"enable_thinking": True}},
)
thought = (thinking.choices[0].message.model_extra or {}).get("reasoning_content")
thought_answer = thinking.choices[0].message.content
print(f"reasoning_content: {thought!r}")
print(f"content:           {thought_answer!r} (finish {thinking.choices[0].finish_reason})")

# %% [markdown]
# A **structured reply** is the same grammar on an ordinary answer: `response_format` with a
# `json_schema` and `strict: true` holds every token of the reply to the schema, so `json.loads` never
# fails and the object validates (`jsonschema` checks it here, as a client would). A string field is
# bounded (`maxLength`) so a model that never closes its quote still ends within `max_tokens`; an
# `enum` field can only be one of its values. The schema fixes the shape; the values are the model's.

# %%
schema = {
    "type": "object",
    "properties": {"country": {"type": "string", "maxLength": 16}, "capital": {"enum": sorted(capitals.values())}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
structured = client.chat.completions.create(
    model=variant, messages=question, response_format=response_format, max_tokens=90
)
structured_text = structured.choices[0].message.content
structured_reply = json.loads(structured_text)
structured_valid = jsonschema.Draft202012Validator(schema).is_valid(structured_reply)
print(f"structured reply: {structured_reply} (finish {structured.choices[0].finish_reason})")
print(f"it validates against the schema: {structured_valid}")
tools_s = time.perf_counter() - tools_started
print(f"this section ran in {tools_s:.1f} s")

# %% [markdown]
# ## 6. Stop it: SIGTERM drains
#
# On SIGTERM the server stops taking requests (a new one gets 503 with `Retry-After`), lets every
# queued and running request finish, then exits with status 0. That is what a rolling restart or a
# scale-down needs: no client sees a reply cut in the middle. Its log says what it drained.

# %%
code = server.stop()
print(f"exit status after SIGTERM: {code}")
print("\n".join(line for line in server.log_tail(4000).splitlines() if "drain" in line.lower()))

# %% [markdown]
# ## 7. On inf2: one bundle, N replicas with Ray Serve
#
# One server drives one engine on one set of NeuronCores. More traffic needs more replicas, on
# the other cores of the same instance or on other instances. For E2B that means other instances
# of the `inf2.xlarge`: `01_e2b`'s host-RAM plan leaves no room for a second replica's host model on
# one (a bigger instance's cores can each take one, within its host RAM). Ray Serve is the engine for
# that: it starts the replicas, gives each the NeuronCores it reserves (`neuron_cores` = its TP
# degree; Ray sets `NEURON_RT_VISIBLE_CORES`), routes each request to the least loaded one,
# restarts a replica that dies and, if you ask it, scales their number with the load.
#
# **Where the bundle compiles.** Compiling E2B's graphs is the slow step and, by the compile-host plan
# (`01_e2b`, [`doctor`](00_overview.ipynb#doctor); computed, unverified on inf2), needs more host RAM than the instance that
# serves it has. So two machines play two roles. The **compile host** (the bigger instance the plan
# names) runs `export` once, with the same port arguments as the server above (the cell prints that
# command): it compiles the graphs and writes the NEFFs and weight shards as a bundle. The **serving
# instances** never compile: the bundle is copied to them, `artifacts` names it, and the server of
# section 2 and every replica load it; loading checks first that the bundle fits this environment
# (variant, TP, shapes, SDK and library versions), so a restarted replica serves again in the time a
# load takes, and reports no compile time (`compile_s`) in its `/health`, which the cell prints per
# replica. This notebook on inf2 runs on a serving instance: without `artifacts` its setup cell
# stops and says to export first.
#
# The command carries this run's parameters: here the smoke profile's `--backend cpu`, on inf2 the
# `--backend neuron` and checkpoint of the full profile. It is the command-line form of `01_e2b`'s
# `export_bundle(s, ...)` (§3c), which writes the same bundle from a notebook.
#
# Here the cell prints the compile host's command, then `skipped: backend=cpu`; on CPU the same deployment runs in
# `tests/test_server_ray.py` (two replicas on a local cluster bound to 127.0.0.1, one killed under
# load: its requests get 503 with `Retry-After`, the rest succeed, Ray restarts it from the bundle).

# %%
print("on the compile host, once: python -m gemma4lib export", *port_args, "--out bundles/e2b")
if on_inf2:  # inf2-only, on a serving instance: written against SDK 2.28, never run on inf2
    from gemma4lib.cli import load_engine_from
    from gemma4lib.server.ray_app import RayOptions, deploy, stop_ray

    replica_settings = dataclasses.replace(settings, artifacts=artifacts)  # the bundle: loaded, never compiled
    url = deploy(replica_settings, RayOptions(replicas=replicas, max_queue=max_queue), load_engine_from)
    try:
        ray_client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = ray_client.chat.completions.create(model=variant, messages=question, max_tokens=max_tokens)
        print(f"through Ray Serve: {reply.choices[0].message.content!r}")
        seen = {}
        for _ in range(4 * replicas):
            replica_health = httpx.get(url + "/health", timeout=30).json()
            seen[replica_health["replica"]] = replica_health
        rows = [[name, h["compile_s"], h["load_s"]] for name, h in seen.items()]
        display(nb.Table(["replica", "compile_s", "load_s"], rows, "replicas that answered /health"))
        print("replicas that compiled:", [name for name, h in seen.items() if h["compile_s"]] or "none")
    finally:
        stop_ray()
else:
    print(f"skipped: backend={backend}")

# %% [markdown]
# ## 8. Record
#
# One JSON record of this run: the answers, the error statuses, every load level, the tool call, the
# thought and the structured reply, the server's start-up and exit. `checks_passed` is true only
# when the plain reply says `expect`, the streamed text equals it, the too-long request got its 400,
# the burst got at least one 429 with `Retry-After`, every level completed with no mixed reply, the
# tool call named its function with arguments that validate, the final reply after it gave the
# tool's result, the structured reply validated, the thought came back apart from an answer that
# says `expect`, and SIGTERM ended the server cleanly. The smoke job fails on a false one.

# %%
checks = {
    "coherent": expect in answer,
    "stream_equals_plain": streamed == answer,
    "too_long_is_400": too_long is not None and too_long.status_code == 400,
    "full_queue_is_429": bool(refused) and int(refused[0].headers["retry-after"]) >= 1,
    "levels_complete": all(level.complete for level in levels),
    "none_mixed": sum(level.mixed for level in levels) == 0,
    "sigterm_exit_0": code == 0,
    "tool_call_valid": call_valid,
    "tool_answer_uses_result": call_valid and tool_final == f"The capital of {call_args['country']} is {tool_result}.",
    "structured_reply_validates": structured_valid,
    "thought_apart_from_answer": bool(thought)
    and bool(thought_answer)
    and thought not in thought_answer
    and "<|channel>" not in thought_answer
    and expect in thought_answer,
}
record = {
    "kind": "serve",
    "notebook": "07_serve",
    "variant": variant,
    "profile": profile,
    "backend": backend,
    "batch_size": batch_size,
    "answer": answer,
    "streamed": streamed,
    "stream_chunks": len(pieces),
    "too_long": too_long.body if too_long else None,
    "burst_statuses": {str(k): v for k, v in statuses.items()},
    "levels": [level.as_dict() for level in levels],
    "speedup_top_over_one": levels[-1].tokens_per_s / one.tokens_per_s,
    "server_ready_s": server.ready_s,
    "compile_s": health.get("compile_s"),
    "sigterm_exit": code,
    "tool_call": {"name": name, "arguments": call_args, "result": tool_result, "final": tool_final},
    "structured_reply": structured_text,
    "thinking": {"reasoning_content": thought, "content": thought_answer},
    "tools_s": tools_s,
    "checks": checks,
    "failed_checks": [name for name, ok in checks.items() if not ok],
    "checks_passed": all(checks.values()),
    "wall_s": time.perf_counter() - started,
}
nb.save_record(results_path, record)
print("failed checks:", record["failed_checks"] or "none")
print(f"this notebook ran in {record['wall_s']:.0f} s")

# %% [markdown]
# ## Takeaways
#
# - An endpoint is the engine behind a scheduler: one thread owns the compiled graphs, admits
#   requests into free rows between decode steps and frees a row the moment its request ends. The
#   HTTP side only queues requests and streams their text.
# - Continuous batching fills rows that would otherwise idle, so total tokens/s can grow with the
#   number of clients while rows are free. Past the number of rows, requests queue and wait for a
#   row; whether tokens/s still grows there (the rows stay full, admissions overlap) is what this
#   run's table shows, not a rule.
#   Every admission's prefill pauses the other rows, so a row that joins alone prefills through a
#   single-row graph over its own slice of the K/V, not the batch's fixed-shape prefill; the table
#   above shows what the levels gave on this run.
# - A bounded queue with 429 and `Retry-After` keeps the latency of accepted requests bounded and
#   tells clients when to come back; SIGTERM drains instead of cutting replies.
# - Scale out with replicas that load one exported bundle and never compile: Ray Serve places them
#   on NeuronCores, routes to the least loaded and restarts the ones that die.
