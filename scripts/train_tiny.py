#!/usr/bin/env python
"""Train the tiny Gemma-4 fixtures and write them with their provenance.

    python scripts/train_tiny.py --variant all --out gemma4lib/fixtures --seed 0

Writes `<out>/tokenizer/`, `<out>/<variant>/{config.json,generation_config.json,model.safetensors}`
and `<out>/PROVENANCE.json` (updated in place when only some variants are retrained). One thread,
deterministic: the same seed gives byte-identical weights on the same CPU type and torch version.
Exits non-zero when a model does not converge or does not answer the canonical prompt exactly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

# One thread before torch starts: thread count changes the floating-point reduction order.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4lab.training import corpus as training_corpus  # noqa: E402
from gemma4lab.training.machine import cpu_type  # noqa: E402
from gemma4lab.training.text import (  # noqa: E402
    TrainConfig,
    fault_answers,
    greedy_reply,
    held_out_accuracy,
    save_fixture,
    state_sha256,
    train_variant,
)
from gemma4lab.training.tokenizer import TOKENIZER_FILES, build_tokenizer, save_tokenizer  # noqa: E402
from gemma4lib.models.tokenizer import load_tokenizer  # noqa: E402
from gemma4lib.models.trained import sha256_file  # noqa: E402
from gemma4lib.models.variants import VARIANTS, get_variant  # noqa: E402

log = logging.getLogger("train_tiny")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="all", help=f"one of {', '.join(VARIANTS)} or 'all'")
    p.add_argument("--out", default=str(ROOT / "gemma4lib" / "fixtures"), help="fixtures folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the fixtures use 1)")
    p.add_argument("--max-steps", type=int, default=None, help="override the step cap")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    for name in ("transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    variants = list(VARIANTS) if args.variant == "all" else [get_variant(args.variant).name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prov_path = out / "PROVENANCE.json"
    prov = json.loads(prov_path.read_text()) if prov_path.is_file() else {}
    if prov.get("seed", args.seed) != args.seed and args.variant != "all":
        log.warning("PROVENANCE.json records seed %s; retraining %s with seed %s", prov["seed"], variants, args.seed)

    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, out / "tokenizer")
    tokenizer = load_tokenizer(out / "tokenizer")  # train with exactly what ships
    files = dict(prov.get("files", {}))
    for name in TOKENIZER_FILES:
        files[f"tokenizer/{name}"] = sha256_file(out / "tokenizer" / name)

    command = "python scripts/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cfg = TrainConfig(seed=args.seed)
    if args.max_steps is not None:
        cfg.max_steps = args.max_steps
    records = dict(prov.get("variants", {}))
    failed = []
    for name in variants:
        variant = get_variant(name)
        log.info("training %s (seed %d, %d thread(s))", name, args.seed, args.threads)

        def progress(r, name=name):
            if r["step"] % 25 == 0:
                log.info(
                    "  %s step %4d  loss %.4f  min margin %+.2f", name, r["step"], r.get("loss", 0.0), r["min_margin"]
                )

        res = train_variant(variant, tokenizer, cfg, progress=None if args.quiet else progress)
        lm = res.loaded.lm
        text, ids = greedy_reply(lm, tokenizer, training_corpus.CANONICAL_PROMPT)
        canonical_ok = text == training_corpus.CANONICAL_ANSWER and ids[-1:] == [tokenizer.eos_token_id]
        held_ok, held_n, held_failures = held_out_accuracy(lm, tokenizer)
        target = out / name
        file_hashes = save_fixture(lm, target)
        for fname, digest in file_hashes.items():
            files[f"{name}/{fname}"] = digest
        state_hash = state_sha256(lm)
        answers = fault_answers(lm, tokenizer)
        assert state_sha256(lm) == state_hash  # the fault probes restored every buffer
        records[name] = {
            "command": command,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # the CPU type decides the bytes (machine.CPU_TYPE_KEYS): tests/test_trained_fixtures.py
            # checks a retraining against them only on the same type
            "cpu": cpu_type(),
            "model_class": type(lm).__name__,
            "params": sum(p.numel() for p in lm.parameters()),
            "steps": res.steps,
            "converged": res.converged,
            "train_seconds": round(res.seconds, 1),
            "final_min_margin": round(res.min_margin, 4),
            "fault_margins": {k: round(v, 4) for k, v in res.fault_margins.items()},
            "faults_trained": bool(res.fault_margins),
            "canonical_reply": text,
            "held_out_correct": f"{held_ok}/{held_n}",
            "held_out_failures": held_failures,
            "answers_under_faults": answers,
            "state_sha256": state_hash,
            "bytes": (target / "model.safetensors").stat().st_size,
        }
        log.info(
            "%s: %d steps, %.0f s, min margin %.2f, faults %s, canonical %r, held-out %d/%d, %.1f MB",
            name,
            res.steps,
            res.seconds,
            res.min_margin,
            records[name]["fault_margins"],
            text,
            held_ok,
            held_n,
            records[name]["bytes"] / 1e6,
        )
        if not (res.converged and canonical_ok):
            failed.append(name)

    import tokenizers
    import transformers

    prov.update(
        {
            "script": "scripts/train_tiny.py",
            "command": command,
            "seed": args.seed,
            "threads": args.threads,
            "corpus_sha256": training_corpus.corpus_sha256(),
            "corpus": {
                "train_chats": len(training_corpus.training_chats()),
                "held_out_phrasing": training_corpus.HELD_OUT_PHRASING,
            },
            "tokenizer_vocab_size": len(tokenizer),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "python": platform.python_version(),
            },
            "machine": {"processor": platform.processor() or platform.machine(), "system": platform.system()},
            "train_config": cfg.to_dict(),
            "variants": {k: records[k] for k in VARIANTS if k in records},
            "files": dict(sorted(files.items())),
        }
    )
    prov_path.write_text(json.dumps(prov, indent=2) + "\n")
    log.info("wrote %s", prov_path)
    if failed:
        log.error("did not converge or answer the canonical prompt exactly: %s", failed)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
