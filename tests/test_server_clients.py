"""Clients nobody here wrote, against the endpoint on 127.0.0.1: the OpenAI Agents SDK running a
function-tool agent to its final answer, LangChain's `ChatOpenAI.bind_tools`.

Against the scripted fake of tests/test_server_tools.py (Gemma-4's reply format, a small
tool-declaring template): it calls the first declared tool with `country: France` and, once the tool
has answered, answers with the tool's result; what this proves is the protocol (the clients' own
request shapes, our parsing of the call, their tool loop over our `tool` messages), whatever a model
would write. The same clients against the real tiny E2B (compiled, served with its own tokenizer and
chat template: the model itself picks the declared tool, writes the argument from the question, and
answers with the tool's made-up result) are written below; they skip only if the shipped E2B's record
says it was not taught tools (`gemma4lab.training.tools`, `scripts/train_tools.py`).
LangChain's `with_structured_output` runs against the compiled tiny model (tests/test_server_engine.py).
"""

from __future__ import annotations

import asyncio

import pytest
from test_server import EOS
from test_server_tools import MODEL, ScriptedEngine, served, tool_tokenizer  # noqa: F401 (fixtures)

from gemma4lab.serving.background import BackgroundServer
from gemma4lib.server.launch import build_served

CALLS: list[str] = []


def get_capital(country: str) -> str:
    """The capital city of a country."""
    CALLS.append(country)
    return {"France": "Lutetia"}.get(country, "unknown")


class FirstToolEngine(ScriptedEngine):
    """Calls the first declared tool (whatever the client named it) with `country: France`."""

    def answer(self, request) -> list[int]:
        prompt = self.tokenizer.decode(list(request.prompt_ids))
        if "<|tool>declaration:" in prompt and "<|tool_response>" not in prompt:
            name = prompt.split("<|tool>declaration:", 1)[1].split("{", 1)[0]
            text = f'<|tool_call>call:{name}{{country:<|"|>France<|"|>}}<tool_call|>'
            return [*self.tokenizer(text, add_special_tokens=False)["input_ids"], EOS]
        return super().answer(request)


@pytest.fixture(scope="module")
def server(tool_tokenizer):  # noqa: F811
    engine = FirstToolEngine(tool_tokenizer, batch=2, context_length=512)
    background = BackgroundServer(build_served(engine, tool_tokenizer, model_name=MODEL, eos_ids=(EOS,))).start()
    yield background
    background.stop()


def test_the_agents_sdk_runs_a_function_tool_agent_to_its_final_answer(server):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    agent = Agent(
        name="geographer",
        instructions="Answer with the tool's result.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        tools=[function_tool(get_capital)],
    )
    CALLS.clear()
    result = asyncio.run(asyncio.wait_for(Runner.run(agent, "What is the capital of France?", max_turns=4), 60))
    assert CALLS == ["France"]  # the SDK ran our parsed call against its Python function
    assert result.final_output == "The capital of France is Lutetia."  # the tool's result, used


