"""The released text configs at real widths, with few layers: the device graph checked where the
tiny configs cannot reach.

Tiny configs prove the wiring in seconds, but at hidden 64 and vocabulary 810 they never meet the
shapes the port meets on inf2: the 262,144-token vocabulary and its tied LM head, head dims 256
(sliding) / 512 (full), the real KV-head counts, PLE width 256 over the full vocabulary, and the
MoE's 128 experts with top-8 routing. Here every width is the released one
(`variants.VARIANTS[...].real_config`); only the layer count is cut, and it keeps each variant's
features: both attention types (the one-layer MoE plan: full only), and for E2B/E4B KV sharing with
a producer of each type. Weights are seeded random, tempered like the medium models
(`medium.temper_attention`) so greedy tokens are decided by the model, not by rounding, and with
stronger layer outputs (`temper_residual`) so that a one- or two-layer model does not just copy its
input token. What is compared: the eager device graph (or an AOTInductor-compiled decode graph)
against HF's own greedy `generate`, token for token, and the softcapped logits at every generated
position against one full HF forward over the same sequence.

Memory: fp32 weights are 4 bytes per parameter and the vocabulary alone is 262,144 x hidden
(E2B 1.6 GB, 12B 4.0 GB, 31B 5.6 GB). `LAYER_PLANS` keeps every fp32 plan under ~6.5 GB; the 31B
does not fit fp32 even at one layer (7.8 GB), so its plan runs in bfloat16 (`PLAN_DTYPES`),
compared with a tolerance set by HF's own bf16 spread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gemma4lab.models.medium import temper_attention
from gemma4lib.backends.compile_cpu import compile_graph
from gemma4lib.backends.engine import engine_over
from gemma4lib.cache.artifacts import ArtifactCache
from gemma4lib.device.graph import DeviceGraph, GraphShape, index_tensor
from gemma4lib.models.loading import LoadedModel, build_random, text_config
from gemma4lib.models.variants import VARIANTS, Variant, get_variant
from gemma4lib.reference import hf_greedy, random_prompt, teacher_forced_logits
from gemma4lib.runtime import Engine, softcap

log = logging.getLogger(__name__)

S, F = "sliding_attention", "full_attention"

# Layer count per variant (every width stays the released one; `Variant.real_width_layers`). E2B: one 4+1 period, then a
# KV-shared sliding and full layer (producers 3 and 4). E4B: sliding, full, then the two shared.
# 12B / 31B: one sliding and one full layer. 26B-A4B: one full (k_eq_v) layer with the 128-expert
# block: its experts are 3.0 GB per layer at fp32, a second layer would pass 9 GB.
LAYER_PLANS: dict[str, dict[str, Any]] = {
    v.name: v.real_width_layers for v in VARIANTS.values()
}  # `Variant.real_width_layers`
PLAN_DTYPES: dict[str, torch.dtype] = {"31b": torch.bfloat16}
# Prompt seed per plan (`reference.random_prompt`); 31B: seed 1 falls into a one-token loop.
PROMPT_SEEDS: dict[str, int] = {"31b": 2}
# Plans this shallow copy their input token unless the residual is tempered (`temper_residual`).
SHALLOW = 2


def residual_gain(config: Any) -> float:
    """The `temper_residual` gain for a config: 0.3 * initializer_range * hidden_size.

    Through the tied head, the input token's own scaled embedding scores itself about
    initializer_range**2 * hidden**1.5 / rms(h), any other token about
    initializer_range * sqrt(hidden): a gain proportional to initializer_range * hidden keeps the
    layers ahead of the copy at every width (measured: 26B-A4B, one layer, hidden 2816: gain 8
    still copies, 16 gives 8 distinct tokens).
    """
    return 0.3 * float(config.initializer_range) * int(config.hidden_size)


@torch.no_grad()
def temper_residual(text_model: torch.nn.Module, gain: float) -> int:
    """Set every post-attention and post-feedforward norm weight to `gain`; return the norms set.

    Random layers write unit-RMS outputs (their post-norms) next to the token embedding, which
    Gemma scales by sqrt(hidden). With the released depth, each layer's `layer_scalar` shrinks what
    came before and the layers decide the next token; with one or two layers the embedding
    dominates, and the tied LM head then predicts the input token again, forever. Larger post-norm
    weights give the layers their say back (a trained model has learnt weights there too).
    """
    count = 0
    for layer in text_model.layers:
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            norm = getattr(layer, name, None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                norm.weight.fill_(gain)
                count += 1
    return count


def plan_config(name: str, **overrides: Any):
    """The transformers text config of a real-width plan (no weights allocated)."""
    variant = get_variant(name)
    return text_config(variant, "real", **{**LAYER_PLANS[variant.name], **overrides})


def plan_bytes(name: str, dtype: torch.dtype | None = None, **overrides: Any) -> int:
    """Bytes of the plan's weights (counted on the meta device, nothing allocated)."""
    variant = get_variant(name)
    dtype = dtype or PLAN_DTYPES.get(variant.name, torch.float32)
    from gemma4lib.models.loading import _text_classes

    _, lm_cls = _text_classes(variant)
    with torch.device("meta"):
        lm = lm_cls(plan_config(name, **overrides))
    count = sum(p.numel() for p in lm.parameters())  # a tied head is one parameter
    count += sum(b.numel() for b in lm.buffers())
    return count * torch.finfo(dtype).bits // 8


