"""Images on the device path (docs/IMAGES.md): the vision graph, soft tokens placed on the host,
the checks against transformers' own `generate(pixel_values=...)`, the bad inputs, the fixtures,
and the notebook-facing pictures.

Cheap by design: the eager backend (the same graphs, uncompiled) where the test is about the
logic, tiny models, a few new tokens. The AOTInductor runs are `slow`.
"""

from __future__ import annotations

import pytest
from conftest import parse_answer

from gemma4lab.training import vision as vision_training
from gemma4lab.training.shapes import shape_images
from gemma4lib.errors import ImageInputError, NoVisionError, PromptTooLongError, TooManyImagesError
from gemma4lib.models import vision
from gemma4lib.models.shapes import SAMPLES, describe

IMAGES = vision.VISION_DIR / "images"
RED_CIRCLE = IMAGES / "red_circle.png"
VARIANTS = vision.VISION_VARIANTS


@pytest.fixture(scope="module")
def random_e2b():
    return vision.build_random_multimodal("e2b", seed=3)


def _engine(model, settings):
    from gemma4lib.backends import registry

    return registry.compile_graphs(model, settings).runtime


# ---- the synthetic images and their labels -----------------------------------------------------------
def test_shapes_are_deterministic_and_describe_reads_them():
    first, again = shape_images(3, seed=7), shape_images(3, seed=7)
    assert [e.image.tobytes() for e in first] == [e.image.tobytes() for e in again]
    images = shape_images(8, seed=11)
    assert all(describe(e.image) == (e.colour, e.shape) for e in images)
    assert parse_answer("A red circle.") == ("red", "circle")
    for colour, shape in SAMPLES:
        assert describe(__import__("PIL.Image").Image.open(IMAGES / f"{colour}_{shape}.png")) == (colour, shape)


# ---- held out: random-weight multimodal models of every vision variant equal transformers ------------------
def _equal_to_transformers(variant, **chosen):
    """A random-weight multimodal port of `variant` with the red circle through the settings' backend
    (`chosen`): device tokens == HF generate(pixel_values), logits within the reference's spread."""
    from gemma4lib.port import PortSettings, eos_ids, judge_rows, load_model, prompt_rows, requests_for, run_device

    settings = PortSettings(
        variant=variant, model="random", images=(str(RED_CIRCLE),), max_new_tokens=6, seed=5, **chosen
    )
    model = load_model(settings)
    rows = prompt_rows(model, settings)
    assert rows[0].media.prompt.soft_tokens == 16
    run = run_device(model, settings, requests_for(rows, settings, eos_ids(model)), bench=False)
    ((report, reference),) = judge_rows(model, settings, rows, [], run)
    assert run.tokens == reference and report.seq_match
    assert report.logits_match, report.logits.explain()
    assert run.prefill_logits_max_abs_diff < 1e-3
    assert len(set(reference)) > 1  # the witness moves: a logit error would show
    return run


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_multimodal_equals_transformers(variant):
    """Our own random multimodal configs (not the fixtures): device tokens == HF generate(pixel_values)
    and logits within the reference's spread, through the vision graph, on the eager backend."""
    _equal_to_transformers(variant, backend="eager")


