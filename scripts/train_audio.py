#!/usr/bin/env python
"""Teach the tiny multimodal fixtures to hear (issue 50): an audio part (a 2-layer conformer +
`embed_audio`) added to gemma4lib/fixtures/vision/<variant>, trained on espeak-ng clips of the text
fixture's countries (T1: transcribe a clip; T2: answer a spoken capital question), and written back
with the audio tokenizer and the provenance.

    sudo apt-get install -y espeak-ng   # training only: clips are spoken into $GEMMA4LIB_CACHE/espeak-clips
    python scripts/train_audio.py --variant e2b --seed 0

Writes `gemma4lib/fixtures/vision/tokenizer/` (the vision tokenizer with fillers 6, 7, 8 renamed to the
audio tokens; every other id and the rendering of images and text unchanged), the variant's folder, and
the `audio` section of `gemma4lib/fixtures/vision/PROVENANCE.json` (and its file hashes). One thread,
deterministic. Exits non-zero when a shipped clip (gemma4lib/fixtures/audio) is misanswered, or the
decoder, fine-tuned, lost a text answer the fixture gave before, or image answers beyond the vision fixture's
own shipping rule (`train_vision.shippable`: every shipped sample named, at most one held-out miss in 50).
"""

from __future__ import annotations

import argparse
import copy
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

from gemma4lab.training import hearing, vision_repair  # noqa: E402
from gemma4lab.training import vision as vision_training  # noqa: E402
from gemma4lab.training.audio import audio_tokenizer, with_hearing  # noqa: E402
from gemma4lab.training.text import held_out_accuracy  # noqa: E402
from gemma4lib.cache.artifacts import sha256_file  # noqa: E402
from gemma4lib.models import vision  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402

log = logging.getLogger("train_audio")
VARIANTS = ("e2b", "e4b", "12b")
# per variant: the recipe's class (the 12B has no conformer: `hearing.UnifiedHearConfig`) and its settings
# (the 12B's vision repair: docs/measurements/hearing_12b_unshipped_2026-12-06.json runs 8-10, images 49 -> 51/52)
RECIPES: dict[str, tuple[type, dict]] = {
    "12b": (
        hearing.UnifiedHearConfig,
        {
            "probe_steps": 1600,
            "steps": 2000,
            "image_batch": 12,
            "image_per_class": 48,
            "vision_repair_steps": 150,
            "vision_repair_lr": 1e-3,
            "vision_repair_every": 10,
            "vision_repair_per_class": 8,
        },
    )
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="e2b", help=f"one of {', '.join(VARIANTS)} or 'all'")
    p.add_argument("--out", default=str(vision.VISION_DIR))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="stage two's steps (default: HearTrainConfig's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a HearTrainConfig field for this run, e.g. --set image_batch=12 --set lr=2e-3 (repeatable)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run of the script: one speaker each, 2 steps")
    p.add_argument("--speakers", type=int, default=None, help="a reduced run: the first N training speakers")
    p.add_argument(
        "--from-hearing",
        default=None,
        metavar="DIR",
        help="skip the hearing: start from a run's written end state (DIR/<variant>, an --out folder) "
        "and run only what follows it (the vision repair, the judging): a probe, not a shipping run",
    )
    return p.parse_args(argv)


