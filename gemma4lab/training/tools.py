"""Tool calls for the tiny fixtures (issue 49, item 5): a small tool corpus in Gemma-4's format, and the
short fine-tune that teaches it to a fixture while keeping everything it knew.

Why: a tool-calling client (an agent, `bind_tools`) against a fixture that knows no tools shows only
the protocol; coherence on a tool call (the right function, the right argument, an answer that uses
the tool's result) needs a model that was taught to call.

The corpus (seeded, so the same on every run): a user asks a capital question ("What is the capital of
France?") or a weather one ("What is the weather in Paris?"); the request declares one to three tools
drawn from a pool, in a shuffled order, with varied descriptions (`get_capital(country)`,
`get_weather(city)` and unrelated ones: `get_time`, `get_population`, `convert_currency`,
`search_web`, `send_email`), sometimes after a system message. When the matching tool is declared
the model calls it, `<|tool_call>call:get_capital{country:<|"|>France<|"|>}<tool_call|>`, then
`<|tool_response>` (Gemma-4's stop after its calls); after the tool's result
(`<|tool_response>response:get_capital{value:<|"|>Zanmor<|"|>}<tool_response|>`, the tools declared
again or not) it answers with
the result, "The capital of France is Zanmor.", a made-up capital half of the time, so the answer
can only come from the result; when no matching tool is declared it answers from what it knows, and
a general fact is answered plainly whatever is declared. Every prompt is rendered by the fixture
tokenizer's template with tools (`gemma4lab.training.tokenizer.TOOLS_CHAT_TEMPLATE`), so training sees
what the server would send.

Fine-tune (deterministic: seeded, one thread): first `tool_first_steps` steps of tool chats and
`replay_rows` training chats only (about half a full step's cost), then the needle's recipe
(`gemma4lab.training.needle`) with tool chats added: each step the 128 training chats as they are, the
faults' hinge (`fault_rows` chats under each trained fault, every reply token pushed below
-`fault_hinge_target`), the needle rows (one long filler, `short_rows` short ones: the needle must stay
answered) and `tool_rows` tool chats. Loss on the reply tokens, a tool reply's name and value tokens
weighted by `copy_weight`; the learning rate constant after its warm-up. It stops when every training
chat is right by `margin`, every chat of the fixed tool set (`tool_eval_chats`) by `tool_margin`, every
chat of the needle set by `needle_margin`, and every trained fault breaks every training chat by
`fault_margin`. When it does not within `max_steps`, it returns the evaluated state with the most tool
chats passing among those that kept every earlier property (training chats, needle, faults), and says
so (`converged` False). Each evaluation logs `failing_tokens`: the reply tokens below the margin by
kind (the function's name, the copied value, the question's country or city repeated in an answer,
other) and the chats passing by chat kind.

Measured, NOT converged (E2B, seed 0, one thread, 2026-12-06, loaded two-core AMD EPYC):
- the first recipe (no tool-first phase, no copy weight, cosine to 0.1 over 240 steps): 240 steps in
  890 s, best 77 of the 204 tool chats right by margin 1 (step 200), 3 of 68 exact under HF greedy;
  continued to 425 steps it plateaued at 89/204 with the learning rate at its floor. Every earlier
  property held (training chats' margin 2.70, held-out 40/40, the needle 40/40, faults <= -9.97).
- this recipe (`--tool-first-steps 300 --max-steps 200`, copy weight 5, lr 2e-3 constant): after the
  tool-first phase 77/204 (calls 3/34 capital, 0/34 weather; answers after the tool turn 13/34 capital,
  0/34 weather; no tool to call 34/34; facts with tools declared 27/34). The full recipe then restores
  the faults' hinge (it drifts in the tool-first phase: training chats' margin -8.3 at step 10, 1.15 at
  step 125) and ends at step 200 with 92/204, the most of any run (calls 7/34 capital, 0/34 weather;
  answers after the tool turn 18/34 capital, 0/34 weather; no tool 34/34; facts 33/34), every earlier
  property kept: training chats' margin 2.60, the needle set's 3.80, faults <= -7.35. Failing tokens
  at every evaluation: never the function's name (0 of 204 chats), the value 178-208, other 66-261 (this
  run's code counted the question's country in an answer as other; `failing_tokens` now calls it asked).
  HF greedy: 19 of 68 exact (3 before), 11 of 36 on the held-out countries; held-out 40/40, after 3,000
  tokens of filler 40/40. 2,425 s in all (other jobs shared the two cores). Still wrong: the country or
  city ("Which city is the capital of Germany?" -> `get_capital{country:"Norway"}`, "The weather in
  Jakarta is cold." for Paris, the result "cold" used right). Its log, parsed:
  docs/measurements/tool_finetune_2026-12-06.json.

Diagnosis (the failing tokens by kind, and on a tool-only scratch run of 150 steps the first wrong token
of each chat): the model picks the right function every time but cannot bring the question's country or
city to where it is needed. A call's argument is predicted as one constant first piece ("C" for France,
Germany and Spain; "B" for Paris, Rome and Madrid: 26 of 34 calls fail at the argument's first piece),
and an answer after the tool turn fails at the question's country ("The capital of Hungary is ..."),
though the same model answers the plain question right. Why (a reading of that evidence, not a
measured mechanism): the fixture's window is 8 tokens. The plain answer repeats the country 10 tokens
after the question's; a call's argument comes 27 after it (`call:get_capital{country:<|"|>` alone is 19
pieces of the fixture's vocabulary), an answer after the tool turn about 60. So the country must be
relayed through the stacked sliding layers or fetched by the two global layers (4, and 9, which reuses
4's keys and values), and neither learnt to for these distances in the budget: in every corpus chat,
and in the needle, the question ends within about 10 tokens of its answer. The argument's pieces also
differ from the question's (" France" is one piece; "France" after the quote is "F", "rance"): a mapping
per country on top. What would help next: teach the global layers to retrieve first (a curriculum of
chats whose answer repeats the question's country after a growing number of tokens, no tools), then the
tool corpus; or give the fixtures a wider window (the released E2B's is 512), which means retraining
them and re-checking the sliding-window fault, which short chats inside the window would no longer show.

Measured, the retrieval curriculum (`retrieval_steps`, off by default; scratch probes of the first phases only,
`scripts/probe_tools.py`, E2B seed 0, 2026-12-06, the other core busy; figures by kind in
docs/measurements/tool_finetune_2026-12-06_curriculum.json): 900 retrieval steps (300 at each gap, 317 s)
then 150 tool-first steps: 127 of 204 tool chats by margin (the same 150 tool-first steps alone: 36), the calls'
argument's first piece the argmax in 67 of 68 calls (alone: 14; 53 after the retrieval phase, before any tool
chat), calls 32/34 capital and 20/34 weather (alone: 0 and 0), answers after the tool turn 14/34 capital and
0/34 weather, no tool 33/34, facts 28/34; 90 retrieval steps did nothing (13/68). With the recipe's 300
tool-first steps (the same retrieval phase, reproduced exactly): 147/204 (the recorded run's phase: 77), first
piece 68/68, calls 33/34 and 24/34, answers after the tool turn 18/34 and 5/34, no tool 33/34, facts 34/34.
Still failing: the weather answer (its result word, and the city), 82 value tokens.

Measured, the full run with the curriculum, NOT converged (`scripts/train_tools.py --variant e2b --retrieval-steps
900`, E2B seed 0, 2026-12-07, 1,894 s of training; docs/measurements/tool_finetune_2026-12-07.json):
the first phases reproduce the probe exactly (147/204); the full recipe's evaluations 147, 76, 121, 147, 145, 139,
157, 151, 135 (every 25 steps); kept step 150, every earlier property held (training chats' margin 2.09, the needle
set's 3.05, faults <= -15.7, held-out 40/40, after filler 40/40): 157/204 by margin (calls 32/34 capital, 24/34
weather; answers after the tool turn 21/34 capital, 17/34 weather; no tool 34/34; facts 29/34), HF greedy 55 of 68
exact (the recorded best: 19), 11 of 36 on the held-out countries (calls name a trained country instead). 12 of the
13 greedy failures are the weather's word ("rainy" -> "warm", "stormy" -> "sunny"); the failing tokens at the kept
step are the tool result's copy (capital answers: all on made-up results, the first piece 13 and later pieces 23;
weather answers: the city 10, the word 5 first and 6 later) and a call's later argument pieces (12). The weather
answers swing between evaluations (5 to 17 to 4 of 34): the word 15 tokens after the result, past the 8-token
window, loses to the nine words' prior. Next lever, `retrieval_result_share` (off by default): curriculum chats
that copy a tool result's quoted value into an answer's spelling. Probed at 0.3 (the same 900 + 300 first phases,
1,083 s): 155/204 (147 without), weather answers 28/34 (5), capital answers 19/34 (18), no tool 34/34, facts 29/34,
but calls 29/34 and 16/34 (33, 24), the argument's first piece 4/68 after the retrieval phase (53 without) and 60/68
after the tool-first one (68): the result copies take steps from the country's. The next full try:
`scripts/train_tools.py --variant e2b --retrieval-steps 900 --retrieval-result-share 0.3` (or more retrieval steps,
to keep the calls). More answer rows instead (`--kind-shares capital_call=0.2,capital_answer=0.3,weather_answer=0.25`,
900 + 150 steps, 624 s) did worse: 104/204 (127 with the recorded shares), capital calls 0/34 (32), weather answers
5/34 (0), capital answers 20/34 (14).

Measured, that full try, NOT converged (`--retrieval-result-share 0.3`, 2026-12-07, 2,963 s of training on a loaded
machine; the file's `second_run`): evaluations 155, 78, 138, 144, 155, 143, 130, 164, 171, kept step 200 (the last,
still rising), every earlier property held (needle 3.34, faults <= -11.3): 171/204 (calls 31/34 capital, 20/34
weather; answers 21/34 capital, 33/34 weather; no tool 34/34; facts 32/34). The result share fixed the weather
answers; what fails is the later pieces of a copied city (capital answers 19, weather calls 12). The same recipe
with `--max-steps 400` (`third_run`; its first 200 steps repeat these exactly): 182/204 at step 400 (calls 29/34
capital, 30/34 weather; answers 21/34 capital, 34/34 weather; no tool and facts 34/34), about 10 chats per 200
steps, every earlier property held (training chats 5.82, needle 5.75, faults <= -12.6). The capital answer, which
copies the tool's result, is what stays short.

Measured, the copy practised after the curriculum, worse (2026-12-07, fifteenth session; the file's `fourth_run`):
the same recipe with `--retrieval-keep-rows 8 --retrieval-keep-result-share 1.0` (eight result-copy chats a step in the
later phases). Its retrieval phase repeats the second run's evaluations exactly, on another machine. Then 138/204 after
the tool-first phase (155 without the rows) and 135 at step 200 (171), where it was stopped: capital answers 19/34
(21), weather calls 5/34 (20), weather answers 18/34 (33). Copying a result quoted in a user turn does not carry over
to the answer after a tool turn, and the rows take steps from the calls.

Measured, what the passing capital answers are (`scripts/probe_tools.py`, the second run's first phases again, 812 s,
the `probes` of that file): 155/204, capital answers 19/34, and every one of the 19 is a chat whose result is the real
capital (21 of the 34). Not one of the 13 made-up results is copied, with a repeated piece (0/4) or without (0/9). The
model answers a capital from what it knows and ignores the result's name. The weather word, one of nine it knows, it
mostly takes from the result (28/34). What it has not learnt is to copy an unseen name piece by piece (an induction
copy), so the next lever is that copy itself, taught where it is short and easy before it is asked across a tool turn.
A first probe of that (`--retrieval-steps 2400 --tool-first-steps 0 --gaps 0,0,10,10 --retrieval-result-share 1.0`,
714 s): result copies only, 1,200 steps at gap 0 then 1,200 at gap 10. The gap-0 set reached 38/68, which is its 38
weather words; the gap-10 set 37/68 (35 weather words, so at least 2 of 33 capitals), and the gap-0 set fell back to
0/68. The copy learnt is tied to one distance, and a made-up name is hardly copied after about 19,000 capital copies:
this fixture (one global layer, 8-token window) does not pick up a content-addressed copy from these chats.

Measured, the distance varied from the first step (sixteenth session, the same file's `probes`): with every row's gap
drawn from 0-20 (`retrieval_mixed`, `--mixed-gaps`), result copies only, the made-up capitals ARE copied: 13/34 per gap
at step 600, 34/34 at every gap from step 2,400 (half the learning rate: 26-30 at 2,400). So the fixture can learn
the copy by content; a fixed distance let it learn a position instead. And with results that are another country's
real capital (`result_names="other_capital"`: a name it knows, as it knows the weather words, and still never its own
answer, so the answer can only come from the tool) the second run's first phases reach 195/204 (made-up: 155):
capital answers 34/34, every one of the 19 non-own results copied, calls 29/34 and 33/34, weather answers 31/34.
With made-up results kept and both copies mixed over gaps 0-70 (2,400 retrieval steps, half result copies, then the
300 tool-first steps): 191/204, calls 34/34 and 34/34, capital answers 29/34, and 11 of the 13 made-up results copied
(fixed gaps: 0 of 13). That is the curriculum the next full run takes (`--retrieval-mixed`). The full recipe with
other-capital results (`fifth_run`): NOT converged, 202/204 at step 400 (two capital calls short), every earlier
property held, HF greedy 67/68; swapped into a clone, the image, audio, trained-text and drafting tests pass on it
(135), except the E2B assistant's retraining, which follows its target: shipping a tool fixture retrains it.

Measured, CONVERGED (`sixth_run`: `--retrieval-steps 2400 --retrieval-gaps 0,4,8,12,16,20,30,45,70 --retrieval-mixed
--retrieval-result-share 0.5 --max-steps 400`, made-up results): at step 325, 204/204 by margin (min 1.71), HF greedy
68/68, every earlier property held (needle 6.45, faults <= -12.3, held-out 40/40). NOT shipped: in a clone, the Agents
SDK and LangChain make the right call, but the answer to the tests' result "Lutetia" is "Lutor". It copies unseen
names made of the 16 training syllables (4/4) and none with other pieces (0/6; `probe_tools.py --copy-names`): the
made-up names must be drawn from any pieces, then the E2B assistant retrained, before the fixture ships.

Shipped before the thought (`seventh_run`, seventeenth session): made-up results of any letters (`result_name`: 4-8
letters, consonant and vowel mostly alternating), 3,000 retrieval steps, otherwise the sixth run's command: 202/204 at
step 375 (kept); two continuations from the kept state (`--tool-first-steps 0`; at 5e-4, then at 2e-4: the recipe's
2e-3 shook it) reached 204/204 by margin (min 1.06), HF greedy 68/68, every earlier property held (needle 7.81, faults
<= -10.0, held-out 40/40). It copies 19 of 20 unseen names of every shape ("Lutetia", "Hobart", "Oaxaca", "Zwolle";
only "Valparaiso", longer than any trained result, loses a piece), and the Agents SDK and LangChain tests reach
"Lutetia" with it.

Measured, a short thought, NOT converged, NOT shipped (`eighth_run`, eighteenth session): the thinking kinds
(`THOUGHT_KINDS`, drawn only with `--kind-shares capital_thought=0.15,capital_call_thought=0.15`; the fixed set grows
from 204 to 272 chats, the 204 unchanged), continued from the seventh run's (then shipped) state with
`--tool-first-steps 0`. A thought that only restated the question ("The user asks about France.") left the choice to
call after it, far from the declarations: at 5e-4, after 275 steps, 15/34 thought answers and 0/34 thought calls, the
calls without thinking shaken to 7/34; discarded. A thought that says first what comes next (`thought_text`), at 1e-3:
270/272 at step 275 (kept), every thinking chat right (68/68), HF greedy 91/91, every earlier property held; two
capital answers stay short, the copies of the made-up "Saveo" and "Cmoai". Continued at 2e-4 and at 5e-4: 268-270.

Measured, the short thought again, NOT converged (`ninth_run`, nineteenth session). From the kept 270/272 state: four
result copies a step beside the recipe (`--retrieval-keep-rows 4`), 256-270; another draw of the rows (seed 1, 3e-4),
271 once (step 50), then 269-270; small steps from there (1e-4, evaluated every 5), 270-271; a probe's margin hinge on
the reply tokens, 254-270. From the seventh run's state at a lower thinking share (0.08 each), 183-198 by step 100.
What stays short is one copy: "Saveo", `S`+`ave`+`o`, where the model's second choice is another piece (`um`, `ac`);
the seventh run's state itself passes it by 1.06 only. The seventh run's whole recipe from the needle's state (its
retrieval curriculum first) with the thinking kinds drawn from the start: at 0.15 each, 263/272 at best; at 0.1 each,
269 at its last step (every earlier property held, HF greedy 91/91), and its continuation at 5e-4 (the seventh run's
first) 267-271, one capital answer short. That state (271) is where the next continuation (2e-4, as the seventh run's
second) starts.

SHIPPED, the short thought (`tenth_run`, twentieth session): H's kept state continued at 2e-4 (the seventh run's
second continuation) with two draws of the rows, run side by side. Seed 0 stayed at 270-271; seed 1 (`--seed 1
--tool-first-steps 0 --lr 2e-4 --kind-shares capital_thought=0.1,capital_call_thought=0.1`) passed all 272 chats by
margin at step 75 (min 1.17; the seventh run's state passed its 204 by 1.06), every thinking chat and both made-up
copies that had stayed short, every earlier property held (training chats 6.62, needle 5.63, faults <= -11.6, held-out
40/40, after filler 40/40), HF greedy 91/91. The E2B's chain (G10, H, this run) is in the fixtures' `PROVENANCE.json`;
the E2B assistant was retrained on it (`scripts/train_assistants.py --variant e2b`, which distils the thinking kinds
too).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gemma4lab.training.corpus import FACTS, TRAIN_PHRASINGS, Chat, answer_for, training_chats
from gemma4lab.training.needle import (
    NeedleConfig,
    _by_length,
    _loss,
    filler_text,
    needle_eval_chats,
    needle_rows,
    replay_loss,
)
from gemma4lab.training.needle import reply_margin_rows as needle_margin_rows
from gemma4lab.training.text import (
    IGNORE,
    Batch,
    _lr_at,
    encode_chats,
    fault_margins,
    pad_rows,
    reply_margins,
    trained_faults,
)
from gemma4lib.models.corpus import COUNTRIES

log = logging.getLogger(__name__)

# The variants taught tools (the others: only if cheap).
TOOL_VARIANTS: tuple[str, ...] = ("e2b",)
# Countries never asked in a tool chat (report only: the call and the answer on countries it was not
# shown calling for).
HELD_OUT_COUNTRIES: tuple[str, ...] = tuple(c for c, _ in COUNTRIES[-6:])
TOOL_COUNTRIES: tuple[str, ...] = tuple(c for c, _ in COUNTRIES if c not in HELD_OUT_COUNTRIES)
WEATHER_PHRASINGS: tuple[str, ...] = (
    "What is the weather in {city}?",
    "How is the weather in {city}?",
    "Tell me the weather in {city}.",
)
WEATHER_ANSWER = "The weather in {city} is {weather}."
WEATHERS: tuple[str, ...] = ("sunny", "rainy", "cloudy", "windy", "snowy", "foggy", "stormy", "warm", "cold")
SYSTEMS: tuple[str | None, ...] = (
    None,
    None,
    "You are a helpful assistant.",
    "Answer with the tool's result.",
    "Use the tools when they help.",
)
# Made-up capitals (so an answer naming one can only come from the tool's result). "Lutetia", the
# tests' result, is never among them.
_SYLLABLES = ("lu", "zan", "mor", "ka", "del", "ri", "vo", "sen", "ba", "tor", "nel", "pi", "gra", "os", "fen", "dor")
HELD_OUT_RESULT = "Lutetia"


def _param(name: str, description: str | None, typed: bool = True) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "string"} if typed else {}  # a client may leave the type out
    if description:
        prop["description"] = description
    return {"type": "object", "properties": {name: prop}, "required": [name]}


# (name, descriptions, parameter, parameter descriptions): the pool a request's tools are drawn from.
TOOL_POOL: tuple[tuple[str, tuple[str, ...], str, tuple[str | None, ...]], ...] = (
    (
        "get_capital",
        (
            "The capital of a country",
            "The capital city of a country.",
            "Look up the capital city of a country.",
            "Returns a country's capital city.",
            "A country's capital city.",
        ),
        "country",
        (None, "A country", "The country's name"),
    ),
    (
        "get_weather",
        ("The weather in a city", "Current weather for a city.", "Look up today's weather in a city."),
        "city",
        (None, "A city", "The city's name"),
    ),
    ("get_time", ("The local time in a city", "What time it is in a city."), "city", (None, "A city")),
    ("get_population", ("How many people live in a country", "A country's population."), "country", (None,)),
    ("convert_currency", ("Convert an amount of money", "Exchange rates between currencies."), "amount", (None,)),
    ("search_web", ("Search the web", "Find pages on the web about a topic."), "query", (None, "What to search")),
    ("send_email", ("Send an email", "Write an email to someone."), "to", (None, "The address")),
)


def tool_spec(rng: random.Random, name: str) -> dict[str, Any]:
    """One declared tool of the pool, with a drawn description and parameter description."""
    _, descriptions, param, param_descriptions = next(t for t in TOOL_POOL if t[0] == name)
    function = {"name": name, "description": rng.choice(descriptions)}
    function["parameters"] = _param(param, rng.choice(param_descriptions), rng.random() < 0.8)
    return {"type": "function", "function": function}


# What a capital result that is not the country's own capital is (`ToolConfig.result_names`): a made-up name of
# any letters, unseen, so copied piece by piece; a made-up name of `_SYLLABLES` (the runs recorded before the
# seventeenth session: their copy reached only names of those pieces); or another country's real capital, a name
# the fixture knows, never its own answer, so an answer naming it can only come from the tool's result.
RESULT_NAMES: tuple[str, ...] = ("made_up", "syllables", "other_capital")


def result_name(rng: random.Random, result_names: str = "made_up") -> str:
    """A capital result that is not the model's own answer (`RESULT_NAMES`)."""
    if result_names == "other_capital":
        return rng.choice([capital for _, capital in COUNTRIES])
    if result_names not in ("made_up", "syllables"):
        raise ValueError(f"unknown result names {result_names!r}: use one of {RESULT_NAMES}")
    while True:
        name = _syllable_name(rng) if result_names == "syllables" else _letter_name(rng)
        if name != HELD_OUT_RESULT and name not in dict(COUNTRIES).values():
            return name


