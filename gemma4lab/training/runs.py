"""What the fixture fine-tune scripts (scripts/train_needle.py, scripts/train_tools.py) share: their
arguments and set-up, and the checks every continued fine-tune must pass before its weights are written.

Why: each script repeated the same argument block, the same one-thread deterministic set-up and the same
after-run checks (the canonical reply, the held-out phrasing, the needle after 3,000 tokens of filler).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gemma4lab.training import corpus as training_corpus
from gemma4lab.training.needle import held_out_needles, needle_accuracy, needle_prompt
from gemma4lab.training.text import greedy_reply, held_out_accuracy
from gemma4lib.models.trained import FIXTURES_DIR


def fixture_parser(doc: str, variants: tuple[str, ...]) -> argparse.ArgumentParser:
    """The arguments every fixture fine-tune takes: the variants, the seed, the fixtures folder."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--variant", default=",".join(variants), help="comma-separated variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(FIXTURES_DIR))
    return parser


@dataclass
class Run:
    out: Path
    provenance: dict[str, Any]
    command: str

    def write_provenance(self) -> None:
        self.provenance["files"] = dict(sorted(self.provenance["files"].items()))
        (self.out / "PROVENANCE.json").write_text(json.dumps(self.provenance, indent=2) + "\n")


def start_run(args: argparse.Namespace, script: str, argv: list[str] | None) -> Run:
    """Logging, one deterministic thread (the thread count changes the reduction order), the PROVENANCE read."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    command = f"python scripts/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    return Run(out, json.loads((out / "PROVENANCE.json").read_text()), command)


@dataclass
class FixtureChecks:
    """What a fine-tuned fixture must still answer (HF greedy)."""

    canonical_reply: str
    canonical_ok: bool  # the canonical reply, ended by <eos>
    held_out: tuple[int, int, list[str]]
    held_out_after_filler: tuple[int, int, list[str]]
    canonical_needle_reply: str

    @property
    def ok(self) -> bool:
        held_ok, held_n, _ = self.held_out
        needle_right = self.canonical_needle_reply == training_corpus.CANONICAL_ANSWER
        return self.canonical_ok and held_ok == held_n and needle_right


def fixture_checks(lm: torch.nn.Module, tokenizer: Any) -> FixtureChecks:
    text, ids = greedy_reply(lm, tokenizer, training_corpus.CANONICAL_PROMPT)
    canonical_ok = text == training_corpus.CANONICAL_ANSWER and ids[-1:] == [tokenizer.eos_token_id]
    needle_text, _ = greedy_reply(lm, tokenizer, needle_prompt(tokenizer, training_corpus.CANONICAL_PROMPT))
    return FixtureChecks(
        text,
        canonical_ok,
        held_out_accuracy(lm, tokenizer),
        needle_accuracy(lm, tokenizer, held_out_needles(tokenizer)),
        needle_text,
    )
