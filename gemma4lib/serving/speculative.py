"""Greedy-exact drafting: the assistant drafts k tokens on the device, the target verifies them in
one step of k + 1 tokens, the host keeps the drafts up to the first disagreement plus the target's
own next token.

Why it is exact: every kept token is the target's argmax given the tokens before it (a kept draft
equals the target's prediction at its position; the bonus token is the target's prediction), so the
tokens are the target's plain greedy tokens whatever the drafts were. Only the speed depends on
the assistant: each verify step emits 1 + (drafts accepted) tokens.

The loop follows transformers' `_assisted_decoding` with `SinglePositionMultiTokenCandidateGenerator`:
prefill, the first token from the prefill's logits; then per round up to
`min(k, max_new_tokens - generated - 1)` drafts from the last seen token's position, a verify of
`[last token, drafts...]` at that position, acceptance, eos cut. One difference, on purpose: over
the shared K/V, transformers' assistant also sees some rejected drafts' stale K/V (its slice keeps
the verify step's whole output for sliding layers, and one stale slot of full layers); ours masks
every uncommitted slot (`drafting.draft_masks`). Tokens are equal either way; acceptance may differ,
and both are recorded (`accepted_per_step`, `hf_accepted_per_step`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..backends.base import DeviceRun
from ..device.drafting import DraftGraph, RoomyLayout, TargetGraph, verify_expert_form
from ..device.embedder import HostEmbedder
from ..device.experts import EXPERT_FORMS
from ..device.graph import GraphShape
from ..errors import SettingsError
from ..runtime import Sampling, choose_token, sampling_probs
from .rejection import verify_drafts

if TYPE_CHECKING:
    from ..models.assistant import LoadedAssistant
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

log = logging.getLogger(__name__)

DRAFT_KINDS = ("assistant",)
DRAFT_BACKENDS = ("cpu", "eager", "xla", "neuron")  # neuron: the ModelBuilder recipe's drafting keys


def check_draft(settings: PortSettings) -> None:
    """Refuse what drafting does not run on, before anything is loaded."""
    if settings.draft is None:
        if getattr(settings, "verify_experts", None) is not None:
            raise SettingsError(
                f"verify_experts={settings.verify_experts!r} sets the verify graph's MoE expert form, which only "
                f"drafting builds: pass draft='assistant' too, or leave verify_experts unset"
            )
        return
    if getattr(settings, "verify_experts", None) not in (None, *EXPERT_FORMS):
        from ..errors import UnknownNameError

        raise UnknownNameError("verify_experts form", settings.verify_experts, EXPERT_FORMS)
    if settings.draft not in DRAFT_KINDS:
        from ..errors import UnknownNameError

        raise UnknownNameError("draft", settings.draft, DRAFT_KINDS)
    rank_graphs = settings.tp_degree > 1 or settings.backend == "neuron"
    if getattr(settings, "verify_experts", None) is not None and rank_graphs:
        raise SettingsError(
            f"verify_experts={settings.verify_experts!r} chooses the expert form of the single-device verify "
            f"graph; the rank graphs (tp_degree {settings.tp_degree}, backend {settings.backend!r}) verify with "
            f"the dense experts: leave verify_experts unset there"
        )
    if settings.backend == "neuron":
        from ..inf2.memory_plan import neuron_recipe

        recipe = neuron_recipe(settings.variant_spec, settings.tp_degree, settings.neuron_recipe)
        if recipe == "trace":
            raise SettingsError(
                "draft='assistant' needs the draft, verify and prefill graphs over one set of device K/V "
                "states; the one-graph trace recipe has a single decode graph: use the ModelBuilder recipe "
                "(neuron_recipe=None) or draft=None"
            )
    if settings.backend not in DRAFT_BACKENDS:
        raise SettingsError(
            f"draft='assistant' runs on backends {DRAFT_BACKENDS} so far; on backend {settings.backend!r} the "
            f"draft and verify graphs are not built yet: use backend='cpu' or 'eager', or draft=None"
        )


@dataclass
class DraftGraphs:
    """The graphs of drafted generation over one set of K/V buffers (`layout`: rings with room for k)."""

    prefill: dict[int, TargetGraph]
    verify: TargetGraph
    draft: DraftGraph
    layout: RoomyLayout
    draft_tokens: int

    def all(self) -> list[tuple[str, Any]]:
        return [*((f"prefill{b}", g) for b, g in self.prefill.items()), ("verify", self.verify), ("draft", self.draft)]

    def new_kv(self) -> list[torch.Tensor]:
        return self.verify.new_kv()


def build_draft_graphs(model: LoadedModel, assistant: LoadedAssistant, settings: PortSettings) -> DraftGraphs:
    """Prefill (one per bucket, returning the last hidden state too), verify (k + 1 tokens, every
    position) and draft graphs, sharing one K/V layout. Backend `xla` builds the functional form
    (`inplace=False`: the updated K/V are outputs), the others the in-place one."""
    from ..device.build import PREFILL_EXPERTS

    k = int(settings.draft_tokens)
    inplace = settings.backend != "xla"
    layout = RoomyLayout.around(model.layout, k + 1)  # why k + 1: `drafting` module docstring
    ctx, ring = settings.context_length, settings.ring_kv

    def target(tokens: int, experts: str, every: bool) -> TargetGraph:
        return TargetGraph(
            model.text_model,
            model.lm_head,
            layout,
            GraphShape(1, tokens, ctx, ring),
            expert_form=experts,
            weights=settings.weights,
            every_position=every,
            inplace=inplace,
        )

    prefill = {b: target(b, PREFILL_EXPERTS, False) for b in settings.prefill_buckets}
    # MoE: the k + 1 tokens' routed experts gathered (B x k slices with the tokens as rows) when
    # that reads fewer bytes than all experts, else dense (`verify_expert_form`; the roofline agrees)
    verify = target(k + 1, verify_expert_form(model.config, k, getattr(settings, "verify_experts", None)), True)
    draft = DraftGraph(assistant.model, layout, GraphShape(1, 1, ctx, ring), assistant.read_layers)
    return DraftGraphs(prefill, verify, draft, layout, k)


@dataclass
class CompiledDraft:
    prefill: dict[int, Callable[..., Any]]
    verify: Callable[..., Any]
    draft: Callable[..., Any]
    compile_s: float = 0.0
    cache_hits: list[bool] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    new_kv: Callable[[], list[torch.Tensor]] | None = None  # K/V where the steps want them (xla: on the device)
    report: Callable[[], dict[str, Any]] | None = None  # the backend's after-run figures (xla: fallbacks, compiles)


def compile_draft_graphs(graphs: DraftGraphs, settings: PortSettings) -> CompiledDraft:
    """`cpu`: each graph through torch.export + AOTInductor (cached like the others); `eager`: as is;
    `xla`: one `XLASession` over every graph (compiled on first use, K/V on the device)."""
    if settings.backend == "eager":
        return CompiledDraft(dict(graphs.prefill), graphs.verify, graphs.draft, new_kv=graphs.new_kv)
    if settings.backend == "xla":
        return _on_xla(graphs, settings)
    from ..backends.compile_cpu import compile_graph
    from ..cache.artifacts import ArtifactCache

    cache = ArtifactCache(settings.cache_dir)
    steps = {name: compile_graph(graph, cache) for name, graph in graphs.all()}
    prefill = {b: steps[f"prefill{b}"] for b in graphs.prefill}
    return CompiledDraft(
        prefill,
        steps["verify"],
        steps["draft"],
        sum(s.compile_s for s in steps.values()),
        [s.cache_hit for s in steps.values()],
        {name: str(s.entry.path) for name, s in steps.items()},
        new_kv=graphs.new_kv,
    )


def _on_xla(graphs: DraftGraphs, settings: PortSettings) -> CompiledDraft:
    """The drafted graphs through torch_xla (`backends.xla.XLASession`): one K/V set on the device
    that the prefill and verify steps rebind and the draft step reads; each step's outputs come back
    to the host (the host loop picks tokens and builds the next inputs)."""
    from ..backends.xla import XLASession, use_fast_cpu_compile
    from ..cache.artifacts import ArtifactCache

    use_fast_cpu_compile()
    variant = settings.variant_spec.name
    hlo_dir = ArtifactCache(settings.cache_dir).root / "xla-hlo" / variant / f"draft-k{graphs.draft_tokens}"
    session = XLASession(dict(graphs.all()), hlo_dir=hlo_dir)

    def on_host(name: str) -> Callable[..., Any]:
        step = session.step(name)

        def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(t.cpu() for t in step(*args))

        return run

    return CompiledDraft(
        {b: on_host(f"prefill{b}") for b in graphs.prefill},
        on_host("verify"),
        on_host("draft"),
        new_kv=lambda: session.new_kv("verify"),
        report=session.report,
    )


@dataclass
class DraftedGeneration:
    prompt_ids: list[int]
    tokens: list[int]
    accepted: list[int]  # drafts accepted at each verify step
    emitted: list[int]  # tokens kept at each verify step (accepted + the target's own, eos/budget cut)
    drafted: list[int]  # drafts proposed at each verify step
    step_logits: torch.Tensor  # raw target logits that chose each token, [n, vocab]
    prefill_s: float
    round_s: list[float]  # draft + verify seconds of each round

    @property
    def accepted_per_step(self) -> float | None:
        """Mean tokens emitted per target verify step (1 = no draft ever accepted)."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else None

    @property
    def decode_tok_s(self) -> float | None:
        total = sum(self.round_s)
        return (len(self.tokens) - 1) / total if total > 0 else None