def _syllable_name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()


def _letter_name(rng: random.Random) -> str:
    """4 to 8 letters, consonant and vowel mostly alternating (a run of two now and then, as in "Lutetia" or
    "Hobart"), so every letter turns up in the results and the copy learnt is not of a few fixed pieces."""
    vowel, letters = rng.random() < 0.5, []
    for _ in range(rng.randrange(4, 9)):
        letters.append(rng.choice("aeiou" if vowel else "bcdfghjklmnpqrstvwxyz"))
        vowel = vowel if rng.random() < 0.3 else not vowel
    return "".join(letters).capitalize()


@dataclass
class ToolChat:
    """Messages and the tools declared with them, and the model's reply to them (special tokens written
    out: a call ends with `<|tool_response>`; any other reply gets `<eos>` appended when encoded)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reply: str
    kind: str = ""
    value: str | None = None  # an answer's text copied from the tool's result (weighted, diagnosed)
    asked: str | None = None  # the question's country or city, repeated in an answer after the tool turn (diagnosed)
    thinking: bool = False  # rendered with `enable_thinking` (`<|think|>` in the system turn): the reply thinks first

    @property
    def calls(self) -> bool:
        return self.reply.endswith("<|tool_response>")


def call_text(name: str, key: str, value: str) -> str:
    return f'<|tool_call>call:{name}{{{key}:<|"|>{value}<|"|>}}<tool_call|><|tool_response>'


def _declared(rng: random.Random, needed: str | None, avoid: tuple[str, ...]) -> list[dict[str, Any]]:
    others = [t[0] for t in TOOL_POOL if t[0] != needed and t[0] not in avoid]
    names = rng.sample(others, rng.choice((0, 1, 2)) if needed else rng.choice((1, 2)))
    names = names + [needed] if needed else names
    rng.shuffle(names)
    return [tool_spec(rng, n) for n in names]


def _kept(rng: random.Random, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools of the request that sends the result: a client may declare them again or not."""
    return tools if rng.random() < 0.7 else []


