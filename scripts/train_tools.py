#!/usr/bin/env python
"""Teach a tiny fixture Gemma-4's tool calls (issue 49, item 5): its tokenizer's tool specials, then a fine-tune.

    python scripts/train_tools.py --variant e2b

Runs after scripts/train_needle.py (it keeps the needle) and before scripts/train_assistants.py (the
assistant is distilled against this target). First it writes the fixture tokenizer as
`gemma4lab.training.tokenizer` builds it now (Gemma-4's tool and thought specials at their real ids in
place of `<unusedN>` fillers; every other id unchanged, which it checks; the chat template that declares
tools, `TOOLS_CHAT_TEMPLATE`, only once a model converged: it is what makes the server accept `tools`),
then fine-tunes the variant in place (`gemma4lab.training.tools`), checks every training and
held-out answer and the needle are still right, and records the run in PROVENANCE.json
(`variants.<name>.tools`; `state_sha256`, the bytes, the canonical reply, the held-out counts and the
answers under faults are the fine-tuned model's). One thread, deterministic for a given torch version
and CPU type. When the fine-tune does not converge or an answer is lost it writes no weights and exits
non-zero. Then retrain the variant's assistant (`scripts/train_assistants.py --variant e2b`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # thread count changes the floating-point reduction order
os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4lab.training.machine import cpu_type  # noqa: E402
from gemma4lab.training.runs import fixture_checks, fixture_parser, start_run  # noqa: E402
from gemma4lab.training.text import fault_answers, save_fixture, state_sha256  # noqa: E402
from gemma4lab.training.tokenizer import build_tokenizer, save_tokenizer, with_tools_template  # noqa: E402
from gemma4lab.training.tools import (  # noqa: E402
    HELD_OUT_COUNTRIES,
    RESULT_NAMES,
    TOOL_VARIANTS,
    ToolConfig,
    finetune_tools,
    kind_shares,
    retrieval_gaps,
    tool_accuracy,
    tool_eval_chats,
)
from gemma4lib.cache.artifacts import sha256_file  # noqa: E402
from gemma4lib.models.tokenizer import load_tokenizer  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402
from gemma4lib.models.variants import get_variant  # noqa: E402

log = logging.getLogger("train_tools")


def write_tokenizer(out: Path, prov: dict, tools: bool) -> None:
    """The fixture tokenizer with the tool specials (and, `tools`, the template that declares tools);
    refuses one that moves any other id."""
    folder = out / "tokenizer"
    before = load_tokenizer(folder)
    tokenizer = with_tools_template(build_tokenizer()) if tools else build_tokenizer()
    renamed = {i for t, i in tokenizer.get_vocab().items() if before.get_vocab().get(t) != i}
    if len(tokenizer) != len(before) or any(not before.convert_ids_to_tokens(i).startswith("<unused") for i in renamed):
        raise SystemExit(f"the rebuilt tokenizer moves ids other than <unusedN> fillers: {sorted(renamed)}")
    save_tokenizer(tokenizer, folder)
    for name in sorted(p.name for p in folder.iterdir()):
        prov["files"][f"tokenizer/{name}"] = sha256_file(folder / name)
    log.info("tokenizer: renamed ids %s", sorted(renamed))


def main(argv=None) -> int:
    parser = fixture_parser(__doc__, TOOL_VARIANTS)
    parser.add_argument("--max-steps", type=int, default=None, help="steps of this run; default the config's")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate; default the config's")
    parser.add_argument("--tool-rows", type=int, default=None, help="tool chats per step; default the config's")
    parser.add_argument("--tool-first-steps", type=int, default=None, help="steps of the tool-first phase")
    parser.add_argument("--copy-weight", type=float, default=None, help="loss weight of name and value tokens")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations; default the config's")
    parser.add_argument("--retrieval-steps", type=int, default=None, help="steps of the retrieval curriculum (0: off)")
    parser.add_argument("--retrieval-keep-rows", type=int, default=None, help="retrieval chats per later step")
    parser.add_argument("--retrieval-result-share", type=float, default=None, help="retrieval chats copying a result")
    parser.add_argument("--retrieval-keep-result-share", type=float, default=None, help="of the kept rows, copies")
    parser.add_argument("--retrieval-gaps", default=None, help="the curriculum's filler lengths, e.g. 0,4,8,12,16,20")
    parser.add_argument("--retrieval-mixed", action="store_true", help="every row's gap from all gaps")
    parser.add_argument("--result-names", default=None, choices=RESULT_NAMES, help="a capital result not the capital")
    parser.add_argument("--kind-shares", default="", help="tool chat kinds' shares, e.g. weather_answer=0.3")
    parser.add_argument(
        "--keep-unconverged-tools",
        action="store_true",
        help="save the weights when every earlier property holds but the tool set misses its margin (recorded)",
    )
    args = parser.parse_args(argv)
    run = start_run(args, "train_tools.py", argv)
    out, prov, command = run.out, run.provenance, run.command
    write_tokenizer(out, prov, tools=False)  # the specials; the template only with a model that calls (below)
    run.write_provenance()
    config = ToolConfig(seed=args.seed)
    keys = ("max_steps", "lr", "tool_rows", "tool_first_steps", "copy_weight", "eval_every", "retrieval_steps")
    keys += ("retrieval_keep_rows", "retrieval_result_share", "retrieval_keep_result_share", "result_names")
    for key in keys:  # a continued run may change them
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    if args.retrieval_gaps:
        config.retrieval_gaps = retrieval_gaps(args.retrieval_gaps)
    config.retrieval_mixed = args.retrieval_mixed
    config.kind_shares = kind_shares(args.kind_shares)
    config.cosine_steps = min(config.cosine_steps, config.max_steps)
    failed = []
    for name in (get_variant(v).name for v in args.variant.split(",")):
        loaded = load_trained(name, root=out)
        lm, tokenizer = loaded.lm, with_tools_template(loaded.tokenizer)
        base = state_sha256(lm)

        def progress(r, name=name):
            if r["step"] % 10 == 0:
                log.info("  %s step %4d  %s", name, r["step"], {k: round(v, 3) for k, v in r.items() if k != "step"})

        result = finetune_tools(lm, tokenizer, config, progress)
        checks = fixture_checks(lm, tokenizer)
        (held_ok, held_n, held_failures), (needle_ok, needle_n, _) = checks.held_out, checks.held_out_after_filler
        tools_ok, tools_n, tools_failures = tool_accuracy(
            lm, tokenizer, tool_eval_chats(result_names=config.result_names, shares=config.kind_shares)[::3]
        )  # HF greedy: slow
        unseen_ok, unseen_n, unseen_failures = tool_accuracy(
            lm, tokenizer, tool_eval_chats(2, HELD_OUT_COUNTRIES, config.result_names, config.kind_shares)
        )
        record = {
            "command": command,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": cpu_type(),
            "from_state_sha256": base,
            "steps": result.steps,
            "converged": result.converged,
            "kept_step": result.kept_step,
            "train_seconds": round(result.seconds, 1),
            "final_min_margin": round(result.min_margin, 4),
            "tool_min_margin": round(result.tool_min_margin, 4),
            "needle_min_margin": round(result.needle_min_margin, 4),
            "fault_margins": {k: round(v, 4) for k, v in result.fault_margins.items()},
            "tool_set_correct": f"{tools_ok}/{tools_n}",
            "tool_set_failures": tools_failures,
            "unseen_countries_correct": f"{unseen_ok}/{unseen_n}",
            "unseen_countries_failures": unseen_failures,
            "canonical_needle_reply": checks.canonical_needle_reply,
            "held_out_correct": f"{held_ok}/{held_n}",
            "held_out_after_filler_correct": f"{needle_ok}/{needle_n}",
            "train_config": config.to_dict(),
        }
        log.info("%s: %s", name, record)
        kept = checks.ok and result.min_margin >= config.margin
        kept = kept and result.needle_min_margin >= config.needle_margin
        kept = kept and max(result.fault_margins.values()) <= -config.fault_margin  # every fault still breaks
        record["kept_unconverged"] = kept and args.keep_unconverged_tools and not result.converged
        if not (kept and (result.converged or args.keep_unconverged_tools)):
            failed.append(name)  # the fixture's weights are left as they were
            continue
        target = out / name
        if result.converged:  # a model that calls: its (shared) tokenizer declares tools from now on
            write_tokenizer(out, prov, tools=True)
        for fname, digest in save_fixture(lm, target).items():
            prov["files"][f"{name}/{fname}"] = digest
        rec = prov["variants"][name]
        rec.update(
            {
                "state_sha256": state_sha256(lm),
                "canonical_reply": checks.canonical_reply,
                "held_out_correct": f"{held_ok}/{held_n}",
                "held_out_failures": held_failures,
                "answers_under_faults": fault_answers(lm, tokenizer),
                "bytes": (target / "model.safetensors").stat().st_size,
                "tools": record,  # the last run; the runs before it (a continued fine-tune) in tools_earlier
                "tools_earlier": rec.get("tools_earlier", []) + ([rec["tools"]] if "tools" in rec else []),
            }
        )
    run.write_provenance()
    if failed:
        log.error("did not converge or lost an answer (weights left unchanged): %s", failed)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
