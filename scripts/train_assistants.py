"""Train the tiny assistants: one per variant, distilled against the variant's tiny trained target.

    python scripts/train_assistants.py --variant e2b          # or --variant all

Writes `gemma4lib/fixtures/<variant>/assistant/` and records hashes, steps, accuracies and the
train config in `gemma4lib/fixtures/PROVENANCE.json` (key "assistants"; the files under "files",
checked on every load). A target taught tools (its record's `tools` converged: scripts/train_tools.py)
gets an assistant distilled on every `TOOL_CHATS_EVERY`-th tool chat as well, so that it drafts the
calls and thoughts too. One thread, deterministic for a given torch version and CPU type.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from gemma4lab.training.assistant import AssistantTrainConfig, train_assistant
from gemma4lab.training.machine import cpu_type
from gemma4lab.training.text import MODEL_FILES
from gemma4lib.cache.artifacts import sha256_file
from gemma4lib.models.assistant import assistant_dir, assistant_spec, fully_shared_construction, load_assistant_folder
from gemma4lib.models.trained import FIXTURES_DIR, load_trained
from gemma4lib.models.variants import VARIANTS, get_variant

log = logging.getLogger("train_assistants")
# every 4th chat of the tool set: 51 of its 204 chats (68 of 272 with the thinking kinds); the E2B's, taught to think:
# 206 steps in 274 s with the plain chats (before the thought, 195 steps in 146 s; the plain chats alone: 122 in 22.5 s)
TOOL_CHATS_EVERY = 4


def save_assistant(model: torch.nn.Module, path: Path, variant) -> dict[str, str]:
    """Save and check the folder reloads with identical tensors."""
    path.mkdir(parents=True, exist_ok=True)
    with fully_shared_construction():
        model.save_pretrained(str(path), safe_serialization=True)
    reloaded = load_assistant_folder(path, variant)
    before, after = model.state_dict(), reloaded.state_dict()
    bad = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    if bad or before.keys() != after.keys():
        raise SystemExit(
            f"assistant at {path} reloads with different tensors: {bad or sorted(set(before) ^ set(after))}"
        )
    return {name: sha256_file(path / name) for name in MODEL_FILES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(FIXTURES_DIR))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    prov_path = out / "PROVENANCE.json"
    prov = json.loads(prov_path.read_text())
    names = list(VARIANTS) if args.variant == "all" else [get_variant(args.variant).name]
    command = "python scripts/train_assistants.py " + " ".join(argv if argv is not None else sys.argv[1:])
    base = AssistantTrainConfig(seed=args.seed)
    records = dict(prov.get("assistants", {}))
    files = dict(prov["files"])
    for name in names:
        variant = get_variant(name)
        target = load_trained(variant, root=out)
        tools, config = prov["variants"][name].get("tools", {}), base
        if tools.get("converged"):  # the kinds it was taught, as its tool run drew them
            kinds = tuple((kind, share) for kind, share in tools["train_config"]["kind_shares"])
            config = replace(base, tool_chats_every=TOOL_CHATS_EVERY, tool_kinds=kinds)
        result = train_assistant(target, config)
        path = assistant_dir(variant, out)
        for fname, digest in save_assistant(result.assistant, path, variant).items():
            files[f"{name}/assistant/{fname}"] = digest
        records[name] = {
            "command": command,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": cpu_type(),
            "model_class": type(result.assistant).__name__,
            "released": assistant_spec(variant).hub_id,
            "params": sum(p.numel() for p in result.assistant.parameters()),
            "steps": result.steps,
            "train_seconds": round(result.seconds, 1),
            "train_accuracy_per_draft_step": [round(a, 4) for a in result.train_accuracy],
            "held_out_accuracy_per_draft_step": [round(a, 4) for a in result.held_out_accuracy],
            "train_config": config.to_dict(),
            "bytes": (path / "model.safetensors").stat().st_size,
        }
        log.info("%s: %s", name, records[name])
    prov["assistants"] = {k: records[k] for k in VARIANTS if k in records}
    prov["files"] = dict(sorted(files.items()))
    prov_path.write_text(json.dumps(prov, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
