"""The image prefill ceiling on inf2, computed: the vision graph's FLOPs and bytes, its floor on one
NeuronCore, and what the image's soft tokens add to the decoder's prefill.

An image prompt costs two things before its first token: the vision graph (once per image, at
admission; its own compiled graph on one core, no TP, `vision_plan.PLACEMENT`) and a longer
decoder prefill (the image's `soft_tokens` plus its two marker tokens, `vision_plan.IMAGE_MARKERS`).
Both floors are computed as `prefill.prefill_estimate` computes the text one: matmul FLOPs at the
chip's datasheet bf16 peak (`hardware.BF16_FLOPS_PER_CORE`: AWS's 190 TFLOPS per chip over its 2
cores) and the weights read once at one core's share of the HBM bandwidth, whichever takes longer.
The vision part's shapes are **computed from transformers 5.23.0 config defaults, unverified
against the released config.json** (`vision_plan.SOURCE`); the whole is unverified on inf2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, GB, INSTANCES
from gemma4lib.inf2.vision_plan import (
    IMAGE_MARKERS,
    SOURCE,
    VisionSpec,
    vision_modules,
    vision_plan,
    vision_spec,
)
from gemma4lib.models.variants import REPORTED_VISION as REPORTED
from gemma4lib.models.variants import VARIANTS, get_variant

from .prefill import prefill_estimate


def _linear_weights(module: nn.Module | None) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)) if module is not None else 0


def vision_flops(config: Any, text_hidden: int, patches: int, soft_tokens: int) -> float:
    """FLOPs of one vision-graph call (one image) as the graph computes them, from transformers' own
    modules for `config` (meta device):

    - encoder variants: 2 per weight per patch for the patch projection and every encoder linear
      (q, k, v, o and the gated MLP); each layer's attention over all patches, 4 x P^2 x heads x
      head_dim (QK^T and AV; the encoder is bidirectional, every patch attends to every patch); the
      pooler's average as the one-hot matmul it is, 2 x P x soft x width; the embedder's projection
      for every soft token;
    - the 12B (encoder-free): 2 per weight per merged patch for its dense projection and for the
      embedder's, one of each per soft token (its "single projection").

    Norms, RoPE, the position lookups and the activation functions are left out (elementwise)."""
    modules = vision_modules(config, text_hidden)
    tower = getattr(modules, "vision_tower", None)
    if tower is None:
        return 2.0 * patches * (_linear_weights(modules.patch_dense) + _linear_weights(modules.multimodal_embedder))
    layers = int(config.num_hidden_layers)
    heads, head_dim = int(config.num_attention_heads), int(config.head_dim)
    per_patch = _linear_weights(tower.patch_embedder) + _linear_weights(tower.encoder)
    attention = 4.0 * patches * patches * heads * head_dim * layers
    pooler = 2.0 * patches * soft_tokens * int(config.hidden_size)
    embed = 2.0 * soft_tokens * _linear_weights(modules.embed_vision)
    return 2.0 * patches * per_patch + attention + pooler + embed


def spec_flops(spec: VisionSpec) -> float:
    return vision_flops(spec.config, spec.text_hidden, spec.patches, spec.soft_tokens)


@dataclass
class ImagePrefillEstimate:
    """The floor of an image prompt's prefill on inf2 (computed, never measured): the vision graph
    on one core, then the decoder prefill over the text and the image's tokens at the recipe's TP."""

    variant: str
    instance: str
    tp: int
    patches: int
    soft_tokens: int
    text_tokens: int
    vision_flops: float
    vision_bytes: float
    vision_compute_ms: float
    vision_memory_ms: float
    text_prefill_ms: float  # the decoder prefill of the text tokens alone
    image_prefill_ms: float  # the decoder prefill of text + soft tokens + markers
    source: str = SOURCE

    @property
    def vision_ms(self) -> float:
        return max(self.vision_compute_ms, self.vision_memory_ms)

    @property
    def vision_bound(self) -> str:
        return "compute" if self.vision_compute_ms >= self.vision_memory_ms else "memory"

    @property
    def added_tokens(self) -> int:
        return self.soft_tokens + IMAGE_MARKERS

    @property
    def added_prefill_ms(self) -> float:
        return self.image_prefill_ms - self.text_prefill_ms

    @property
    def total_ms(self) -> float:
        """Vision graph, then the decoder prefill with the image: the floor before the first token."""
        return self.vision_ms + self.image_prefill_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "vision_ms": self.vision_ms,
            "vision_bound": self.vision_bound,
            "added_tokens": self.added_tokens,
            "added_prefill_ms": self.added_prefill_ms,
            "total_ms": self.total_ms,
            "placement": "one NeuronCore, no TP",
        }


def image_prefill_estimate(
    variant: Any,
    text_tokens: int = 32,
    *,
    source: str = "defaults",
    context_length: int = 2048,
    dtype_bytes: int = 2,
) -> ImagePrefillEstimate:
    """`ImagePrefillEstimate` of one image at the processor's budget in a prompt of `text_tokens`
    other tokens, at the variant's recipe TP and instance (`prefill.prefill_estimate` for the decoder)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    spec = vision_spec(v, source)
    inst = INSTANCES[v.instance_type]
    flops = spec_flops(spec)
    weights = vision_plan(v, source, dtype_bytes).weights_gib * 2**30
    text = prefill_estimate(v, text_tokens, context_length=context_length, dtype_bytes=dtype_bytes)
    image = prefill_estimate(
        v, text_tokens + spec.soft_tokens + IMAGE_MARKERS, context_length=context_length, dtype_bytes=dtype_bytes
    )
    return ImagePrefillEstimate(
        v.name,
        inst.name,
        text.tp,
        spec.patches,
        spec.soft_tokens,
        int(text_tokens),
        flops,
        weights,
        flops / BF16_FLOPS_PER_CORE * 1e3,
        weights / inst.bandwidth_bytes_s(1) * 1e3,
        text.expected_ms,
        image.expected_ms,
        spec.source,
    )


def image_prefill_table(text_tokens: int = 32, source: str = "defaults") -> list[dict[str, Any]]:
    """`image_prefill_estimate` of every variant (with `source="reported"`: those a report exists for)."""
    names = [n for n in VARIANTS if source == "defaults" or n in REPORTED]
    return [image_prefill_estimate(n, text_tokens, source=source).to_dict() for n in names]


def format_image_prefill_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `image_prefill_table` rows."""
    lines = [
        "| variant | recipe | patches -> soft tokens | vision TFLOP | vision GB read | vision ms (one core) | "
        "text prefill ms | with the image ms | added tokens / ms | image floor ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['instance']} TP={r['tp']} | {r['patches']:,} -> {r['soft_tokens']} | "
            f"{r['vision_flops'] / 1e12:.2f} | {r['vision_bytes'] / GB:.2f} | {r['vision_ms']:.1f} "
            f"({r['vision_bound']}) | {r['text_prefill_ms']:.1f} | {r['image_prefill_ms']:.1f} | "
            f"+{r['added_tokens']} / +{r['added_prefill_ms']:.1f} | {r['total_ms']:.1f} |"
        )
    return "\n".join(lines)