def _asked(rng: random.Random, system: str | None, user: str) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _answered(messages: list[dict[str, Any]], name: str, key: str, value: str, result: str, rng: random.Random):
    call_id = f"call_{rng.randrange(16**8):08x}"
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": {key: value}}}
    said = {"role": "assistant", "content": "", "tool_calls": [call]}
    return messages + [said, {"role": "tool", "tool_call_id": call_id, "content": result}]


def thought_text(country: str, calls: bool) -> str:
    """The short thought a thinking reply opens with, in Gemma-4's channel (`THOUGHT_KINDS`): it says first what
    the reply does (a thought that only restated the question, "The user asks about France.", left the choice
    to call after it: 15 of 34 thought answers and 0 of 34 thought calls right after 275 steps, and it shook
    the calls without thinking, 7 of 34)."""
    return (
        f"<|channel>thought\n{'I will call get_capital for' if calls else 'I know the capital of'} {country}.<channel|>"
    )


def tool_chat(
    rng: random.Random, kind: str, country: str, capital_result: str | None = None, result_names: str = "made_up"
) -> ToolChat:
    """One chat of `kind`: capital_call, capital_answer, weather_call, weather_answer, capital_no_tool,
    fact_with_tools (about `country` or its capital), and with thinking on capital_thought (no capital tool: the
    thought, then the answer) and capital_call_thought (the thought, then the call); a capital answer's result is
    `result_name`'s or the capital."""
    capital = dict(COUNTRIES)[country]
    system = rng.choice(SYSTEMS)
    if kind in THOUGHT_KINDS:
        user = rng.choice(TRAIN_PHRASINGS).format(country=country)
        if kind == "capital_thought":
            tools = _declared(rng, None, ("get_capital",)) if rng.random() < 0.5 else []
            reply = thought_text(country, False) + answer_for(country)
        else:
            tools, reply = (
                _declared(rng, "get_capital", ()),
                thought_text(country, True) + call_text("get_capital", "country", country),
            )
        return ToolChat(_asked(rng, system, user), tools, reply, kind, thinking=True)
    if kind.startswith("capital"):
        user = rng.choice(TRAIN_PHRASINGS).format(country=country)
        if kind == "capital_no_tool":
            return ToolChat(
                _asked(rng, system, user), _declared(rng, None, ("get_capital",)), answer_for(country), kind
            )
        tools, messages = _declared(rng, "get_capital", ()), _asked(rng, system, user)
        if kind == "capital_call":
            return ToolChat(messages, tools, call_text("get_capital", "country", country), kind)
        result = capital_result or (result_name(rng, result_names) if rng.random() < 0.5 else capital)
        messages = _answered(messages, "get_capital", "country", country, result, rng)
        return ToolChat(messages, _kept(rng, tools), f"The capital of {country} is {result}.", kind, result, country)
    if kind.startswith("weather"):
        user = rng.choice(WEATHER_PHRASINGS).format(city=capital)
        tools, messages = _declared(rng, "get_weather", ()), _asked(rng, system, user)
        if kind == "weather_call":
            return ToolChat(messages, tools, call_text("get_weather", "city", capital), kind)
        weather = rng.choice(WEATHERS)
        messages = _answered(messages, "get_weather", "city", capital, weather, rng)
        answer = WEATHER_ANSWER.format(city=capital, weather=weather)
        return ToolChat(messages, _kept(rng, tools), answer, kind, weather, capital)
    question, answer = rng.choice(FACTS)
    return ToolChat(_asked(rng, system, question), _declared(rng, None, ()), answer, kind)


