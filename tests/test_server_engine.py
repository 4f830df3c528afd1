"""The endpoint over the real engine: the tiny trained E2B compiled (cpu backend, smoke profile),
served on 127.0.0.1, called with the official `openai` client and lm-eval.

One compiled server for the module (compiling a tiny graph takes ~25 s on one thread), at the notebooks'
smoke shapes (`SERVED`: 07_serve's server, whose batch graphs 06_serving compiles, and whose one-row prefill
is 01_e2b's batch-1 prefill, so the headless notebook run and this file share those programs); the other
variants' "Paris" runs are marked slow (each compiles its own graphs).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
from conftest import SMOKE_SHAPES

from gemma4lab.serving.background import BackgroundServer
from gemma4lib.cli import load_engine, serving_defaults
from gemma4lib.port import PortSettings
from gemma4lib.server.launch import build_served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTRIES = ["Germany", "Italy", "Spain", "Japan", "Kenya", "Peru", "Chile", "Egypt"]


class RecordingEngine:
    """The engine, with every admit, step and release written down (which rows, in which order)."""

    def __init__(self, engine):
        self.engine = engine
        self.trace: list[tuple[str, tuple[int, ...]]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def admit(self, requests, reuse=False):
        with self.lock:
            self.trace.append(("admit", tuple(sorted(requests))))
        return self.engine.admit(requests, reuse=reuse)

    def step(self):
        out = self.engine.step()
        with self.lock:
            self.trace.append(("step", tuple(sorted(out))))
        return out

    def release(self, row):
        with self.lock:
            self.trace.append(("release", (row,)))
        return self.engine.release(row)


# 07_serve's settings: the served E2B, four rows, at the notebooks' smoke shapes
SERVED = {"variant": "e2b", "profile": "smoke", "batch_size": 4, **SMOKE_SHAPES}


@pytest.fixture(scope="module")
def loaded():
    """What `serve` runs: rows that join alone prefill through the one-row graphs (`row_prefill`, the
    server's default; its batch-1 programs are the ones `port` compiles at batch 1)."""
    return load_engine(PortSettings(**serving_defaults(SERVED)))


@pytest.fixture(scope="module")
def alone(loaded):
    """What `port` runs for each prompt, one request on the engine before it serves: its tokens."""
    codec_tokenizer = loaded.tokenizer
    out = {}
    for country in ["France", *COUNTRIES]:
        ids = codec_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is the capital of {country}?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out[country] = loaded.engine.generate(list(ids), 24, eos_token_ids=loaded.eos_ids).tokens
    return out


@pytest.fixture(scope="module")
def server(loaded, alone):
    engine = RecordingEngine(loaded.engine)
    served = build_served(
        engine, loaded.tokenizer, model_name=loaded.model_name, eos_ids=loaded.eos_ids, aliases=loaded.aliases
    )
    with BackgroundServer(served) as background:
        yield background


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_openai_client_gets_paris_and_stream_equals_plain(server, loaded, alone):
    c = client(server)
    plain = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=24)
    text = plain.choices[0].message.content
    assert "Paris" in text, text
    assert text == loaded.tokenizer.decode(alone["France"], skip_special_tokens=True)
    assert plain.usage.completion_tokens == len(alone["France"])
    assert plain.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=24, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    hub = c.chat.completions.create(model="google/gemma-4-E2B-it", messages=QUESTION, max_tokens=24)
    assert hub.choices[0].message.content == text  # the hub id is an alias of the served variant


