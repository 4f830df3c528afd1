"""Building the tiny fixtures' tokenizer (`gemma4lib.models.tokenizer` says what it shares with the real
one): a byte-level BPE learnt from the synthetic corpus, Gemma-4's specials at their ids, its chat
template."""

from __future__ import annotations

from pathlib import Path

from gemma4lab.training.corpus import tokenizer_texts
from gemma4lib.models.tokenizer import BOS, BOS_ID, EOS, PAD, TURN_CLOSE, TURN_CLOSE_ID, TURN_OPEN, TURN_OPEN_ID

DEFAULT_VOCAB_SIZE = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # the files a fixture hashes
# Gemma-4's tool and thought specials at the real tokenizer's ids (google-deepmind/gemma's Gemma-4
# tokenizer: `<|tool_response>` 50, the sampler's third stop token; its chat template and generation
# config: eos [1, 106, 50]). They take the place of `<unusedN>` fillers, so the vocabulary's size and every
# other id are unchanged and every fixture's weights stay valid.
TOOL_SPECIALS: dict[int, str] = {
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
}
TOOL_RESPONSE_ID = 50

# The shipped fixtures' chat template: Gemma-4's turns. Assistant turns are written with role "model";
# contents are stripped. It declares no tools: the server refuses `tools` for a model whose template does
# not. The shipped template is `TOOLS_CHAT_TEMPLATE` once a fixture was taught tools (`scripts/train_tools.py`).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' + (message['content'] | trim) + '<turn|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)

# Gemma-4's chat format with tools, written here (not copied) to render what the released template
# renders for what this project sends (plain chats exactly as `CHAT_TEMPLATE` does): the system turn
# (`<|think|>` first when thinking is on, then the system text, then each tool's
# `<|tool>declaration:NAME{description:…,parameters:{…}}<tool|>`), user and model turns (role "model",
# contents trimmed), a model turn's calls `<|tool_call>call:NAME{key:<|"|>v<|"|>}<tool_call|>` followed
# by the `role: "tool"` messages after it as `<|tool_response>response:NAME{value:<|"|>…<|"|>}<tool_response|>`
# in the same model turn (the name from the call whose id the result names), the turn left open after a
# result (the model's answer continues it: no `<|turn>model` then), and `<|tool_response>` after calls
# with no result yet. Nested object/array parameters are declared by type only (the released template
# expands them). The shipped fixtures' template once a fixture was taught tools (`tools.py`).
_Q = '<|"|>'
TOOLS_CHAT_TEMPLATE = (
    "{%- macro arg(v) -%}"
    "{%- if v is string -%}{{ '" + _Q + "' + v + '" + _Q + "' }}"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ ',' if not loop.first }}{{ k }}:"
    "{{ arg(x) }}{%- endfor -%}{{ '}' }}"
    "{%- elif v is iterable -%}[{%- for x in v -%}{{ ',' if not loop.first }}{{ arg(x) }}{%- endfor -%}]"
    "{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro kind(t) -%}{{ '" + _Q + "' + (t | upper) + '" + _Q + "' }}{%- endmacro -%}"
    "{%- macro declaration(f) -%}"
    "declaration:{{ f['name'] }}{description:{{ arg(f['description'] or '') }}"
    "{%- set p = f['parameters'] -%}"
    "{%- if p -%},parameters:{{ '{' }}{%- set d = namespace(sep='') -%}"
    "{%- if p['properties'] -%}properties:{{ '{' }}{%- for k, v in p['properties'] | dictsort -%}"
    "{{ ',' if not loop.first }}{{ k }}:{{ '{' }}{%- set b = namespace(sep='') -%}"
    "{%- if v['description'] -%}description:{{ arg(v['description']) }}{%- set b.sep = ',' -%}{%- endif -%}"
    "{%- if (v['type'] or '') | upper == 'STRING' and v['enum'] -%}{{ b.sep }}enum:{{ arg(v['enum']) }}"
    "{%- set b.sep = ',' -%}{%- endif -%}"
    "{%- if v['nullable'] -%}{{ b.sep }}nullable:true{%- set b.sep = ',' -%}{%- endif -%}"
    "{{ b.sep }}type:{{ kind(v['type'] or '') }}{{ '}' }}{%- endfor -%}{{ '}' }}{%- set d.sep = ',' -%}{%- endif -%}"
    "{%- if p['required'] -%}{{ d.sep }}required:[{%- for r in p['required'] -%}{{ ',' if not loop.first }}"
    "{{ arg(r) }}{%- endfor -%}]{%- set d.sep = ',' -%}{%- endif -%}"
    "{%- if p['type'] -%}{{ d.sep }}type:{{ kind(p['type']) }}{%- endif -%}{{ '}' }}"
    "{%- endif -%}{{ '}' }}"
    "{%- endmacro -%}"
    "{%- macro response(name, body) -%}"
    "<|tool_response>response:{{ name }}{{ '{' }}"
    "{%- if body is mapping -%}{%- for k, x in body | dictsort -%}{{ ',' if not loop.first }}{{ k }}:{{ arg(x) }}"
    "{%- endfor -%}{%- else -%}value:{{ arg(body) }}{%- endif -%}}<tool_response|>"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last=none) -%}"
    "{%- set system = messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set turns = messages[1:] if system else messages -%}"
    "{{ bos_token }}"
    "{%- if enable_thinking or tools or system -%}"
    "{{ '<|turn>system\\n' }}{%- if enable_thinking -%}{{ '<|think|>\\n' }}{%- endif -%}"
    "{%- if system -%}{{ messages[0]['content'] | trim }}{%- endif -%}"
    "{%- for t in tools or [] -%}{{ '<|tool>' + declaration(t['function']) | trim + '<tool|>' }}{%- endfor -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in turns -%}{%- if m['role'] != 'tool' -%}"
    "{%- set ns.last = none -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{%- set before = namespace(role=none) -%}"
    "{%- for j in range(loop.index0) -%}{%- if turns[j]['role'] != 'tool' -%}{%- set before.role = turns[j]['role'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if not (role == 'model' and before.role == 'assistant') -%}{{ '<|turn>' + role + '\\n' }}{%- endif -%}"
    "{%- set calls = m.get('tool_calls') or [] -%}"
    "{%- for c in calls -%}{%- set f = c['function'] -%}{{ '<|tool_call>call:' + f['name'] + '{' }}"
    "{%- if f['arguments'] is mapping -%}{%- for k, x in f['arguments'] | dictsort -%}{{ ',' if not loop.first }}"
    "{{ k }}:{{ arg(x) }}{%- endfor -%}{%- else -%}{{ f['arguments'] }}{%- endif -%}{{ '}<tool_call|>' }}"
    "{%- set ns.last = 'call' -%}{%- endfor -%}"
    "{%- set answered = namespace(any=false, open=true) -%}"
    "{%- if calls -%}{%- for k in range(loop.index0 + 1, turns | length) -%}"
    "{%- if turns[k]['role'] != 'tool' -%}{%- set answered.open = false -%}"
    "{%- elif answered.open -%}{%- set r = turns[k] -%}{%- set who = namespace(name=r.get('name') or 'unknown') -%}"
    "{%- for c in calls -%}{%- if c.get('id') and c.get('id') == r.get('tool_call_id') -%}"
    "{%- set who.name = c['function']['name'] -%}{%- endif -%}{%- endfor -%}"
    "{{ response(who.name, r['content']) }}{%- set answered.any = true -%}{%- set ns.last = 'response' -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- set text = (m['content'] or '') | trim -%}{{ text }}"
    "{%- if ns.last == 'call' -%}{{ '<|tool_response>' }}"
    "{%- elif not (answered.any and not text) -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt and ns.last not in ['call', 'response'] -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)