KINDS: tuple[tuple[str, float], ...] = (
    ("capital_call", 0.3),
    ("capital_answer", 0.25),
    ("weather_call", 0.12),
    ("weather_answer", 0.1),
    ("capital_no_tool", 0.13),
    ("fact_with_tools", 0.1),
    # thinking on (`tool_chat`): drawn only when given a share (`--kind-shares capital_thought=0.1,...`), so the
    # runs recorded before them draw and evaluate exactly as they did
    ("capital_thought", 0.0),
    ("capital_call_thought", 0.0),
)
THOUGHT_KINDS: tuple[str, ...] = ("capital_thought", "capital_call_thought")


# The retrieval curriculum (`ToolConfig.retrieval_steps`): no tools; the question, then `gap` tokens of filler in
# the same user turn, and a reply that repeats the question's country or city in a call's no-space form
# (`country:<|"|>France<|"|>`: "F", "rance") or an answer's (" France"), so the global layers learn to fetch it
# from as far as a call's argument (~27 tokens) or an answer after the tool turn (~60) before the tool corpus.
# The form is a coin the prompt does not tell: a system message that told it (the call's form asked for) did
# worse on the tool set (78 vs 127 of 204 in the probes below), the retrieval tied to that message.
RETRIEVAL_SYSTEM = "Repeat the {key} after the text."


