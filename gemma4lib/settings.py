"""The settings of one port: every value a run depends on, checked before anything is loaded.

Plain values, so a notebook's parameters cell and the command line map onto them. The checks that
can be made from the values alone happen here (names, ranges, TP degree, inf2's limits and the
Neuron SDK for `backend="neuron"`), so a mistake fails in a second, not after a checkpoint load or
half an hour of compiling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .backends.registry import selectable
from .device.experts import EXPERT_FORMS
from .device.quant import WEIGHT_FORMS
from .errors import SettingsError, TensorParallelError, UnknownNameError
from .models.variants import check_profile, get_variant

BACKENDS = selectable()  # the backends this library ships (a test may register another: checks read `selectable()`)
MODEL_SOURCES = ("auto", "trained", "random", "checkpoint")
# what proposes drafts (`generation.drafters`): Gemma-4's own assistant, or n-gram prompt lookup
DRAFT_KINDS = ("assistant", "prompt_lookup")
DEFAULT_PROMPT = "What is the capital of France?"
# where an image prompt runs and is checked today (docs/IMAGES.md): at TP 1 on these backends; at
# TP > 1 on the gloo ranks (backend "cpu"/"eager" with tp_degree > 1), the vision graph replicated;
# on "neuron" at the decoder's TP degree, the vision graph on one NeuronCore of its own after the
# decoder's (`recipes.neuron_vision`; built, not run: no inf2 here)
IMAGE_BACKENDS = ("cpu", "eager", "xla", "neuron")


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
    # batch_size > 1: also compile each bucket's prefill at batch 1, over one row of the batch's K/V, so
    # that a request joining running rows alone (a server's usual case) pays one row's prefill, not the
    # batch's; `serve` turns it on where the backend can (cpu, eager at TP 1)
    row_prefill: bool = False

    def __post_init__(self):
        self.variant_spec = get_variant(self.variant)
        self._check_images()
        check_profile(self.profile)
        if self.backend not in selectable():
            raise UnknownNameError("backend", self.backend, selectable())
        if self.model not in MODEL_SOURCES:
            raise UnknownNameError("model source", self.model, MODEL_SOURCES)
        if self.decode_experts not in EXPERT_FORMS:
            raise UnknownNameError("decode_experts form", self.decode_experts, EXPERT_FORMS)
        if self.weights not in WEIGHT_FORMS:
            raise UnknownNameError("weights form", self.weights, WEIGHT_FORMS)
        for name, minimum in _COUNTS.items():
            setattr(self, name, whole_number(name, getattr(self, name), minimum))
        buckets = _as_tuple(self.prefill_buckets)
        self.prefill_buckets = tuple(sorted(whole_number("prefill_buckets", b, 1) for b in buckets))
        if not self.prefill_buckets:
            raise SettingsError("prefill_buckets is empty; give at least one compiled prompt length, e.g. (64,)")
        if self.prefill_buckets[-1] > self.context_length:
            raise SettingsError(
                f"prefill bucket {self.prefill_buckets[-1]} is longer than context_length "
                f"{self.context_length}; use buckets <= context_length"
            )
        if self.seed is None:
            self.seed = self.variant_spec.tiny_seed
        self._check_batch()
        self._check_row_prefill()
        if self.tp_degree not in self.variant_spec.supported_tp:
            raise TensorParallelError(
                f"{self.variant_spec.name} cannot run at TP={self.tp_degree}: its head and expert counts split "
                f"evenly only for TP in {self.variant_spec.supported_tp}; pick one of those"
            )
        if self.tp_degree > 1 and self.backend == "xla":
            raise TensorParallelError(
                f"TP={self.tp_degree} runs on backend 'cpu' or 'eager' (one gloo process per rank) or 'neuron' "
                f"(NeuronCores); the xla lane compiles one device: use tp_degree=1 there"
            )
        if self.neuron_recipe is not None or self.backend == "neuron":
            from .inf2.memory_plan import neuron_recipe

            neuron_recipe(self.variant_spec, self.tp_degree, self.neuron_recipe)  # unknown name, or trace at TP > 1
        if self.weights == "int8":
            self._check_int8()
        self._check_draft()  # before the SDK check: a recipe that cannot draft is refused anywhere
        if self.backend == "neuron":
            self._check_neuron()
        if self.artifacts:
            from .cache.bundle import check_settings

            check_settings(self)  # shapes, formats, versions, machine: before anything loads

    def _check_images(self) -> None:
        """Images: one prompt, on cpu/eager/xla at TP 1 or the gloo ranks at TP > 1 (what runs and is
        checked here), or on neuron at its TP degree with a NeuronCore left for the vision graph (built,
        not run here); the defaults that only fit text grow to fit an image (field comment)."""
        if isinstance(self.images, (str, bytes)) or not isinstance(self.images, (tuple, list)):
            self.images = (self.images,) if self.images is not None else ()
        self.images = tuple(self.images)
        if not isinstance(self.vision, bool):
            raise SettingsError(f"vision is true or false, got {self.vision!r}")
        if self.vision and not self.images:
            if self.backend not in IMAGE_BACKENDS or (int(self.tp_degree) != 1 and self.backend != "neuron"):
                raise SettingsError(
                    f"vision=True (images per request) runs on backend {', '.join(map(repr, IMAGE_BACKENDS))} at "
                    f"tp_degree 1 (backend 'neuron' at its TP degree) so far, not backend {self.backend!r} at "
                    f"tp_degree {self.tp_degree} (docs/IMAGES.md)"
                )
            self._check_image_blocks()
            self._check_vision_core()
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
                (f"batch_size {self.batch_size}", int(self.batch_size) != 1 or self.prompts is not None),
                (f"backend {self.backend!r}", self.backend not in IMAGE_BACKENDS),
            )
            if bad
        ]
        if unsupported:
            raise SettingsError(
                f"images run with one prompt, on backend "
                f"{', '.join(map(repr, IMAGE_BACKENDS))} at tp_degree 1 and on the gloo ranks at tp_degree > 1 "
                f"(backend 'cpu' or 'eager'; 'neuron' at its TP degree) so far; not with {', '.join(unsupported)} "
                f"(docs/IMAGES.md says what is not reached yet)"
            )
        self._check_image_blocks()
        self._check_vision_core()

    def _check_image_blocks(self, bidirectional: bool | None = None) -> None:
        """An image's tokens see each other where the config asks (the 12B; its prefill graphs take
        the image blocks, `DeviceGraph.image_blocks`): built for the cpu, eager and xla graphs at TP 1;
        the gloo rank graphs and the neuron decoder keys do not take them yet, so images there are
        refused. Before loading, the variant decides (`bidirectional` None: the 12B); once a model is
        loaded, `check_loaded_images` asks again with its config, so another variant's config that
        asks for the blocks is refused too instead of running causal."""
        bidirectional = self.variant_spec.unified if bidirectional is None else bidirectional
        if bidirectional and (int(self.tp_degree) > 1 or self.backend == "neuron"):
            raise SettingsError(
                f"the {self.variant_spec.name}'s images need its bidirectional image mask in the prefill graphs, "
                f"built on backend 'cpu', 'eager' and 'xla' at tp_degree 1 so far, not on backend {self.backend!r} "
                f"at tp_degree {self.tp_degree}; use one of those (docs/IMAGES.md)"
            )

    def check_loaded_images(self, config: Any) -> None:
        """`_check_image_blocks` with the loaded model's own config (module docstring of
        `models.image_attention`), for settings that load a vision part."""
        if self.wants_vision:
            from .models.image_attention import bidirectional_images

            self._check_image_blocks(bidirectional_images(config))

    def _check_vision_core(self) -> None:
        """Backend neuron: the vision graph loads onto the NeuronCore after the decoder's `tp_degree`
        cores (`recipes.neuron_vision.vision_core`), so the instance needs one more core than the TP
        degree. Sharing a decoder core would put a second model in that core's HBM beside a rank that
        was sized to fill it (`inf2.memory_plan`), so it is refused here, before anything loads. An
        unknown host (not inf2, no `GEMMA4LIB_INSTANCE_TYPE`) is not judged."""
        if self.backend != "neuron":
            return
        from .inf2.hardware import INSTANCES, host_instance_type
        from .recipes.neuron_vision import cores_needed

        instance = INSTANCES.get(host_instance_type() or "")
        if instance is not None and cores_needed(self.tp_degree, True) > instance.neuron_cores:
            bigger = [i.name for i in INSTANCES.values() if i.neuron_cores > int(self.tp_degree)]
            raise SettingsError(
                f"images on backend 'neuron' put the vision graph on a NeuronCore of its own after the decoder's "
                f"{self.tp_degree}; {instance.name} has {instance.neuron_cores} cores, none left over. Use a smaller "
                f"tp_degree, or {' or '.join(bigger) if bigger else 'no image'} for tp_degree {self.tp_degree}"
            )

    def _check_draft(self) -> None:
        """k >= 1, and only with a drafter; where drafting runs: refused here, before anything loads."""
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
        rank_graphs = self.tp_degree > 1 or self.backend == "neuron"
        if self.verify_experts is not None and rank_graphs:
            raise SettingsError(
                f"verify_experts={self.verify_experts!r} chooses the expert form of the single-device verify "
                f"graph; the rank graphs (tp_degree {self.tp_degree}, backend {self.backend!r}) verify with "
                f"the dense experts: leave verify_experts unset there"
            )
        if self.backend == "neuron":
            from .inf2.memory_plan import neuron_recipe

            if neuron_recipe(self.variant_spec, self.tp_degree, self.neuron_recipe) == "trace":
                raise SettingsError(
                    f"draft={self.draft!r} needs the verify and prefill graphs over one set of device K/V "
                    "states; the one-graph trace recipe has a single decode graph: use the ModelBuilder recipe "
                    "(neuron_recipe=None) or draft=None"
                )
            if self.draft != "assistant":
                raise SettingsError(
                    f"draft={self.draft!r} on backend 'neuron': the ModelBuilder drafting keys are built for "
                    f"Gemma-4's assistant; use draft='assistant', or a CPU backend for {self.draft!r}"
                )

    def _check_batch(self) -> None:
        """The batch's prompts: at most `batch_size`, none empty, one expectation per prompt."""
        from .errors import BadPromptError, BatchTooLargeError

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

    def _check_row_prefill(self) -> None:
        words = {"true": True, "1": True, "false": False, "0": False}  # `serve run ... row_prefill=true`
        if isinstance(self.row_prefill, str) and self.row_prefill.strip().lower() in words:
            self.row_prefill = words[self.row_prefill.strip().lower()]
        if not isinstance(self.row_prefill, bool):
            raise SettingsError(f"row_prefill must be True or False, got {self.row_prefill!r}")
        if not self.row_prefill:
            return
        from .backends.registry import get_backend

        if not get_backend(self.backend).row_prefill or self.tp_degree > 1:
            raise SettingsError(
                f"row_prefill runs one-row prefill graphs over one row of host K/V buffers (backend 'cpu' or "
                f"'eager' at tp_degree 1); backend {self.backend!r} at tp_degree {self.tp_degree} holds its K/V "
                f"as device state that a graph takes whole: use row_prefill=False there (joins use the "
                f"batch-shaped prefill; README, serving)"
            )

    def batch_rows(self) -> tuple[tuple[str, str | None], ...]:
        """The (prompt, expected answer) rows: `prompts`/`expects` when given (any batch size); else
        `prompt`/`expect` in row 0 and capital questions in the other rows of the batch."""
        from .generation.prompts import capital_questions

        if self.prompts is None:
            return ((self.prompt, self.expect), *capital_questions(self.batch_size)[1:])
        expects = self.expects if self.expects is not None else (None,) * len(self.prompts)
        return tuple(zip(self.prompts, expects, strict=True))

    def _check_int8(self) -> None:
        """Where weight-only int8 is built: the single-device graph (cpu, eager, xla at TP=1) and
        the Neuron ModelBuilder recipe (NxD's quantized layers); not the CPU gloo rank graph, nor
        the one-graph trace recipe."""
        if self.backend == "neuron":
            from .inf2.memory_plan import neuron_recipe

            recipe = neuron_recipe(self.variant_spec, self.tp_degree, self.neuron_recipe)
            if recipe != "model_builder":
                raise SettingsError(
                    f"weights='int8' on backend 'neuron' uses the ModelBuilder recipe (NxD's quantized layers); "
                    f"{self.variant_spec.name} at TP={self.tp_degree} compiles with {recipe!r}: drop "
                    f"neuron_recipe={self.neuron_recipe!r} (ModelBuilder is the default), or use weights='bf16'"
                )
        elif self.tp_degree > 1:
            raise SettingsError(
                f"weights='int8' at tp_degree {self.tp_degree} runs on backend 'neuron' only: the CPU gloo rank "
                f"graph takes full-precision weights; use tp_degree=1 on backend {self.backend!r}, or weights='bf16'"
            )

    def _check_neuron(self) -> None:
        """Before anything is loaded: the TP degree, the cores' and the serving host's memory fit inf2,
        and the SDK is here."""
        from .inf2.hardware import host_instance_type
        from .inf2.memory_plan import require_fit, require_neuron_tp
        from .recipes import neuron_env

        instance = host_instance_type()
        if self.profile == "full":  # the released model: weights + K/V must fit each core
            require_fit(
                self.variant_spec,
                self.tp_degree,
                instance=instance,
                context_length=self.context_length,
                ring=self.ring_kv,
                recipe=self.neuron_recipe,
                weights=self.weights,
                batch=self.batch_size,
                draft_tokens=self.draft_tokens if self.draft else None,
            )
            from .inf2.serving_host import require_serving_host

            require_serving_host(  # the host that serves and checks: model, shards, reference, spread
                self.variant_spec,
                self.tp_degree,
                instance,
                context_length=self.context_length,
                ring=self.ring_kv,
                prompt_tokens=self.prefill_buckets[-1],
                new_tokens=self.max_new_tokens,
                weights=self.weights,
            )
        else:  # tiny models fit anywhere; the degree must still be one inf2 can run
            require_neuron_tp(self.variant_spec, self.tp_degree, instance)
        neuron_env.require_sdk(f"backend 'neuron' ({self.variant_spec.name})")

    @property
    def model_source(self) -> str:
        if self.model != "auto":
            return self.model
        if self.profile == "full":
            return "checkpoint"
        from .models.trained import fixture_available

        return "trained" if fixture_available(self.variant_spec.name) else "random"

    @property
    def wants_vision(self) -> bool:
        """Whether the model's vision part is loaded and its vision graph compiled."""
        return bool(self.images) or self.vision

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
        out["model_source"] = self.model_source
        return out
