#!/usr/bin/env python
"""Train the tiny multimodal fixtures (vision part + a fine-tuned copy of the text fixture's
decoder) on synthetic shapes, and write them with their provenance.

    python scripts/train_vision.py --variant all --seed 0

Writes `gemma4lib/fixtures/vision/tokenizer/`, `gemma4lib/fixtures/vision/<variant>/` (config,
generation config, weights, image processor config) and `gemma4lib/fixtures/vision/PROVENANCE.json`
(updated in place when only some variants are retrained). The text fixtures are read, never written.
One thread, deterministic. Exits non-zero when a model does not converge or misnames a held-out image.
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4lib.cache.artifacts import sha256_file  # noqa: E402
from gemma4lib.models import vision  # noqa: E402
from gemma4lib.models.shapes import shape_images  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402
from gemma4lib.models.training import state_sha256  # noqa: E402

log = logging.getLogger("train_vision")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="all", help=f"one of {', '.join(vision.VISION_VARIANTS)} or 'all'")
    p.add_argument("--out", default=str(vision.VISION_DIR))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    return p.parse_args(argv)


def held_out(full, tokenizer, processor, seed: int) -> tuple[int, int, list[str]]:
    """Fresh images (another seed): how many answers equal the label exactly."""
    images = shape_images(2, seed=seed + 1000)
    failures = []
    for example in images:
        answer, _ = vision.answer_image(full, tokenizer, processor, example.image)
        if answer.strip() != example.answer:
            failures.append(f"{example.answer} -> {answer.strip()!r}")
    return len(images) - len(failures), len(images), failures


def train_one(name: str, out: Path, seed: int, max_steps: int | None) -> dict:
    torch.manual_seed(seed)
    text = load_trained(name)
    tokenizer = vision.vision_tokenizer(text.tokenizer)
    processor = vision.image_processor(name)
    full = vision.build_multimodal(name, text.lm, seed=seed)
    cfg = vision.VisionTrainConfig(seed=seed, **({"max_steps": max_steps} if max_steps else {}))
    result = vision.train_vision(full, tokenizer, processor, cfg)
    full = full.to(torch.bfloat16).to(torch.float32)  # the saved values (bf16): judge what ships
    state = state_sha256(full)
    margin = vision.min_margin(full, vision.encode_examples(tokenizer, processor, shape_images(cfg.per_class, seed)))
    correct, total, failures = held_out(full, tokenizer, processor, seed)
    files = vision.save_vision_fixture(full.to(torch.bfloat16), processor, out / name)
    log.info("%s: %d steps, margin %.3f (bf16), held out %d/%d", name, result.steps, margin, correct, total)
    return {
        "record": {
            "steps": result.steps,
            "converged": result.converged and margin > 0,
            "train_seconds": result.seconds,
            "final_min_margin_bf16": round(margin, 4),
            "held_out_correct": f"{correct}/{total}",
            "held_out_failures": failures,
            "history": result.history,
            "params_vision": sum(p.numel() for p in vision.vision_parameters(full)),
            "state_sha256": state,
            "train_config": cfg.to_dict(),
        },
        "files": {f"{name}/{k}": v for k, v in files.items()},
        "ok": result.converged and margin > 0 and not failures,
    }


def merge(into: Path, other: Path) -> None:
    """Fold a PROVENANCE.json written elsewhere (a variant trained into another --out folder) and
    its variant folders into `into` (files are copied as they are; their hashes were recorded)."""
    import shutil

    theirs = json.loads((other / "PROVENANCE.json").read_text())
    path = into / "PROVENANCE.json"
    ours = json.loads(path.read_text())
    for name, record in theirs["variants"].items():
        shutil.copytree(other / name, into / name, dirs_exist_ok=True)
        ours["variants"][name] = record
    ours["files"].update({k: v for k, v in theirs["files"].items() if not k.startswith("tokenizer/")})
    ours["files"] = dict(sorted(ours["files"].items()))
    path.write_text(json.dumps(ours, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    out = Path(args.out)
    names = list(vision.VISION_VARIANTS) if args.variant == "all" else [args.variant]
    prov_path = out / "PROVENANCE.json"
    prov = json.loads(prov_path.read_text()) if prov_path.is_file() else {"files": {}, "variants": {}}
    text = load_trained(names[0])
    tok_dir = out / "tokenizer"
    vision.vision_tokenizer(text.tokenizer).save_pretrained(str(tok_dir))
    for f in sorted(tok_dir.iterdir()):
        prov["files"][f"tokenizer/{f.name}"] = sha256_file(f)
    ok = True
    for name in names:
        started = time.perf_counter()
        done = train_one(name, out, args.seed, args.max_steps)
        done["record"]["wall_seconds"] = round(time.perf_counter() - started, 1)
        done["record"]["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        steps = f" --max-steps {args.max_steps}" if args.max_steps else ""
        done["record"]["command"] = f"python scripts/train_vision.py --variant {name} --seed {args.seed}{steps}"
        prov["variants"][name] = done["record"]
        prov["files"].update(done["files"])
        ok = ok and done["ok"]
    prov.update(
        {
            "script": "scripts/train_vision.py",
            "command": f"python scripts/train_vision.py --variant all --seed {args.seed}",
            "seed": args.seed,
            "threads": 1,
            "text_fixtures": "gemma4lib/fixtures/<variant> (read only; their files and answers are unchanged)",
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
        }
    )
    import transformers

    prov["versions"]["transformers"] = transformers.__version__
    prov["files"] = dict(sorted(prov["files"].items()))
    prov_path.write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
