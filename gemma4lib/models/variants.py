"""The five Gemma-4 variants: released text-config values, the inf2 recipe each needs, and a
tiny configuration per variant that keeps every architectural feature for CPU tests.

The real values are the released configs' (each hub id's `config.json`); the tiny ones are ours,
chosen so every feature is exercised: PLE, KV sharing with both producer types, the double-wide MLP
on shared layers, k_eq_v with its own global KV-head count and head_dim, a sliding window shorter
than the test prompt, the final softcap, and for the MoE the parallel dense MLP with >= 8 experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UnknownNameError

SOFTCAP = 30.0
VOCAB_SIZE = 262_144


@dataclass(frozen=True)
class FieldReportFigures:
    """What the field report (the earlier inf2 port this cookbook builds on; README, "The family
    at a glance") measured on inf2 for this variant, for comparison only. No copy of the report
    ships in the repository: these figures are its record here."""

    decode_tok_s: float | None = None
    prefill_ms: float | None = None
    recipe: str | None = None  # the recipe the field report measured with, where it is not ModelBuilder


@dataclass(frozen=True)
class Variant:
    """One member of the family: identity, real text config, and the recipe that ports it."""

    name: str
    hf_id: str
    model_class: str
    recipe: str  # the default inf2 recipe at the variant's TP degree (`memory_plan.neuron_recipe`)
    tp_degree: int
    instance_type: str
    real_config: dict[str, Any]
    tiny_config: dict[str, Any]
    field_report: FieldReportFigures
    supported_tp: tuple[int, ...]
    # Seed of the tiny random model and its prompt: chosen so the 32-token greedy reference has
    # >= 10 distinct tokens and a top-1/top-2 logit margin >= 0.019 at every step (a near-tie
    # would let fp32 rounding, not the port, decide the comparison). See scripts/pick_tiny_seeds.py.
    tiny_seed: int
    # The witness's seed with an image (None: `tiny_seed`): the random multimodal model and the image
    # prompt's random ids give other margins. The 26B-A4B's tiny_seed 22 came within 2.4e-6 of a tie
    # at token 20 of the red-circle witness (fp32 rounding, not the port, flipped it); 3 keeps >= 4.5e-3.
    image_witness_seed: int | None = None
    # On inf2 the 12B's sliding window overflows the fused-attention SBUF: force eager attention.
    attn_implementation: str = "eager"
    released_context: int = 131_072  # the released maximum context (model cards; the 12B's config default)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Its notebook in notebooks/ (papermill_runs and the notebook tests read it from here); its
    # two-digit prefix is also a name `get_variant` accepts.
    notebook: str = ""
    aliases: tuple[str, ...] = ()  # other names `get_variant` (and `papermill_runs --variant`) accept
    # The real-width layer plan (`models.real_width`): the released widths, a few layers.
    real_width_layers: dict[str, Any] = field(default_factory=dict)
    # Rank graphs the HLO byte audit lowers (`tools.hlo_audit`): (TP degree, expert form, expert split).
    audit_tp: tuple[tuple[int, str, str | None], ...] = ()

    @property
    def is_moe(self) -> bool:
        return bool(self.real_config.get("enable_moe_block"))

    @property
    def expert_forms(self) -> tuple[str, ...]:
        """The decode expert forms a port can pick (`PortSettings.decode_experts`): MoE has two."""
        return ("dense", "selective") if self.is_moe else ("dense",)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the variant answers to: its own, its aliases, its notebook's number."""
        return (self.name, *self.aliases, *((self.notebook[:2],) if self.notebook else ()))

    @property
    def unified(self) -> bool:
        return self.model_class.startswith("Gemma4Unified")


_S, _F = "sliding_attention", "full_attention"


def sliding_pattern(sliding_per_full: int, n_layers: int) -> list[str]:
    """`sliding_per_full` sliding layers then one full layer, repeated; the last layer is full."""
    period = sliding_per_full + 1
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


# The fixture tokenizer's size (gemma4lib/fixtures/tokenizer): random and trained tiny models of a
# variant then have one architecture, so one compiled graph serves both (weights load at run time).
TINY_VOCAB = 810

# Shared tiny dimensions: small enough to compile in seconds, large enough that random weights
# (initializer_range 0.1) give varied greedy sequences.
_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    vocab_size=TINY_VOCAB,
    final_logit_softcapping=SOFTCAP,
    initializer_range=0.1,
    max_position_embeddings=4096,
)

# what the released 12B, 31B and 26B-A4B share: head widths; no per-layer inputs, no KV sharing, K = V globally
_REAL_COMMON = dict(head_dim=256, global_head_dim=512)
_NO_PLE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True)

