"""lm-evaluation-harness against the endpoint, and the same tasks in-process through the engine.

Two local tasks. `gemma4lib_capitals` (`tasks/capitals.jsonl`: capital questions, two of them about
places the tiny models never saw) is generated and scored by exact match of the whole reply ("The
capital of France is Paris."): over HTTP lm-eval's own `local-chat-completions` model sends each
question through the server's chat route; in process `EngineLM` runs the same requests through
`Engine.generate` (what `port` runs). `gemma4lib_capitals_choice` (`tasks/capitals_choice.jsonl`) is a
log-likelihood task: each of four answers ("The capital of Kenya is Cairo.") is scored by its
log-probability after the chat-formatted question, the likeliest one is the model's choice (`acc`).
Over HTTP lm-eval's `local-completions` sends the token ids of question and answer (its default,
`tokenized_requests`: lm-eval splits question and answer at a token, which a text prompt would
re-tokenize across) with `echo` and `logprobs`, and the server teacher-forces the prompt through its
decode graph; in process `EngineLM` prefills the question and forces the answer's tokens on the
engine's rows. Equal scores and log-likelihoods within the logit tolerance say the endpoint adds
nothing and loses nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM

from gemma4lib.errors import SettingsError

TASK = "gemma4lib_capitals"
CHOICE_TASK = "gemma4lib_capitals_choice"
DATA = Path(__file__).parent / "tasks" / "capitals.jsonl"
CHOICE_DATA = Path(__file__).parent / "tasks" / "capitals_choice.jsonl"
QUESTION = "What is the capital of {{country}}?"


def write_tasks(folder: str | Path, data: Path = DATA, choice_data: Path = CHOICE_DATA) -> list[Path]:
    """Both tasks' YAML in `folder` (lm-eval's `include_path`), pointing at the local data files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": QUESTION, "num_fewshot": 0}
    generated = {
        "task": TASK,
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "output_type": "generate_until",
        "doc_to_target": "The capital of {{country}} is {{capital}}.",
        "generation_kwargs": {"until": ["<turn|>"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    chosen = {  # each answer a whole reply, as the model writes it after the chat template's model turn
        "task": CHOICE_TASK,
        "dataset_kwargs": {"data_files": {"test": str(choice_data.resolve())}},
        "output_type": "multiple_choice",
        "doc_to_choice": "[{% for c in choices %}'The capital of {{country}} is {{c}}.', {% endfor %}]",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    paths = []
    for config in (generated, chosen):
        paths.append(folder / f"{config['task']}.yaml")
        paths[-1].write_text(json.dumps({**common, **config}, indent=2) + "\n")  # JSON is YAML
    return paths


def _evaluate(
    model: Any, model_args: dict[str, Any] | None, folder: str | Path, limit: int | None, task: str = TASK
) -> dict[str, Any]:
    """`task` through `model`: its score, and per question the reply (generated) or each answer's
    log-likelihood (multiple choice)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the data is a local file: never reach a hub
    write_tasks(folder)
    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),  # not lm-eval's ~6 s index
        apply_chat_template=True,
        limit=limit,
        log_samples=True,
    )
    samples, scores = results["samples"][task], results["results"][task]
    if task == CHOICE_TASK:
        lls = {s["doc"]["country"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
        return {"acc": float(scores["acc,none"]), "loglikelihoods": lls}
    return {
        "exact_match": float(scores["exact_match,none"]),
        "replies": {s["doc"]["country"]: s["resps"][0][0] for s in samples},
    }


def evaluate_endpoint(base_url: str, model: str, folder: str | Path, limit: int | None = None) -> dict[str, Any]:
    """The task through the server's `/v1/chat/completions` (lm-eval's `local-chat-completions`)."""
    args = {
        "model": model,
        "base_url": base_url.rstrip("/") + "/v1/chat/completions",
        "num_concurrent": 4,
        "max_retries": 1,
        "tokenized_requests": False,
    }
    return _evaluate("local-chat-completions", args, folder, limit)


def choose_over_endpoint(
    base_url: str, model: str, tokenizer: str | Path, folder: str | Path, limit: int | None = None
) -> dict[str, Any]:
    """The multiple-choice task through the server's `/v1/completions` (lm-eval's `local-completions`,
    token-id prompts); `tokenizer` is the served model's tokenizer folder (lm-eval counts the question's
    tokens with it to find the answer's log-probabilities in the echo)."""
    args = {
        "model": model,
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "tokenizer_backend": "huggingface",  # not "auto": it probes routes this server does not have
        "tokenizer": str(tokenizer),
        "num_concurrent": 4,
        "max_retries": 1,
    }
    return _evaluate("local-completions", args, folder, limit, CHOICE_TASK)


def evaluate_in_process(
    engine: Any,
    tokenizer: Any,
    eos_ids: tuple[int, ...],
    folder: str | Path,
    limit: int | None = None,
    task: str = TASK,
) -> dict[str, Any]:
    """The same task through the engine (`generate_rows`), no server."""
    return _evaluate(EngineLM(engine, tokenizer, eos_ids), None, folder, limit, task)


class EngineLM(TemplateLM):
    """lm-eval's model interface over the engine, in batches of the engine's rows: greedy
    `generate_until`, and `loglikelihood` (lm-eval's `TemplateLM` splits context and continuation into
    tokens as its API models do, so both sides score the same ids)."""

    def __init__(self, engine: Any, tokenizer: Any, eos_ids: tuple[int, ...]):
        super().__init__()
        self.engine, self.tokenizer, self.eos_ids = engine, tokenizer, tuple(eos_ids)

    @property
    def eot_token_id(self) -> int:
        return self.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: `<bos>`, as lm-eval's API models take it."""
        return int(self.tokenizer.bos_token_id)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The ids of `string` (the chat template already wrote `<bos>`), as `local-completions` counts them."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    @property
    def tokenizer_name(self) -> str:
        return "gemma4lib-" + str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from gemma4lib.runtime import Request

        out: list[str] = []
        for start in range(0, len(requests), self.engine.batch):
            chunk = requests[start : start + self.engine.batch]
            jobs, stops = [], []
            for request in chunk:
                context, kwargs = request.args
                ids = self.tokenizer(context, add_special_tokens=False)["input_ids"]  # the template has <bos>
                jobs.append(Request(ids, int(kwargs.get("max_gen_toks", 24)), eos_token_ids=self.eos_ids))
                stops.append([s for s in kwargs.get("until", []) if s])
            for result, until in zip(self.engine.generate_rows(jobs).rows, stops, strict=True):
                text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
                cuts = [text.index(s) for s in until if s in text]
                out.append(text[: min(cuts)] if cuts else text)
        return out

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        """Each (context, continuation) pair: the context prefilled, the continuation's tokens forced one
        decode step each; its log-likelihood is the sum of theirs (the softcapped distribution, as the
        server reports), greedy when each was also the likeliest."""
        from gemma4lib.runtime import Request
        from gemma4lib.server.logprobs import Forced, TokenLogprobs

        out: list[tuple[float, bool]] = []
        for start in range(0, len(requests), self.engine.batch):
            chunk = requests[start : start + self.engine.batch]
            watches = [TokenLogprobs(1, getattr(self.engine, "cap", None), Forced(list(c))) for _, _, c in chunk]
            jobs = [Request(ctx, len(c), watch=w) for (_, ctx, c), w in zip(chunk, watches, strict=True)]
            self.engine.generate_rows(jobs)  # no eos: the answer's tokens are forced to their end
            for w in watches:
                out.append((sum(lp for _, lp, _ in w.entries), all(t == top[0][0] for t, _, top in w.entries)))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise SettingsError("EngineLM scores answers, not whole texts: run a multiple_choice or generate_until task")