def vision_answers(full, tokenizer, processor, seed: int) -> tuple[int, int, list[str], list[str]]:
    """train_vision's held-out images and shipped samples, as `train_vision.py` judges them: the misses,
    then those of the shipped samples alone."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_vision import held_out  # noqa: PLC0415

    correct, total, failures, sample_failures = held_out(full, tokenizer, processor, seed)
    return correct, total, failures, sample_failures


def judged(full, tokenizer, processor, train, held, seed: int) -> dict:
    """Every figure the ship rule reads, on `full` as it is: training and held-out clips, shipped clips,
    text, images."""
    mels: dict = {}
    train_examples, held_examples = hearing.examples_of(train), hearing.examples_of(held)
    train_right, _ = hearing.accuracy(full, tokenizer, train_examples, mels)
    held_right, held_misses = hearing.accuracy(full, tokenizer, held_examples, mels)
    text_right, text_total, text_failures = held_out_accuracy(full, tokenizer)
    image_right, image_total, image_failures, sample_failures = vision_answers(full, tokenizer, processor, seed)
    return {
        "train": f"{train_right}/{len(train_examples)}",
        "held_out": f"{held_right}/{len(held_examples)}",
        "held_out_misses": held_misses,
        "shipped_misses": hearing.shipped_misses(full, tokenizer),
        "text": (text_right, text_total),
        "text_failures": text_failures,
        "images": (image_right, image_total),
        "image_failures": image_failures,
        "sample_failures": sample_failures,
    }


# what the vision repair must leave exactly as it found it (it trains image soft tokens only)
UNCHANGED_BY_REPAIR = ("train", "held_out", "held_out_misses", "shipped_misses", "text", "text_failures")


def config_changes(kind: type, pairs: list[str]) -> dict:
    """`--set NAME=VALUE` pairs as the recipe's config values, each cast to its field's default's type."""
    defaults, changes = kind().to_dict(), {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in defaults or name in ("seed", "steps"):
            raise SystemExit(f"--set {pair}: not a {kind.__name__} field (--seed and --steps have their own options)")
        field = type(defaults[name])
        changes[name] = value.lower() in ("1", "true", "yes") if field is bool else field(value)
    return changes


def train_one(
    name: str,
    out: Path,
    seed: int,
    steps: int | None,
    quick: bool = False,
    pairs: list[str] | None = None,
    n_speakers: int | None = None,
    from_hearing: str | None = None,
) -> dict:
    torch.manual_seed(seed)
    base = vision.load_vision_fixture(name, root=out)
    text = load_trained(name)
    tokenizer = audio_tokenizer(text.tokenizer)
    before_text, text_total, _ = held_out_accuracy(base.multimodal, tokenizer)
    before_images, image_total, _, _ = vision_answers(base.multimodal, tokenizer, base.processor, seed)
    full = with_hearing(base.variant, base.multimodal, seed)
    kind, settings = RECIPES.get(name, (hearing.HearTrainConfig, {}))
    changes = settings | ({"steps": steps} if steps else {}) | config_changes(kind, pairs or [])
    cfg = kind(seed=seed, **changes)
    speakers, held_speakers = hearing.train_speakers()[:n_speakers], list(hearing.HELD_OUT_SPEAKERS)
    if quick:
        cfg.probe_steps, cfg.steps, cfg.eval_every = 2, 2, 1
        speakers, held_speakers = speakers[:1], held_speakers[:1]
    started = time.perf_counter()
    train = [c for s in speakers for c in hearing.speaker_clips(s)]
    held = [c for s in held_speakers for c in hearing.speaker_clips(s)]
    clip_seconds = round(time.perf_counter() - started, 1)

    def images_right(model) -> int:  # judged as what ships: the weights rounded to bf16
        rounded = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
        return vision_answers(rounded, tokenizer, base.processor, seed)[0]

    check = images_right if cfg.keep_best else None
    if from_hearing:  # a probe of what follows the hearing, from a run's written end state
        full = vision.load_vision_fixture(name, root=Path(from_hearing)).multimodal
        result = hearing.HearResult(0, 0.0, [], None)
    else:
        result = hearing.train_hearing(full, tokenizer, base.processor, train, held, cfg, check, before_images)
    full = full.to(torch.bfloat16).to(torch.float32)  # the saved values (bf16): judge what ships
    figures, repair = judged(full, tokenizer, base.processor, train, held, seed), None
    if cfg.vision_repair_steps:
        log.info("%s before the vision repair: %s", name, {k: v for k, v in figures.items() if "misses" not in k})
        frozen_before = vision_repair.frozen_sha256(full)
        fixed = vision_repair.repair_vision(
            full,
            tokenizer,
            base.processor,
            cfg.vision_repair_steps,
            cfg.vision_repair_lr,
            cfg.vision_repair_every,
            seed,
            images_right,
            image_total,
            cfg.vision_repair_per_class,
        )
        full = full.to(torch.bfloat16).to(torch.float32)
        frozen_after = vision_repair.frozen_sha256(full)
        before, figures = figures, judged(full, tokenizer, base.processor, train, held, seed)
        repair = {
            "steps": fixed.steps,
            "kept_step": fixed.kept_step,
            "seconds": fixed.seconds,
            "history": fixed.history,
            "params": sum(p.numel() for p in vision_repair.repair_parameters(full)),
            "frozen_sha256_before": frozen_before,
            "frozen_sha256_after": frozen_after,
            "frozen_identical": frozen_before == frozen_after,
            "unchanged_figures": {k: before[k] == figures[k] for k in UNCHANGED_BY_REPAIR},
            "images_before_repair": "{}/{}".format(*before["images"]),
            "images_failures_before_repair": before["image_failures"],
        }
        log.info("%s vision repair: %s", name, {k: v for k, v in repair.items() if k != "history"})
    files = vision_training.save_vision_fixture(full.to(torch.bfloat16), base.processor, out / name)
    train_right, held_right = figures["train"], figures["held_out"]
    (text_right, _), (image_right, _) = figures["text"], figures["images"]
    shipped = figures["shipped_misses"]
    log.info(
        "%s: train %s, held out %s, shipped misses %s, text %d/%d (was %d), images %d/%d (was %d)",
        name,
        train_right,
        held_right,
        shipped,
        text_right,
        text_total,
        before_text,
        image_right,
        image_total,
        before_images,
    )
    record = {
        "steps": result.steps,
        "kept_step": result.kept_step,  # keep_best: the step restored (None: the last)
        "clip_seconds": clip_seconds,
        "train_seconds": result.seconds,
        "train_correct": train_right,
        "held_out_correct": held_right,
        "held_out_misses": figures["held_out_misses"],
        "shipped_misses": shipped,
        "decoder_fine_tuned": cfg.train_decoder,
        "text_held_out_correct": f"{text_right}/{text_total}",
        "text_held_out_before": f"{before_text}/{text_total}",
        "text_held_out_failures": figures["text_failures"],
        "images_held_out_correct": f"{image_right}/{image_total}",
        "images_held_out_before": f"{before_images}/{image_total}",
        "images_held_out_failures": figures["image_failures"],
        "images_sample_failures": figures["sample_failures"],  # of those, the shipped samples (fixtures/vision/images)
        "vision_repair": repair,  # None: no repair phase (vision_repair_steps 0)
        "history": result.history,
        "params_audio": sum(p.numel() for n, p in full.named_parameters() if "audio" in n),
        "train_config": cfg.to_dict(),
        "speakers": {"train": speakers, "held_out": held_speakers},
    }
    # images: none lost, or train_vision's own shipping rule (every shipped sample named, at most one held-out
    # miss in 50), since these weights replace the vision fixture; text: none lost
    from train_vision import images_shippable  # noqa: PLC0415 (scripts/ is on the path: vision_answers)

    images_ok = image_right >= before_images or images_shippable(
        image_total - image_right, figures["sample_failures"], image_total
    )
    ok = not shipped and text_right >= before_text and images_ok
    if repair is not None:  # the repair's claim, checked: nothing but the images moved
        ok = ok and repair["frozen_identical"] and all(repair["unchanged_figures"].values())
    return {"record": record, "files": {f"{name}/{k}": v for k, v in files.items()}, "ok": ok}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    out = Path(args.out)
    names = list(VARIANTS) if args.variant == "all" else [args.variant]
    prov_path = out / "PROVENANCE.json"
    prov = json.loads(prov_path.read_text())
    tok_dir = out / "tokenizer"
    audio_tokenizer(load_trained(names[0]).tokenizer).save_pretrained(str(tok_dir))
    for f in sorted(tok_dir.iterdir()):
        prov["files"][f"tokenizer/{f.name}"] = sha256_file(f)
    prov_path.write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")  # the fixtures load verified
    section = prov.setdefault("audio", {"variants": {}})
    ok = True
    for name in names:
        started = time.perf_counter()
        done = train_one(name, out, args.seed, args.steps, args.quick, args.set, args.speakers, args.from_hearing)
        steps = f" --steps {args.steps}" if args.steps else ""
        steps += "".join(f" --set {pair}" for pair in args.set)
        steps += f" --speakers {args.speakers}" if args.speakers else ""
        steps += f" --from-hearing {args.from_hearing}" if args.from_hearing else ""
        done["record"].update(
            wall_seconds=round(time.perf_counter() - started, 1),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            command=f"python scripts/train_audio.py --variant {name} --seed {args.seed}{steps}",
            ok=done["ok"],
        )
        section["variants"][name] = done["record"]
        prov["files"].update(done["files"])
        ok = ok and done["ok"]
    import subprocess

    import transformers

    espeak = subprocess.run(["espeak-ng", "--version"], check=True, capture_output=True, text=True).stdout
    section.update(
        script="scripts/train_audio.py",
        espeak_ng=espeak.split("  Data at")[0].strip(),
        seed=args.seed,
        threads=1,
        tasks={
            "T1": f'[clip, "{hearing.TRANSCRIBE}"] -> the clip\'s words',
            "T2": "[clip of a capital question] -> the text fixture's answer",
        },
        versions={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    )
    prov["files"] = dict(sorted(prov["files"].items()))
    prov_path.write_text(json.dumps(prov, indent=1, sort_keys=True) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
