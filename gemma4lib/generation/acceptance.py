"""How a verify step keeps drafts: the greedy rule, and sampling-mode speculative (rejection) sampling.

Greedy (`greedy_verdict`): the drafts equal to the target's argmax, in order, are kept, then the
target's own next token, so the output is plain greedy decoding's whatever the drafts were.

Rejection sampling (`verify_drafts`, `verify_batch`; Leviathan et al. 2023, algorithm 1): draft i is
kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn from
normalize(max(0, p - q)) there, and if all k are kept a bonus token from p_k. So the emitted sequence
has the target's distribution whatever q is; the proof and the edge cases (q(x) = 0: the test is
`u * q < p`, no division; an all-rounding residual falls back to p; differing top-p supports) are in
docs/DRAFTING.md, "Sampling-mode verification".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import SettingsError

# below this the residual max(0, p - q) is rounding, not mass: sample from p instead
RESIDUAL_FLOOR = 1e-12


@dataclass(frozen=True)
class Verdict:
    """One verify step's outcome: drafts kept, and every emitted token (the kept drafts, then the
    token sampled at the first rejection or the bonus token): `len(tokens) == accepted + 1`."""

    accepted: int
    tokens: list[int]


def _check(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> None:
    if p.dim() != 3 or q.dim() != 3 or drafts.dim() != 2:
        raise SettingsError(
            f"rejection sampling takes p [n, k + 1, vocab], q [n, k, vocab] and drafts [n, k]; got "
            f"{tuple(p.shape)}, {tuple(q.shape)}, {tuple(drafts.shape)}"
        )
    n, k = drafts.shape
    if tuple(q.shape[:2]) != (n, k) or tuple(p.shape[:2]) != (n, k + 1) or p.shape[2] != q.shape[2]:
        raise SettingsError(
            f"{k} drafts need {k} draft distributions and {k + 1} target distributions over one vocabulary; "
            f"got q {tuple(q.shape)} and p {tuple(p.shape)}"
        )


def greedy_verdict(v_logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, list[int]]:
    """Greedy verification of `drafts` against the verify logits `[k + 1, vocab]` (raw: argmax needs
    no softcap): (drafts kept, emitted tokens = the target's predictions up to and including the
    first that differs)."""
    predicted = torch.argmax(v_logits[: len(drafts) + 1], dim=-1).tolist()
    n_ok = 0
    while n_ok < len(drafts) and int(drafts[n_ok]) == predicted[n_ok]:
        n_ok += 1
    return n_ok, predicted[: n_ok + 1]


def verify_batch(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for n independent verify steps at once (the runtime passes n = 1; the
    distribution tests pass many). `p` [n, k + 1, V], `q` [n, k, V] (rows are probabilities),
    `drafts` [n, k]. Returns `accepted` [n] and `tokens` [n, k + 1]: row j's first
    `accepted[j] + 1` entries are its emitted tokens, the rest -1."""
    drafts = drafts.long()
    _check(p, q, drafts)
    n, k = drafts.shape
    p, q = p.double(), q.double()
    rows = torch.arange(n)
    if k:
        p_x = p[:, :k].gather(2, drafts[..., None])[..., 0]
        q_x = q.gather(2, drafts[..., None])[..., 0]
        u = torch.rand(n, k, generator=generator, dtype=torch.float64)
        keep = u * q_x < p_x  # P = min(1, p / q); q = 0 < p: kept; p = 0: never
        accepted = torch.cumprod(keep.long(), dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(n, dtype=torch.long)
    at = p[rows, accepted]  # the target's distribution where the first unkept position is
    rejected = accepted < k
    if k:
        residual = (at - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        usable = rejected[:, None] & (mass > RESIDUAL_FLOOR)
        at = torch.where(usable, residual / mass.clamp(min=RESIDUAL_FLOOR), at)
    at = at / at.sum(dim=1, keepdim=True)
    emitted = torch.multinomial(at, 1, generator=generator)[:, 0]
    tokens = torch.full((n, k + 1), -1, dtype=torch.long)
    if k:
        kept = torch.arange(k)[None] < accepted[:, None]
        tokens[:, :k] = torch.where(kept, drafts, tokens[:, :k])
    tokens[rows, accepted] = emitted
    return accepted, tokens


def verify_drafts(
    p: torch.Tensor, q: torch.Tensor | None, drafts: Sequence[int], generator: torch.Generator | None = None
) -> Verdict:
    """One verify step: `p` [k + 1, V] (the target's distributions at the verified positions),
    `q` [k, V] (the distributions the k drafts were sampled from), the drafts; k may be 0 (q None:
    the token is sampled from p_0)."""
    k = len(drafts)
    if q is None and k == 0:
        q = p.new_zeros(0, p.shape[-1])
    if q is None:
        raise SettingsError(f"{k} drafts need the {k} distributions they were sampled from (q), got None")
    accepted, tokens = verify_batch(p[None], q[None], torch.tensor([list(drafts)], dtype=torch.long), generator)
    a = int(accepted[0])
    return Verdict(a, tokens[0, : a + 1].tolist())
