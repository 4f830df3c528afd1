"""`python -m gemma4lib port` flags: each maps to its `PortSettings` field (or is refused by
argparse), and `--prompts` at batch 1 answers those prompts."""

from __future__ import annotations

import json

import pytest

from gemma4lib.cli import _settings, build_parser, main
from gemma4lib.errors import SettingsError


def settings_of(*flags: str):
    return _settings(build_parser().parse_args(["port", "--variant", "e2b", *flags]))


def test_batch_and_drafting_flags_map_to_the_settings():
    s = settings_of("--batch", "2", "--draft", "prompt_lookup", "--draft-tokens", "3", "--prompts", "a?| b?")
    assert (s.batch_size, s.draft, s.draft_tokens, s.prompts) == (2, "prompt_lookup", 3, ("a?", "b?"))
    s = settings_of("--draft", "assistant", "--no-ring-kv", "--prefill-buckets", "16,64")
    assert (s.draft, s.draft_tokens, s.ring_kv, s.prefill_buckets) == ("assistant", 4, False, (16, 64))
    s = settings_of("--context-length", "512", "--context-buckets", "64, 256")
    assert s.context_buckets == (64, 256)
    with pytest.raises(SettingsError, match="context_buckets must be a whole number"):
        settings_of("--context-buckets", "64,")


def test_an_unknown_drafter_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        settings_of("--draft", "medusa")
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


def test_prompts_at_batch_1_answer_those_prompts(capsys):
    question = "What is the capital of Italy?"
    flags = ["--backend", "eager", "--prompts", question, "--no-witness", "--iters", "1", "--warmup", "0"]
    code = main(["port", "--variant", "e2b", "--model", "trained", *flags, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result["failed_checks"]
    assert result["tokens"] == result["reference_tokens"] and result["logits_match"], result
    assert "Rome" in result["answer"] and "Paris" not in result["answer"], result["answer"]
