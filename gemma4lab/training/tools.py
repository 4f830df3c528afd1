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

Fine-tune (deterministic: seeded, one thread): the needle's recipe (`gemma4lab.training.needle`) with
tool chats added: each step the 128 training chats as they are, the faults' hinge (`fault_rows`
chats under each trained fault, every reply token pushed below -`fault_hinge_target`), the needle
rows (one long filler, `short_rows` short ones: the needle must stay answered) and `tool_rows` tool
chats; loss on the reply tokens. It stops when every training chat is right by `margin`, every chat of
the fixed tool set (`tool_eval_chats`) by `tool_margin`, every chat of the needle set by
`needle_margin`, and every trained fault breaks every training chat by `fault_margin`. When it does not
within `max_steps`, it returns the evaluated state with the most tool chats passing among those that
kept every earlier property (training chats, needle, faults), and says so (`converged` False).

Measured (E2B, seed 0, one thread, 2026-12-06, loaded two-core AMD EPYC, `--keep-unconverged-tools`):
NOT converged. 240 steps in 890 s; the best state kept (step 200) had 77 of the 204 tool chats right
by margin 1 (teacher-forced), 3 of 68 exact under HF greedy (12 of 36 on the held-out countries), with
every earlier property intact (training chats' margin 2.70, held-out 40/40, needle margin 3.66 and
40/40 after 3,000 tokens, faults <= -9.97). It learnt the format (which tool, `call:NAME{key:`, the
quotes, `<|tool_response>`, an answer after the result) but not the copying: the argument is one
country for most questions ("Iraq" for France) and a made-up result comes back mangled ("lu" for
"Lutetia"). An earlier run (300 steps, 10 tool rows, lr 2e-3) reached 60/204. So the fixtures ship
without these weights and without the tools template; what would help next: more steps (the tool loss
was still falling), a curriculum from one declared tool to several, fewer made-up results at first.
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
    needle_chat,
    needle_eval_chats,
)
from gemma4lab.training.needle import reply_margin_rows as needle_margin_rows
from gemma4lab.training.text import (
    IGNORE,
    Batch,
    _lr_at,
    encode_chats,
    fault_margins,
    forward_segments,
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


def made_up_capital(rng: random.Random) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name != HELD_OUT_RESULT and name not in dict(COUNTRIES).values():
            return name


@dataclass
class ToolChat:
    """Messages and the tools declared with them, and the model's reply to them (special tokens written
    out: a call ends with `<|tool_response>`; any other reply gets `<eos>` appended when encoded)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reply: str

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


def tool_chat(rng: random.Random, kind: str, country: str, capital_result: str | None = None) -> ToolChat:
    """One chat of `kind`: capital_call, capital_answer, weather_call, weather_answer, capital_no_tool,
    fact_with_tools (about `country` or its capital)."""
    capital = dict(COUNTRIES)[country]
    system = rng.choice(SYSTEMS)
    if kind.startswith("capital"):
        user = rng.choice(TRAIN_PHRASINGS).format(country=country)
        if kind == "capital_no_tool":
            return ToolChat(_asked(rng, system, user), _declared(rng, None, ("get_capital",)), answer_for(country))
        tools, messages = _declared(rng, "get_capital", ()), _asked(rng, system, user)
        if kind == "capital_call":
            return ToolChat(messages, tools, call_text("get_capital", "country", country))
        result = capital_result or (made_up_capital(rng) if rng.random() < 0.5 else capital)
        messages = _answered(messages, "get_capital", "country", country, result, rng)
        return ToolChat(messages, _kept(rng, tools), f"The capital of {country} is {result}.")
    if kind.startswith("weather"):
        user = rng.choice(WEATHER_PHRASINGS).format(city=capital)
        tools, messages = _declared(rng, "get_weather", ()), _asked(rng, system, user)
        if kind == "weather_call":
            return ToolChat(messages, tools, call_text("get_weather", "city", capital))
        weather = rng.choice(WEATHERS)
        messages = _answered(messages, "get_weather", "city", capital, weather, rng)
        return ToolChat(messages, _kept(rng, tools), WEATHER_ANSWER.format(city=capital, weather=weather))
    question, answer = rng.choice(FACTS)
    return ToolChat(_asked(rng, system, question), _declared(rng, None, ()), answer)


KINDS: tuple[tuple[str, float], ...] = (
    ("capital_call", 0.3),
    ("capital_answer", 0.25),
    ("weather_call", 0.12),
    ("weather_answer", 0.1),
    ("capital_no_tool", 0.13),
    ("fact_with_tools", 0.1),
)


def draw_tool_chats(rng: random.Random, n: int, countries: tuple[str, ...] = TOOL_COUNTRIES) -> list[ToolChat]:
    kinds, weights = zip(*KINDS, strict=True)
    return [tool_chat(rng, rng.choices(kinds, weights)[0], rng.choice(countries)) for _ in range(n)]


def tool_eval_chats(seed: int = 1, countries: tuple[str, ...] = TOOL_COUNTRIES) -> list[ToolChat]:
    """The fixed set the fine-tune stops on: every kind for every country (its own seeded draw of
    tools, descriptions and systems)."""
    rng = random.Random(seed)
    return [tool_chat(rng, kind, c) for c in countries for kind, _ in KINDS]


def tool_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def encode_tool_chats(tokenizer: Any, chats: list[ToolChat]) -> Batch:
    """Prompt (the chat template, tools declared) + reply (+ `<eos>` unless it calls), right-padded."""
    rows = []
    for chat in chats:
        reply = tokenizer(chat.reply, add_special_tokens=False)["input_ids"]
        rows.append((tool_prompt_ids(tokenizer, chat.messages, chat.tools), reply + ([] if chat.calls else [1])))
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (prompt, reply) in enumerate(rows):
        seq = prompt + reply
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(reply)
    return Batch(ids, labels, [len(p) for p, _ in rows])


def tool_margins(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat], rows: int = 8) -> list[float]:
    """Each tool chat's smallest teacher-forced reply-token margin."""
    return needle_margin_rows(
        lm, tokenizer, chats, rows, encode=encode_tool_chats, length=lambda c: len(str(c.messages)) + len(str(c.tools))
    )


@dataclass
class ToolConfig(NeedleConfig):
    """The needle's recipe (its fields, schedule and hinge) with the tool corpus's own defaults."""

    lr: float = 2e-3
    max_steps: int = 240
    cosine_steps: int = 240
    short_rows: int = 3
    tool_rows: int = 16
    long_every: int = 4  # the long needle row every this many steps (a 3,000-token row is most of a step)
    tool_margin: float = 1.0


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


def _tool_loss(lm: torch.nn.Module, tokenizer: Any, chats: list[ToolChat]) -> torch.Tensor:
    return _loss(lm, tokenizer, chats, encode=encode_tool_chats)


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
    evals = tool_eval_chats()
    faults = trained_faults(lm)
    n, k_rows = clean.input_ids.shape[0], cfg.fault_rows
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = cfg.schedule()

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    history: list[dict[str, float]] = []
    start = time.perf_counter()
    min_margin = tool_margin = needle_margin = float("-inf")
    fmargins: dict[str, float] = {}
    converged, step = False, 0
    best: tuple[int, int, dict[str, torch.Tensor], dict[str, float]] | None = None  # passing, step, state, checks
    lm.train()
    for step in range(cfg.max_steps + 1):
        lm.set_attn_implementation(attention)  # the faults' masks are built for the model's own form
        rows = torch.randperm(n, generator=gen)[: k_rows * len(faults)]
        subs = [rows[k * k_rows : (k + 1) * k_rows] for k in range(len(faults))]
        segments = [(None, clean.input_ids)] + [(f, clean.input_ids[s]) for f, s in zip(faults, subs, strict=True)]
        logits = forward_segments(lm, segments)
        lm.set_attn_implementation("sdpa")
        with torch.no_grad():
            margins = reply_margins(logits[:n].detach(), clean.labels)
            min_margin = float(torch.nan_to_num(margins, nan=float("inf")).min())
        record: dict[str, float] = {"step": step, "min_margin": min_margin}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            lm.eval()
            per_tool = tool_margins(lm, tokenizer, evals)
            tool_margin = min(per_tool)
            record["tool_min_margin"] = tool_margin
            record["tool_passing"] = sum(m >= cfg.tool_margin for m in per_tool)
            passing = int(record["tool_passing"])
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
        loss = F.cross_entropy(
            logits[:n].reshape(-1, logits.shape[-1]).float(), clean.labels.reshape(-1), ignore_index=IGNORE
        )
        if faults:
            hinge = []
            for k, sub in enumerate(subs):
                m = reply_margins(logits[n + k * k_rows : n + (k + 1) * k_rows], clean.labels[sub])
                hinge.append(F.relu(m[~torch.isnan(m)] + cfg.fault_hinge_target).mean())
            loss = loss + cfg.fault_weight * torch.stack(hinge).mean()
        picks = torch.randint(0, len(chats), (cfg.short_rows + 1,), generator=gen).tolist()
        long_row = needle_chat(tokenizer, chats[picks[0]], draw(cfg.short_max, cfg.long_max), draw(0, 7))
        short_rows = [needle_chat(tokenizer, chats[i], draw(0, cfg.short_max), draw(0, 7)) for i in picks[1:]]
        needle_loss = _loss(lm, tokenizer, short_rows)
        if step % cfg.long_every == 0:
            needle_loss = needle_loss + _loss(lm, tokenizer, [long_row])
        tool_loss = _tool_loss(lm, tokenizer, draw_tool_chats(rng, cfg.tool_rows))
        record.update(loss=loss.item(), needle_loss=needle_loss.item(), tool_loss=tool_loss.item())
        lr = _lr_at(step, schedule)
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
def greedy_tool_reply(lm: torch.nn.Module, tokenizer: Any, chat: ToolChat, max_new_tokens: int = 40) -> str:
    """HF greedy `generate` on a tool chat's prompt, stopping at `<eos>`, `<turn|>` or `<|tool_response>`;
    the reply with special tokens kept."""
    ids = torch.tensor([tool_prompt_ids(tokenizer, chat.messages, chat.tools)])
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