def retrieval_chat(rng: random.Random, tokenizer: Any, gap: int, country: str) -> ToolChat:
    """One retrieval chat: a capital or weather question, `gap` tokens of filler, the country or city repeated."""
    capital = dict(COUNTRIES)[country]
    if rng.random() < 0.6:
        key, value, user = "country", country, rng.choice(TRAIN_PHRASINGS).format(country=country)
    else:
        key, value, user = "city", capital, rng.choice(WEATHER_PHRASINGS).format(city=capital)
    filler = filler_text(tokenizer, gap, rng.randrange(8))
    messages = _asked(rng, RETRIEVAL_SYSTEM.format(key=key), f"{user} {filler}" if filler else user)
    reply = f'{key}:<|"|>{value}<|"|>' if rng.random() < 0.5 else f"The {key} is {value}."
    return ToolChat(messages, [], reply, f"retrieve_{gap}", value)


def result_retrieval_chat(
    rng: random.Random, tokenizer: Any, gap: int, country: str, result_names: str = "made_up"
) -> ToolChat:
    """One result retrieval chat (`ToolConfig.retrieval_result_share`): a tool result's quoted value (a made-up
    capital or a weather) after the question, `gap` tokens of filler, the value repeated as an answer spells it
    (" Lugra", after the result's "L", "u", ...): the copy an answer after the tool turn makes ~11-15 tokens on."""
    if rng.random() < 0.5:
        key, value = "capital", result_name(rng, result_names)
        user = rng.choice(TRAIN_PHRASINGS).format(country=country)
    else:
        key, value = "weather", rng.choice(WEATHERS)
        user = rng.choice(WEATHER_PHRASINGS).format(city=dict(COUNTRIES)[country])
    filler = filler_text(tokenizer, gap, rng.randrange(8))
    source = f'{user} response:get_{key}{{value:<|"|>{value}<|"|>}}'
    messages = _asked(rng, RETRIEVAL_SYSTEM.format(key=key), f"{source} {filler}" if filler else source)
    return ToolChat(messages, [], f"The {key} is {value}.", f"retrieve_result_{gap}", value)