def test_a_greedy_request_equals_ports_tokens_while_others_join_and_leave(server, loaded, alone):
    """France runs with 24 new tokens of budget while eight others of 3..12 tokens come and go on the
    other three rows: its reply is still the one it gets alone, and so is every other's prefix."""
    from openai import AsyncOpenAI

    engine: RecordingEngine = server.served.scheduler.engine
    start = len(engine.trace)
    budgets = {country: 3 + (i % 4) * 3 for i, country in enumerate(COUNTRIES)}

    async def run():
        c = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def ask(country, max_tokens, delay):
            await asyncio.sleep(delay)
            messages = [{"role": "user", "content": f"What is the capital of {country}?"}]
            return await c.chat.completions.create(model="e2b", messages=messages, max_tokens=max_tokens)

        target = asyncio.create_task(ask("France", 24, 0.0))
        others = [asyncio.create_task(ask(k, m, 0.01 * i)) for i, (k, m) in enumerate(budgets.items())]
        results = await asyncio.gather(target, *others)
        await c.close()
        return results

    france, *others = asyncio.run(run())
    assert france.choices[0].message.content == loaded.tokenizer.decode(alone["France"], skip_special_tokens=True)
    assert france.usage.completion_tokens == len(alone["France"])
    for (country, budget), out in zip(budgets.items(), others, strict=True):
        want = alone[country][:budget]
        assert out.choices[0].message.content == loaded.tokenizer.decode(want, skip_special_tokens=True), country
        assert out.usage.completion_tokens == len(want)
    trace = engine.trace[start:]
    admits = [rows for kind, rows in trace if kind == "admit"]
    assert sum(len(r) for r in admits) == 9 and len(admits) >= 3, trace
    # a request joined while others were decoding, and rows were freed while others kept going
    live: set[int] = set()
    joined_mid = left_mid = False
    for kind, rows in trace:
        if kind == "admit":
            joined_mid |= bool(live)
            live |= set(rows)
        elif kind == "release":
            live -= set(rows)
            left_mid |= bool(live)
    assert joined_mid and left_mid, trace


def test_ignore_eos_generates_every_token_of_the_budget(server, loaded, alone):
    """vLLM's `ignore_eos` (in `extra_body`): a fixed output length, as the serve benchmark sends; the
    reply runs past the eos that ends it otherwise, and its first tokens are still the eos reply's."""
    assert loaded.engine.steps.row_prefill, "the served engine prefills joining rows alone"
    c = client(server)
    out = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=40, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 40 and out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith("The capital of France is Paris")


def test_completions_route_on_the_real_engine(server, loaded):
    c = client(server)
    prompt = loaded.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    out = c.completions.create(model="e2b", prompt=prompt, max_tokens=24)
    assert "Paris" in out.choices[0].text


@pytest.fixture(scope="module")
def host_lm():
    """The host reference of the served model (the same trained tiny E2B)."""
    from gemma4lib.port import load_model

    return load_model(PortSettings(**serving_defaults(SERVED))).lm


def test_logprobs_equal_the_host_reference_plain_and_streamed(server, loaded, alone, host_lm):
    """Each token's log-probability and the top 5 alternatives' equal log_softmax of the host reference's
    teacher-forced logits, within twice the logit tolerance (a log-softmax moves by at most twice the
    largest logit error); the stream's equal the plain reply's; completions give the same numbers."""
    import torch

    from gemma4lib.checks import logits_tolerance
    from gemma4lib.reference import logits_spread, teacher_forced_logits

    c, n = client(server), 8
    out = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=n, logprobs=True, top_logprobs=5)
    tokens = alone["France"][:n]
    prompt = loaded.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reference = teacher_forced_logits(host_lm, prompt, tokens)
    tolerance = 2 * logits_tolerance(logits_spread(host_lm, prompt, tokens, reference)[0])
    expected = torch.log_softmax(reference, dim=-1)
    entries = out.choices[0].logprobs.content
    assert len(entries) == n
    for i, entry in enumerate(entries):
        assert entry.token == loaded.tokenizer.decode([tokens[i]])
        assert abs(entry.logprob - float(expected[i, tokens[i]])) <= tolerance, (i, entry.logprob)
        best = torch.topk(expected[i], 5).values.tolist()
        assert max(abs(t.logprob - b) for t, b in zip(entry.top_logprobs, best, strict=True)) <= tolerance
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the likeliest
    worst = max(abs(e.logprob - float(expected[i, tokens[i]])) for i, e in enumerate(entries))
    print(f"logprobs vs host reference: worst {worst:.3g} <= {tolerance:.3g}")
    streamed = []
    for chunk in c.chat.completions.create(
        model="e2b", messages=QUESTION, max_tokens=n, logprobs=True, top_logprobs=5, stream=True
    ):
        streamed += chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    text = loaded.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    done = c.completions.create(model="e2b", prompt=text, max_tokens=n, logprobs=3)
    assert all(len(top) == 3 for top in done.choices[0].logprobs.top_logprobs)
    assert len(done.choices[0].logprobs.token_logprobs) == n


