"""The settings of one port: every value a run depends on, as plain values.

A notebook's parameters cell and the command line map onto them, and every lower module may read them.
They check what the values alone tell (closed lists, ranges, buckets against the context, which
backend runs what: `backends.facts`), so a typo fails in a second; what needs more (a bundle, the inf2
plans, the SDK) is `backends.preflight`, run once before anything loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .backends.facts import BackendFacts, facts, names_where, row_at, runs_row_prefill, runs_tp, selectable
from .errors import BadPromptError, BatchTooLargeError, SettingsError, TensorParallelError, UnknownNameError
from .models.variants import check_profile, get_variant

BACKENDS = selectable()  # the backends this library ships (a test may register another: checks read `selectable()`)
# MoE expert forms (`device.experts`): all experts dense, or the routed ones gathered
EXPERT_FORMS = ("dense", "selective")
# weight formats (`device.quant`): full precision (the backend's dtype), or weight-only int8 linears
WEIGHT_FORMS = ("bf16", "fp32", "int8")
MODEL_SOURCES = ("auto", "trained", "random", "checkpoint")
# what proposes drafts (`generation.drafters`): Gemma-4's own assistant, or n-gram prompt lookup
DRAFT_KINDS = ("assistant", "prompt_lookup")
DEFAULT_PROMPT = "What is the capital of France?"


# Integer settings and their smallest allowed value.
_COUNTS = {
    "batch_size": 1,
    "tp_degree": 1,
    "max_new_tokens": 1,
    "context_length": 2,
    "random_prompt_tokens": 1,
    "warmup": 0,
    "iters": 1,
}


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _sizes(value: Any) -> tuple:
    """Bucket sizes: a sequence, one size, or "32,64" (the command line, `serve run name=value`)."""
    return tuple(p.strip() for p in value.split(",")) if isinstance(value, str) else _as_tuple(value)


def whole_number(name: str, value: Any, minimum: int) -> int:
    """`value` as an int >= `minimum`; digit strings (a CLI or environment value) are accepted."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(
            f"{name} must be a whole number, got {value!r} ({type(value).__name__}); pass e.g. {name}={max(minimum, 1)}"
        )
    if value < minimum:
        raise SettingsError(f"{name} must be at least {minimum}, got {value}")
    return value


