#!/usr/bin/env python
"""A short scratch probe of the tool recipe's first phases (no fault hinge, no needle, nothing saved).

    python scripts/probe_tools.py --retrieval-steps 90 --tool-first-steps 150
    python scripts/probe_tools.py --fixtures /tmp/run/fixtures   # no training: a saved run's failing pieces

Why: a full `scripts/train_tools.py` run costs ~40 minutes; whether a change to the first phases (the
retrieval curriculum, `ToolConfig.retrieval_*`) moves the failing tokens shows in a few. It loads the shipped
fixture (read only), runs `_retrieval` then `_tool_first` from `gemma4lab.training.tools`, and logs the tool
set's `failing_tokens` by kind, the chats passing by chat kind, and how many calls get the argument's first
piece as the argmax (the diagnosis: 26 of 34 calls failed there), and which answers copy a made-up result.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gemma4lab.training.corpus import CANONICAL_PROMPT  # noqa: E402
from gemma4lab.training.text import reply_margins  # noqa: E402
from gemma4lab.training.tokenizer import build_tokenizer, with_tools_template  # noqa: E402
from gemma4lab.training.tools import (  # noqa: E402
    RESULT_NAMES,
    VALUE,
    WEATHERS,
    ToolChat,
    ToolConfig,
    _answered,
    _retrieval,
    _tool_first,
    encode_tool_chats,
    failing_tokens,
    kind_shares,
    retrieval_eval_chats,
    retrieval_gaps,
    token_kinds,
    tool_accuracy,
    tool_eval_chats,
    tool_spec,
)
from gemma4lib.models.corpus import COUNTRIES  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402

log = logging.getLogger("probe_tools")


@torch.no_grad()
def scored(lm, tokenizer, chats):
    """Each chat with its reply's margins (NaN off the reply made +inf), token kinds and labels, 8 chats a batch."""
    for k in range(0, len(chats), 8):
        picked = chats[k : k + 8]
        batch = encode_tool_chats(tokenizer, picked)
        margins = reply_margins(lm(input_ids=batch.input_ids, use_cache=False).logits, batch.labels)
        margins, kinds = torch.nan_to_num(margins, nan=float("inf")), token_kinds(tokenizer, picked, batch)
        for i, chat in enumerate(picked):
            yield chat, margins[i], kinds[i], batch.labels[i]


def right(counts: dict[str, list[int]], chat_key: str, ok: bool) -> None:
    group = counts.setdefault(chat_key, [0, 0])
    group[0], group[1] = group[0] + int(ok), group[1] + 1


def first_piece_right(lm, tokenizer, chats) -> str:
    """Calls whose argument's first piece is the argmax by a margin > 0, of the calls."""
    calls = [c for c in chats if c.calls]
    ok = sum(int(m[int((k == VALUE).nonzero()[0])] > 0) for _, m, k, _ in scored(lm, tokenizer, calls))
    return f"{ok}/{len(calls)}"


def value_pieces_failing(lm, tokenizer, chats, margin: float) -> dict[str, dict[str, int]]:
    """By chat kind, the copied value's pieces below `margin`: its first piece, or a later one (the first maps
    a piece's spelling, "L" to " L"; the later ones are copies of the piece after the one just written)."""
    out: dict[str, dict[str, int]] = {}
    for chat, margins, kinds, _ in scored(lm, tokenizer, chats):
        counts = out.setdefault(chat.kind, {"first": 0, "later": 0})
        for n, j in enumerate((kinds == VALUE).nonzero().flatten().tolist()):
            counts["later" if n else "first"] += int(margins[j] < margin)
    return out


def copies_by_repeat(lm, tokenizer, chats, margin: float) -> dict[str, str]:
    """Answers after a tool turn whose result is not the country's capital (made up, or another country's with
    `--result-names other_capital`), right by `margin` (every reply piece), of those whose name repeats a piece
    ("Gratordor": `or` twice) and of those that do not: a copy that follows only the last piece written cannot
    tell a repeated piece's two places apart."""
    capitals = dict(COUNTRIES)
    others = [c for c in chats if c.kind == "capital_answer" and c.value != capitals[c.asked]]
    counts = {"repeats": [0, 0], "no_repeat": [0, 0]}
    for _, margins, kinds, labels in scored(lm, tokenizer, others):
        pieces = labels[kinds == VALUE].tolist()
        right(counts, "repeats" if len(set(pieces)) < len(pieces) else "no_repeat", bool((margins >= margin).all()))
    return {name: f"{ok}/{n}" for name, (ok, n) in counts.items()}