def test_echo_logprobs_of_the_prompt_equal_the_teacher_forced_reference(server, loaded, host_lm):
    """What lm-eval's log-likelihood requests send (echo, logprobs 1, max_tokens 1): each prompt token's
    log-probability equals log_softmax of the host reference's teacher-forced logits (within twice the
    logit tolerance), the first has none, the text is the prompt and the reply."""
    import httpx
    import torch

    from gemma4lib.checks import logits_tolerance
    from gemma4lib.reference import logits_spread, teacher_forced_logits

    text = loaded.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    text += "The capital of France is Paris"
    body = {"model": "e2b", "prompt": text, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    ids = server.served.scheduler.codec.text(text)
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    assert out["choices"][0]["text"].startswith(text) and out["usage"]["prompt_tokens"] == len(ids)
    reference = teacher_forced_logits(host_lm, ids[:1], ids[1:])
    tolerance = 2 * logits_tolerance(logits_spread(host_lm, ids[:1], ids[1:], reference)[0])
    expected = torch.log_softmax(reference, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(logprobs["token_logprobs"][1 : len(ids)], dtype=torch.float64)
    worst = float((got - expected).abs().max())
    print(f"echo logprobs of {len(ids) - 1} prompt tokens vs teacher-forced: worst {worst:.3g} <= {tolerance:.3g}")
    assert worst <= tolerance
    paris = max(i for i, token in enumerate(logprobs["tokens"][: len(ids)]) if "Par" in token)
    assert logprobs["token_logprobs"][paris] > -1.0  # "Paris" after "The capital of France is": the model is sure


def test_token_id_prompts_score_as_their_text_and_ids_outside_the_vocabulary_are_a_400(server, loaded):
    """OpenAI's token-id prompts (what lm-eval's `local-completions` sends): the ids of a text prompt
    give its reply and its echoed log-probabilities exactly, one or a list; an id outside the model's
    vocabulary is a 400 saying so, echoed or not, before any row runs."""
    import httpx

    text = loaded.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = server.served.scheduler.codec.text(text)

    def post(prompt, **fields):
        body = {"model": "e2b", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

    by_text, by_ids, both = post(text).json(), post(ids).json(), post([ids, ids]).json()
    assert "Paris" in by_text["choices"][0]["text"]
    assert [c["text"] for c in both["choices"]] == [by_text["choices"][0]["text"]] * 2
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]
    echo = {"max_tokens": 1, "logprobs": 1, "echo": True}
    text_echo, ids_echo = post(text, **echo).json()["choices"][0], post([ids], **echo).json()["choices"][0]
    assert ids_echo["logprobs"] == text_echo["logprobs"]
    assert ids_echo["text"] == loaded.tokenizer.decode(ids) + text_echo["text"][len(text) :]
    vocab = loaded.engine.vocab_size
    for fields in ({}, echo):
        bad = post([*ids[:-1], vocab], **fields)
        assert bad.status_code == 400 and "outside this model's vocabulary" in bad.json()["error"]["message"]
    assert post([ids, []]).status_code == 400 and post([-1, *ids]).status_code == 400


def test_lm_eval_log_likelihoods_over_http_equal_in_process(server, loaded, host_lm, tmp_path):
    """lm-eval's `local-completions` on the multiple-choice capitals (token-id prompts, echo and
    logprobs: the server teacher-forces each through its decode graph) and `EngineLM` in process
    (the question prefilled, the answer forced on the engine's rows): the same accuracy, well above
    chance (1 in 4), and every answer's log-likelihood within the logit tolerance per token (twice it:
    a log-softmax moves by at most twice the largest logit error). The in-process figure of the right
    answer to France is the host reference's teacher-forced one too."""
    import json

    import torch

    from gemma4lab.serving.evaluation import CHOICE_DATA, CHOICE_TASK, choose_over_endpoint, evaluate_in_process
    from gemma4lib.checks import logits_tolerance
    from gemma4lib.models.trained import TOKENIZER_DIR
    from gemma4lib.reference import logits_spread, teacher_forced_logits

    over_http = choose_over_endpoint(server.url, "e2b", TOKENIZER_DIR, tmp_path / "http")
    scheduler = server.served.scheduler
    assert scheduler.idle()
    with scheduler.paused():
        local = evaluate_in_process(
            loaded.engine, loaded.tokenizer, loaded.eos_ids, tmp_path / "local", task=CHOICE_TASK
        )
    assert over_http["acc"] == local["acc"] > 0.5

    def answer_of(country: str, capital: str) -> tuple[list[int], list[int]]:
        """Question and answer ids as lm-eval splits them: it moves the template's trailing newline
        into the answer (`_encode_pair`)."""
        ask = [{"role": "user", "content": f"What is the capital of {country}?"}]
        context = loaded.tokenizer.apply_chat_template(ask, add_generation_prompt=True, tokenize=False)
        prompt = loaded.tokenizer(context.rstrip(), add_special_tokens=False)["input_ids"]
        whole = loaded.tokenizer(f"{context}The capital of {country} is {capital}.", add_special_tokens=False)
        return prompt, whole["input_ids"][len(prompt) :]

    prompt, answer = answer_of("France", "Paris")
    reference = teacher_forced_logits(host_lm, prompt, answer)
    per_token = 2 * logits_tolerance(logits_spread(host_lm, prompt, answer, reference)[0])
    expected = float(torch.log_softmax(reference.float(), dim=-1)[torch.arange(len(answer)), answer].sum())
    assert abs(local["loglikelihoods"]["France"][0] - expected) <= len(answer) * per_token
    worst = 0.0
    for doc in map(json.loads, CHOICE_DATA.read_text().splitlines()):
        pairs = zip(over_http["loglikelihoods"][doc["country"]], local["loglikelihoods"][doc["country"]], strict=True)
        for capital, (http_ll, local_ll) in zip(doc["choices"], pairs, strict=True):
            gap = abs(http_ll - local_ll)
            assert gap <= len(answer_of(doc["country"], capital)[1]) * per_token, (doc, capital, gap)
            worst = max(worst, gap)
    print(f"lm-eval acc: endpoint {over_http['acc']:.4f}, in process {local['acc']:.4f}; worst ll gap {worst:.3g}")


def schemas_to_hold(n: int) -> list[dict]:
    """`n` different JSON schemas whose every value ends within a tiny model's budget (bounded
    strings, enums, bounded integers, booleans, short arrays), varied in names, kinds and order."""
    kinds = [
        {"type": "string", "maxLength": 6},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "boolean"},
        {"enum": ["Paris", "Rome", "Lima"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    ]
    names = ["city", "count", "ok", "capital", "digits", "name", "n"]
    out = []
    for i in range(n):
        keys = [names[(i + j) % len(names)] for j in range(1 + i % 3)]
        props = {k: kinds[(i + j * 2) % len(kinds)] for j, k in enumerate(keys)}
        out.append({"type": "object", "properties": props, "required": keys, "additionalProperties": False})
    return out


def test_json_schema_replies_validate_and_the_other_rows_are_unchanged(server, loaded, alone):
    """20 schemas, each reply (greedy, masked by the grammar on its row) parses and validates; the
    unconstrained requests running beside them get exactly the tokens they get alone."""
    import json

    import jsonschema

    c = client(server)
    schemas = schemas_to_hold(20)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 20
    free: dict[str, str] = {}

    async def run():
        from openai import AsyncOpenAI

        ac = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def constrained(schema):
            rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
            out = await ac.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=90, response_format=rf)
            return out.choices[0]

        async def unconstrained(country):
            msgs = [{"role": "user", "content": f"What is the capital of {country}?"}]
            out = await ac.chat.completions.create(model="e2b", messages=msgs, max_tokens=24)
            free[country] = out.choices[0].message.content

        jobs = [constrained(s) for s in schemas] + [unconstrained(k) for k in COUNTRIES[:4]]
        return (await asyncio.gather(*jobs))[: len(schemas)]

    choices = asyncio.run(run())
    for schema, choice in zip(schemas, choices, strict=True):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    for country, text in free.items():
        assert text == loaded.tokenizer.decode(alone[country], skip_special_tokens=True)
    obj = c.chat.completions.create(
        model="e2b", messages=QUESTION, max_tokens=90, response_format={"type": "json_object"}
    )
    text, reason = obj.choices[0].message.content, obj.choices[0].finish_reason
    print("json_object reply:", text, reason)
    assert text.startswith("{")  # an object from its first token; a whole one when it ended by itself
    assert reason == "length" or isinstance(json.loads(text), dict)


def test_langchain_with_structured_output_gets_a_valid_object(server):
    """LangChain's `with_structured_output` (a json_schema response_format) against the tiny model: the
    grammar holds the reply to the schema, LangChain parses it into its pydantic class."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        city: str = Field(max_length=8)
        known: bool

    llm = ChatOpenAI(model="e2b", base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60, max_tokens=60)
    answer = llm.with_structured_output(Capital, method="json_schema", strict=True).invoke(QUESTION[0]["content"])
    print("with_structured_output:", answer)
    assert isinstance(answer, Capital) and len(answer.city) <= 8


def test_a_prompt_over_the_compiled_context_is_a_400(server):
    import openai

    with pytest.raises(openai.BadRequestError, match=f"compiled context length {SERVED['context_length']}"):
        client(server).chat.completions.create(model="e2b", messages=QUESTION, max_tokens=200)


def test_lm_eval_scores_the_endpoint_as_in_process(server, loaded, tmp_path):
    """lm-eval's local-chat-completions model over HTTP and `EngineLM` in process: same task file, same
    exact-match score, same reply for every question (the server is idle; the engine is used in turn)."""
    from gemma4lab.serving.evaluation import evaluate_endpoint, evaluate_in_process

    over_http = evaluate_endpoint(server.url, "e2b", tmp_path / "http")
    scheduler = server.served.scheduler
    assert scheduler.idle()
    with scheduler.paused():  # the engine is the scheduler's: borrow it while nothing runs
        local = evaluate_in_process(loaded.engine, loaded.tokenizer, loaded.eos_ids, tmp_path / "local")
    assert over_http["replies"] == local["replies"]
    assert over_http["exact_match"] == local["exact_match"]
    assert 0.5 < local["exact_match"] < 1.0  # the known capitals right, the invented places not
    assert local["replies"]["France"] == "The capital of France is Paris."
    print(f"lm-eval exact_match: endpoint {over_http['exact_match']:.4f}, in process {local['exact_match']:.4f}")


def test_serve_with_a_missing_or_wrong_bundle_exits_at_once(tmp_path):
    bad = tmp_path / "bundle"
    bad.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "gemma4lib", "serve", "--variant", "e2b", "--port", "1", "--artifacts"]
    missing = subprocess.run([*cmd, str(tmp_path / "none")], capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2 and "not a compiled-port bundle" in missing.stderr, missing.stderr
    (bad / "manifest.json").write_text("{not json")
    wrong = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert wrong.returncode == 2 and "error:" in wrong.stderr and "Traceback" not in wrong.stderr, wrong.stderr
    assert "manifest" in wrong.stderr


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["e4b", "12b", "31b", "26b-a4b"])
def test_every_variant_answers_paris_through_the_endpoint(variant):
    one = load_engine(PortSettings(**serving_defaults({"variant": variant, "profile": "smoke", "batch_size": 2})))
    served = build_served(one.engine, one.tokenizer, model_name=one.model_name, eos_ids=one.eos_ids)
    with BackgroundServer(served) as background:
        c = client(background)
        plain = c.chat.completions.create(model=one.model_name, messages=QUESTION, max_tokens=24)
        chunks = c.chat.completions.create(model=one.model_name, messages=QUESTION, max_tokens=24, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "Paris" in plain.choices[0].message.content
    assert streamed == plain.choices[0].message.content


def test_the_serve_command_answers_then_drains_on_sigterm(loaded):
    """`python -m gemma4lib serve` as a user runs it (the module's compile is in the cache, so it only
    loads): Paris over HTTP from its own process, then SIGTERM and exit 0."""
    import signal
    import time

    import httpx

    from gemma4lib.server.launch import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    shapes = ["--context-length", str(SERVED["context_length"]), "--prefill-buckets", str(*SERVED["prefill_buckets"])]
    cmd = [sys.executable, "-m", "gemma4lib", "serve", "--variant", "e2b", "--batch", "4", *shapes, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health is not None and health["rows"] == 4, proc.stdout.read() if proc.poll() is not None else health
        assert health["compile_s"] == 0  # the graphs came from the cache the module's fixture filled
        answer = client(type("S", (), {"url": url})()).chat.completions.create(model="e2b", messages=QUESTION)
        assert "Paris" in answer.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0 and "drained: every started request finished" in log, log


@pytest.mark.slow
def test_drafted_steps_stream_through_the_endpoint():
    """With Gemma-4's assistant drafting, a step hands a row 1..k+1 tokens: the streamed text still
    equals the plain reply and the reply the drafted engine gives alone (greedy-exact)."""
    one = load_engine(PortSettings(variant="e2b", profile="smoke", batch_size=2, draft="assistant"))
    ids = one.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = one.tokenizer.decode(
        one.engine.generate(list(ids), 24, eos_token_ids=one.eos_ids).tokens, skip_special_tokens=True
    )
    served = build_served(one.engine, one.tokenizer, model_name=one.model_name, eos_ids=one.eos_ids)
    with BackgroundServer(served) as background:
        c = client(background)
        plain = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=24)
        chunks = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=24, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "Paris" in want and plain.choices[0].message.content == want == streamed


def _reused_tokens(server) -> float:
    import httpx

    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith("gemma4lib_reused_prompt_tokens_total")))


def test_a_second_turn_reuses_the_first_turns_kv_and_answers_as_a_cold_request(server, loaded):
    """The next turn of a conversation goes to the row that served the first: its prompt's first
    tokens (the first turn's prompt and reply) are not prefilled again (the metric counts them), and
    its reply equals the one the same prompt gets on a cold row."""
    c = client(server)
    first = c.chat.completions.create(model="e2b", messages=QUESTION, max_tokens=24).choices[0].message.content
    turn = [*QUESTION, {"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    before = _reused_tokens(server)
    warm = c.chat.completions.create(model="e2b", messages=turn, max_tokens=24)
    reused = _reused_tokens(server) - before
    ids = loaded.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
    first_prompt = loaded.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(first_prompt) <= reused < len(ids)
    with server.served.scheduler.paused() as engine:  # the engine alone; `generate` never reuses
        cold = engine.generate(list(ids), 24, eos_token_ids=loaded.eos_ids)
    assert cold.reused == 0
    assert warm.choices[0].message.content == loaded.tokenizer.decode(cold.tokens, skip_special_tokens=True)
