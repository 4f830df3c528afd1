"""Clients nobody here wrote, against the endpoint on 127.0.0.1: the OpenAI Agents SDK running a
function-tool agent to its final answer, LangChain's `ChatOpenAI.bind_tools`.

The engine is the scripted fake of tests/test_server_tools.py (Gemma-4's reply format, the tool
tokens and a tool-declaring template): it calls the first declared tool with `country: France` and,
once the tool has answered, answers with the tool's result. What this proves is the protocol: the
clients' own request shapes, our parsing of the call, their tool loop over our `tool` messages. The
trained tiny models know no tools yet (their coherence on tool calls is not shown here).
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
    scripted engine, its rows held by the grammar): the `try` branch, which the tiny fixtures never
    reach, forces the call, parses it from `tool_calls`, runs it, and sends the result back as a tool
    turn (an error when the arguments break the declared schema, which the grammar does not hold them to);
    the scripted model's final reply then quotes that result."""
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