def result_copies(lm, tokenizer, gaps, margin: float, result_names: str) -> dict[str, str]:
    """The retrieval set's result copies right by `margin` (every reply piece), by gap and by what is copied:
    a capital result (made up or another country's) or a weather word (one of nine it knows)."""
    chats = retrieval_eval_chats(tokenizer, gaps, results=True, result_names=result_names)
    counts: dict[str, list[int]] = {}
    for chat, margins, _, _ in scored(lm, tokenizer, [c for c in chats if c.kind.startswith("retrieve_result")]):
        copied = "weather" if chat.value in WEATHERS else "capital"
        right(counts, f"{chat.kind}/{copied}", bool((margins >= margin).all()))
    return {name: f"{ok}/{n}" for name, (ok, n) in sorted(counts.items())}


def copied_names(lm, tokenizer, names: list[str]) -> tuple[int, int, list[str]]:
    """HF greedy's answers to the canonical question after `get_capital` returned each name: how many copy
    it exactly (`tool_accuracy`), and what the others said."""
    asked, chats = [{"role": "user", "content": CANONICAL_PROMPT}], []
    for name in names:
        rng = random.Random(7)
        answered = _answered(asked, "get_capital", "country", "France", name, rng)
        chats.append(ToolChat(answered, [tool_spec(rng, "get_capital")], f"The capital of France is {name}."))
    return tool_accuracy(lm, tokenizer, chats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrieval-steps", type=int, default=90)
    parser.add_argument("--tool-first-steps", type=int, default=150)
    parser.add_argument("--gaps", default="10,30,70", help="the curriculum's filler lengths, comma-separated")
    parser.add_argument("--mixed-gaps", action="store_true", help="each row's gap drawn from all gaps from step 0")
    parser.add_argument(
        "--result-names", choices=RESULT_NAMES, default="made_up", help="a capital result not the capital"
    )
    parser.add_argument("--lr", type=float, default=ToolConfig.lr)
    parser.add_argument("--retrieval-result-share", type=float, default=0.0, help="retrieval chats copying a result")
    parser.add_argument("--kind-shares", default="", help="tool chat kinds' shares, e.g. weather_answer=0.3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-names", default="", help="with --fixtures: results to answer with, comma-separated")
    parser.add_argument("--fixtures", default=None, help="no training: diagnose the E2B saved under this folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if args.fixtures:
        loaded = load_trained("e2b", root=Path(args.fixtures))
        lm, tokenizer, evals = (
            loaded.lm.eval(),
            with_tools_template(loaded.tokenizer),
            tool_eval_chats(result_names=args.result_names),
        )
        log.info("failing tokens, passing chats: %s", failing_tokens(lm, tokenizer, evals, ToolConfig.tool_margin))
        log.info("value pieces failing: %s", value_pieces_failing(lm, tokenizer, evals, ToolConfig.tool_margin))
        log.info("results not the capital, copied: %s", copies_by_repeat(lm, tokenizer, evals, ToolConfig.tool_margin))
        if args.copy_names:
            log.info(
                "results copied, and the answers that did not: %s",
                copied_names(lm, tokenizer, args.copy_names.split(",")),
            )
        return 0
    cfg = ToolConfig(seed=args.seed, retrieval_steps=args.retrieval_steps, tool_first_steps=args.tool_first_steps)
    cfg.kind_shares = kind_shares(args.kind_shares)
    cfg.retrieval_result_share = args.retrieval_result_share
    cfg.retrieval_gaps = retrieval_gaps(args.gaps)
    cfg.retrieval_mixed, cfg.lr = args.mixed_gaps, args.lr
    cfg.result_names = args.result_names
    lm = load_trained("e2b").lm
    tokenizer = with_tools_template(build_tokenizer())
    torch.manual_seed(cfg.seed)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    lm.set_attn_implementation("sdpa")
    evals = tool_eval_chats(result_names=cfg.result_names, shares=cfg.kind_shares)
    start = time.perf_counter()
    lm.train()
    _retrieval(lm, tokenizer, cfg, opt, rng, gen)
    seconds = time.perf_counter() - start
    lm.eval()
    log.info("after the retrieval phase (%.0f s): first piece %s", seconds, first_piece_right(lm, tokenizer, evals))
    if cfg.retrieval_result_share > 0:
        log.info(
            "result copies: %s", result_copies(lm, tokenizer, cfg.retrieval_gaps, cfg.tool_margin, cfg.result_names)
        )
    lm.train()
    _tool_first(lm, tokenizer, cfg, opt, rng, gen)
    lm.eval()
    log.info("after the tool-first phase (%.0f s):", time.perf_counter() - start)
    log.info("  failing tokens, passing chats: %s", failing_tokens(lm, tokenizer, evals, cfg.tool_margin))
    log.info("  calls with the argument's first piece right: %s", first_piece_right(lm, tokenizer, evals))
    log.info("  value pieces failing: %s", value_pieces_failing(lm, tokenizer, evals, cfg.tool_margin))
    log.info("  results not the capital, copied: %s", copies_by_repeat(lm, tokenizer, evals, cfg.tool_margin))
    log.info("probe done in %.0f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
