"""Bad inputs and faults: each is met with a clear error that says what to do, and no damage.

`CASES` is the table: one row per bad input or fault, with the call that triggers it, the exact
error type (or warning category, or a logged WARNING) and a fragment of the message that tells the
user what to do. A row may carry an `after` check for "no damage" (nothing half-written was
published, the next run rebuilds, ...). Faults that have no error of their own (two builders at
once, a crash mid-write, a leaked token) are tested below the table.

Everything here is fast and needs neither network, nor Neuron SDK, nor a compile: versions are
simulated through the metadata lookups, hub calls through a monkeypatched `AutoConfig` or download
(or an endpoint that cannot resolve: no network for real), compiles
through fake build functions on a `tmp_path` artifact cache, notebooks through a fake papermill.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gemma4lib import environment
from gemma4lib.backends import registry
from gemma4lib.backends.preflight import preflight
from gemma4lib.cache import artifacts
from gemma4lib.cache.artifacts import ArtifactCache, atomic_write_json
from gemma4lib.errors import (
    ArtifactError,
    BadPromptError,
    BaselineError,
    BatchTooLargeError,
    CheckpointError,
    DeviceMemoryError,
    EnvironmentMismatchError,
    GatedCheckpointError,
    HubUnreachableError,
    LowHostMemoryWarning,
    NeuronSDKMissingError,
    NotGemma4Error,
    PromptTooLongError,
    SettingsError,
    TensorParallelError,
    UnknownNameError,
    VariantMismatchError,
)
from gemma4lib.inf2 import compile_ram
from gemma4lib.inf2.memory_plan import neuron_recipe, require_fit, require_neuron_tp
from gemma4lib.models import checkpoint as checkpoint_module
from gemma4lib.models import hub
from gemma4lib.models.checkpoint import check_config_matches_variant, load_checkpoint
from gemma4lib.models.loading import build_tiny, text_config
from gemma4lib.models.trained import FIXTURES_DIR, sha256_file, verify_fixture_hashes
from gemma4lib.models.variants import get_variant
from gemma4lib.port import PortSettings
from gemma4lib.recipes import neuron_env
from gemma4lib.record import write_result
from gemma4lib.runtime import Engine, Request, Sampling, Steps, bind_kv, encode_prompt
from gemma4lib.tp.plan import make_plan
from papermill_runs import baselines
from papermill_runs import run as pm_run

SENTINEL = "hf_SENTINELtoken0123456789abcdef"  # a fake HF_TOKEN that must never surface anywhere
KEY = "ab" * 32  # an artifact-cache key
LOGGED = "logged WARNING"  # `error` of rows whose outcome is a WARNING log record, not an exception


@dataclass
class Ctx:
    tmp: Path
    mp: pytest.MonkeyPatch


@dataclass(frozen=True)
class Case:
    name: str
    trigger: Callable[[Ctx], Any]
    error: type[BaseException] | type[Warning] | str
    fragment: str  # part of the message that tells the user what to do
    after: Callable[[Ctx], None] | None = None  # "no damage" checks, run after the error


# ---- helpers the rows use ------------------------------------------------------------------------


class _Forbidden:
    """A compiled step that must never run: bad requests are rejected before any device work."""

    def __call__(self, *args):
        raise AssertionError("device step called for a request that cannot fit")


_RUNTIME: list[Engine] = []


def runtime() -> Engine:
    """An engine over the tiny E2B with one 16-token prefill bucket and a 32-token context."""
    if not _RUNTIME:
        model = build_tiny(get_variant("e2b"))
        _RUNTIME.append(Engine.for_model(model, Steps({16: _Forbidden()}, _Forbidden()), batch=1, context_length=32))
    return _RUNTIME[0]


_TOKENIZER: list[Any] = []


def tokenizer():
    if not _TOKENIZER:
        from gemma4lib.models.tokenizer import load_tokenizer

        _TOKENIZER.append(load_tokenizer(FIXTURES_DIR / "tokenizer"))
    return _TOKENIZER[0]


def hub_up(ctx: Ctx) -> None:
    """The hub answers the connection probe (what a machine with network sees); not offline."""
    ctx.mp.delenv("HF_HUB_OFFLINE", raising=False)
    ctx.mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
    ctx.mp.setattr(checkpoint_module, "probe_hub", lambda *a, **k: None)


def hub_config_fails(ctx: Ctx, token: str | None) -> None:
    """The hub is up but answers every config request with an error (echoing the token, as a
    careless HTTP error might: it must still never reach the user)."""
    import transformers

    hub_up(ctx)
    if token is None:
        ctx.mp.delenv("HF_TOKEN", raising=False)
    else:
        ctx.mp.setenv("HF_TOKEN", token)

    def fail(*args, **kwargs):
        raise OSError(f"401 Client Error for url with Authorization: Bearer {kwargs.get('token')}")

    ctx.mp.setattr(transformers.AutoConfig, "from_pretrained", fail)


def hub_returns(ctx: Ctx, config) -> None:
    import transformers

    hub_up(ctx)
    ctx.mp.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: config)


def checkpoint_folder(ctx: Ctx, config: dict | str | None, weights: bool = True) -> Path:
    folder = ctx.tmp / "ckpt"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 16)  # never read: validation comes first
    return folder


def e2b_shaped_folder(ctx: Ctx) -> Path:
    """A local folder holding an E2B-shaped Gemma-4 config (PLE, KV sharing, no k_eq_v)."""
    return checkpoint_folder(ctx, text_config(get_variant("e2b"), "tiny").to_json_string())


HUB_ID = "google/gemma-4-E2B-it"


def hub_download_raises(ctx: Ctx, error: BaseException, token: str | None = None) -> None:
    """The hub is up; huggingface_hub's download (under transformers' own error handling) raises `error`."""
    import transformers.utils.hub as hf_hub

    hub_up(ctx)
    if token is None:
        ctx.mp.delenv("HF_TOKEN", raising=False)
    else:
        ctx.mp.setenv("HF_TOKEN", token)

    def download(*args, **kwargs):
        raise error

    ctx.mp.setattr(hf_hub, "hf_hub_download", download)


def http_error(cls, status: int):
    """A huggingface_hub HTTP error as the hub raises it (with its response)."""
    import httpx2

    url = f"https://huggingface.co/{HUB_ID}/resolve/main/config.json"
    response = httpx2.Response(status, request=httpx2.Request("GET", url))
    return cls(f"{status} Client Error for url {url}", response=response)


def gated_hub(ctx: Ctx, token: str | None) -> None:
    from huggingface_hub.errors import GatedRepoError

    hub_download_raises(ctx, http_error(GatedRepoError, 401 if token is None else 403), token)


def download_cut(ctx: Ctx) -> None:
    """The probe got through, then the download lost the network (huggingface_hub's own wording)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    error = LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
    error.__cause__ = ConnectionError("[Errno 101] Network is unreachable")
    hub_download_raises(ctx, error)


def no_network(ctx: Ctx) -> None:
    """A hub endpoint that cannot resolve (RFC 2606 `.invalid`): the real probe fails for real."""
    ctx.mp.delenv("HF_HUB_OFFLINE", raising=False)
    ctx.mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
    ctx.mp.setattr(hub, "hub_endpoint", lambda: "https://hub-endpoint.invalid")


def offline_mode(ctx: Ctx) -> None:
    """HF_HUB_OFFLINE=1: no probe, no download attempt, only the local hub cache."""
    ctx.mp.setenv("HF_HUB_OFFLINE", "1")

    def probe(*args, **kwargs):
        raise AssertionError("offline mode must not touch the network")

    ctx.mp.setattr(checkpoint_module, "probe_hub", probe)


def released_folder(ctx: Ctx, variant: str = "e2b") -> Path:
    """A released-layout checkpoint: the trained tiny decoder inside the multimodal class."""
    from gemma4lab.models.released import save_released_layout
    from gemma4lib.models.trained import load_trained

    trained = load_trained(variant)
    return save_released_layout(variant, ctx.tmp / f"released-{variant}", trained.lm, trained.tokenizer)


def edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def hidden_size_edited(ctx: Ctx) -> Path:
    return edit_config(released_folder(ctx), lambda c: c["text_config"].update(hidden_size=96))


def layers_edited(ctx: Ctx) -> Path:
    """One more layer in config.json than the weights have (its per-layer settings no longer fit)."""

    def edit(config: dict) -> None:
        text = config["text_config"]
        text["num_hidden_layers"] += 2
        text["layer_types"] += ["sliding_attention", "full_attention"]

    return edit_config(released_folder(ctx), edit)


def tensor_dropped(ctx: Ctx) -> Path:
    """A checkpoint missing one decoder tensor (a shard lost in the download)."""
    from safetensors.torch import load_file, save_file

    folder = released_folder(ctx)
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    del state["model.language_model.layers.3.mlp.up_proj.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    return folder


def text_only_folder(ctx: Ctx, variant: str, tokenizer_files: bool = True) -> Path:
    """What `save_pretrained` of a `*ForCausalLM` writes: model_type gemma4_text / gemma4_unified_text."""
    from gemma4lib.models.trained import load_trained

    trained = load_trained(variant)
    folder = ctx.tmp / f"text-{variant}"
    trained.lm.save_pretrained(str(folder))
    if tokenizer_files:
        trained.tokenizer.save_pretrained(str(folder))
    return folder


def versions_found(ctx: Ctx, **found: str | None) -> None:
    """Simulate an installation: distribution name (with '-') -> version, None = absent."""
    ctx.mp.setattr(neuron_env, "metadata_version", lambda dist: found.get(dist))
    ctx.mp.setattr(neuron_env, "apply_path_fix", lambda *a, **k: {})


def transformers_version(ctx: Ctx, version: str | None) -> None:
    real = environment.package_version
    ctx.mp.setattr(environment, "package_version", lambda name: version if name == "transformers" else real(name))


def cache(ctx: Ctx) -> ArtifactCache:
    return ArtifactCache(ctx.tmp / "cache")


def good_build(folder: Path) -> dict:
    (folder / "model.neff").write_bytes(b"NEFF" + bytes(range(256)) * 64)
    (folder / "weights.bin").write_bytes(b"W" * 4096)
    return {"recipe": "fake"}


def interrupted_build(folder: Path) -> dict:
    """A compile killed half-way: one file complete, the next half-written, then the interrupt."""
    (folder / "model.neff").write_bytes(b"NEFF" + bytes(range(256)) * 64)
    with open(folder / "weights.bin", "wb") as handle:
        handle.write(b"W" * 100)
        raise KeyboardInterrupt  # Ctrl-C, or the kernel restarted while compiling


def compile_killed(ctx: Ctx) -> None:
    c = cache(ctx)
    with pytest.raises(KeyboardInterrupt):
        c.get_or_build(KEY, interrupted_build)
    c.verify(KEY)  # what a later run sees: no entry at all


def rebuilt_after_kill(ctx: Ctx) -> None:
    c = cache(ctx)
    assert not list(c.root.glob(".building-*")), "the half-written temp folder was left behind"
    assert not c.entry_dir(KEY).exists() and c.lookup(KEY) is None
    calls = []
    entry = c.get_or_build(KEY, lambda folder: calls.append(1) or good_build(folder))
    assert calls == [1] and not entry.hit, "the next run must compile again"
    assert entry.file("weights.bin").read_bytes() == b"W" * 4096
    assert c.get_or_build(KEY, good_build).hit


def corrupt_then_get(ctx: Ctx) -> None:
    c = cache(ctx)
    c.get_or_build(KEY, good_build)
    neff = c.entry_dir(KEY) / "model.neff"
    data = bytearray(neff.read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size
    neff.write_bytes(bytes(data))
    ctx.calls = []
    entry = c.get_or_build(KEY, lambda folder: ctx.calls.append(1) or good_build(folder))
    assert not entry.hit and ctx.calls == [1], "a corrupt entry must be rebuilt, not loaded"


def verify_after_rebuild(ctx: Ctx) -> None:
    c = cache(ctx)
    assert c.verify(KEY)["files"]["model.neff"] == artifacts.sha256_file(c.entry_dir(KEY) / "model.neff")
    assert c.get_or_build(KEY, good_build).hit


def truncated_meta_then_get(ctx: Ctx) -> None:
    c = cache(ctx)
    c.get_or_build(KEY, good_build)
    meta = c.entry_dir(KEY) / artifacts.META
    meta.write_text(meta.read_text()[:40])
    assert not c.get_or_build(KEY, good_build).hit


def low_ram(ctx: Ctx) -> str | None:
    ctx.mp.setattr(compile_ram, "host_ram_bytes", lambda: 16 * 2**30)  # an inf2.xlarge
    return compile_ram.warn_low_host_ram("31b", 8)


def malformed_baseline(ctx: Ctx):
    path = baselines.baseline_path("smoke", "test-kind", ctx.tmp)
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "profile": "smoke", "variants": {"e2b": {"seq_')  # torn write
    return baselines.load_baseline(path, "smoke", "test-kind", ["decode_tok_s"])


def wrong_shape_baseline(ctx: Ctx):
    path = ctx.tmp / "b.json"
    path.write_text(
        json.dumps(
            {
                "schema": 1,
                "profile": "smoke",
                "machine_kind": "test-kind",
                "variants": {"e2b": {"seq_match": "yes", "decode_tok_s": -3}},
            }
        )
    )
    return baselines.load_baseline(path, "smoke", "test-kind", ["decode_tok_s"])


def tampered_fixture(ctx: Ctx):
    """A copy of the E2B fixture with its own PROVENANCE.json, then one byte of the weights flipped."""
    root = ctx.tmp / "fixtures"
    for part in ("e2b", "tokenizer"):
        shutil.copytree(FIXTURES_DIR / part, root / part)
    files = {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
    (root / "PROVENANCE.json").write_text(json.dumps({"files": files}))
    verify_fixture_hashes(root, ["e2b"])  # intact: passes
    weights = root / "e2b" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    return verify_fixture_hashes(root, ["e2b"])


def sdk_absent(ctx: Ctx):
    versions_found(ctx)
    return neuron_env.require("torch_neuronx", "backend 'neuron' (e2b)")


SDK_228 = {d: v[0] for d, v in neuron_env.SDK_PINS.items()}


# ---- the table -----------------------------------------------------------------------------------

CASES = [
    # names
    Case(
        "unknown variant",
        lambda c: PortSettings(variant="e3b"),
        UnknownNameError,
        "unknown variant 'e3b'; choose one of: 12b, 26b-a4b, 31b, e2b, e4b",
    ),
    Case(
        "unknown profile",
        lambda c: PortSettings(variant="e2b", profile="fast"),
        UnknownNameError,
        "unknown profile 'fast'; choose one of: smoke, full",
    ),
    Case(
        "unknown backend",
        lambda c: PortSettings(variant="e2b", backend="cuda"),
        UnknownNameError,
        "unknown backend 'cuda'; choose one of: cpu, eager, xla, neuron",
    ),
    Case(
        "unknown model source",
        lambda c: PortSettings(variant="e2b", model="pretrained"),
        UnknownNameError,
        "choose one of: auto, trained, random, checkpoint",
    ),
    Case(
        "unknown recipe",
        lambda c: neuron_recipe(get_variant("e2b"), 1, "nxdi"),
        UnknownNameError,
        "unknown neuron recipe 'nxdi'; choose one of: model_builder, trace",
    ),
    Case(
        "unknown MoE decode form",
        lambda c: PortSettings(variant="26b-a4b", decode_experts="sparse"),
        UnknownNameError,
        "unknown decode_experts form 'sparse'; choose one of: dense, selective",
    ),
    # tensor parallelism
    Case(
        "TP the variant can't use (26B-A4B at TP=3)",
        lambda c: PortSettings(variant="26b-a4b", tp_degree=3),
        TensorParallelError,
        "only for TP in (1, 2, 4, 8); pick one of those",
    ),
    Case(
        "TP plan that can't shard (26B-A4B real config at TP=3)",
        lambda c: make_plan(text_config(get_variant("26b-a4b"), "real"), 3, get_variant("26b-a4b")),
        TensorParallelError,
        "use one of 1, 2, 4, 8",
    ),
    Case(
        "more ranks than the instance has NeuronCores (12B TP=4 on inf2.8xlarge)",
        lambda c: (
            c.mp.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge"),
            preflight(PortSettings(variant="12b", backend="neuron", tp_degree=4)),
        ),
        TensorParallelError,
        "TP=4 needs 4 NeuronCores and an inf2.8xlarge has 2; use tp_degree 1 or 2 on inf2.8xlarge",
    ),
    Case(
        "TP degree the Neuron runtime does not run on inf2 (31B at TP=12)",
        lambda c: require_neuron_tp(get_variant("31b"), 12, "inf2.48xlarge"),
        TensorParallelError,
        "TP=12 is not a degree the Neuron runtime supports on inf2 (1, 2, 4, 8, 24)",
    ),
    Case(
        "released 12B on one NeuronCore (backend neuron, full profile, TP=1)",
        lambda c: (
            c.mp.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge"),
            preflight(PortSettings(variant="12b", profile="full", backend="neuron", tp_degree=1)),
        ),
        DeviceMemoryError,
        "exceed a NeuronCore's 16 GiB; use TP=2 on inf2.8xlarge",
    ),
    Case(
        "released 31B at TP=4 (weights + K/V + working memory over 16 GiB)",
        lambda c: require_fit(get_variant("31b"), 4, instance="inf2.24xlarge", context_length=2048, ring=True),
        DeviceMemoryError,
        "does not fit: 14.3 GiB of weights",
    ),
    Case(
        "backend neuron without the SDK: refused by the preflight, before any load",
        lambda c: (versions_found(c), preflight(PortSettings(variant="e2b", backend="neuron"))),
        NeuronSDKMissingError,
        "backend 'neuron' (e2b) needs the Neuron SDK package torch-neuronx",
    ),
    Case(
        "tensor parallelism on the one-device XLA lane (TP=2)",
        lambda c: PortSettings(variant="e4b", backend="xla", tp_degree=2),
        TensorParallelError,
        "the xla lane compiles one device: use tp_degree=1 there",
    ),
    # settings
    Case(
        "max_new_tokens of 0",
        lambda c: PortSettings(variant="e2b", max_new_tokens=0),
        SettingsError,
        "max_new_tokens must be at least 1, got 0",
    ),
    Case(
        "max_new_tokens negative",
        lambda c: PortSettings(variant="e2b", max_new_tokens=-3),
        SettingsError,
        "max_new_tokens must be at least 1, got -3",
    ),
    Case(
        "TP degree that is not a number",
        lambda c: PortSettings(variant="e2b", tp_degree="two"),
        SettingsError,
        "tp_degree must be a whole number, got 'two' (str); pass e.g. tp_degree=1",
    ),
    Case(
        "context length as a float",
        lambda c: PortSettings(variant="e2b", context_length=128.0),
        SettingsError,
        "context_length must be a whole number, got 128.0 (float)",
    ),
    Case(
        "prefill bucket longer than the context",
        lambda c: PortSettings(variant="e2b", prefill_buckets=(256,)),
        SettingsError,
        "prefill bucket 256 is longer than context_length 128; use buckets <= context_length",
    ),
    # prompts and shapes
    Case(
        "prompt + max_new_tokens > compiled context",
        lambda c: runtime().generate(list(range(3, 15)), 30),
        PromptTooLongError,
        "shorten the prompt, lower max_new_tokens, or recompile with a larger context_length",
    ),
    Case(
        "one token past the compiled context (12 + 22 - 1 = 33 > 32)",
        lambda c: runtime().generate(list(range(3, 15)), 22),
        PromptTooLongError,
        "need 33 K/V positions (the last new token is never fed back), more than the compiled context length 32",
    ),
    Case(
        "max_new_tokens of 0 at generate()",
        lambda c: runtime().generate([5, 6, 7], 0),
        SettingsError,
        "max_new_tokens must be a whole number >= 1, got 0",
    ),
    Case(
        "token ids outside the vocabulary",
        lambda c: runtime().generate([5, 6, 900_000], 4),
        BadPromptError,
        "token ids [900000] are outside this model's vocabulary (0..809); encode the text with this model's",
    ),
    Case(
        "negative token id",
        lambda c: runtime().generate([-1, 6], 4),
        BadPromptError,
        "token ids [-1] are outside this model's vocabulary",
    ),
    Case(
        "top_p of 0 (an empty nucleus)",
        lambda c: Sampling(temperature=0.7, top_p=0.0),
        SettingsError,
        "top_p must be in (0, 1], got 0.0",
    ),
    Case(
        "negative temperature",
        lambda c: Sampling(temperature=-1.0),
        SettingsError,
        "temperature must be 0 (greedy) or >= 1e-05, got -1.0",
    ),
    Case(
        "prompt longer than the context",
        lambda c: runtime().generate(list(range(3, 38)), 1),
        PromptTooLongError,
        "shorten the prompt, lower max_new_tokens, or recompile with a larger context_length",
    ),
    Case(
        "empty prompt",
        lambda c: encode_prompt(tokenizer(), "   "),
        BadPromptError,
        "pass a question, e.g. 'What is the capital of France?'",
    ),
    Case(
        "non-string prompt",
        lambda c: encode_prompt(tokenizer(), ["What", "is"]),
        BadPromptError,
        "prompt must be a string, got list; pass the question as text",
    ),
    Case(
        "text where token ids are expected",
        lambda c: runtime().generate("What is the capital?", 4),
        BadPromptError,
        "encode the text first with encode_prompt(tokenizer, prompt)",
    ),
    Case("prompt with no tokens", lambda c: runtime().generate([], 4), BadPromptError, "pass a non-empty prompt"),
    Case(
        "batch larger than compiled",
        lambda c: runtime().generate([[5, 6, 7], [8, 9, 10]], 4),
        BatchTooLargeError,
        "send at most 1 at a time or recompile",
    ),
    # checkpoints
    Case(
        "gated checkpoint without HF_TOKEN",
        lambda c: (hub_config_fails(c, None), load_checkpoint(get_variant("e2b"), "google/gemma-4-E2B-it")),
        GatedCheckpointError,
        "accept the licence on the model page, then `export HF_TOKEN=...`",
    ),
    Case(
        "hub checkpoint unreadable with a token",
        lambda c: (hub_config_fails(c, SENTINEL), load_checkpoint(get_variant("e2b"), "google/gemma-4-E2B-it")),
        CheckpointError,
        "check the id and the network, and that the HF_TOKEN account accepted the model's licence",
    ),
    Case(
        "gated checkpoint, the hub's own GatedRepoError, no token",
        lambda c: (gated_hub(c, None), load_checkpoint(get_variant("e2b"), HUB_ID)),
        GatedCheckpointError,
        "accept the licence on the model page, then `export HF_TOKEN=...`",
    ),
    Case(
        "gated checkpoint, token of an account without access",
        lambda c: (gated_hub(c, SENTINEL), load_checkpoint(get_variant("e2b"), HUB_ID)),
        GatedCheckpointError,
        "the HF_TOKEN account has no access to 'google/gemma-4-E2B-it'",
    ),
    Case(
        "hub unreachable (the endpoint does not resolve)",
        lambda c: (no_network(c), load_checkpoint(get_variant("e2b"), HUB_ID)),
        HubUnreachableError,
        "download it on a machine with access (`hf download google/gemma-4-E2B-it --local-dir <folder>`), "
        "copy the folder over and point checkpoint= at it; or set HF_ENDPOINT",
    ),
    Case(
        "HF_HUB_OFFLINE set, checkpoint not cached",
        lambda c: (offline_mode(c), load_checkpoint(get_variant("e2b"), HUB_ID)),
        HubUnreachableError,
        "HF_HUB_OFFLINE is set, and it is not in the local hub cache",
    ),
    Case(
        "network lost after the probe",
        lambda c: (download_cut(c), load_checkpoint(get_variant("e2b"), HUB_ID)),
        HubUnreachableError,
        "the download failed on the network",
    ),
    Case(
        "config.json hidden_size edited (weights disagree)",
        lambda c: load_checkpoint(get_variant("e2b"), str(hidden_size_edited(c)), torch.float32),
        CheckpointError,
        "model.language_model.embed_tokens.weight is [810, 64] in the weights but [810, 96] by "
        "config.json (the weights have hidden_size 64, config.json says 96)",
    ),
    Case(
        "config.json layer count edited",
        lambda c: load_checkpoint(get_variant("e2b"), str(layers_edited(c)), torch.float32),
        CheckpointError,
        "); download the checkpoint again, or fix config.json",
    ),
    Case(
        "checkpoint missing a decoder tensor",
        lambda c: load_checkpoint(get_variant("e2b"), str(tensor_dropped(c)), torch.float32),
        CheckpointError,
        "lacks 1 tensors of the text decoder (e.g. model.language_model.layers.3.mlp.up_proj.weight)",
    ),
    Case(
        "text-only 12B folder for the 31B notebook",
        lambda c: load_checkpoint(get_variant("31b"), str(text_only_folder(c, "12b"))),
        VariantMismatchError,
        "it looks like 12b: use variant='12b'",
    ),
    Case(
        "text-only folder without tokenizer files",
        lambda c: load_checkpoint(get_variant("e2b"), str(text_only_folder(c, "e2b", False)), torch.float32),
        CheckpointError,
        "the folder needs the released tokenizer files (tokenizer.json",
    ),
    Case(
        "checkpoint path that does not exist",
        lambda c: load_checkpoint(get_variant("e2b"), str(c.tmp / "no" / "such-folder")),
        CheckpointError,
        "is neither an existing folder nor a hub id (owner/name); check the path",
    ),
    Case(
        "local folder without config.json",
        lambda c: load_checkpoint(get_variant("e2b"), str(checkpoint_folder(c, None))),
        CheckpointError,
        "point checkpoint at the folder that holds config.json, the *.safetensors weights and the tokenizer",
    ),
    Case(
        "local folder without weights",
        lambda c: load_checkpoint(get_variant("e2b"), str(checkpoint_folder(c, {"model_type": "gemma4"}, False))),
        CheckpointError,
        "download the full checkpoint (e.g. `hf download <id> --local-dir",
    ),
    Case(
        "local folder with a truncated config.json",
        lambda c: load_checkpoint(get_variant("e2b"), str(checkpoint_folder(c, '{"model_type": "gem'))),
        CheckpointError,
        "the download was probably cut short: download the checkpoint again",
    ),
    Case(
        "local folder of another model type",
        lambda c: load_checkpoint(get_variant("e2b"), str(checkpoint_folder(c, {"model_type": "llama"}))),
        NotGemma4Error,
        "); pick a Gemma-4 checkpoint",
    ),
    Case(
        "hub config that isn't Gemma-4",
        lambda c: (
            hub_returns(c, __import__("transformers").LlamaConfig()),
            load_checkpoint(get_variant("31b"), "meta-llama/Llama-3.1-8B"),
        ),
        NotGemma4Error,
        "pick a Gemma-4 checkpoint, e.g. 'google/gemma-4-31B-it'",
    ),
    Case(
        "E2B-shaped checkpoint loaded as the 31B",
        lambda c: load_checkpoint(get_variant("31b"), str(e2b_shaped_folder(c))),
        VariantMismatchError,
        "it looks like e2b or e4b: use variant='e2b' (its notebook) for it, or point checkpoint at the 31b weights",
    ),
    Case(
        "12B (unified) config for the 31B notebook",
        lambda c: check_config_matches_variant(text_config(get_variant("12b"), "real"), get_variant("31b")),
        VariantMismatchError,
        "it looks like 12b: use variant='12b'",
    ),
    Case(
        "dense 31B config for the MoE notebook",
        lambda c: (
            hub_returns(c, text_config(get_variant("31b"), "real")),
            load_checkpoint(get_variant("26b-a4b"), "google/gemma-4-31B-it"),
        ),
        VariantMismatchError,
        "MoE block absent, but the 26b-a4b has it; it looks like 31b: use variant='31b'",
    ),
    Case(
        "trained fixture changed on disk",
        tampered_fixture,
        CheckpointError,
        "restore them from git or regenerate with scripts/train_tiny.py",
    ),
    # environment
    Case(
        "transformers older than the pin",
        lambda c: (transformers_version(c, "5.13.0"), build_tiny(get_variant("e2b"))),
        EnvironmentMismatchError,
        f"transformers 5.13.0 is older than the pinned {environment.TRANSFORMERS_PIN}; "
        f"`pip install transformers=={environment.TRANSFORMERS_PIN}`",
    ),
    Case(
        "transformers absent",
        lambda c: (transformers_version(c, None), load_checkpoint(get_variant("e2b"), "google/gemma-4-E2B-it")),
        EnvironmentMismatchError,
        f"`pip install transformers=={environment.TRANSFORMERS_PIN}`",
    ),
    Case(
        "Neuron SDK absent",
        sdk_absent,
        NeuronSDKMissingError,
        f"run `source /opt/{neuron_env.DLAMI_VENV}/bin/activate`",
    ),
    Case(
        "torch-neuronx at another version",
        lambda c: (
            versions_found(c, **{**SDK_228, "torch-neuronx": "2.5.1.2.4.0"}),
            neuron_env.require("torch_neuronx"),
        ),
        EnvironmentMismatchError,
        "torch-neuronx 2.5.1.2.4.0 is installed, but this cookbook pins 2.9.0.2.12.22436",
    ),
    Case(
        "neuronx-distributed at another version",
        lambda c: (
            versions_found(c, **{**SDK_228, "neuronx-distributed": "0.16.0"}),
            neuron_env.require("neuronx_distributed.trace"),
        ),
        EnvironmentMismatchError,
        f"pip install --extra-index-url {neuron_env.NEURON_PIP_INDEX}",
    ),
    # the artifact cache
    Case(
        "compile killed half-way",
        compile_killed,
        ArtifactError,
        "(never built, or its build was interrupted); get_or_build compiles it again",
        after=rebuilt_after_kill,
    ),
    Case(
        "corrupted cached artifact",
        corrupt_then_get,
        LOGGED,
        "is missing or corrupt (checksum mismatch); rebuilding",
        after=verify_after_rebuild,
    ),
    Case("torn meta.json in the cache", truncated_meta_then_get, LOGGED, "; rebuilding", after=verify_after_rebuild),
    # host memory
    Case(
        "host RAM below the compile peak estimate",
        low_ram,
        LowHostMemoryWarning,
        "estimated peak 133.8 GB host RAM > 17 GB here; compile on inf2.24xlarge or add swap",
    ),
    # papermill baselines and arguments
    Case(
        "malformed (torn) baseline",
        malformed_baseline,
        BaselineError,
        "; fix it, or delete it and rerun with --update-baseline",
    ),
    Case(
        "baseline with wrong shapes",
        wrong_shape_baseline,
        BaselineError,
        "got -3; fix it, or delete it and rerun with --update-baseline",
    ),
    Case(
        "tolerance file missing",
        lambda c: baselines.load_tolerances("smoke", c.tmp / "tolerances.json"),
        BaselineError,
        "restore papermill_runs/tolerances.json",
    ),
    Case(
        "papermill: unknown notebook",
        lambda c: pm_run.selected(["e3b"]),
        SystemExit,
        "choose from e2b, e4b, 12b, 31b, 26b-a4b, serving, serve, overview",
    ),
    Case(
        "papermill: malformed -p", lambda c: pm_run.parse_overrides(["tp_degree"]), SystemExit, "-p expects KEY=VALUE"
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_error(case: Case, tmp_path, monkeypatch, caplog):
    ctx = Ctx(tmp_path, monkeypatch)
    if case.error == LOGGED:
        with caplog.at_level(logging.WARNING):
            case.trigger(ctx)
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert records, "no WARNING was logged"
        message = "\n".join(r.getMessage() for r in records)
    elif issubclass(case.error, Warning):
        with pytest.warns(case.error) as caught:
            case.trigger(ctx)
        matching = [w for w in caught if w.category is case.error]
        message = str(matching[0].message)
    else:
        with pytest.raises(case.error) as info:
            case.trigger(ctx)
        assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
        message = str(info.value)
    assert case.fragment in message, message
    if case.after:
        case.after(ctx)


def test_the_table_is_big_enough():
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)
    assert all(c.fragment.strip() for c in CASES)


# ---- faults without an error of their own: no damage ---------------------------------------------


def test_concurrent_builders_of_one_key_build_once(tmp_path):
    """Two runs compiling the same key at once: one builds, the other waits on the lock and loads it."""
    c = ArtifactCache(tmp_path / "cache")
    calls, entries, errors = [], [], []
    started = threading.Barrier(2)

    def slow_build(folder: Path) -> dict:
        calls.append(threading.get_ident())
        (folder / "model.neff").write_bytes(b"half")
        time.sleep(0.3)  # long enough that the second builder arrives mid-build
        return good_build(folder)

    def builder():
        try:
            started.wait()
            entries.append(c.get_or_build(KEY, slow_build))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=builder) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert len(calls) == 1, "both builders compiled the same key"
    assert sorted(e.hit for e in entries) == [False, True]
    assert entries[0].path == entries[1].path and entries[0].meta["files"] == entries[1].meta["files"]
    assert c.verify(KEY)["files"] == entries[0].meta["files"]
    assert not list(c.root.glob(".building-*"))


def test_builder_killed_outright_leaves_nothing_loadable(tmp_path):
    """SIGKILL (the kernel's OOM killer) runs no cleanup: the half-written temp folder stays, but it is
    never loaded, and the next build of that key removes it."""
    c = ArtifactCache(tmp_path / "cache")
    c.root.mkdir(parents=True)
    stale = c.root / f".building-{KEY[:12]}-deadbeef"
    stale.mkdir()
    (stale / "model.neff").write_bytes(b"NEFF-half")
    assert c.lookup(KEY) is None
    entry = c.get_or_build(KEY, good_build)
    assert not entry.hit and not stale.exists()
    assert entry.file("model.neff").read_bytes().startswith(b"NEFF\x00\x01")


def _crash_mid_write(monkeypatch):
    """Make the next atomic write die after writing half of its text (as a kill or full disk would)."""
    import os

    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.write(text[: len(text) // 2])
            self.handle.flush()
            raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(
        artifacts.os, "fdopen", lambda fd, mode="r", *a, **k: HalfWriter(real_fdopen(fd, mode, *a, **k))
    )


@pytest.mark.parametrize("writer", ["result", "baseline", "json"])
def test_crash_mid_write_keeps_the_old_file(tmp_path, monkeypatch, writer):
    """Results, baselines and the papermill results.json go through `atomic_write_json`: a crash while
    writing leaves the previous file whole (never a truncated JSON a later run would trust)."""
    old = {"variant": "e2b", "profile": "smoke", "tp_degree": 1, "decode_tok_s": 100.0, "seq_match": True}
    new = {**old, "decode_tok_s": 50.0, "padding": "x" * 10_000}
    if writer == "result":
        path = write_result(old, tmp_path, "e2b.json")
        write = lambda: write_result(new, tmp_path, "e2b.json")  # noqa: E731
        read = lambda: json.loads(path.read_text())  # noqa: E731
    elif writer == "baseline":
        path = baselines.baseline_path("smoke", "test-kind", tmp_path)
        verdict = {"e2b": baselines.Verdict("e2b", "pass")}
        baselines.update_baseline(path, "smoke", "test-kind", {"e2b": old}, verdict, None)
        write = lambda: baselines.update_baseline(  # noqa: E731
            path,
            "smoke",
            "test-kind",
            {"e2b": new},
            verdict,  # noqa: E731
            baselines.load_baseline(path, "smoke", "test-kind"),
        )
        read = lambda: baselines.load_baseline(path, "smoke", "test-kind")["variants"]["e2b"]  # noqa: E731
    else:
        path = tmp_path / "results.json"
        atomic_write_json(path, old)
        write = lambda: atomic_write_json(path, new)  # noqa: E731
        read = lambda: json.loads(path.read_text())  # noqa: E731
    before = path.read_bytes()
    _crash_mid_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt, match="killed mid-write"):
        write()
    monkeypatch.undo()
    assert path.read_bytes() == before, "the old file was touched"
    assert read()["decode_tok_s"] == 100.0
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


def test_low_ram_warning_comes_before_the_neuron_compile(tmp_path, monkeypatch):
    """The `neuron` backend warns (with the estimate) before it hands anything to the compiler."""
    from gemma4lib.recipes import neuron_trace

    model = build_tiny(get_variant("e2b"))
    import tempfile

    monkeypatch.delenv("GEMMA4LIB_INSTANCE_TYPE", raising=False)
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    settings = PortSettings(
        variant="e2b",
        profile="full",
        backend="neuron",
        context_length=32,
        prefill_buckets=(16,),
        cache_dir=str(tmp_path / "cache"),
        neuron_recipe="trace",
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the compiler workdir lands here, not in /tmp
    events = []
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setattr(compile_ram, "host_ram_bytes", lambda: 4 * 2**30)

    def compiler(*args, **kwargs):
        events.append("compile")
        raise RuntimeError("stop here: no Neuron compiler on this machine")

    monkeypatch.setattr(neuron_trace, "compile_trace", compiler)
    with pytest.warns(LowHostMemoryWarning, match=r"estimated peak 14\.3 GB host RAM > 4 GB here") as caught:
        with pytest.raises(RuntimeError, match="stop here"):
            registry.compile_graphs(model, settings)
    assert caught and events == ["compile"]
    assert not list((tmp_path / "cache").glob(".building-*")) and not list((tmp_path / "cache").glob("*/meta.json"))


def test_doctor_reports_the_ram_estimate(monkeypatch):
    """E2B's ModelBuilder compile (its default) does not fit the 16 GiB inf2.xlarge it runs on: the
    doctor says where it does, and that the trace recipe's compile (weights kept out of the NEFF)
    fits here; the 12B's ModelBuilder compile does not fit a 16 GiB host either."""
    from gemma4lab.tools import doctor

    monkeypatch.setattr(doctor, "host_ram_bytes", lambda: 16 * 2**30)
    report = doctor.run_doctor("e2b")
    assert report["compile_estimate"]["recipe"] == "model_builder"
    assert report["compile_estimate"]["smallest_instance_with_headroom"] == "inf2.8xlarge"
    assert any("compile on inf2.8xlarge" in w and "neuron_recipe='trace' (~14.3 GB" in w for w in report["warnings"])
    report = doctor.run_doctor("12b")
    assert any("estimated peak 63.9 GB host RAM > 17 GB here; compile on inf2.8xlarge" in w for w in report["warnings"])


# ---- papermill: a notebook failing mid-way ------------------------------------------------------


def _record(variant: str) -> dict:
    return {
        "variant": variant,
        "profile": "smoke",
        "compiler": "cpu-aotinductor",
        "tp_degree": 1,
        "model_source": "tiny-trained",
        "seq_match": True,
        "coherent": True,
        "coherence_rule": "contains('Paris')",
        "answer": "Paris.",
        "first_mismatch": None,
        "new_tokens": 8,
        "prefill_ms": 10.0,
        "decode_tok_s": 200.0,
        "compile_s": 0.0,
        "peak_rss_mb": 500.0,
        "prefill_logits_max_abs_diff": 1e-5,
        "versions": {"git_sha": "abc"},
    }


def _fake_papermill(monkeypatch, failing: str, cell: int):
    """papermill without a kernel: `failing` dies in source cell `cell`; the others write their record."""
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    def execute_notebook(source, output, parameters=None, **kwargs):
        nb = nbformat.read(source, as_version=4)
        name = Path(source).name
        if name == failing:
            target = nb.cells[cell]
            assert target.cell_type == "code", "pick a code cell"
            target.metadata["papermill"] = {"exception": True, "status": "failed"}
            target.execution_count = 7
            target.outputs = [
                nbformat.v4.new_output(
                    "error", ename="RuntimeError", evalue="neuronx-cc was killed (out of memory)", traceback=[]
                )
            ]
            nbformat.write(nb, output)
            raise PapermillExecutionError(
                cell, 7, target.source, "RuntimeError", "neuronx-cc was killed (out of memory)", []
            )
        atomic_write_json(Path(parameters["results_path"]), _record(pm_run.selected([name[3:-6]])[0]))
        nbformat.write(nb, output)

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)


def test_failing_notebook_is_named_with_its_cell_and_the_others_are_kept(tmp_path, monkeypatch, capsys):
    import nbformat

    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    source = nbformat.read(str(pm_run.NOTEBOOK_DIR / "03_12b.ipynb"), as_version=4)
    cell = next(i for i, c in enumerate(source.cells) if c.cell_type == "code" and i > 3)
    _fake_papermill(monkeypatch, "03_12b.ipynb", cell)
    out = tmp_path / "out"
    code = pm_run.main(
        [
            "run",
            "--variant",
            "e2b,12b,31b",
            "--out",
            str(out),
            "--machine-kind",
            "test-kind",
            "--baseline-dir",
            str(tmp_path / "baselines"),
            "--history",
            str(tmp_path / "h.jsonl"),
            "--allow-missing-baseline",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    assert f"ERROR: 03_12b.ipynb, cell {cell} (In [7])" in printed
    assert "RuntimeError: neuronx-cc was killed (out of memory)" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["results"]["12b"] is None and data["verdicts"]["12b"]["status"] == "error"
    assert data["notebooks"]["12b"]["failed_cell"]["index"] == cell
    for name in ("e2b", "31b"):  # the notebooks around the failure still ran and were judged
        assert data["results"][name]["seq_match"] is True
        assert data["verdicts"][name]["status"] == "no-baseline"
        assert (out / "results" / f"{name}.json").is_file()
    assert f"03_12b.ipynb, cell {cell}" in (out / "summary.md").read_text()
    for path in out.rglob("*"):  # nothing the runner writes carries the token
        if path.is_file() and path.suffix in (".json", ".md", ".csv", ".log", ".ipynb", ".jsonl"):
            assert SENTINEL not in path.read_text(errors="replace"), path


def test_missing_baseline_is_an_error_not_a_silent_pass(tmp_path, capsys):
    results = tmp_path / "run" / "results.json"
    results.parent.mkdir()
    results.write_text(
        json.dumps(
            {
                "profile": "smoke",
                "machine_kind": "test-kind",
                "results": {"e2b": _record("e2b")},
                "notebooks": {},
                "errors": {},
            }
        )
    )
    args = [
        "check",
        "--results",
        str(results),
        "--baseline-dir",
        str(tmp_path / "none"),
        "--history",
        str(tmp_path / "h.jsonl"),
    ]
    assert pm_run.main(args) == 1
    assert "NO-BASELINE: 01_e2b.ipynb" in capsys.readouterr().out
    assert json.loads(results.read_text())["verdicts"]["e2b"]["status"] == "no-baseline"


# ---- HF_TOKEN never surfaces ---------------------------------------------------------------------


def test_hf_token_never_appears_in_errors_logs_or_results(tmp_path, monkeypatch, caplog, capsys):
    from gemma4lib.port import port

    ctx = Ctx(tmp_path, monkeypatch)
    caplog.set_level(logging.DEBUG)
    texts = []
    for checkpoint in ("google/gemma-4-E2B-it", "someone/private-model"):
        hub_config_fails(ctx, SENTINEL)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(get_variant("e2b"), checkpoint)
        texts += [str(info.value), repr(info.value), "".join(traceback.format_exception(info.value))]
        logging.getLogger("gemma4lib").error("load failed", exc_info=info.value)  # as a handler would log it
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    result = port(
        PortSettings(
            variant="e2b",
            model="random",
            backend="eager",
            max_new_tokens=6,
            warmup=0,
            iters=1,
            results_dir=str(tmp_path / "results"),
            expect=None,
        )
    )
    texts.append(json.dumps(result, default=str))
    texts += [p.read_text() for p in (tmp_path / "results").glob("*.json")]
    captured = capsys.readouterr()
    texts += [caplog.text, captured.out, captured.err]
    assert result["seq_match"] is True and len(texts) > 8
    leaks = [t[:200] for t in texts if SENTINEL in t]
    assert not leaks, leaks


def test_check_fits_is_exact_at_the_context_boundary():
    """The longest request `check_fits` accepts really runs, and equals the reference: prompt +
    max_new_tokens - 1 positions fill the context exactly (the last token is never written)."""
    from gemma4lib.device.graph import DeviceGraph, GraphShape
    from gemma4lib.reference import reference_greedy

    model = build_tiny(get_variant("e2b"), seed=get_variant("e2b").tiny_seed)
    context, prompt = 24, list(range(3, 15))
    prefill = DeviceGraph(model.text_model, model.lm_head, model.layout, GraphShape(1, 16, context, False))
    decode = DeviceGraph(model.text_model, model.lm_head, model.layout, GraphShape(1, 1, context, False))
    kv = decode.new_kv()
    rt = Engine.for_model(
        model, Steps({16: bind_kv(prefill, kv)}, bind_kv(decode, kv)), batch=1, context_length=context
    )
    longest = context - len(prompt) + 1
    generation = rt.generate(prompt, longest)
    assert len(generation.tokens) == longest
    assert generation.tokens == reference_greedy(model.lm, prompt, longest, [])
    with pytest.raises(PromptTooLongError):
        rt.check(Request(prompt, longest + 1))


# ---- checkpoints that load ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["e2b", "12b"])
def test_text_only_checkpoint_folder_loads(tmp_path, monkeypatch, variant):
    """A consistent `gemma4_text` / `gemma4_unified_text` folder loads as the `*ForCausalLM` itself."""
    from gemma4lib.models.trained import load_trained

    folder = text_only_folder(Ctx(tmp_path, monkeypatch), variant)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == ("gemma4_unified_text" if variant == "12b" else "gemma4_text")
    loaded = load_checkpoint(get_variant(variant), str(folder), torch.float32)
    trained = load_trained(variant)
    assert type(loaded.lm) is type(trained.lm)
    got, want = loaded.lm.state_dict(), trained.lm.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.tokenizer.convert_tokens_to_ids("<|turn>") == 105


def test_no_network_fails_fast_with_the_real_endpoint(monkeypatch):
    """Where the hub cannot be reached (this machine, most CI runners), a hub id fails within a few
    seconds with `HubUnreachableError`, not after huggingface_hub's retries as a token problem."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if hub.probe_hub() is None:
        pytest.skip(f"{hub.hub_endpoint()} is reachable from here")
    started = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="No network"):
        load_checkpoint(get_variant("e2b"), HUB_ID)
    assert time.perf_counter() - started < 8.0


def _hub_cache_with(tmp_path: Path, monkeypatch, folder: Path) -> None:
    """A local hub cache holding `folder` as HUB_ID's snapshot (what a past download leaves)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable"])
def test_hub_id_loads_from_the_local_cache_without_network(tmp_path, monkeypatch, caplog, how):
    """Offline (or with the hub out of reach) a hub id loads when a past download is cached."""
    ctx = Ctx(tmp_path, monkeypatch)
    _hub_cache_with(tmp_path, monkeypatch, released_folder(ctx))
    offline_mode(ctx) if how == "HF_HUB_OFFLINE" else no_network(ctx)
    with caplog.at_level(logging.WARNING, logger="gemma4lib"):
        loaded = load_checkpoint(get_variant("e2b"), HUB_ID, torch.float32)
    assert loaded.source == HUB_ID and type(loaded.lm).__name__ == "Gemma4ForCausalLM"
    assert loaded.tokenizer.convert_tokens_to_ids("<turn|>") == 106
    assert "loading google/gemma-4-E2B-it from the local hub cache" in caplog.text