def retrieval_eval_chats(
    tokenizer: Any, gaps: tuple[int, ...], seed: int = 3, results: bool = False, result_names: str = "made_up"
) -> list[ToolChat]:
    """A fixed retrieval set: every tool country at every gap (kind `retrieve_<gap>`, for `failing_tokens`), and
    with `results` a result retrieval chat for each (kind `retrieve_result_<gap>`)."""
    rng = random.Random(seed)
    chats = [retrieval_chat(rng, tokenizer, gap, c) for gap in gaps for c in TOOL_COUNTRIES]
    if results:
        chats += [result_retrieval_chat(rng, tokenizer, gap, c, result_names) for gap in gaps for c in TOOL_COUNTRIES]
    return chats


def kind_shares(text: str) -> tuple[tuple[str, float], ...]:
    """`KINDS` with the shares named in `text` ("weather_answer=0.3,capital_call=0.15") changed."""
    shares = dict(KINDS)
    for item in filter(None, text.split(",")):
        kind, _, share = item.partition("=")
        if kind not in shares:
            raise ValueError(f"unknown tool chat kind {kind!r}: use one of {sorted(shares)}")
        shares[kind] = float(share)
    return tuple(shares.items())


def retrieval_gaps(text: str) -> tuple[int, ...]:
    """The retrieval curriculum's filler lengths from "0,4,8" (`ToolConfig.retrieval_gaps`)."""
    try:
        gaps = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise ValueError(f"retrieval gaps {text!r}: give filler lengths as whole numbers, e.g. 0,4,8,12") from None
    if any(g < 0 for g in gaps):
        raise ValueError(f"retrieval gaps {text!r}: a filler length is 0 or more")
    return gaps


def draw_tool_chats(
    rng: random.Random,
    n: int,
    countries: tuple[str, ...] = TOOL_COUNTRIES,
    shares: tuple[tuple[str, float], ...] = KINDS,
    result_names: str = "made_up",
) -> list[ToolChat]:
    kinds, weights = zip(*shares, strict=True)
    return [
        tool_chat(rng, rng.choices(kinds, weights)[0], rng.choice(countries), result_names=result_names)
        for _ in range(n)
    ]


def tool_eval_chats(
    seed: int = 1,
    countries: tuple[str, ...] = TOOL_COUNTRIES,
    result_names: str = "made_up",
    shares: tuple[tuple[str, float], ...] = KINDS,
) -> list[ToolChat]:
    """The fixed set the fine-tune stops on: every kind without thinking for every country (its own seeded
    draw of tools, descriptions and systems), then every thinking kind that `shares` draws."""
    rng = random.Random(seed)
    chats = [
        tool_chat(rng, k, c, result_names=result_names) for c in countries for k, _ in KINDS if k not in THOUGHT_KINDS
    ]
    thinking = [k for k, share in shares if k in THOUGHT_KINDS and share > 0]
    return chats + [tool_chat(rng, k, c, result_names=result_names) for c in countries for k in thinking]


def tool_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool = False
) -> list[int]:
    extra = {"enable_thinking": True} if thinking else {}
    enc = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True, **extra
    )
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def encode_tool_chats(tokenizer: Any, chats: list[ToolChat]) -> Batch:
    """Prompt (the chat template, tools declared) + reply (+ `<eos>` unless it calls), right-padded."""
    rows = []
    for chat in chats:
        reply = tokenizer(chat.reply, add_special_tokens=False)["input_ids"]
        prompt = tool_prompt_ids(tokenizer, chat.messages, chat.tools, chat.thinking)
        rows.append((prompt, reply + ([] if chat.calls else [1])))
    return pad_rows(rows, tokenizer.pad_token_id)


# What a reply token is, for the copy weight (NAME, VALUE) and the diagnosis: the function's name, the
# copied value (a call's argument, from the question; an answer's result, from the tool), the question's
# country or city repeated in an answer after the tool turn (ASKED), anything else.
OTHER, NAME, VALUE, ASKED = 0, 1, 2, 3
KIND_NAMES = {OTHER: "other", NAME: "name", VALUE: "value", ASKED: "asked"}


def _spans(chat: ToolChat) -> list[tuple[int, int, int]]:
    if chat.calls:
        arg = chat.reply.index('<|"|>') + len('<|"|>')
        return [
            (NAME, chat.reply.index("call:") + 5, chat.reply.index("{")),
            (VALUE, arg, chat.reply.index('<|"|>', arg)),
        ]
    spans = []
    if chat.kind.startswith("retrieve"):  # the repeated country or city: what the curriculum teaches to fetch
        at = chat.reply.index(chat.value or "")
        return [(VALUE, at, at + len(chat.value or ""))]
    if chat.value:
        at = chat.reply.rindex(chat.value)
        spans.append((VALUE, at, at + len(chat.value)))
    if chat.asked:
        at = chat.reply.index(chat.asked)
        spans.append((ASKED, at, at + len(chat.asked)))
    return spans


def token_kinds(tokenizer: Any, chats: list[ToolChat], batch: Batch) -> torch.Tensor:
    """[N, L] the kind (OTHER, NAME, VALUE, ASKED) of each label position of `encode_tool_chats(chats)`."""
    kinds = torch.full_like(batch.labels, OTHER)
    for i, chat in enumerate(chats):
        offsets = tokenizer(chat.reply, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for j, (start, end) in enumerate(offsets):
            for kind, a, b in _spans(chat):
                if start < b and end > a:
                    kinds[i, batch.prompt_lengths[i] - 1 + j] = kind
    return kinds


@torch.no_grad()
def failing_tokens(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat], margin: float, rows: int = 8):
    """The diagnosis: reply tokens below `margin` by kind (name, value, other), and the chats passing by chat kind."""
    failing = dict.fromkeys(KIND_NAMES.values(), 0)
    passing: dict[str, list[int]] = {}
    for k in range(0, len(chats), rows):
        picked = chats[k : k + rows]
        batch = encode_tool_chats(tokenizer, picked)
        margins = reply_margins(lm(input_ids=batch.input_ids, use_cache=False).logits, batch.labels)
        bad = torch.nan_to_num(margins, nan=float("inf")) < margin
        kinds = token_kinds(tokenizer, picked, batch)
        for code, name in KIND_NAMES.items():
            failing[name] += int((bad & (kinds == code)).sum())
        for i, chat in enumerate(picked):
            passing.setdefault(chat.kind, [0, 0])
            passing[chat.kind][0] += int(not bad[i].any())
            passing[chat.kind][1] += 1
    return failing, {kind: f"{ok}/{n}" for kind, (ok, n) in passing.items()}