VARIANTS: dict[str, Variant] = {
    "e2b": Variant(
        name="e2b",
        hf_id="google/gemma-4-E2B-it",
        model_class="Gemma4ForConditionalGeneration",
        recipe="model_builder",
        tp_degree=1,
        instance_type="inf2.xlarge",
        real_config=dict(
            _REAL_COMMON,
            hidden_size=1536,
            num_hidden_layers=35,
            num_attention_heads=8,
            num_key_value_heads=1,
            num_global_key_value_heads=1,
            intermediate_size=6144,
            use_double_wide_mlp=True,
            attention_k_eq_v=False,
            sliding_window=512,
            hidden_size_per_layer_input=256,
            num_kv_shared_layers=20,
            layer_types=sliding_pattern(4, 35),
            params_text_b=4.63,
            ple_table_b=2.35,
        ),
        tiny_config=dict(
            _TINY_COMMON,
            num_hidden_layers=10,
            layer_types=sliding_pattern(4, 10),
            num_attention_heads=4,
            num_key_value_heads=1,
            hidden_size_per_layer_input=16,
            num_kv_shared_layers=4,
            use_double_wide_mlp=True,
            attention_k_eq_v=False,
        ),
        field_report=FieldReportFigures(decode_tok_s=44.0, recipe="torch_neuronx.trace"),
        supported_tp=(1, 2),
        tiny_seed=10,
        notes=("PLE table stays on the host", "20 of 35 layers reuse K/V of layers 13 and 14"),
        notebook="01_e2b.ipynb",
        real_width_layers=dict(num_hidden_layers=7, layer_types=[_S, _S, _S, _S, _F, _S, _F], num_kv_shared_layers=2),
    ),
    "e4b": Variant(
        name="e4b",
        hf_id="google/gemma-4-E4B-it",
        model_class="Gemma4ForConditionalGeneration",
        recipe="model_builder",
        tp_degree=2,
        instance_type="inf2.8xlarge",
        real_config=dict(
            _REAL_COMMON,
            hidden_size=2560,
            num_hidden_layers=42,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_global_key_value_heads=2,
            intermediate_size=10240,
            use_double_wide_mlp=False,
            attention_k_eq_v=False,
            sliding_window=512,
            hidden_size_per_layer_input=256,
            num_kv_shared_layers=18,
            layer_types=sliding_pattern(5, 42),
            params_text_b=7.46,
            ple_table_b=2.82,
        ),
        tiny_config=dict(
            _TINY_COMMON,
            num_hidden_layers=12,
            layer_types=sliding_pattern(5, 12),
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size_per_layer_input=16,
            num_kv_shared_layers=5,
            use_double_wide_mlp=False,
            attention_k_eq_v=False,
        ),
        field_report=FieldReportFigures(decode_tok_s=34.0, recipe="hand-driven TP"),
        supported_tp=(1, 2),
        tiny_seed=8,
        notes=("TP=2 leaves one KV head per rank",),
        notebook="02_e4b.ipynb",
        real_width_layers=dict(num_hidden_layers=4, layer_types=[_S, _F, _S, _F], num_kv_shared_layers=2),
    ),
    "12b": Variant(
        name="12b",
        hf_id="google/gemma-4-12B-it",
        model_class="Gemma4UnifiedForConditionalGeneration",
        recipe="model_builder",
        tp_degree=2,
        instance_type="inf2.8xlarge",
        real_config=dict(
            _REAL_COMMON,
            hidden_size=3840,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=1,
            intermediate_size=15360,
            sliding_window=1024,
            layer_types=sliding_pattern(5, 48),
            params_text_b=11.9,
            **_NO_PLE,
        ),
        tiny_config=dict(
            _TINY_COMMON,
            num_hidden_layers=6,
            layer_types=sliding_pattern(5, 6),
            num_attention_heads=4,
            num_key_value_heads=2,
            num_global_key_value_heads=1,
            **_NO_PLE,
        ),
        field_report=FieldReportFigures(prefill_ms=101.0),
        supported_tp=(1, 2, 4),
        released_context=262_144,
        tiny_seed=38,
        notes=(
            "eager attention: the fused kernel overflows SBUF at window 1024",
            "one global KV head: replicated under TP",
        ),
        notebook="03_12b.ipynb",
        real_width_layers=dict(num_hidden_layers=2, layer_types=[_S, _F]),
        audit_tp=((2, "dense", None),),
    ),
    "31b": Variant(
        name="31b",
        hf_id="google/gemma-4-31B-it",
        model_class="Gemma4ForConditionalGeneration",
        recipe="model_builder",
        tp_degree=8,
        instance_type="inf2.24xlarge",
        real_config=dict(
            _REAL_COMMON,
            hidden_size=5376,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=16,
            num_global_key_value_heads=4,
            intermediate_size=21504,
            sliding_window=1024,
            layer_types=sliding_pattern(5, 60),
            params_text_b=30.7,
            **_NO_PLE,
        ),
        tiny_config=dict(
            _TINY_COMMON,
            num_hidden_layers=6,
            layer_types=sliding_pattern(5, 6),
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            **_NO_PLE,
        ),
        field_report=FieldReportFigures(prefill_ms=115.0),
        supported_tp=(1, 2, 4, 8),
        released_context=262_144,
        tiny_seed=35,
        notes=("4 global KV heads at TP=8: replicated, not sharded",),
        notebook="04_31b.ipynb",
        real_width_layers=dict(num_hidden_layers=2, layer_types=[_S, _F]),
        audit_tp=((8, "dense", None),),
    ),
    "26b-a4b": Variant(
        name="26b-a4b",
        hf_id="google/gemma-4-26B-A4B-it",
        model_class="Gemma4ForConditionalGeneration",
        recipe="model_builder",
        tp_degree=8,
        instance_type="inf2.24xlarge",
        real_config=dict(
            _REAL_COMMON,
            hidden_size=2816,
            num_hidden_layers=30,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            intermediate_size=2112,
            sliding_window=1024,
            layer_types=sliding_pattern(5, 30),
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
            params_text_b=25.2,
            experts_b=22.8,
            **_NO_PLE,
        ),
        tiny_config=dict(
            _TINY_COMMON,
            num_hidden_layers=6,
            layer_types=sliding_pattern(5, 6),
            num_attention_heads=8,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            enable_moe_block=True,
            num_experts=16,
            top_k_experts=4,
            moe_intermediate_size=32,
            **_NO_PLE,
        ),
        field_report=FieldReportFigures(prefill_ms=77.0),
        supported_tp=(1, 2, 4, 8),
        released_context=262_144,
        tiny_seed=22,
        image_witness_seed=3,
        notes=("all 128 experts are resident: A4B saves compute, not memory",),
        notebook="05_26b_a4b.ipynb",
        aliases=("26b", "26ba4b"),
        real_width_layers=dict(num_hidden_layers=1, layer_types=[_F]),
        audit_tp=(
            (8, "dense", "experts"),
            (8, "selective", "experts"),
            (2, "selective", "experts"),
            (8, "dense", "intermediate"),
            (8, "selective", "intermediate"),
            (2, "dense", "intermediate"),
            (2, "selective", "intermediate"),
        ),
    ),
}

