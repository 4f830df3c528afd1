"""The vision graph on backend `neuron` (`recipes.neuron_vision`), with the Neuron SDK stood in by
fakes: what `torch_neuronx.trace` is handed, the vision artifact's own cache key, its reuse, its
placement on the core after the decoder's, the soft tokens it returns through the engine, and the
settings that let images reach inf2 (and still refuse what does not fit)."""

from __future__ import annotations

import gc
import types
from pathlib import Path

import pytest
import torch
from conftest import held_cores, release_core_claims
from torch import nn

from gemma4lib.backends.preflight import preflight
from gemma4lib.device.build import image_graph
from gemma4lib.device.vision import vision_graph
from gemma4lib.errors import NeuronCoresBusyError, NeuronSDKMissingError, SettingsError
from gemma4lib.models import vision
from gemma4lib.port import PortSettings
from gemma4lib.recipes import cores, neuron_env, neuron_vision

RED_CIRCLE = vision.VISION_DIR / "images" / "red_circle.png"


@pytest.fixture(scope="module")
def random_e2b():
    return vision.build_random_multimodal("e2b", seed=3)


@pytest.fixture(autouse=True)
def _free_cores():
    """Each test starts and ends with no NeuronCore claimed (a claim outlives a failed test otherwise)."""
    release_core_claims()
    yield
    release_core_claims()


def _image_settings(tmp_path, **chosen):
    return PortSettings(
        variant="e2b",
        model="random",
        backend="neuron",
        images=(str(RED_CIRCLE),),
        max_new_tokens=3,
        cache_dir=str(tmp_path),
        **chosen,
    )


@pytest.fixture
def inf2(monkeypatch):
    """An inf2.8xlarge (2 NeuronCores) whose SDK checks pass; the SDK itself is the fake each test installs."""
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)


class _SoftTokens(nn.Module):
    """What the fake compiler returns: a real TorchScript module (so `torch.jit.save`/`load` run for
    real) that answers any image with a fixed pattern of soft tokens and counts its calls."""

    def __init__(self, slots: int, hidden: int):
        super().__init__()
        self.register_buffer("pattern", torch.arange(slots * hidden, dtype=torch.float32).reshape(1, slots, hidden))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.pattern.to(pixel_values.dtype)


class _FakeNeuronx:
    """Stands in for `torch_neuronx` (`trace`, `neuron_cores_context`): SDK 2.28's names only, so a
    load through the deprecated `torch_neuronx.experimental` placement fails here."""

    def __init__(self, slots: int, hidden: int):
        self.traces: list[dict] = []
        self.placements: list[dict] = []
        self.slots, self.hidden = slots, hidden
        fake = self

        class _Context:
            def __init__(self, start_nc=-1, nc_count=-1):
                fake.placements.append({"start_nc": start_nc, "nc_count": nc_count})

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        def trace(func, example_inputs, **kwargs):
            fake.traces.append({"func": func, "example_inputs": example_inputs, **kwargs})
            return torch.jit.script(_SoftTokens(fake.slots, fake.hidden))

        self.module = types.SimpleNamespace(trace=trace, neuron_cores_context=_Context)

    def require(self, module, purpose=""):
        assert module == "torch_neuronx", f"asked for {module}"
        return self.module


class _FakeDecoder:
    """The loaded ModelBuilder model: logits of zeros, no states; token 0 from the key that returns
    ids (the call whose last input is the sampling `[B, 3]`, as NxD routes by input shapes)."""

    def __init__(self, vocab):
        self.vocab, self.calls = vocab, 0
        self.nxd_model = self  # the keyed entry point (`forward(inputs)`) is the same fake

    def forward(self, inputs):
        return self(*inputs)

    def __call__(self, *inputs):
        self.calls += 1
        if inputs[-1].dim() == 2 and inputs[-1].dtype == torch.float32:
            return torch.zeros(inputs[0].shape[0], dtype=torch.int32)
        return torch.zeros(inputs[0].shape[0], self.vocab)