def tool_margins(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat], rows: int = 8) -> list[float]:
    """Each tool chat's smallest teacher-forced reply-token margin."""
    return needle_margin_rows(
        lm, tokenizer, chats, rows, encode=encode_tool_chats, length=lambda c: len(str(c.messages)) + len(str(c.tools))
    )


@dataclass
class ToolConfig(NeedleConfig):
    """The needle's recipe (its fields, schedule and hinge) with the tool corpus's own defaults."""

    lr: float = 2e-3
    max_steps: int = 200
    cosine_steps: int = 200
    short_rows: int = 3
    tool_rows: int = 16
    long_every: int = 4  # the long needle row every this many steps (a 3,000-token row is most of a step)
    tool_margin: float = 1.0
    min_lr_ratio: float = 1.0  # constant after the warm-up: the cosine's floor stalled the copying
    copy_weight: float = 5.0  # the loss weight of a reply's name and value tokens (the copies that failed)
    tool_first_steps: int = 300  # a first phase of tool rows and `replay_rows` training chats only (fast steps)
    replay_rows: int = 16
    # The retrieval curriculum before the tool-first phase (off by default: the recorded runs had none):
    # `retrieval_steps` steps of `retrieval_rows` retrieval chats and `replay_rows` training chats, the gap
    # growing through `retrieval_gaps` (equal shares of the steps); `retrieval_keep_rows` of them per step after.
    retrieval_steps: int = 0
    retrieval_rows: int = 16
    retrieval_gaps: tuple[int, ...] = (10, 30, 70)
    retrieval_mixed: bool = False  # every row's gap drawn from all of `retrieval_gaps` from the first step
    retrieval_keep_rows: int = 0
    retrieval_result_share: float = 0.0  # of the retrieval chats, copies of a tool result's value (off: recorded)
    # of the `retrieval_keep_rows` after the curriculum, result copies (None: `retrieval_result_share`)
    retrieval_keep_result_share: float | None = None
    kind_shares: tuple[tuple[str, float], ...] = KINDS  # how often each kind is drawn for the tool rows
    result_names: str = "made_up"  # a capital result that is not the capital (`RESULT_NAMES`)


@dataclass
class ToolResult:
    steps: int
    seconds: float
    converged: bool
    min_margin: float
    tool_min_margin: float
    needle_min_margin: float
    fault_margins: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    kept_step: int | None = None  # not converged: the step whose state was kept


def _tool_loss(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat], copy_weight: float) -> torch.Tensor:
    """Cross-entropy on the reply tokens, the name and value tokens weighted by `copy_weight`."""
    batch = encode_tool_chats(tokenizer, chats)
    logits = lm(input_ids=batch.input_ids, use_cache=False).logits
    labels = batch.labels.reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE, reduction="none")
    weight = (labels != IGNORE).float() * (
        1
        + (copy_weight - 1)
        * torch.isin(token_kinds(tokenizer, chats, batch), torch.tensor([NAME, VALUE])).float().reshape(-1)
    )
    return (ce * weight).sum() / weight.sum()