def special_tokens() -> list[str]:
    """Special tokens in id order: index == id (0..106)."""
    tokens = [PAD, EOS, BOS] + [TOOL_SPECIALS.get(i, f"<unused{i}>") for i in range(3, TURN_OPEN_ID)]
    tokens += [TURN_OPEN, TURN_CLOSE]
    assert tokens.index(TURN_OPEN) == TURN_OPEN_ID and tokens.index(TURN_CLOSE) == TURN_CLOSE_ID
    return tokens


def build_backend(texts: list[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The raw `tokenizers.Tokenizer`: byte-level BPE trained on `texts` (default: the corpus).

    `vocab_size` is a cap; with the default corpus the merges run out first (810 tokens).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if texts is None:
        # The role names of the chat template are learnt too: one token each, as in Gemma's vocabulary.
        texts = tokenizer_texts() + ["user\n", "model\n"]
    specials = special_tokens()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    for i, t in enumerate(specials):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t!r} landed at id {tok.token_to_id(t)}, not {i}")
    return tok


def wrap(backend):
    """Wrap a backend tokenizer as a transformers fast tokenizer with the Gemma-4 chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        padding_side="left",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, texts: list[str] | None = None):
    """A deterministic tokenizer for the tiny trained models (same corpus → same vocabulary)."""
    return wrap(build_backend(texts, vocab_size))


def with_tools_template(tokenizer):
    """A copy of `tokenizer` whose chat template declares tools, calls and results (`TOOLS_CHAT_TEMPLATE`)."""
    import copy

    tools = copy.deepcopy(tokenizer)
    tools.chat_template = TOOLS_CHAT_TEMPLATE
    return tools


def save_tokenizer(tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path