def _stub_decoder(monkeypatch, model):
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setattr(
        neuron_model_builder,
        "compile_model_builder",
        lambda m, tp, folder, **k: (folder / "manifest.json").write_text("{}"),
    )
    loaded: list[_FakeDecoder] = []  # a new one per load: a released model must be collectable

    def load(path, tp):
        loaded.append(_FakeDecoder(model.config.vocab_size))
        return loaded[-1]

    monkeypatch.setattr(neuron_model_builder, "load_model_builder", load)
    return loaded


# ---- the recipe: what torch_neuronx.trace is handed ---------------------------------------------------
def test_the_vision_trace_gets_the_graph_its_example_inputs_and_the_vision_flags(random_e2b, tmp_path, monkeypatch):
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    graph = image_graph(random_e2b, _image_settings(tmp_path))
    fake = _FakeNeuronx(graph.slots, random_e2b.config.hidden_size)
    monkeypatch.setattr(neuron_env, "require", fake.require)
    neuron_vision.compile_vision(graph, compiler_workdir=str(tmp_path / "cc"))
    (call,) = fake.traces
    assert call["func"] is graph
    pixels, positions = call["example_inputs"]
    expected = graph.example_inputs()
    assert pixels.shape == (1, graph.shape.patches, graph.shape.patch_dim) and pixels.dtype == graph.dtype
    assert positions.shape == (1, graph.shape.patches, 2) and positions.dtype == torch.int32
    assert torch.equal(positions, expected[1]) and torch.equal(pixels, expected[0])
    assert call["compiler_args"] == ["--model-type=transformer", "--auto-cast=none",
                                     "--enable-mixed-precision-accumulation", "-O1"]  # fmt: skip
    assert call["compiler_workdir"] == str(tmp_path / "cc")
    assert call["inline_weights_to_neff"] is True
    assert not call.get("input_output_aliases")  # no K/V, no state: nothing aliased


def test_the_vision_entry_points_raise_the_documented_error_without_the_sdk(random_e2b, tmp_path):
    if neuron_env.sdk_present():
        pytest.skip("Neuron SDK installed")
    graph = vision_graph(random_e2b.multimodal, 1, 9, 48)
    for call in (lambda: neuron_vision.compile_vision(graph), lambda: neuron_vision.load(tmp_path / "vision.pt", 1)):
        with pytest.raises(NeuronSDKMissingError, match="torch-neuronx"):
            call()


# ---- the vision artifact's own cache key -----------------------------------------------------------------
def test_the_vision_key_moves_with_vision_weights_config_and_shape_not_with_the_prompt(tmp_path, monkeypatch):
    from gemma4lib.backends.neuron import tower_cache_key

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    model = vision.build_random_multimodal("e2b", seed=3)  # its own: the test edits its weights and config
    args = neuron_vision.COMPILER_ARGS
    graph = image_graph(model, _image_settings(tmp_path))
    key, parts = tower_cache_key(model, graph, args)
    assert parts["recipe"] == "neuron-vision_trace" and set(parts["sdk"]) >= set(neuron_env.SDK_PINS)
    assert '"vision_config"' in parts["config"]
    # another prompt, context, decoder TP or text weights: the same vision program, the same key
    other = _image_settings(tmp_path, prompt="Which colour is it?", context_length=256, prefill_buckets=(128,))
    assert tower_cache_key(model, image_graph(model, other), args)[0] == key
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert tower_cache_key(model, image_graph(model, other), args)[0] == key
    # another patch budget (shape), other compiler flags: another key
    wider = vision_graph(model.multimodal, 1, graph.shape.patches + 9, graph.shape.patch_dim)
    assert tower_cache_key(model, wider, args)[0] != key
    assert tower_cache_key(model, graph, args.replace("-O1", "-O2"))[0] != key
    # the vision weights the NEFF inlines: an edit of the encoder or of the embedder moves the key
    tower_weight = next(model.multimodal.model.vision_tower.parameters())
    with torch.no_grad():
        tower_weight.add_(1e-3)
    edited = tower_cache_key(model, graph, args)[0]
    assert edited != key
    with torch.no_grad():
        next(model.multimodal.model.embed_vision.parameters()).mul_(2.0)
    assert tower_cache_key(model, graph, args)[0] not in (key, edited)
    # the vision config
    before = tower_cache_key(model, graph, args)[0]
    model.multimodal.config.vision_config.layer_norm_eps = 1e-3
    assert tower_cache_key(model, graph, args)[0] != before