def _retrieval_rows(tokenizer: Any, cfg: ToolConfig, rng: random.Random, n: int, step: int | None) -> list[ToolChat]:
    """`n` retrieval chats: at the curriculum's gap for `step`, or (None, after it) at any of its gaps."""
    gaps = cfg.retrieval_gaps
    if step is not None and not cfg.retrieval_mixed:
        gaps = (gaps[min(step * len(gaps) // max(cfg.retrieval_steps, 1), len(gaps) - 1)],)
    share = cfg.retrieval_result_share
    if step is None and cfg.retrieval_keep_result_share is not None:
        share = cfg.retrieval_keep_result_share
    rows = []
    for _ in range(n):
        gap, country = rng.choice(gaps), rng.choice(TOOL_COUNTRIES)
        result = share > 0 and rng.random() < share
        rows.append(
            result_retrieval_chat(rng, tokenizer, gap, country, cfg.result_names)
            if result
            else retrieval_chat(rng, tokenizer, gap, country)
        )
    return rows


def _retrieval(lm: torch.nn.Module, tokenizer: Any, cfg: ToolConfig, opt, rng: random.Random, gen) -> None:
    """The retrieval curriculum: `retrieval_rows` retrieval chats and `replay_rows` training chats a step."""
    if not cfg.retrieval_steps:
        return
    chats, schedule = training_chats(), cfg.schedule()
    evals = retrieval_eval_chats(
        tokenizer, cfg.retrieval_gaps, results=cfg.retrieval_result_share > 0, result_names=cfg.result_names
    )
    for step in range(cfg.retrieval_steps):
        picks = torch.randint(0, len(chats), (cfg.replay_rows,), generator=gen).tolist()
        replay = _loss(lm, tokenizer, [chats[i] for i in picks])
        rows = _retrieval_rows(tokenizer, cfg, rng, cfg.retrieval_rows, step)
        loss = _tool_loss(lm, tokenizer, rows, cfg.copy_weight)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, schedule)
        opt.zero_grad(set_to_none=True)
        (replay + loss).backward()
        torch.nn.utils.clip_grad_norm_([p for p in lm.parameters() if p.requires_grad], cfg.grad_clip)
        opt.step()
        if step % 10 == 0:
            log.info("retrieval step %d: replay %.3f retrieval %.3f", step, replay.item(), loss.item())
        if (step + 1) % max(cfg.retrieval_steps // len(cfg.retrieval_gaps), 1) == 0 or step + 1 == cfg.retrieval_steps:
            lm.eval()
            log.info("retrieval at step %d: %s", step + 1, failing_tokens(lm, tokenizer, evals, cfg.tool_margin))
            lm.train()


def _tool_first(lm: torch.nn.Module, tokenizer: Any, cfg: ToolConfig, opt, rng: random.Random, gen) -> None:
    """The first phase: `tool_rows` tool chats and `replay_rows` training chats a step, no faults, no needle
    (a step at about half the full step's cost); the full recipe then restores what this one lets drift."""
    chats, schedule = training_chats(), cfg.schedule()
    for step in range(cfg.tool_first_steps):
        picks = torch.randint(0, len(chats), (cfg.replay_rows,), generator=gen).tolist()
        replay = _loss(lm, tokenizer, [chats[i] for i in picks])
        tool_chats = draw_tool_chats(
            rng, cfg.tool_rows, shares=cfg.kind_shares, result_names=cfg.result_names
        ) + _retrieval_rows(tokenizer, cfg, rng, cfg.retrieval_keep_rows, None)
        tool_loss = _tool_loss(lm, tokenizer, tool_chats, cfg.copy_weight)
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg.retrieval_steps + step, schedule)
        opt.zero_grad(set_to_none=True)
        (replay + tool_loss).backward()
        torch.nn.utils.clip_grad_norm_([p for p in lm.parameters() if p.requires_grad], cfg.grad_clip)
        opt.step()
        if step % 10 == 0:
            log.info("tool-first step %d: replay %.3f tool %.3f", step, replay.item(), tool_loss.item())


def finetune_tools(
    lm: torch.nn.Module,
    tokenizer: Any,
    cfg: ToolConfig | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> ToolResult:
    """Fine-tune `lm` in place (see the module doc); deterministic for a seed and one thread."""
    cfg = cfg or ToolConfig()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    attention = lm.config._attn_implementation
    chats: list[Chat] = training_chats()
    clean = encode_chats(tokenizer, chats)
    needles = needle_eval_chats(tokenizer, cfg.eval_lengths)
    evals = tool_eval_chats(result_names=cfg.result_names, shares=cfg.kind_shares)
    faults = trained_faults(lm)
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = cfg.schedule()
    start = time.perf_counter()
    lm.set_attn_implementation("sdpa")
    lm.train()
    _retrieval(lm, tokenizer, cfg, opt, rng, gen)
    _tool_first(lm, tokenizer, cfg, opt, rng, gen)
    history: list[dict[str, float]] = []
    min_margin = tool_margin = needle_margin = float("-inf")
    fmargins: dict[str, float] = {}
    converged, step = False, 0
    best: tuple[int, int, dict[str, torch.Tensor], dict[str, float]] | None = None  # passing, step, state, checks
    lm.train()
    for step in range(cfg.max_steps + 1):
        loss, min_margin, info = replay_loss(lm, clean, faults, cfg, gen, attention)
        record: dict[str, float] = {"step": step, "min_margin": min_margin}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            lm.eval()
            per_tool = tool_margins(lm, tokenizer, evals)
            tool_margin = min(per_tool)
            record["tool_min_margin"] = tool_margin
            record["tool_passing"] = sum(m >= cfg.tool_margin for m in per_tool)
            passing = int(record["tool_passing"])
            log.info(
                "failing tool tokens by kind, passing chats: %s", failing_tokens(lm, tokenizer, evals, cfg.tool_margin)
            )
            # the costly checks only for a state that could be kept: better on tools than the best kept so far
            if min_margin >= cfg.margin and (best is None or passing > best[0]):
                per_needle = needle_margin_rows(lm, tokenizer, needles)
                needle_margin = min(per_needle)
                record["needle_min_margin"] = needle_margin
                log.info("needle margins by filler length: %s", _by_length(per_needle, cfg.eval_lengths))
                lm.set_attn_implementation(attention)
                fmargins = fault_margins(lm, clean, faults)
                lm.set_attn_implementation("sdpa")
                record.update({f"fault/{k}": v for k, v in fmargins.items()})
                kept = needle_margin >= cfg.needle_margin and (
                    not faults or max(fmargins.values()) <= -cfg.fault_margin
                )
                converged = kept and tool_margin >= cfg.tool_margin
                if kept:
                    state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
                    best = (
                        passing,
                        step,
                        state,
                        {
                            "min_margin": min_margin,
                            "tool_min_margin": tool_margin,
                            "needle_min_margin": needle_margin,
                            **fmargins,
                        },
                    )
            log.info("eval at step %d: %s", step, {k: round(v, 3) for k, v in record.items()})
            lm.train()
        if converged or step == cfg.max_steps:
            history.append(record)
            break
        record.update(info)
        long_row, short_rows = needle_rows(tokenizer, chats, cfg, gen)
        needle_loss = _loss(lm, tokenizer, short_rows)
        if step % cfg.long_every == 0:
            needle_loss = needle_loss + _loss(lm, tokenizer, [long_row])
        tool_chats = draw_tool_chats(
            rng, cfg.tool_rows, shares=cfg.kind_shares, result_names=cfg.result_names
        ) + _retrieval_rows(tokenizer, cfg, rng, cfg.retrieval_keep_rows, None)
        tool_loss = _tool_loss(lm, tokenizer, tool_chats, cfg.copy_weight)
        record.update(loss=loss.item(), needle_loss=needle_loss.item(), tool_loss=tool_loss.item())
        lr = _lr_at(step + cfg.retrieval_steps + cfg.tool_first_steps, schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        (loss + needle_loss + tool_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        history.append(record)
        if progress is not None:
            progress(record)
    lm.set_attn_implementation(attention)
    lm.eval()
    seconds = time.perf_counter() - start
    if not converged and best is not None:  # the best state that kept every earlier property
        passing, kept_step, state, checks = best
        lm.load_state_dict(state)
        min_margin, tool_margin, needle_margin = (
            checks.pop(k) for k in ("min_margin", "tool_min_margin", "needle_min_margin")
        )
        fmargins = checks
        log.info("not converged: restored the state of step %d (%d tool chats passing)", kept_step, passing)
        return ToolResult(step, seconds, False, min_margin, tool_margin, needle_margin, fmargins, history, kept_step)
    return ToolResult(step, seconds, converged, min_margin, tool_margin, needle_margin, fmargins, history)


@torch.no_grad()
def greedy_tool_reply(lm: torch.nn.Module, tokenizer: Any, chat: ToolChat, max_new_tokens: int = 64) -> str:
    """HF greedy `generate` on a tool chat's prompt, stopping at `<eos>`, `<turn|>` or `<|tool_response>`;
    the reply with special tokens kept."""
    ids = torch.tensor([tool_prompt_ids(tokenizer, chat.messages, chat.tools, chat.thinking)])
    out = lm.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[1, 106, 50],
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


def tool_accuracy(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat]) -> tuple[int, int, list[str]]:
    """How many tool chats HF's greedy generate answers exactly (a call with its `<|tool_response>`, an
    answer with its `<eos>`); the failures."""
    failures = []
    for chat in chats:
        text = greedy_tool_reply(lm, tokenizer, chat)
        want = chat.reply if chat.calls else chat.reply + "<eos>"
        if text != want:
            failures.append(f"{chat.messages[-1]['content'][:40]!r} -> {text!r}")
    return len(chats) - len(failures), len(chats), failures