# the gloo ranks (backend "cpu" at tp_degree > 1); each takes 3-10 s here, but CI's main suite keeps one
TP_CASES = [
    pytest.param("e4b", 2, id="e4b-tp2"),
    pytest.param("31b", 8, id="31b-tp8", marks=pytest.mark.slow),
    pytest.param("26b-a4b", 8, id="26b-a4b-tp8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("variant", "tp"), TP_CASES)
def test_random_multimodal_under_tp_equals_transformers(variant, tp):
    """Tensor parallel on the gloo ranks: the vision graph unsharded in the parent (it reads no K/V), its
    soft tokens in the host embeddings every rank is sent, the sharded text graphs unchanged; equal to
    transformers."""
    run = _equal_to_transformers(variant, backend="cpu", tp_degree=tp)
    assert run.compiler == "cpu-gloo-tp" and run.details["world"]["processes"] == tp
    assert run.details["ranks_agree"]
    assert run.details["vision_graph"] == "unsharded, in the parent process (it reads no K/V)"


def test_soft_tokens_change_the_answer(random_e2b):
    """The image reaches the decoder: two different images give different first logits."""
    from gemma4lib.images import image_prompt
    from gemma4lib.port import PortSettings
    from gemma4lib.runtime import Request

    settings = PortSettings(variant="e2b", model="random", backend="eager", images=(str(RED_CIRCLE),))
    engine = _engine(random_e2b, settings)
    tok = vision_training.vision_tokenizer(
        __import__("gemma4lib.models.trained", fromlist=["x"]).load_trained("e2b").tokenizer
    )
    logits = []
    for name in ("red_circle.png", "blue_square.png"):
        inputs = image_prompt(tok, random_e2b.processor, [IMAGES / name], "What?", image_token_id=vision.IMAGE_TOKEN_ID)
        result = engine.generate_rows([Request(inputs.ids, 1, media=inputs.prompt)]).rows[0]
        logits.append(result.first_logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-2


# ---- bad inputs: library errors that say what to do ---------------------------------------------------
@pytest.mark.parametrize(
    ("chosen", "named"),
    [
        ({"batch_size": 2}, "batch_size 2"),
        ({"batch_size": 2, "backend": "neuron"}, "batch_size 2"),  # neuron takes images, not the port's rows
    ],
)
def test_image_settings_not_reached_are_refused(chosen, named):
    """What images do not run with yet is a SettingsError before anything loads, naming it and where
    they do run."""
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings

    with pytest.raises(SettingsError, match=named) as caught:
        PortSettings(variant="e2b", model="random", images=(str(RED_CIRCLE),), **chosen)
    assert "'xla'" in str(caught.value) and "gloo ranks at tp_degree > 1" in str(caught.value)


@pytest.mark.parametrize(("backend", "tp"), [("cpu", 2), ("neuron", 1)])
def test_12b_images_where_its_image_blocks_are_not_built_are_refused(backend, tp):
    """The 12B's prefill needs its image blocks, built for cpu/eager/xla at TP 1: the gloo ranks and
    the neuron keys are refused before anything loads, with where it runs."""
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings

    with pytest.raises(SettingsError, match="bidirectional image mask") as caught:
        PortSettings(variant="12b", model="random", backend=backend, tp_degree=tp, images=(str(RED_CIRCLE),))
    assert "'xla' at tp_degree 1" in str(caught.value)
    with pytest.raises(SettingsError, match="tp_degree 1"):  # per-request images (the endpoint) too
        PortSettings(variant="12b", model="random", backend=backend, tp_degree=tp, vision=True)


def test_vision_without_an_image_is_refused_where_it_does_not_run():
    """`vision=True` (images per request, the server's `--vision`) at TP 1 on cpu, eager and xla (and on
    neuron at its TP degree: tests/test_neuron_vision.py)."""
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings

    for chosen in ({"tp_degree": 2}, {"backend": "xla", "tp_degree": 2}):
        with pytest.raises(SettingsError, match="vision=True"):
            PortSettings(variant="e2b", vision=True, **chosen)
    with pytest.raises(SettingsError, match="true or false"):
        PortSettings(variant="e2b", vision="yes")
    assert PortSettings(variant="e2b", vision=True, batch_size=4).wants_vision


def test_image_under_tp_refuses_cpu_seeded_prefill():
    """The E4B recipe's CPU-seeded prefill embeds token ids on the host without the soft tokens: refused."""
    from gemma4lib.backends import gloo, registry
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings, eos_ids, load_model, prompt_rows, requests_for

    settings = PortSettings(variant="e4b", model="random", tp_degree=2, images=(str(RED_CIRCLE),), max_new_tokens=2)
    model = load_model(settings)
    requests = requests_for(prompt_rows(model, settings), settings, eos_ids(model))
    with pytest.raises(SettingsError, match="prefill='graph'"):
        graphs = gloo.rank_graphs(model, settings, prefill="cpu-seeded")
        registry.run_device(model, settings, requests, graphs=graphs, bench=False)


def test_image_file_missing(tmp_path):
    from gemma4lib.images import load_image

    with pytest.raises(ImageInputError, match="does not exist"):
        load_image(tmp_path / "nope.png")


def test_image_file_not_an_image(tmp_path):
    from gemma4lib.images import load_image

    path = tmp_path / "notes.png"
    path.write_text("not pixels")
    with pytest.raises(ImageInputError, match="PNG or JPEG"):
        load_image(path)


def test_image_for_checkpoint_without_vision(tmp_path):
    from gemma4lib.models.trained import load_trained

    with pytest.raises(NoVisionError, match="train one with"):
        vision.load_vision_fixture("12b", root=tmp_path)  # a fixture folder without the 12B's
    from gemma4lib.images import require_vision

    text_only = load_trained("e2b")
    with pytest.raises(NoVisionError, match="send text only"):
        require_vision(text_only.multimodal, text_only.processor)


def test_more_images_than_image_tokens(random_e2b):
    from gemma4lib.images import image_prompt

    tok = vision_training.vision_tokenizer(
        __import__("gemma4lib.models.trained", fromlist=["x"]).load_trained("e2b").tokenizer
    )
    one_part = vision.image_messages("What is in the image?", 1)
    with pytest.raises(TooManyImagesError, match="one"):
        image_prompt(
            tok,
            random_e2b.processor,
            [RED_CIRCLE, RED_CIRCLE],
            "x",
            image_token_id=vision.IMAGE_TOKEN_ID,
            messages=one_part,
        )


def test_image_prompt_over_the_compiled_context(random_e2b):
    from gemma4lib.port import PortSettings, prompt_rows, requests_for

    settings = PortSettings(
        variant="e2b",
        model="random",
        backend="eager",
        images=(str(RED_CIRCLE),),
        prefill_buckets=(48,),
        context_length=48,
        max_new_tokens=40,
    )
    rows = prompt_rows(random_e2b, settings)
    engine = _engine(random_e2b, settings)
    with pytest.raises(PromptTooLongError, match="16 of them image or audio soft tokens"):
        engine.generate_rows(requests_for(rows, settings, []))
    assert not engine.rows  # refused before any device call: no row taken


def test_engine_without_vision_graph_refuses_images(random_e2b):
    from gemma4lib.port import PortSettings, prompt_rows, requests_for

    with_images = PortSettings(variant="e2b", model="random", backend="eager", images=(str(RED_CIRCLE),))
    rows = prompt_rows(random_e2b, with_images)
    text_engine = _engine(random_e2b, PortSettings(variant="e2b", model="random", backend="eager"))
    with pytest.raises(NoVisionError, match="without a vision graph"):
        text_engine.generate_rows(requests_for(rows, with_images, []))


# ---- notebook-facing functions ------------------------------------------------------------------------
def test_notebook_pictures(random_e2b):
    from gemma4lab.notebook import vision as nbv
    from gemma4lib.port import PortSettings, prompt_rows

    rows = prompt_rows(random_e2b, PortSettings(variant="e2b", model="random", images=(str(RED_CIRCLE),)))
    inputs = rows[0].media
    assert nbv.show_image(RED_CIRCLE).axes
    assert "16 soft tokens" in nbv.patch_picture(RED_CIRCLE, 4, 2).axes[0].get_title()
    layout = nbv.prompt_layout(inputs.ids, inputs.prompt.positions)
    soft = [r for r in layout if r["kind"] == "soft tokens"]
    assert len(soft) == 1 and soft[0]["tokens"] == 16 and soft[0]["first"] == inputs.prompt.positions[0]
    masks = nbv.reference_masks(random_e2b.multimodal, inputs.ids, inputs.prompt.positions)
    first, last = inputs.prompt.positions[0], inputs.prompt.positions[-1]
    assert not masks["full_attention"][first, last]  # E2B: causal over the image (no bidirectional config)
    assert len(nbv.mask_picture(masks, inputs.prompt.positions).axes) == len(masks)
    table = nbv.layout_table(inputs.ids, inputs.prompt.positions)
    assert [row[:3] for row in table.rows if row[0] == "soft tokens"] == [["soft tokens", f"{first}..{last}", 16]]


def test_find_image_takes_a_path_or_a_shipped_sample(tmp_path):
    """The notebooks' `image` parameter names a shipped sample or a file; anything else says which
    samples there are, before anything loads."""
    from gemma4lib.images import SAMPLES_DIR, find_image

    assert find_image("red_circle.png") == SAMPLES_DIR / "red_circle.png" == RED_CIRCLE
    own = tmp_path / "mine.png"
    own.write_bytes(RED_CIRCLE.read_bytes())
    assert find_image(str(own)) == str(own)
    with pytest.raises(ImageInputError, match="blue_square.png.*red_circle.png"):
        find_image("purple_star.png")


def test_bidirectional_mask_where_the_config_asks():
    """The 12B's config asks for bidirectional attention among an image's tokens (sliding layers);
    transformers' own mask shows it, which is what its device graph must reproduce (docs/IMAGES.md)."""
    from gemma4lab.notebook import vision as nbv

    model = vision.build_random_multimodal("12b", seed=0)
    ids = [2, 105, 3] + [vision.IMAGE_TOKEN_ID] * 4 + [4, 10, 11]
    positions = list(range(3, 7))
    masks = nbv.reference_masks(model.multimodal, ids, positions)
    assert masks["sliding_attention"][3, 6] and not masks["full_attention"][3, 6]


# ---- the 12B: its torchvision-free processor, its image blocks ----------------------------------------
def _golden_cases():
    from PIL import Image

    samples = {p.name: Image.open(p).convert("RGB") for p in sorted(IMAGES.glob("*.png"))}
    red, blue = samples["red_circle.png"], samples["blue_square.png"]
    wide = Image.new("RGB", (red.width + blue.width, red.height))
    wide.paste(red, (0, 0))
    wide.paste(blue, (red.width, 0))
    return {**samples, "red_circle+blue_square (64x32)": wide}


def test_unified_processor_equals_transformers():
    """The 12B's torchvision-free processor gives, bit for bit, what transformers' own
    `Gemma4UnifiedImageProcessor` gave on the same images (hashes it wrote in a torchvision venv:
    scripts/unified_processor_golden.py), a non-square image included."""
    import hashlib
    import json

    from gemma4lib.models.unified_patches import UnifiedPatchProcessor

    golden = json.loads((vision.VISION_DIR / "12b" / "processor_golden.json").read_text())
    processor = UnifiedPatchProcessor(**golden["settings"])
    cases = _golden_cases()
    assert set(cases) == set(golden["cases"])
    for name, image in cases.items():
        data = processor(images=[image], return_tensors="pt")
        want = golden["cases"][name]
        assert hashlib.sha256(data["pixel_values"].numpy().tobytes()).hexdigest() == want["pixel_values_sha256"], name
        positions = data["image_position_ids"].numpy().tobytes()
        assert hashlib.sha256(positions).hexdigest() == want["image_position_ids_sha256"], name
        assert data["num_soft_tokens_per_image"].tolist() == want["num_soft_tokens"]
        assert list(data["pixel_values"].shape) == want["shape"]


def test_unified_processor_refuses_what_it_cannot_do(tmp_path):
    """No torchvision, no resize: a resizing config or an image that does not cut into merged patches
    is an ImageInputError that says what to do; its config file round-trips."""
    from PIL import Image

    from gemma4lib.models.unified_patches import UnifiedPatchProcessor, load_unified_processor

    with pytest.raises(ImageInputError, match="install torchvision"):
        resizing = UnifiedPatchProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
        resizing(images=[Image.new("RGB", (32, 32))])
    fixed = UnifiedPatchProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70, do_resize=False)
    with pytest.raises(ImageInputError, match="multiples of 8"):
        fixed(images=[Image.new("RGB", (30, 32))])
    with pytest.raises(ImageInputError, match="over the budget of 70"):
        fixed(images=[Image.new("RGB", (96, 64))])
    fixed.save_pretrained(tmp_path)
    assert load_unified_processor(tmp_path) == fixed


def _twelve_b_prompt(model):
    from gemma4lib.images import image_prompt

    tok = vision_training.vision_tokenizer(
        __import__("gemma4lib.models.trained", fromlist=["x"]).load_trained("12b").tokenizer
    )
    question = "What is in the image?"
    return image_prompt(tok, model.processor, [RED_CIRCLE], question, image_token_id=vision.IMAGE_TOKEN_ID)


@pytest.mark.parametrize("ring", [False, True])
def test_device_masks_are_the_intended_masks(ring):
    """The 12B's prefill masks as the device graph builds them from its image blocks (full layers
    causal; sliding layers `(causal OR same image) AND window`) equal transformers' own intended
    masks (`create_masks_for_generate` of the multimodal class), on the flat and the ring K/V."""
    import torch

    from gemma4lib.device.graph import GraphShape, build_masks, index_tensor
    from gemma4lib.models.image_attention import intended_masks
    from gemma4lib.runtime import Engine, Request

    model = vision.build_random_multimodal("12b", seed=0)
    inputs = _twelve_b_prompt(model)
    n = len(inputs.ids)
    engine = Engine(None, _steps_stub(), batch=1, context_length=2 * n, vocab_size=1, cap=None, image_blocks=True)
    engine.prompt_embeds = lambda request, pad_to=None: [torch.zeros(1, n, 1)]  # only the blocks matter here
    blocks = engine.prefill_inputs(Request(inputs.ids, 1, media=inputs.prompt))[-1]
    assert sorted(set(blocks[0].tolist())) == [0, 1] and int(blocks.sum()) == 16
    shape = GraphShape(1, n, 2 * n, ring)
    device = build_masks(model.layout, shape, index_tensor([0]), index_tensor([n]), torch.float32, blocks)
    ids = torch.tensor([inputs.ids])
    want = intended_masks(model.multimodal, ids, torch.ones_like(ids), torch.tensor([inputs.token_types]))
    assert set(device) == set(want)
    window = model.config.sliding_window
    assert window < 16  # the tiny window is shorter than the image: the window's clamp is tested too
    seen = {}
    for layer_type, mask in device.items():
        allowed = mask[0, 0] == 0
        # a buffer's keys are its slots (the prompt in the first n); a ring prefill's are [old ring, chunk]
        keys = allowed[:, :n] if allowed.shape[1] == 2 * n else allowed[:, -n:]
        reference = want[layer_type][0, 0]
        reference = reference if reference.dtype == torch.bool else reference == 0
        assert torch.equal(keys, reference), layer_type
        seen[layer_type] = keys
    first = inputs.prompt.positions[0]  # the image's first token sees the next one on sliding layers only
    assert seen["sliding_attention"][first, first + 1] and not seen["full_attention"][first, first + 1]


def _steps_stub():
    from gemma4lib.runtime import Steps

    return Steps(prefill={}, decode=lambda *a: None)


def test_a_config_asking_for_image_blocks_is_refused_where_they_are_not_built(monkeypatch):
    """The early refusal knows only the variant (the 12B); a loaded model whose config asks for the
    image blocks (vLLM reports the released 31B's does) is refused on the gloo ranks too, once its
    config is known, instead of running causal over the image."""
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings, load_model

    build_random = vision.build_random_multimodal

    def bidirectional(variant, seed=0):
        model = build_random(variant, seed=seed)
        model.multimodal.config.get_text_config().use_bidirectional_attention = "vision"
        return model

    monkeypatch.setattr(vision, "build_random_multimodal", bidirectional)
    at_tp2 = PortSettings(variant="e4b", model="random", images=(str(RED_CIRCLE),), tp_degree=2, backend="cpu")
    with pytest.raises(SettingsError, match="bidirectional image mask"):
        load_model(at_tp2)
    load_model(PortSettings(variant="e4b", model="random", images=(str(RED_CIRCLE),), backend="eager"))  # TP 1: built


def test_without_image_blocks_the_12b_port_fails(monkeypatch):
    """The check can fail: a 12B prefill graph built without the image blocks (causal over the
    image, the seed-style bug) gives logits the reference's spread does not cover."""
    from gemma4lib.device import build
    from gemma4lib.port import PortSettings, eos_ids, judge_rows, load_model, prompt_rows, requests_for, run_device

    monkeypatch.setattr(build, "bidirectional_images", lambda config: False)
    settings = PortSettings(
        variant="12b", model="random", images=(str(RED_CIRCLE),), max_new_tokens=6, seed=5, backend="eager"
    )
    model = load_model(settings)
    rows = prompt_rows(model, settings)
    run = run_device(model, settings, requests_for(rows, settings, eos_ids(model)), bench=False)
    ((report, _),) = judge_rows(model, settings, rows, [], run)
    assert not report.logits_match and run.prefill_logits_max_abs_diff > 1e-2


# ---- the trained multimodal fixtures --------------------------------------------------------------------
SHIPPED = [v for v in VARIANTS if (vision.VISION_DIR / v / "model.safetensors").is_file()]
NOT_SHIPPED = "no converged vision fixture is shipped yet (docs/IMAGES.md): train one with scripts/train_vision.py"


@pytest.mark.skipif(not SHIPPED, reason=NOT_SHIPPED)
@pytest.mark.parametrize("variant", SHIPPED)
def test_trained_fixture_names_what_it_sees(variant):
    """Through the device graphs (eager) and transformers alike, the fixture names the sample
    image's colour and shape, and device == reference with logits inside the spread."""
    from gemma4lib.port import PortSettings, port

    for colour, shape in SAMPLES[:2]:
        record = port(
            PortSettings(
                variant=variant,
                backend="eager",
                images=(str(IMAGES / f"{colour}_{shape}.png"),),
                witness=False,
                iters=1,
                warmup=0,
            )
        )
        assert record["seq_match"] and record["logits_match"] and record["coherent"], record.get("failed_checks")
        assert parse_answer(record["answer"]) == (colour, shape), record["answer"]


@pytest.mark.skipif("e2b" not in SHIPPED, reason=NOT_SHIPPED)
@pytest.mark.parametrize("draft", ["assistant", "prompt_lookup"])
def test_drafting_over_an_image_prompt_equals_plain(draft):
    """Drafting needs nothing of the image: the drafters read the target's K/V (which holds the
    image's soft tokens since the prefill) and the tokens so far. Greedy drafted decode equals
    transformers' plain `generate(pixel_values=...)`, and the answer still names the image."""
    from gemma4lib.port import PortSettings, port

    record = port(
        PortSettings(
            variant="e2b",
            backend="eager",
            images=(str(IMAGES / "blue_square.png"),),
            draft=draft,
            draft_tokens=3,
            witness=False,
            iters=1,
            warmup=0,
        )
    )
    assert record["seq_match"] and record["logits_match"] and record["coherent"], record.get("failed_checks")
    assert parse_answer(record["answer"]) == ("blue", "square"), record["answer"]
    assert record["draft"] == draft and record["accepted_per_step"] >= 1.0
    assert record["checks_passed"], record["failed_checks"]  # assistant: transformers' assisted generate, same tokens


@pytest.mark.skipif("12b" not in SHIPPED, reason=NOT_SHIPPED)
def test_12b_drafting_over_an_image_equals_plain_on_the_intended_masks():
    """The 12B drafts over its image prompt with its assistant, greedy-exact against transformers'
    plain `generate` on the intended masks; transformers' assisted generate cannot take the static
    cache those masks need, so that cross-check says why it did not run instead of failing."""
    from gemma4lib.port import PortSettings, port

    record = port(
        PortSettings(
            variant="12b",
            backend="eager",
            images=(str(IMAGES / "blue_square.png"),),
            draft="assistant",
            draft_tokens=3,
            witness=False,
            iters=1,
            warmup=0,
        )
    )
    assert record["checks_passed"] and record["coherent"], record["failed_checks"]
    assert parse_answer(record["answer"]) == ("blue", "square"), record["answer"]
    assert record["hf_assisted_match"] is None and "static cache" in record["hf_assisted_skipped"]


@pytest.mark.skipif(not SHIPPED, reason=NOT_SHIPPED)
def test_vision_fixture_hashes():
    recorded = vision.verify_vision_hashes()
    assert any(k.startswith("tokenizer/") for k in recorded)


@pytest.mark.slow
def test_port_image_aotinductor():
    """The port on the cpu backend (AOTInductor: the vision graph exported and compiled beside
    prefill and decode) on a random-weight multimodal E2B: equal to transformers."""
    from gemma4lib.port import PortSettings, port

    record = port(
        PortSettings(variant="e2b", model="random", images=(str(RED_CIRCLE),), max_new_tokens=8, iters=1, warmup=0)
    )
    assert record["seq_match"] and record["logits_match"], record.get("failed_checks")
    assert record["images"]["soft_tokens"] == [16]
    # the prefill (the image's soft tokens included) within the reference's own spread, as every step
    # is: AOTInductor's fused kernels round differently from eager (1.4e-3 here, eager 1e-6)
    assert record["prefill_logits_max_abs_diff"] <= record["logits_tolerance"]
