#!/usr/bin/env python
"""Fine-tune a tiny fixture for the needle: a corpus question after ~3,000 tokens of filler (issue 48).

    python scripts/train_needle.py --variant e2b

Runs after scripts/train_tiny.py (and before scripts/train_assistants.py, whose assistant is distilled
against the target): loads the shipped fixture, fine-tunes it in place (`gemma4lab.training.needle`),
checks every training and held-out answer is still exact, and records the run in PROVENANCE.json
(`variants.<name>.needle`, with the state before it as `base_state_sha256`; `state_sha256`, the bytes,
the canonical reply, the held-out count and the answers under faults are the fine-tuned model's).
One thread, deterministic for a given torch version and CPU type. When the fine-tune does not converge
or an answer is lost it writes nothing and exits non-zero (`gemma4lab.training.needle` gives the
measured run: the E2B converged in 300 steps). Then retrain the variant's assistant
(`scripts/train_assistants.py --variant e2b`): it is distilled against this target.
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
from gemma4lab.training.needle import NEEDLE_VARIANTS, NeedleConfig, finetune_needle  # noqa: E402
from gemma4lab.training.runs import fixture_checks, fixture_parser, start_run  # noqa: E402
from gemma4lab.training.text import fault_answers, save_fixture, state_sha256  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402
from gemma4lib.models.variants import get_variant  # noqa: E402

log = logging.getLogger("train_needle")


def main(argv=None) -> int:
    args = fixture_parser(__doc__, NEEDLE_VARIANTS).parse_args(argv)
    run = start_run(args, "train_needle.py", argv)
    out, prov, command = run.out, run.provenance, run.command
    config = NeedleConfig(seed=args.seed)
    failed = []
    for name in (get_variant(v).name for v in args.variant.split(",")):
        loaded = load_trained(name, root=out)
        lm, tokenizer = loaded.lm, loaded.tokenizer
        base = state_sha256(lm)

        def progress(r, name=name):
            if r["step"] % 10 == 0:
                log.info("  %s step %4d  %s", name, r["step"], {k: round(v, 3) for k, v in r.items() if k != "step"})

        result = finetune_needle(lm, tokenizer, config, progress)
        checks = fixture_checks(lm, tokenizer)
        (held_ok, held_n, held_failures), (needle_ok, needle_n, needle_failures) = (
            checks.held_out,
            checks.held_out_after_filler,
        )
        needle = {
            "command": command,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": cpu_type(),
            "from_state_sha256": base,
            "steps": result.steps,
            "converged": result.converged,
            "train_seconds": round(result.seconds, 1),
            "final_min_margin": round(result.min_margin, 4),
            "needle_min_margin": round(result.needle_min_margin, 4),
            "fault_margins": {k: round(v, 4) for k, v in result.fault_margins.items()},
            "canonical_needle_reply": checks.canonical_needle_reply,
            "held_out_correct": f"{held_ok}/{held_n}",
            "held_out_after_filler_correct": f"{needle_ok}/{needle_n}",
            "held_out_after_filler_failures": needle_failures,
            "train_config": config.to_dict(),
        }
        log.info("%s: %s", name, needle)
        if not (result.converged and checks.ok):
            failed.append(name)  # the fixture is left as it was
            continue
        target = out / name
        for fname, digest in save_fixture(lm, target).items():
            prov["files"][f"{name}/{fname}"] = digest
        rec = prov["variants"][name]
        rec.update(
            {
                "base_state_sha256": rec.get("base_state_sha256", base),
                "state_sha256": state_sha256(lm),
                "canonical_reply": checks.canonical_reply,
                "held_out_correct": f"{held_ok}/{held_n}",
                "held_out_failures": held_failures,
                "answers_under_faults": fault_answers(lm, tokenizer),
                "bytes": (target / "model.safetensors").stat().st_size,
                "needle": needle,
            }
        )
    run.write_provenance()
    if failed:
        log.error("did not converge or lost an answer (fixture left unchanged): %s", failed)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
