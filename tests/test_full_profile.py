"""The `full` profile end to end on CPU (issue 12): a checkpoint folder in the released layout goes
through the real loader (`load_checkpoint`), the port, SEQ_MATCH and coherence.

The folders are written at test time by `released.save_released_layout`: each variant's tiny
trained text decoder inside its released multimodal class (`Gemma4ForConditionalGeneration`, the
12B's `Gemma4UnifiedForConditionalGeneration`) with tiny vision/audio parts, plus the fixture
tokenizer with Gemma-4's chat template. The text decoder is the trained fixture's, so the graphs
compiled here are the smoke profile's (same artifact-cache keys, asserted below): at the notebooks'
smoke shapes (`SMOKE_SHAPES`) the ports load the headless notebook run's programs instead of compiling.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import SMOKE_SHAPES, VARIANT_NAMES

from gemma4lab.models.released import AUDIO_VARIANTS, save_released_layout
from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, RECIPE, export_graph, graph_key
from gemma4lib.cache.artifacts import make_key
from gemma4lib.models.checkpoint import load_checkpoint
from gemma4lib.models.trained import load_trained
from gemma4lib.models.variants import get_variant
from gemma4lib.port import PortSettings, build_graphs, port

log = logging.getLogger(__name__)

# fp32 CPU, compiled kernels against HF's eager ops (as in test_spine): measured <= 5e-4.
PREFILL_LOGITS_ATOL = 2e-3


class _Folders:
    """Released-layout folders, written once per session on first use."""

    def __init__(self, root: Path):
        self.root, self._done = root, {}

    def get(self, variant: str) -> Path:
        if variant not in self._done:
            trained = load_trained(variant)
            self._done[variant] = save_released_layout(variant, self.root / variant, trained.lm, trained.tokenizer)
        return self._done[variant]


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> _Folders:
    return _Folders(tmp_path_factory.mktemp("released"))


def _sha256(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_folder_has_the_released_layout(released, variant):
    spec = get_variant(variant)
    folder = released.get(variant)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [spec.model_class]
    assert config["model_type"] == ("gemma4_unified" if spec.unified else "gemma4")
    text_type = "gemma4_unified_text" if spec.unified else "gemma4_text"
    assert config["text_config"]["model_type"] == text_type
    assert config["vision_config"] is not None
    assert (config.get("audio_config") is not None) == (variant in AUDIO_VARIANTS)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
    assert any(n.startswith("model.language_model.layers.0.") for n in names)
    assert any(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in names)
    assert not any(n.startswith("lm_head") for n in names), "the LM head is tied: not stored"
    assert any(n.endswith("layer_scalar") for n in names), "layer_scalar must be in the checkpoint"
    files = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= files


def test_folder_is_deterministic(released, tmp_path):
    trained = load_trained("e2b")
    again = save_released_layout("e2b", tmp_path / "e2b", trained.lm, trained.tokenizer)
    assert _sha256(again) == _sha256(released.get("e2b"))


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_loader_returns_the_trained_decoder(released, variant):
    """The real loader keeps exactly the text decoder that went in (buffers included)."""
    loaded = load_checkpoint(get_variant(variant), str(released.get(variant)), dtype=torch.float32)
    trained = load_trained(variant)
    assert type(loaded.lm) is type(trained.lm)
    got, want = loaded.lm.state_dict(), trained.lm.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.convert_tokens_to_ids("<turn|>") == 106

    # Same program as the smoke profile's trained port: one artifact serves both (the keys hold the
    # exported programs themselves).
    settings = PortSettings(variant=variant, **SMOKE_SHAPES)

    def keys(model) -> list[str]:
        graphs = build_graphs(model, settings)
        return [make_key(graph_key(g, RECIPE, DEFAULT_COMPILER_OPTIONS, export_graph(g))) for _, g in graphs]

    assert keys(loaded) == keys(trained)


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_full_profile_port_on_cpu(released, variant):
    folder = released.get(variant)
    full = dict(profile="full", checkpoint=str(folder), backend="cpu", warmup=0, iters=1)
    settings = PortSettings(variant=variant, **full, **SMOKE_SHAPES)
    assert settings.model_source == "checkpoint"
    result = port(settings)
    log.info(
        "%s full: cache hits %s, compile %.1f s, wall %.1f s",
        variant,
        result["cache_hits"],
        result["compile_s"],
        result["wall_s"],
    )
    assert result["model_source"] == str(folder)
    assert result["profile"] == "full" and result["compiler"] == RECIPE
    assert result["seq_match"] is True, f"first mismatch at {result['first_mismatch']}"
    assert result["coherent"] is True and "Paris" in result["answer"], result["answer"]
    assert result["tokens"][-1] in (1, 106), "the answer must end with <eos> or <turn|>"
    assert result["prefill_logits_max_abs_diff"] <= PREFILL_LOGITS_ATOL


def test_a_released_checkpoints_images_and_audio_go_through_the_full_profile(tmp_path):
    """A checkpoint folder with the whole multimodal model (the E2B fixture that sees and hears, saved with
    its image processor and tokenizer, as a release ships them) runs the full profile with an image and with
    a clip: the loader keeps the vision and audio parts (`load_checkpoint(media=True)`), and the port's
    verdict is the smoke fixture's: SEQ_MATCH, LOGITS_MATCH and coherence on what was shown and said."""
    import shutil

    from gemma4lib.images import SAMPLES_DIR
    from gemma4lib.models.audio import CLIPS_DIR
    from gemma4lib.models.vision import VISION_DIR

    for part in (VISION_DIR / "e2b", VISION_DIR / "tokenizer"):
        shutil.copytree(part, tmp_path, dirs_exist_ok=True)
    full = dict(profile="full", checkpoint=str(tmp_path), backend="cpu", warmup=0, iters=1, **SMOKE_SHAPES)
    for media, said in (
        ({"images": (str(SAMPLES_DIR / "red_circle.png"),)}, "red circle"),
        ({"audio": (str(CLIPS_DIR / "capital_of_france.wav"),)}, "capital of france"),
    ):
        result = port(PortSettings(variant="e2b", **full, **media))
        assert result["model_source"] == str(tmp_path) and result["profile"] == "full", result["model_source"]
        assert result["seq_match"] and result["logits_match"], (result["first_mismatch"], result["logits_explain"])
        assert result["coherent"] and said in result["answer"].lower(), result["answer"]


def test_the_12bs_image_processor_loads_from_a_hub_id_in_the_hub_cache(tmp_path):
    """A hub id (not a folder) reaches the 12B's processor through the hub's cache, as `port` passes
    `checkpoint or variant.hf_id`: the cache's layout, read offline."""
    import gemma4lib
    from gemma4lib.models.vision import folder_processor

    snapshot = tmp_path / "models--google--gemma-4-12b-it" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--google--gemma-4-12b-it" / "refs").mkdir()
    (tmp_path / "models--google--gemma-4-12b-it" / "refs" / "main").write_text("0" * 40)
    shipped = Path(gemma4lib.__file__).parent / "fixtures" / "vision" / "12b" / "preprocessor_config.json"
    (snapshot / "preprocessor_config.json").write_text(shipped.read_text())
    processor = folder_processor(get_variant("12b"), "google/gemma-4-12b-it", cache_dir=tmp_path, local_files_only=True)
    assert processor.to_dict() == folder_processor(get_variant("12b"), str(shipped.parent)).to_dict()
    with pytest.raises(OSError):  # not in the cache: transformers says so, no path built from the id
        folder_processor(get_variant("12b"), "google/other", cache_dir=tmp_path, local_files_only=True)