# ---- the backend: compile, cache, place, serve ------------------------------------------------------------
def _faked_neuron_port(tmp_path, monkeypatch):
    """An image port's settings and model, its vision graph, the faked torch_neuronx and the stubbed
    decoder compiles (what the backend tests below share)."""
    from gemma4lib.port import load_model

    settings = _image_settings(tmp_path)
    model = load_model(settings)
    graph = image_graph(model, settings)
    fake = _FakeNeuronx(graph.slots, model.config.hidden_size)
    monkeypatch.setattr(neuron_env, "require", fake.require)
    return settings, model, graph, fake, _stub_decoder(monkeypatch, model)


def test_backend_neuron_traces_the_vision_graph_once_and_places_it_beside_rank_0(inf2, tmp_path, monkeypatch):
    """The port's compile: the decoder keys as before, the vision graph traced into its own cache entry
    and loaded onto core 1 (after the decoder's core 0); a second compile reuses the entry (no second
    trace), and refuses while the first model still holds the cores."""
    from gemma4lib.backends import registry

    settings, model, graph, fake, decoders = _faked_neuron_port(tmp_path, monkeypatch)

    compiled = registry.compile_graphs(model, settings)
    assert len(fake.traces) == 1 and isinstance(fake.traces[0]["func"], type(graph))
    assert fake.placements == [{"start_nc": 0, "nc_count": 1}]
    assert compiled.steps.vision is not None and compiled.cache_hits == [False, False]
    artifacts = compiled.info["artifacts"]
    assert set(artifacts) == {"decoder", "vision"} and artifacts["vision"] != artifacts["decoder"]
    assert (Path(artifacts["vision"]) / neuron_vision.FILE).is_file()
    held = sorted(held_cores())
    assert held == [(0, 0), (0, 0)], held  # decoder on core 0 (TP=1), vision beside rank 0: one core in all

    with pytest.raises(NeuronCoresBusyError, match="onto NeuronCores 0-0"):
        registry.compile_graphs(model, settings)  # both cores are still held by `compiled`
    with pytest.raises(NeuronCoresBusyError, match="vision graph .* on cores 0-0"):
        cores.check_free(0, 1, "another model")
    assert len(decoders) == 1 and len(fake.placements) == 1  # refused before anything loaded
    del compiled, decoders[:]
    gc.collect()
    again = registry.compile_graphs(model, settings)
    assert len(fake.traces) == 1  # the cached artifact, not a second trace
    assert again.cache_hits == [True, True] and again.compile_s == 0.0


def test_the_loaded_vision_step_feeds_its_soft_tokens_through_the_engine(inf2, tmp_path, monkeypatch):
    from gemma4lib.backends import registry
    from gemma4lib.port import prompt_rows
    from gemma4lib.runtime import Request

    settings, model, graph, fake, decoders = _faked_neuron_port(tmp_path, monkeypatch)
    engine = registry.compile_graphs(model, settings).runtime

    row = prompt_rows(model, settings)[0]
    images = row.media.prompt
    pattern = torch.arange(graph.slots * model.config.hidden_size, dtype=torch.float32)
    pattern = pattern.reshape(graph.slots, model.config.hidden_size)
    (count,) = images.counts
    soft = engine.soft_tokens(images)
    assert torch.equal(soft, pattern[:count].to(soft.dtype))  # the loaded module's output, first `count` slots
    embeds = engine.prompt_embeds(Request(row.ids, 2, media=images))[0]
    assert torch.equal(embeds[0, list(images.positions)], soft)  # written over the image token positions

    before = int(engine.steps.vision.calls)
    result = engine.generate_rows([Request(row.ids, 2, media=images)]).rows[0]
    assert len(result.tokens) == 2 and decoders[-1].calls >= 2
    assert int(engine.steps.vision.calls) - before == len(images.counts)  # once per image, at admission