def build_real_width(name: str, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> LoadedModel:
    """A seeded random model of the variant's released widths, `LAYER_PLANS` layers, tempered."""
    variant: Variant = get_variant(name)
    dtype = dtype or PLAN_DTYPES.get(variant.name, torch.float32)
    started = time.perf_counter()
    model = build_random(variant, "real", seed, dtype, **{**LAYER_PLANS[variant.name], **overrides})
    temper_attention(model.text_model)
    if model.config.num_hidden_layers <= SHALLOW:
        temper_residual(model.text_model, residual_gain(model.config))
    layers = model.config.num_hidden_layers
    model.source = f"real-width-random({variant.name}, {layers} layers, seed={seed})"
    log.info(
        "built %s in %.1f s (%.2f B parameters, %s)",
        model.source,
        time.perf_counter() - started,
        model.param_count() / 1e9,
        dtype,
    )
    return model


@dataclass
class RealWidthReport:
    """What one real-width check found (plain values: for a result record or a test message)."""

    variant: str
    dtype: str
    layers: int
    params: int
    prompt: list[int]
    tokens: list[int]  # device graph, greedy
    reference: list[int]  # HF generate, greedy
    logits_max_abs_diff: float  # device (fed the reference's tokens) vs one HF forward, softcapped
    prefill_logits_max_abs_diff: float  # the same at the first position: the prefill graph's
    reference_spread: float  # HF incremental (generate) vs one HF forward: HF's own spread
    margins: list[float]  # HF top-1 minus top-2 logit at each generated position
    device_argmax: list[int]  # argmax of the device logits at each position (same inputs as HF's)
    decode: str  # "eager" or the compile recipe
    compile_s: float = 0.0
    cache_hit: bool | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def seq_match(self) -> bool:
        return self.tokens == self.reference

    def decided_steps(self, tolerance: float) -> int:
        """Generated positions before the first one whose HF margin is within `tolerance` (a near
        tie: there a correct implementation may pick either token, and later steps then differ)."""
        return next((i for i, m in enumerate(self.margins) if m <= tolerance), len(self.margins))

    @property
    def matching_prefix(self) -> int:
        """Tokens equal to the reference before the first difference."""
        return next(
            (i for i, (a, b) in enumerate(zip(self.tokens, self.reference, strict=False)) if a != b),
            min(len(self.tokens), len(self.reference)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seq_match": self.seq_match, "matching_prefix": self.matching_prefix}


def _hf_logits(model: LoadedModel, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """HF greedy tokens, its per-step logits, and one full forward's logits at those positions."""
    tokens, incremental = hf_greedy(model.lm, prompt, new_tokens, keep_logits=True)
    with torch.no_grad():
        full = teacher_forced_logits(model.lm, prompt, tokens).float()
    return tokens, incremental, full


@torch.no_grad()
def forced_logits(engine: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Raw device logits [len(tokens), vocab] with `tokens` fed in (teacher forcing): the engine's
    prefill and decode steps called on given inputs, not a generation."""
    n, steps = len(prompt), engine.steps
    bucket = engine.bucket_for(n)
    if n > bucket:  # one prefill call here, not the engine's chunks
        raise ValueError(f"prompt of {n} tokens is longer than the largest prefill bucket {bucket}; use a shorter one")
    inputs = engine.embed(torch.tensor([prompt]), pad_to=bucket)
    out = [steps.prefill[bucket](*inputs, index_tensor([0]), index_tensor([n]))[0]]
    for j, token in enumerate(tokens[:-1]):
        out.append(steps.decode(*engine.embed(torch.tensor([[token]])), index_tensor([n + j]), index_tensor([1]))[0])
    return torch.stack(out).float()


def check_real_width(
    model: LoadedModel,
    new_tokens: int = 8,
    prompt_tokens: int = 12,
    context_length: int = 32,
    bucket: int = 16,
    compile_decode: bool = False,
    cache: ArtifactCache | None = None,
    prompt_seed: int | None = None,
) -> RealWidthReport:
    """Greedy tokens and logits of the device graph (prefill eager; decode eager or AOTInductor)
    against HF at the model's own widths."""
    timings: dict[str, float] = {}
    if prompt_seed is None:
        prompt_seed = PROMPT_SEEDS.get(model.variant.name, 1)
    prompt = random_prompt(model.config.vocab_size, prompt_tokens, prompt_seed)
    started = time.perf_counter()
    reference, incremental, full = _hf_logits(model, prompt, new_tokens)
    timings["reference_s"] = time.perf_counter() - started

    layout = model.layout
    dtype = model.lm_head.weight.dtype
    text, head = model.text_model, model.lm_head
    prefill = DeviceGraph(text, head, layout, GraphShape(1, bucket, context_length, True))
    decode_graph = DeviceGraph(text, head, layout, GraphShape(1, 1, context_length, True), expert_form="selective")
    decode, recipe, compile_s, hit = decode_graph, "eager", 0.0, None
    if compile_decode:
        started = time.perf_counter()
        compiled = compile_graph(decode_graph, cache)
        decode, recipe, hit = compiled, compiled.info["compiler"], compiled.cache_hit
        compile_s = time.perf_counter() - started
        timings["compile_and_load_s"] = compile_s
    engine = engine_over(model, {f"prefill{bucket}": prefill, "decode": decode}, decode_graph, kv=decode_graph.new_kv())
    started = time.perf_counter()
    generation = engine.generate(prompt, new_tokens, keep_logits=True)
    timings["device_s"] = time.perf_counter() - started
    if generation.tokens == reference:
        device = generation.step_logits  # the logits that chose each token: the prefill's, then each step's
    else:  # feed the reference's tokens, so every position is compared on the same input
        device = forced_logits(engine, prompt, reference)
    device = softcap(device, model.config.final_logit_softcapping)
    diff = float((device - full).abs().max())
    spread = float((incremental - full).abs().max())
    top2 = full.topk(2, dim=-1).values
    margins = [round(float(m), 6) for m in top2[:, 0] - top2[:, 1]]
    report = RealWidthReport(
        model.variant.name,
        str(dtype).replace("torch.", ""),
        model.config.num_hidden_layers,
        model.param_count(),
        prompt,
        generation.tokens,
        reference,
        diff,
        float((device[0] - full[0]).abs().max()),
        spread,
        margins,
        device.argmax(-1).tolist(),
        recipe,
        compile_s,
        hit,
        timings,
    )
    log.info(
        "real width %s: seq_match=%s, logits diff %.2e (HF spread %.2e), %s",
        report.variant,
        report.seq_match,
        diff,
        spread,
        timings,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m gemma4lab.models.real_width VARIANT [--compile]`: one check in a process of its own, the
    report as JSON on stdout.

    Its own process because the weights are GBs and an AOTInductor package loaded with user-managed
    constants (`compile_cpu.load_weights`) keeps them referenced after it is deleted (torch 2.13):
    a test session that ran a compiled check in-process would hold them to its end.
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m gemma4lab.models.real_width", description=main.__doc__)
    parser.add_argument("variant", choices=sorted(LAYER_PLANS))
    parser.add_argument("--compile", action="store_true", help="compile the decode graph with AOTInductor")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = build_real_width(args.variant, seed=args.seed)
    built = time.perf_counter() - started
    report = check_real_width(model, new_tokens=args.new_tokens, compile_decode=args.compile)
    report.timings_s["build_s"] = built
    import resource

    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: kB
    out = {**report.to_dict(), "peak_rss_gb": peak_gb, "threads": args.threads}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