class DraftedRuntime:
    """Host side of drafted generation over compiled prefill/verify/draft steps and their K/V."""

    def __init__(self, model: LoadedModel, steps: CompiledDraft, kv: list[torch.Tensor], draft_tokens: int):
        self.model, self.steps, self.kv, self.k = model, steps, kv, int(draft_tokens)
        self.embedder = HostEmbedder.from_text_model(model.text_model)
        self.dtype = torch.float32

    @classmethod
    def over(
        cls,
        embedder: HostEmbedder,
        steps: CompiledDraft,
        kv: list[torch.Tensor],
        draft_tokens: int,
        dtype=torch.float32,
    ) -> DraftedRuntime:
        """The same loop over steps that hold their K/V themselves (gloo ranks, ModelBuilder keys):
        only the host embedder is needed, and the dtype the steps were compiled for."""
        runtime = cls.__new__(cls)
        runtime.model, runtime.steps, runtime.kv, runtime.k = None, steps, list(kv), int(draft_tokens)
        runtime.embedder, runtime.dtype = embedder, dtype
        return runtime

    def embed(self, ids: torch.Tensor, pad_to: int | None = None) -> list[torch.Tensor]:
        return self.embedder.inputs(ids, pad_to, self.dtype)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        eos_token_ids: Sequence[int] = (),
        drafter: Callable[[int, torch.Tensor, int, int], list[int]] | None = None,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftedGeneration:
        """Generation with drafts, greedy unless `sampling` says otherwise. `drafter(token, hidden,
        position, n)` replaces the assistant (tests: a drafter that is always wrong or always right);
        None = the draft graph.

        Greedy: the target's argmax at every verified position; the drafts equal to it are kept.
        `sampling` (not greedy): the assistant samples its drafts from its distribution q and the
        verify step keeps them by rejection sampling against the target's p (`rejection`), so the
        tokens are distributed as plain sampling's; `generator` (default: seeded with
        `sampling.seed`) draws every random number. Both run the same rounds (`_rounds`)."""
        if sampling is None or sampling.greedy:
            guess = drafter or (lambda token, hidden, position, n: self._draft(token, hidden, position, n)[0])
            return self._rounds(
                prompt_ids, max_new_tokens, eos_token_ids,
                first=lambda logits: int(torch.argmax(logits)),
                draft=lambda token, hidden, position, n: (guess(token, hidden, position, n), None),
                judge=_greedy_verdict,
            )  # fmt: skip
        if drafter is not None:
            raise SettingsError(
                "a replacement drafter returns tokens only; sampling-mode verification needs the "
                "distributions the drafts were sampled from: drop drafter= or sample greedily"
            )
        if self.model is None:
            raise SettingsError(
                "this drafted runtime drives rank or device steps (gloo ranks, ModelBuilder keys) and was built "
                "without the target model, whose softcap sampling needs: sampling-mode verification "
                "runs on the single-device runtime (DraftedRuntime(model, ...)); sample greedily here"
            )
        cap = getattr(self.model.config, "final_logit_softcapping", None)  # the target's, as plain sampling's
        rng = generator or torch.Generator().manual_seed(sampling.seed)

        def pick(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
            q = sampling_probs(logits, sampling, None)  # the assistant's forward has no softcap (transformers)
            return int(torch.multinomial(q, 1, generator=rng)), q

        def judge(v_logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None) -> tuple[int, list[int]]:
            p = torch.stack([sampling_probs(v_logits[i], sampling, cap) for i in range(len(drafts) + 1)])
            verdict = verify_drafts(p, q, drafts, rng)
            return verdict.accepted, verdict.tokens

        return self._rounds(
            prompt_ids, max_new_tokens, eos_token_ids,
            first=lambda logits: choose_token(logits, sampling, cap, rng),
            draft=lambda token, hidden, position, n: self._draft(token, hidden, position, n, pick),
            judge=judge,
        )  # fmt: skip

    def _rounds(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        *,
        first: Callable[[torch.Tensor], int],
        draft: Callable[[int, torch.Tensor, int, int], tuple[list[int], torch.Tensor | None]],
        judge: Callable[[torch.Tensor, list[int], torch.Tensor | None], tuple[int, list[int]]],
    ) -> DraftedGeneration:
        """Prefill, then rounds of: k drafts (`draft`: the tokens and, when sampled, the q rows they
        came from), one verify call of the target over the last token and the drafts, and `judge`
        (how many drafts are kept, and every emitted token: the kept drafts and one of the target's).
        The K/V of rejected drafts are never read: the next round starts at position + accepted + 1
        and overwrites them; its hidden state is the verify's at the last kept position."""
        ids = list(prompt_ids)
        bucket = min(b for b in self.steps.prefill if b >= len(ids))
        eos = {int(t) for t in eos_token_ids}
        started = time.perf_counter()
        logits, hidden = self.steps.prefill[bucket](
            *self.embed(torch.tensor([ids]), pad_to=bucket), torch.tensor([0]), torch.tensor([len(ids)]), *self.kv
        )
        prefill_s = time.perf_counter() - started
        token = first(logits[0])
        tokens, kept = [token], [logits[0].float().clone()]
        position, last_hidden = len(ids), hidden[0].clone()
        accepted, emitted, drafted, round_s = [], [], [], []
        while len(tokens) < max_new_tokens and token not in eos:
            started = time.perf_counter()
            n = min(self.k, max_new_tokens - len(tokens) - 1)
            drafts, q = draft(token, last_hidden, position, n) if n > 0 else ([], None)
            chunk = torch.tensor([[token, *drafts]])
            v_logits, v_hidden = self.steps.verify(
                *self.embed(chunk, pad_to=self.k + 1),
                torch.tensor([position]),
                torch.tensor([len(drafts) + 1]),
                *self.kv,
            )
            n_ok, new = judge(v_logits[0], list(drafts), q)
            round_s.append(time.perf_counter() - started)
            for i, t in enumerate(new):
                tokens.append(int(t))
                kept.append(v_logits[0, i].float().clone())
                if t in eos or len(tokens) >= max_new_tokens:
                    new = new[: i + 1]
                    break
            accepted.append(n_ok)
            emitted.append(len(new))
            drafted.append(len(drafts))
            position += n_ok + 1
            last_hidden = v_hidden[0, n_ok].clone()
            token = tokens[-1]
        return DraftedGeneration(ids, tokens, accepted, emitted, drafted, torch.stack(kept), prefill_s, round_s)

    def _draft(
        self,
        token: int,
        hidden: torch.Tensor,
        position: int,
        n: int,
        pick: Callable[[torch.Tensor], tuple[int, torch.Tensor]] | None = None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """n assistant steps from the last seen token at `position` (constant), feeding back its
        own token and projected hidden state. `pick(logits)` -> (token, q) samples each token
        (None: the argmax); returns the drafts and, when sampled, their q rows [n, vocab]."""
        out, rows = [], []
        pos = torch.tensor([position])
        for _ in range(n):
            embedding = self.embed(torch.tensor([[token]]))[0]
            x = torch.cat([embedding, hidden[None, None].to(embedding.dtype)], dim=-1)
            logits, hidden = self.steps.draft(x, pos, *self.kv)
            if pick is None:
                token = int(torch.argmax(logits[0]))
            else:
                token, q = pick(logits[0])
                rows.append(q)
            hidden = hidden[0]
            out.append(token)
        return out, torch.stack(rows) if rows else None


def _greedy_verdict(v_logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None) -> tuple[int, list[int]]:
    """Greedy verification: the drafts equal to the target's argmax, in order, are kept; the emitted
    tokens are the target's own predictions up to and including the first that differs."""
    predicted = torch.argmax(v_logits[: len(drafts) + 1], dim=-1).tolist()
    n_ok = 0
    while n_ok < len(drafts) and drafts[n_ok] == predicted[n_ok]:
        n_ok += 1
    return n_ok, predicted[: n_ok + 1]


@torch.no_grad()
def hf_assisted(
    lm: torch.nn.Module, assistant: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int]
) -> tuple[list[int], int]:
    """transformers' own `generate(assistant_model=...)` (greedy): its tokens and the number of
    target verify steps it ran (target forward calls after the prefill)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    calls = []
    hook = lm.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos) or None,
            pad_token_id=0,
            assistant_model=assistant,
        )
    finally:
        hook.remove()
    tokens = out[0, ids.shape[1] :].tolist()
    for i, t in enumerate(tokens):
        if t in set(eos):
            tokens = tokens[: i + 1]
            break
    return tokens, len(calls) - 1


def time_interleaved(runs: Mapping[str, Callable[[], Any]], warmup: int, iters: int) -> dict[str, list[float]]:
    """decode tok/s of each named run (it returns an object with `decode_tok_s`), `iters` rounds after
    `warmup`, the runs taking turns within a round: load from other work then hits every run alike,
    so their ratio holds where back-to-back blocks of runs would each see different neighbours."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + iters):
        for name, run in runs.items():
            rate = run().decode_tok_s
            if i >= warmup and rate:
                figures[name].append(rate)
    return figures


def run_single_device_drafted(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
    sampling: Sampling | None = None,
) -> DeviceRun:
    """The `device_run` of a drafted port: the drafted generation (its tokens and per-token logits
    go through the usual three checks), transformers' assisted generate with the same assistant,
    and decode tok/s with and without drafting from this one run (the plain graphs compiled too).

    `sampling` (not greedy; library and notebook callers, the port has no temperature): drafts
    verified by rejection sampling, seeded with `sampling.seed`. Its tokens are a sample, so the
    record carries `sampling` and no greedy comparison with transformers (`hf_assisted_*` None);
    the benchmark samples in both runs."""
    from .. import backends
    from ..models.assistant import load_assistant

    sampled = sampling is not None and not sampling.greedy
    assistant = load_assistant(model, settings)
    graphs = build_draft_graphs(model, assistant, settings)
    compiled = compile_draft_graphs(graphs, settings)
    runtime = DraftedRuntime(model, compiled, compiled.new_kv(), settings.draft_tokens)
    generation = runtime.generate(ids, settings.max_new_tokens, eos_token_ids=eos, sampling=sampling)
    hf_tokens, hf_steps = (
        (None, None) if sampled else hf_assisted(model.lm, assistant.model, ids, settings.max_new_tokens, eos)
    )
    device_run: dict[str, Any] = {
        "tokens": generation.tokens,
        "step_logits": generation.step_logits,
        "compiler": {"cpu": "cpu-aotinductor", "xla": "torch-xla"}.get(settings.backend, "eager"),
        "compile_s": compiled.compile_s,
        "cache_hits": compiled.cache_hits,
        "prefill_ms": generation.prefill_s * 1000,  # one run (the plain path's benchmark takes medians)
        "draft": settings.draft,
        "draft_tokens": settings.draft_tokens,
        "assistant_source": assistant.source,
        "assistant_reads_layers": assistant.read_layers,
        "verify_experts": graphs.verify.expert_form if getattr(model.config, "enable_moe_block", False) else None,
        "sliding_ring_slots": graphs.layout.slots("sliding_attention", settings.context_length, settings.ring_kv),
        "verify_steps": len(generation.emitted),
        "accepted_per_step": generation.accepted_per_step,
        "drafts_accepted": generation.accepted,
        "hf_assisted_tokens": hf_tokens,
        "hf_assisted_match": hf_tokens == generation.tokens if hf_tokens is not None else None,
        "hf_verify_steps": hf_steps,
        "hf_accepted_per_step": (len(hf_tokens) - 1) / hf_steps if hf_steps else None,
        "artifacts": compiled.artifacts or None,
    }
    if sampled:
        device_run["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}
    if bench:
        plain = backends.compile_graphs(model, settings, progress=progress).runtime
        n = settings.max_new_tokens  # eos ignored: both decode the same number of tokens
        # xla compiles each graph on its first call: at least one untimed round
        warmup = max(1, settings.warmup) if settings.backend == "xla" else settings.warmup
        runs = time_interleaved(
            {
                "with_draft": lambda: runtime.generate(ids, n, sampling=sampling),
                "without_draft": lambda: plain.generate(ids, n, sampling=sampling or Sampling()),
            },
            warmup,
            settings.iters,
        )
        drafted_runs, plain_runs = runs["with_draft"], runs["without_draft"]
        timed = runtime.generate(ids, n, sampling=sampling)
        with_draft = statistics.median(drafted_runs) if drafted_runs else None
        without = statistics.median(plain_runs) if plain_runs else None
        device_run.update(
            decode_tok_s=with_draft,
            decode_tok_s_with_draft=with_draft,
            decode_tok_s_without_draft=without,
            speedup_with_draft=with_draft / without if with_draft and without else None,
            bench_accepted_per_step=timed.accepted_per_step,
            decode_tok_s_runs={"with_draft": drafted_runs, "without_draft": plain_runs},
            bench_tokens=n,
        )
    if compiled.report:  # after the benchmark: the backend counts what the whole run did
        device_run.update(compiled.report())
    return DeviceRun.from_fields(device_run)


__all__ = [
    "DRAFT_BACKENDS",
    "DRAFT_KINDS",
    "CompiledDraft",
    "DraftGraphs",
    "DraftedGeneration",
    "DraftedRuntime",
    "build_draft_graphs",
    "check_draft",
    "compile_draft_graphs",
    "hf_assisted",
    "run_single_device_drafted",
    "time_interleaved",
]