# ---- settings: images reach neuron, what does not fit is still refused --------------------------------------
def test_settings_accept_images_and_vision_on_neuron(inf2):
    settings = PortSettings(variant="e2b", model="random", backend="neuron", images=(str(RED_CIRCLE),))
    preflight(settings)
    assert settings.wants_vision and settings.images == (str(RED_CIRCLE),)
    endpoint = PortSettings(variant="e2b", backend="neuron", vision=True, batch_size=4)
    preflight(endpoint)
    assert endpoint.wants_vision  # the endpoint


def test_images_take_no_core_beyond_the_tp_degree_and_three_tp8_replicas_fit_an_inf2_48xlarge(monkeypatch, inf2):
    """The vision graph sits on rank 0's core, where the memory plan counts it: TP 2 with images runs on
    an inf2.8xlarge's two cores, and a Ray replica reserves exactly its TP degree, so on an
    inf2.48xlarge three TP=8 replicas with images fit (not two), each TP group on whole chips of its
    own. The plans say the vision part fits beside rank 0 for both TP=8 variants; a core it would
    overflow is refused by the full profile's preflight."""
    from gemma4lab.inf2.plans import core_summary
    from gemma4lib.inf2.hardware import CORES_PER_CHIP, INSTANCES
    from gemma4lib.inf2.memory_plan import plan_core_memory
    from gemma4lib.server.ray_app import replica_resources

    for images in ({"images": (str(RED_CIRCLE),)}, {"vision": True}):
        preflight(PortSettings(variant="e4b", model="random", backend="neuron", tp_degree=2, **images))
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.48xlarge")
    for variant in ("31b", "26b-a4b"):
        settings = PortSettings(variant=variant, model="random", backend="neuron", tp_degree=8, vision=True)
        preflight(settings)
        reserved = replica_resources(settings)["resources"]["neuron_cores"]
        replicas = INSTANCES["inf2.48xlarge"].neuron_cores // reserved
        groups = [range(r * reserved, (r + 1) * reserved) for r in range(replicas)]
        assert replicas == 3 and all(g.start % CORES_PER_CHIP == 0 == len(g) % CORES_PER_CHIP for g in groups)
        plan = plan_core_memory(variant, 8, instance="inf2.48xlarge", vision=True)
        assert plan.fits and plan.vision_gib > 0, core_summary(plan)  # the vision part counted on rank 0's core
    seen: list[bool] = []  # the full profile's preflight plans rank 0's core with the vision part on it
    monkeypatch.setattr("gemma4lib.backends.preflight.require_fit", lambda *a, **k: seen.append(k["vision"]))
    monkeypatch.setattr("gemma4lib.backends.preflight.require_serving_host", lambda *a, **k: None)
    preflight(PortSettings(variant="31b", backend="neuron", tp_degree=8, vision=True, profile="full"))
    assert seen == [True]


def test_settings_still_refuse_the_ports_batch_rows_with_images_on_neuron(inf2):
    with pytest.raises(SettingsError, match="batch_size 2"):
        PortSettings(variant="e2b", model="random", backend="neuron", images=(str(RED_CIRCLE),), batch_size=2)


def test_neuron_images_without_the_sdk_fail_the_sdk_check_before_any_work(monkeypatch):
    if neuron_env.sdk_present():
        pytest.skip("Neuron SDK installed")
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    for images in ({"images": (str(RED_CIRCLE),)}, {"vision": True}):
        with pytest.raises(NeuronSDKMissingError, match="backend 'neuron' \\(e2b\\) needs the Neuron SDK"):
            preflight(PortSettings(variant="e2b", model="random", backend="neuron", **images))