@dataclass
class PortSettings:
    """Everything a port run depends on; plain values, so a notebook's parameters cell maps onto it."""

    variant: str
    profile: str = "smoke"
    model: str = "auto"  # smoke: the trained tiny fixture ("random" for equality-only runs); full: checkpoint
    checkpoint: str | None = None  # hub id or local folder (full profile); default: the variant's hub id
    backend: str = "cpu"
    tp_degree: int = 1
    prompt: str = DEFAULT_PROMPT
    expect: str | None = "Paris"  # coherence: the answer must contain this
    random_prompt_tokens: int = 20  # random weights have no tokenizer: a seeded id sequence instead
    max_new_tokens: int = 32
    context_length: int = 128
    prefill_buckets: tuple[int, ...] = (64,)
    ring_kv: bool = True  # sliding layers hold only their window: flat decode cost with context (docs/ROOFLINE.md)
    decode_experts: str = "selective"  # MoE decode reads the k routed experts; prefill stays dense (measured)
    # backend 'neuron': None = ModelBuilder (prefill + decode keys); "trace" (TP=1 only) = the decode
    # graph alone, the prompt prefilled token by token (memory_plan.neuron_recipe)
    neuron_recipe: str | None = None
    # "bf16"/"fp32": full precision (the backend's dtype); "int8": weight-only int8 linears (quant.py)
    weights: str = "bf16"
    warmup: int = 1
    iters: int = 3
    seed: int | None = None  # None: the variant's `tiny_seed`
    results_dir: str | None = None
    cache_dir: str | None = None
    # the random-weights witness: None = on for smoke runs of a trained fixture, off otherwise
    witness: bool | None = None
    # a bundle folder written by `python -m gemma4lib export`: run its compiled graphs, never compile
    artifacts: str | None = None
    # drafting (`generation.drafters`): None = plain decode; "assistant" (Gemma-4's MTP assistant), "prompt_lookup"
    draft: str | None = None
    draft_tokens: int | None = None  # drafts per verify step (k); None with a draft: 4
    assistant_checkpoint: str | None = None  # full profile: hub id or folder; default the variant's own
    # MoE verify graph: None = routed experts gathered when that reads less than all (drafting.verify_expert_form)
    verify_experts: str | None = None
    # batch_size > 1: that many prompts of different lengths through one set of batched graphs
    # (the engine's rows). `prompts`/`expects`: one per row, at any batch size (fewer prompts than
    # batch_size leave spare rows); None = `prompt` in row 0, `generation.prompts.capital_questions` after.
    batch_size: int = 1
    prompts: tuple[str, ...] | None = None
    expects: tuple[str | None, ...] | None = None
    # images (file paths or PIL images) for row 0's prompt: the vision graph joins the port's graphs
    # (docs/IMAGES.md). With images, the default prompt becomes "What is in the image?", the default
    # expectation the colour and shape read from the pixels (`models.shapes.describe`), and the default
    # shapes (64-token bucket, 128 context) grow to hold the ~64 soft tokens an image takes: (128,), 192.
    images: tuple[Any, ...] = ()
    # load the model's vision part and compile its vision graph without an image of its own, so that
    # requests can bring theirs (the endpoint's `image_url` parts, `serve --vision`); `images` implies it
    vision: bool = False
    # 16 kHz WAV clips (paths, bytes) for row 0's prompt, the audio graph beside (docs/AUDIO.md); prompt: transcribe
    audio: tuple[Any, ...] = ()
    # the audio part and a 30 s audio graph without a clip, for requests' clips (`serve --hear`, docs/AUDIO.md)
    hears: bool = False
    # batch_size > 1: also compile each bucket's prefill at batch 1, over one row of the batch's K/V, so
    # that a request joining running rows alone (a server's usual case) pays one row's prefill, not the
    # batch's; `serve` turns it on where the backend can (cpu, eager at TP 1)
    row_prefill: bool = False
    # decode context buckets (NxD Inference's token-generation buckets), ascending, below context_length
    # (itself the implied last): decode, verify and a prefill from position 0 also compiled reading only
    # the first C K/V slots, run when every row ends before C (`device.build`). Empty: one context
    context_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        self.variant_spec = get_variant(self.variant)
        check_profile(self.profile)
        if not facts(self.backend).selectable:  # unknown: UnknownNameError naming the selectable ones
            raise UnknownNameError("backend", self.backend, selectable())
        if self.model not in MODEL_SOURCES:
            raise UnknownNameError("model source", self.model, MODEL_SOURCES)
        if self.decode_experts not in EXPERT_FORMS:
            raise UnknownNameError("decode_experts form", self.decode_experts, EXPERT_FORMS)
        if self.weights not in WEIGHT_FORMS:
            raise UnknownNameError("weights form", self.weights, WEIGHT_FORMS)
        for name, minimum in _COUNTS.items():
            setattr(self, name, whole_number(name, getattr(self, name), minimum))
        self._check_images()
        self._check_audio()
        buckets = _sizes(self.prefill_buckets)
        self.prefill_buckets = tuple(sorted(whole_number("prefill_buckets", b, 1) for b in buckets))
        if not self.prefill_buckets:
            raise SettingsError("prefill_buckets is empty; give at least one compiled prompt length, e.g. (64,)")
        if self.prefill_buckets[-1] > self.context_length:
            raise SettingsError(
                f"prefill bucket {self.prefill_buckets[-1]} is longer than context_length "
                f"{self.context_length}; use buckets <= context_length"
            )
        self._check_context_buckets()
        if self.seed is None:
            self.seed = self.variant_spec.tiny_seed
        self._check_batch()
        self._check_row_prefill()
        if self.tp_degree not in self.variant_spec.supported_tp:
            raise TensorParallelError(
                f"{self.variant_spec.name} cannot run at TP={self.tp_degree}: its head and expert counts split "
                f"evenly only for TP in {self.variant_spec.supported_tp}; pick one of those"
            )
        if self.tp_degree > 1 and not runs_tp(self.backend):
            raise TensorParallelError(
                f"TP={self.tp_degree} runs on backend {names_where(lambda f: f.tp_ranks is not None)} (one gloo "
                f"process per rank) or {names_where(lambda f: f.tp)} (NeuronCores); the {self.backend} lane "
                f"compiles one device: use tp_degree=1 there"
            )
        if self.weights == "int8" and not self.backend_row.int8:
            raise SettingsError(
                f"weights='int8' at tp_degree {self.tp_degree} runs on backend "
                f"{names_where(lambda f: f.int8 and f.tp)} only: the CPU gloo rank graph takes full-precision "
                f"weights; use tp_degree=1 on backend {self.backend!r}, or weights='bf16'"
            )
        self._check_draft()

    @property
    def backend_row(self) -> BackendFacts:
        """The facts row that runs these settings: the backend's own, or at TP > 1 the one it hands its
        ranks to (`backends.facts.row_at`: `cpu` at TP 2 runs on `gloo`)."""
        return row_at(self.backend, self.tp_degree)

    def _check_images(self) -> None:
        """Images: one prompt, on a backend whose row runs them (at TP 1, or on the rows that run TP);
        the defaults that only fit text grow to fit an image (field comment). Whether a NeuronCore is
        left for the vision graph is `backends.preflight`'s (it needs the host's instance)."""
        if isinstance(self.images, (str, bytes)) or not isinstance(self.images, (tuple, list)):
            self.images = (self.images,) if self.images is not None else ()
        self.images = tuple(self.images)
        if not isinstance(self.vision, bool):
            raise SettingsError(f"vision is true or false, got {self.vision!r}")
        row = self.backend_row
        if self.vision and not self.images:
            if not row.request_images or (self.tp_degree != 1 and not row.tp):
                raise SettingsError(
                    f"vision=True (images per request) runs on backend {names_where(lambda f: f.request_images)} "
                    f"at tp_degree 1 (backend {names_where(lambda f: f.request_images and f.tp)} at its TP degree) "
                    f"so far, not backend {self.backend!r} at tp_degree {self.tp_degree} (docs/IMAGES.md)"
                )
            self.check_image_blocks()
            return
        if not self.images:
            return
        if self.prompt == DEFAULT_PROMPT:
            from .models.shapes import QUESTION

            self.prompt = QUESTION
            if self.expect == "Paris":
                self.expect = None  # read from the image instead (port.image_expectation)
        if tuple(_as_tuple(self.prefill_buckets)) == (64,) and self.context_length == 128:
            self.prefill_buckets, self.context_length = (128,), 192
        unsupported = [
            what
            for what, bad in (
                (f"batch_size {self.batch_size}", self.batch_size != 1 or self.prompts is not None),
                (f"backend {self.backend!r}", not row.images),
            )
            if bad
        ]
        if unsupported:
            raise SettingsError(
                f"images run with one prompt, on backend {names_where(lambda f: f.images)} at tp_degree 1 and on "
                f"the gloo ranks at tp_degree > 1 (backend "
                f"{names_where(lambda f: f.tp_ranks is not None and facts(f.tp_ranks).images)}; "
                f"{names_where(lambda f: f.tp and f.images)} at its TP degree) so far; not with "
                f"{', '.join(unsupported)} (docs/IMAGES.md says what is not reached yet)"
            )
        self.check_image_blocks()

    def _check_audio(self) -> None:
        """Audio is refused before loading on the 31B and 26B-A4B (no audio tower in their configs) and where
        the running row has no audio graph; one prompt; the defaults change as the field comment says."""
        if isinstance(self.audio, (str, bytes)) or not isinstance(self.audio, (tuple, list)):
            self.audio = (self.audio,) if self.audio is not None else ()
        self.audio = tuple(self.audio)
        if not self.wants_audio:
            return
        from .models.audio import HEARING_VARIANTS, TRANSCRIBE

        name, hearing = self.variant_spec.name, ", ".join(HEARING_VARIANTS)
        if name not in HEARING_VARIANTS:
            raise SettingsError(f"the {name} does not hear (no audio tower in its config): pick {hearing} for audio")
        if not self.backend_row.audio or (self.audio and (self.batch_size != 1 or self.prompts is not None)):
            raise SettingsError(
                f"audio runs with one prompt on backend {names_where(lambda f: f.audio)} (cpu and eager at TP > 1 on "
                "the gloo ranks) so far, "
                f"not batch_size {self.batch_size} on backend {self.backend!r} at tp_degree {self.tp_degree} "
                f"(docs/AUDIO.md says what is not reached yet)"
            )
        if not self.audio:
            return
        if self.prompt == DEFAULT_PROMPT:
            self.prompt = TRANSCRIBE
            if self.expect == "Paris":
                self.expect = None  # the shipped clip's words instead (port.audio_expectation)
        if tuple(_as_tuple(self.prefill_buckets)) == (64,) and self.context_length == 128:
            self.prefill_buckets, self.context_length = (128,), 192

    def check_image_blocks(self, bidirectional: bool | None = None) -> None:
        """An image's tokens see each other where the config asks (the 12B; its prefill graphs take
        the image blocks, `DeviceGraph.image_blocks`): built where the running row says
        (`image_blocks`: the single-device graphs at TP 1), refused elsewhere. Before loading, the
        variant decides (`bidirectional` None: the 12B); once a model is loaded, the port asks again
        with its config (`models.image_attention.bidirectional_images`), so another variant's config
        that asks for the blocks is refused too instead of running causal."""
        if not self.wants_vision:
            return
        bidirectional = self.variant_spec.unified if bidirectional is None else bidirectional
        if bidirectional and not self.backend_row.image_blocks:
            raise SettingsError(
                f"the {self.variant_spec.name}'s images need its bidirectional image mask in the prefill graphs, "
                f"built on backend {names_where(lambda f: f.image_blocks)} at tp_degree 1 so far, not on backend "
                f"{self.backend!r} at tp_degree {self.tp_degree}; use one of those (docs/IMAGES.md)"
            )

    def _check_draft(self) -> None:
        """k >= 1, and only with a drafter; what the running row drafts with: refused here, before
        anything loads (the inf2 recipe that cannot draft: `backends.preflight`)."""
        if self.draft is None:
            if self.draft_tokens is not None:
                raise SettingsError(
                    f"draft_tokens={self.draft_tokens!r} needs a drafter: pass draft='assistant' "
                    f"(CLI --draft assistant), or leave draft_tokens unset"
                )
            if self.verify_experts is not None:
                raise SettingsError(
                    f"verify_experts={self.verify_experts!r} sets the verify graph's MoE expert form, which only "
                    f"drafting builds: pass draft='assistant' too, or leave verify_experts unset"
                )
            return
        if self.draft not in DRAFT_KINDS:
            raise UnknownNameError("draft", self.draft, DRAFT_KINDS)
        if self.verify_experts not in (None, *EXPERT_FORMS):
            raise UnknownNameError("verify_experts form", self.verify_experts, EXPERT_FORMS)
        self.draft_tokens = whole_number("draft_tokens", 4 if self.draft_tokens is None else self.draft_tokens, 1)
        row = self.backend_row
        if self.verify_experts is not None and row.rank_graphs:
            raise SettingsError(
                f"verify_experts={self.verify_experts!r} chooses the expert form of the single-device verify "
                f"graph; the rank graphs (tp_degree {self.tp_degree}, backend {self.backend!r}) verify with "
                f"the dense experts: leave verify_experts unset there"
            )
        if row.assistant_drafts_only and self.draft != "assistant":
            raise SettingsError(
                f"draft={self.draft!r} on backend {self.backend!r}: the ModelBuilder drafting keys are built for "
                f"Gemma-4's assistant; use draft='assistant', or a CPU backend for {self.draft!r}"
            )

    def _check_batch(self) -> None:
        """The batch's prompts: at most `batch_size`, none empty, one expectation per prompt."""
        if self.prompts is not None:
            self.prompts = _as_tuple(self.prompts)
            if len(self.prompts) > self.batch_size:
                raise BatchTooLargeError(
                    f"{len(self.prompts)} prompts for batch_size {self.batch_size}; pass at most "
                    f"{self.batch_size} prompts or raise batch_size to {len(self.prompts)}"
                )
            for i, prompt in enumerate(self.prompts):
                if not isinstance(prompt, str) or not prompt.strip():
                    raise BadPromptError(f"prompt {i} of the batch is empty or not text ({prompt!r}); pass a question")
        if self.expects is not None:
            self.expects = _as_tuple(self.expects)
            rows = len(self.prompts) if self.prompts is not None else self.batch_size
            if len(self.expects) != rows:
                raise SettingsError(f"{len(self.expects)} expects for {rows} prompts; give one per prompt (None: none)")

    def _check_context_buckets(self) -> None:
        sizes = tuple(whole_number("context_buckets", c, 1) for c in _sizes(self.context_buckets))
        if list(sizes) != sorted(set(sizes)) or (sizes and sizes[-1] > self.context_length):
            raise SettingsError(
                f"context_buckets {sizes} must ascend without repeats, each at most context_length "
                f"{self.context_length} (the context is always the last bucket); e.g. ({self.context_length // 4}, "
                f"{self.context_length // 2})"
            )
        self.context_buckets = tuple(c for c in sizes if c < self.context_length)

    def _check_row_prefill(self) -> None:
        words = {"true": True, "1": True, "false": False, "0": False}  # `serve run ... row_prefill=true`
        if isinstance(self.row_prefill, str) and self.row_prefill.strip().lower() in words:
            self.row_prefill = words[self.row_prefill.strip().lower()]
        if not isinstance(self.row_prefill, bool):
            raise SettingsError(f"row_prefill must be True or False, got {self.row_prefill!r}")
        if self.row_prefill and not runs_row_prefill(self.backend, self.tp_degree):
            raise SettingsError(
                f"row_prefill runs one-row prefill graphs (backend {names_where(lambda f: f.row_prefill)}; not at "
                f"tp_degree > 1 on CPU ranks); backend {self.backend!r} at tp_degree {self.tp_degree} has none: use "
                f"row_prefill=False there (joins use the batch-shaped prefill; README, serving)"
            )

    @property
    def builds_row_prefill(self) -> bool:
        """Whether the one-row prefill graphs are built: asked for, and a batch for a row to join."""
        return self.row_prefill and self.batch_size > 1

    @property
    def builds_decode_ids(self) -> bool:
        """Whether the decode that returns token ids is built beside decode: where the backend's row
        says the logits would cross a bus (`BackendFacts.chooses_on_device`)."""
        return row_at(self.backend, self.tp_degree).chooses_on_device

    def batch_rows(self) -> tuple[tuple[str, str | None], ...]:
        """The (prompt, expected answer) rows: `prompts`/`expects` when given (any batch size); else
        `prompt`/`expect` in row 0 and capital questions in the other rows of the batch."""
        from .generation.prompts import capital_questions

        if self.prompts is None:
            return ((self.prompt, self.expect), *capital_questions(self.batch_size)[1:])
        expects = self.expects if self.expects is not None else (None,) * len(self.prompts)
        return tuple(zip(self.prompts, expects, strict=True))

    @property
    def model_source(self) -> str:
        if self.model != "auto":
            return self.model
        if self.profile == "full":
            return "checkpoint"
        from .models.fixture_paths import fixture_available

        return "trained" if fixture_available(self.variant_spec.name) else "random"

    @property
    def wants_vision(self) -> bool:
        """Whether the model's vision part is loaded and its vision graph compiled."""
        return bool(self.images) or self.vision

    @property
    def wants_audio(self) -> bool:
        """Whether the model's audio part is loaded and its audio graph compiled (clips, or a server that hears)."""
        return bool(self.audio) or self.hears

    @property
    def wants_witness(self) -> bool:
        """Whether `port` also runs the random-weights witness (None: for smoke + trained)."""
        if self.witness is not None:
            return bool(self.witness)
        return self.profile == "smoke" and self.model_source == "trained"

    def parameters(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "variant_spec"}
        out["images"] = [
            i if isinstance(i, str) else str(i) if hasattr(i, "__fspath__") else repr(i) for i in self.images
        ]
        out["audio"] = [str(a) if isinstance(a, (str, Path)) else f"<{type(a).__name__}>" for a in self.audio]
        out["model_source"] = self.model_source
        return out