def test_langchain_bind_tools_gets_the_parsed_call(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    bound = llm.bind_tools([get_capital])
    question = HumanMessage("What is the capital of France?")
    first = bound.invoke([question])
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_capital", {"country": "France"})]
    result = ToolMessage(get_capital(**first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])
    final = bound.invoke([question, first, result])
    assert final.content == "The capital of France is Lutetia." and not final.tool_calls


def test_the_notebooks_tool_loop_cell_takes_the_native_route_on_a_tool_template(served, capsys):  # noqa: F811
    """07_serve's tool-loop cell against a server whose template declares tools (test_server_tools'
    scripted engine, its rows held by the grammar, its arguments' keys not the declared ones): it forces
    the call, parses it from `tool_calls`, runs it, and sends the result back as a tool turn, an error
    when the arguments break the declared schema (which the grammar does not hold them to), the branch
    the tiny E2B's valid calls never take in the notebook; the scripted model's final reply quotes it."""
    import json
    from pathlib import Path

    import jsonschema
    import nbformat
    from openai import BadRequestError, OpenAI

    from gemma4lib.models.corpus import COUNTRIES

    path = Path(__file__).resolve().parent.parent / "notebooks" / "07_serve.ipynb"
    (cell,) = [c.source for c in nbformat.read(str(path), as_version=4).cells if "tools_started =" in c.source]
    server, _ = served
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    namespace = {"client": client, "variant": MODEL, "question": [{"role": "user", "content": "Capital of France?"}]}
    namespace.update(
        max_tokens=160, COUNTRIES=COUNTRIES, json=json, jsonschema=jsonschema, BadRequestError=BadRequestError
    )
    exec(compile(cell, "07_serve.ipynb[tool loop]", "exec"), {"time": __import__("time"), **namespace}, namespace)
    printed = capsys.readouterr().out
    assert "tools refused" not in printed and '"type": "function"' in printed  # the raw call, from tool_calls
    # the grammar held the name; the arguments (this scripted model's keys) are checked, not trusted
    valid = jsonschema.Draft202012Validator(namespace["parameters"]).is_valid(namespace["call_args"])
    assert namespace["name"] == "get_capital" and namespace["call_valid"] is valid
    print("arguments:", namespace["call_args"], "valid:", valid, "result:", namespace["tool_result"])
    assert namespace["tool_final"] == f"The capital of France is {namespace['tool_result']}."


# ---- the real tiny E2B, taught tools (gemma4lab.training.tools), through the real server ------------------

REAL = {"variant": "e2b", "profile": "smoke", "batch_size": 2, "context_length": 384, "prefill_buckets": (128,)}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CAPITAL = {
    "type": "function",
    "function": {
        "name": "get_capital",
        "description": "A country's capital.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}},
    },
}


def lutetia(country: str) -> str:
    """The capital city of a country."""
    CALLS.append(country)
    return {"France": "Lutetia"}.get(country, "unknown")  # made up: a final answer naming it used the result


@pytest.fixture(scope="module")
def real():
    """The compiled tiny E2B (cpu backend) served on 127.0.0.1, its own tokenizer and template; skipped
    while the fixture has not been taught tools."""
    from gemma4lib.cli import load_engine, serving_defaults
    from gemma4lib.models.trained import read_provenance
    from gemma4lib.port import PortSettings

    if not read_provenance()["variants"]["e2b"].get("tools", {}).get("converged"):
        pytest.skip("the E2B fixture was not taught tools: scripts/train_tools.py has not converged (tools.py)")

    loaded = load_engine(PortSettings(**serving_defaults(REAL)))
    app = build_served(loaded.engine, loaded.tokenizer, model_name="e2b", eos_ids=loaded.eos_ids)
    with BackgroundServer(app) as background:
        yield background, loaded


def test_the_agents_sdk_agent_reaches_the_tiny_e2bs_answer_with_the_tools_result(real):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    server, _ = real
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    agent = Agent(
        name="geographer",
        instructions="Answer with the tool's result.",
        model=OpenAIChatCompletionsModel(model="e2b", openai_client=client),
        tools=[function_tool(lutetia, name_override="get_capital")],
    )
    CALLS.clear()
    result = asyncio.run(asyncio.wait_for(Runner.run(agent, "What is the capital of France?", max_turns=4), 120))
    assert CALLS == ["France"]  # the model called the declared tool with the country it was asked about
    assert result.final_output == "The capital of France is Lutetia."  # the tool's made-up result, not Paris


def test_langchain_bind_tools_on_the_tiny_e2b_calls_and_uses_the_result(real):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI

    server, _ = real
    llm = ChatOpenAI(model="e2b", base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    bound = llm.bind_tools([StructuredTool.from_function(lutetia, name="get_capital"), WEATHER])
    question = HumanMessage("What is the capital of France?")
    first = bound.invoke([question])
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_capital", {"country": "France"})]
    result = ToolMessage(lutetia(**first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])
    final = bound.invoke([question, first, result])
    assert final.content == "The capital of France is Lutetia." and not final.tool_calls
    weather = bound.invoke([HumanMessage("What is the weather in Rome?")])
    assert [(c["name"], c["args"]) for c in weather.tool_calls] == [("get_weather", {"city": "Rome"})]


def test_an_auto_tool_call_of_the_tiny_e2b_parses_as_transformers_parser_does(real):
    """`tool_choice: auto` (nothing forced): the model's own call, plain and streamed, equals transformers'
    Gemma-4 parser on the host model's greedy text for the same prompt (special tokens kept)."""
    import json

    import torch
    from openai import OpenAI
    from test_server_tools import reference_calls

    from gemma4lib.models.trained import load_trained

    server, loaded = real
    tools = [WEATHER, CAPITAL]
    messages = [{"role": "user", "content": "Tell me the capital of Japan."}]
    host = load_trained("e2b")
    ids = host.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)
    out = host.lm.generate(
        input_ids=torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=list(loaded.eos_ids)
    )
    text = host.tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=False)
    expected = reference_calls(host.tokenizer, text)
    assert expected == [("get_capital", {"country": "Japan"})], text
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model="e2b", messages=messages, tools=tools, tool_choice="auto")
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
    calls = {}
    for chunk in client.chat.completions.create(model="e2b", messages=messages, tools=tools, stream=True):
        for call in chunk.choices[0].delta.tool_calls or ():
            calls.setdefault(call.index, call.function)
    assert [(f.name, json.loads(f.arguments)) for _, f in sorted(calls.items())] == expected


def test_the_tiny_e2b_thinks_into_reasoning_content_then_answers_or_calls(real):
    """Thinking on (`chat_template_kwargs.enable_thinking`, vLLM's spelling): the fixture taught a short thought
    (gemma4lab.training.tools, `THOUGHT_KINDS`) thinks first; the thought comes back as `reasoning_content`, plain
    and streamed, never in `content`; then it answers, or calls the declared tool. Its answer with thinking off is
    unchanged. Skipped for a fixture whose record says it was not taught to think."""
    import json

    from openai import OpenAI
    from test_server_tools import streamed

    from gemma4lib.models.trained import read_provenance

    shares = dict(read_provenance()["variants"]["e2b"]["tools"]["train_config"]["kind_shares"])
    if not shares.get("capital_thought"):
        pytest.skip("the E2B fixture was not taught to think: its last tool run drew no thinking kind (tools.py)")
    server, _ = real
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="e2b", messages=messages, max_tokens=64, extra_body=think)
    message = plain.choices[0].message
    assert message.model_extra["reasoning_content"] == "I know the capital of France."
    assert message.content == "The capital of France is Paris." and plain.choices[0].finish_reason == "stop"
    assert streamed(client, model="e2b", messages=messages, max_tokens=64, extra_body=think) == (
        message.content,
        message.model_extra["reasoning_content"],
        [],
        "stop",
    )
    off = client.chat.completions.create(model="e2b", messages=messages, max_tokens=64)
    assert off.choices[0].message.content == "The capital of France is Paris."
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content")
    tools = [WEATHER, CAPITAL]
    called = client.chat.completions.create(
        model="e2b", messages=messages, tools=tools, max_tokens=64, extra_body=think
    )
    message = called.choices[0].message
    assert message.model_extra["reasoning_content"] == "I will call get_capital for France."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_capital", {"country": "France"})
    ]
    assert not message.content and called.choices[0].finish_reason == "tool_calls"
