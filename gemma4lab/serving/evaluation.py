"""lm-evaluation-harness against the endpoint, and the same task in-process through the engine.

The task is a local file (`tasks/capitals.jsonl`: capital questions, two of them about places the
tiny models never saw), scored by exact match of the whole reply ("The capital of France is
Paris."). Over HTTP lm-eval's own `local-chat-completions` model sends each question through the
server's chat route; in process `EngineLM` runs the same requests through `Engine.generate` (what
`port` runs). Equal scores and equal replies say the endpoint adds nothing and loses nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from gemma4lib.errors import SettingsError

TASK = "gemma4lib_capitals"
DATA = Path(__file__).parent / "tasks" / "capitals.jsonl"


def write_task(folder: str | Path, data: Path = DATA) -> Path:
    """The task's YAML in `folder` (lm-eval's `include_path`), pointing at the local data file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {  # JSON is YAML: no YAML writer needed
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "What is the capital of {{country}}?",
        "doc_to_target": "The capital of {{country}} is {{capital}}.",
        "generation_kwargs": {"until": ["<turn|>"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "num_fewshot": 0,
    }
    path = folder / f"{TASK}.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def _evaluate(model: Any, model_args: dict[str, Any] | None, folder: str | Path, limit: int | None) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the data is a local file: never reach a hub
    write_task(folder)
    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(folder)),
        apply_chat_template=True,
        limit=limit,
        log_samples=True,
    )
    samples = results["samples"][TASK]
    return {
        "exact_match": float(results["results"][TASK]["exact_match,none"]),
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


def evaluate_in_process(
    engine: Any, tokenizer: Any, eos_ids: tuple[int, ...], folder: str | Path, limit: int | None = None
) -> dict[str, Any]:
    """The same task through `engine.generate`, no server."""
    return _evaluate(EngineLM(engine, tokenizer, eos_ids), None, folder, limit)


class EngineLM(LM):
    """lm-eval's model interface over the engine: greedy `generate_until` in batches of the engine's rows."""

    def __init__(self, engine: Any, tokenizer: Any, eos_ids: tuple[int, ...]):
        super().__init__()
        self.engine, self.tokenizer, self.eos_ids = engine, tokenizer, tuple(eos_ids)

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

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        raise SettingsError("EngineLM only generates: run a generate_until task (such as gemma4lib_capitals)")

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise SettingsError("EngineLM only generates: run a generate_until task (such as gemma4lib_capitals)")