PROFILES = ("smoke", "full")


def _key(name: str) -> str:
    return str(name).strip().lower().replace("_", "-")


# every accepted name -> the variant's own (case and `_`/`-` do not matter)
ALIASES = {_key(alias): v.name for v in VARIANTS.values() for alias in v.names}
# the family's mixture-of-experts member (the expert forms, the expert split, the MoE faults)
MOE_VARIANT = next(v.name for v in VARIANTS.values() if v.is_moe)


def variant_name(name: str) -> str | None:
    """The variant `name` stands for (its own name, an alias or its notebook's number), or None."""
    return ALIASES.get(_key(name))


def get_variant(name: str) -> Variant:
    """Look a variant up by any of its names (`Variant.names`; case-insensitive, `_` for `-`)."""
    key = variant_name(name)
    if key is None:
        raise UnknownNameError("variant", name, sorted(VARIANTS))
    return VARIANTS[key]


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise UnknownNameError("profile", profile, list(PROFILES))
    return profile


def config_kwargs(variant: Variant, which: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `Gemma4TextConfig` / `Gemma4UnifiedTextConfig` (no bookkeeping keys)."""
    source = variant.tiny_config if which == "tiny" else variant.real_config
    kwargs = {k: v for k, v in source.items() if not k.endswith("_b")}
    if which != "tiny":
        kwargs.update(vocab_size=VOCAB_SIZE, final_logit_softcapping=SOFTCAP)
    kwargs.update(overrides)
    if not kwargs.get("hidden_size_per_layer_input"):
        kwargs["hidden_size_per_layer_input"] = 0
    else:
        kwargs.setdefault("vocab_size_per_layer_input", kwargs["vocab_size"])
    # The config class has these fields only on the non-unified class; `unified_config` drops them.
    kwargs.setdefault("num_global_key_value_heads", kwargs.get("num_key_value_heads"))
    return kwargs


# Vision towers reported by third parties for two releases (not the released config.json itself):
# the memory plan's `source="reported"` (inf2/vision_plan.py)
# both reports give the same tower: width 1152, 27 layers, 16 heads of 72, MLP 4304
_REPORTED_TOWER = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=72,
    standardize=True,
)
REPORTED_VISION: dict[str, dict[str, Any]] = {
    "31b": {
        "config": _REPORTED_TOWER,
        "source": "reported by third-party extractions of google/gemma-4-31B-it's vision tower "
        "(huggingface.co/rnagabh/gemma4-vision-encoder and huggingface.co/nebulette/gemma-4-vision-module "
        "config.json: width 1152, 27 layers, 16 heads of 72, MLP 4304); unverified against the released config.json",
    },
    "26b-a4b": {
        "config": _REPORTED_TOWER,
        "source": "reported by Ollama's gemma4:26b-a4b-it-qat vision blob metadata (ollama.com/library: 27 blocks, "
        "width 1152, 16 heads, MLP 4304, projection 2816); unverified against the released config.json",
    },
}
