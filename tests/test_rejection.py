"""Rejection-sampling verification emits the target's distribution, whatever the drafts' q.

Statistic: the total-variation distance between the empirical distribution of N seeded draws and
the exact one. Tolerance from the Bretagnolle-Huber-Carol inequality, P(TV >= t) <= 2^m exp(-2 N t^2)
over m cells: t = sqrt((m ln 2 + ln(1 / DELTA)) / (2 N)), so a correct rule exceeds it with
probability below DELTA (the draws are seeded: the outcome is fixed, the bound says why it holds).
The witnesses run wrong rules through the same statistic and must exceed the same tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from gemma4lib.errors import SettingsError
from gemma4lib.generation.acceptance import verify_batch, verify_drafts
from gemma4lib.runtime import Sampling, sampling_probs

N = 40_000
DELTA = 1e-6
V = 6


def tolerance(cells: int, n: int = N) -> float:
    return math.sqrt((cells * math.log(2) + math.log(1 / DELTA)) / (2 * n))


def tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    return 0.5 * float((counts / samples.numel() - expected.double()).abs().sum())


def dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w / w.sum()


# (name, p_0, q_1): the first draft's q against the target's p at its position
PAIRS = [
    ("different", dist(5, 1, 1, 3, 2, 1), dist(1, 4, 2, 1, 1, 3)),
    ("q where p has none", dist(4, 0, 3, 0, 2, 1), dist(1, 3, 1, 3, 1, 1)),
    ("p has mass where q has none", dist(1, 3, 1, 3, 1, 1), dist(4, 0, 3, 0, 2, 1)),
    ("p = q", dist(3, 1, 4, 1, 5, 9), dist(3, 1, 4, 1, 5, 9)),
    ("q a point mass on a token p excludes", dist(2, 2, 0, 3, 1, 1), dist(0, 0, 1, 0, 0, 0)),
    ("q a point mass on a token p allows", dist(2, 2, 1, 3, 1, 1), dist(0, 0, 1, 0, 0, 0)),
]
LATER = dist(1, 1, 2, 2, 3, 3)  # p_1, p_2 and q_2 of the drafts after the first (any rows will do)


def first_tokens(p0: torch.Tensor, q1: torch.Tensor, rule=verify_batch, k: int = 2, seed: int = 0):
    """N verify steps of k drafts sampled from q (q_1 then LATER), p = [p0, LATER...]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.stack([q1, *[LATER] * (k - 1)])[None].expand(N, k, V)
    p = torch.stack([p0, *[LATER] * k])[None].expand(N, k + 1, V)
    drafts = torch.stack([torch.multinomial(q[0, i], N, replacement=True, generator=g) for i in range(k)], 1)
    accepted, tokens = rule(p, q, drafts, g)
    return accepted, tokens, drafts


def accept_always(p, q, drafts, g):
    """A wrong rule: keep every draft, then the bonus token from p_k."""
    n, k = drafts.shape
    bonus = torch.multinomial(p[:, k], 1, generator=g)
    return torch.full((n,), k), torch.cat([drafts, bonus], 1)


def resample_from_p(p, q, drafts, g):
    """A subtler wrong rule: the right acceptance test, but at a rejection a token from p instead
    of the residual max(0, p - q)."""
    accepted, tokens = verify_batch(p, q, drafts, g)
    rows = torch.arange(drafts.shape[0])
    rejected = accepted < drafts.shape[1]
    fresh = torch.multinomial(p[rows, accepted], 1, generator=g)[:, 0]
    tokens[rows[rejected], accepted[rejected]] = fresh[rejected]
    return accepted, tokens


@pytest.mark.parametrize("name, p0, q1", PAIRS, ids=[name for name, _, _ in PAIRS])
def test_the_first_emitted_token_is_distributed_as_the_target(name, p0, q1):
    accepted, tokens, drafts = first_tokens(p0, q1)
    distance, limit = tv(tokens[:, 0], p0), tolerance(V)
    rate = float((accepted > 0).double().mean())
    print(f"{name}: TV {distance:.4f} (tolerance {limit:.4f}), first-draft acceptance {rate:.4f}")
    assert distance < limit
    assert bool((p0[tokens[:, 0]] > 0).all())  # never a token the target excludes
    # acceptance of the first draft: sum_x min(p, q), within Hoeffding's bound for N draws
    expected = float(torch.minimum(p0, q1).sum())
    assert abs(rate - expected) < math.sqrt(math.log(2 / DELTA) / (2 * N))


def test_a_point_mass_on_an_excluded_token_is_never_accepted_and_still_exact():
    p0, q1 = PAIRS[4][1], PAIRS[4][2]
    accepted, tokens, drafts = first_tokens(p0, q1)
    assert bool((drafts[:, 0] == 2).all()) and int(accepted.max()) == 0  # acceptance 0 ...
    assert tv(tokens[:, 0], p0) < tolerance(V)  # ... and exactly p


def test_q_equal_to_p_accepts_every_draft():
    p = dist(3, 1, 4, 1, 5, 9)
    g = torch.Generator().manual_seed(1)
    k = 3
    drafts = torch.multinomial(p, N * k, replacement=True, generator=g).view(N, k)
    accepted, tokens = verify_batch(p.expand(N, k + 1, V), p.expand(N, k, V), drafts, g)
    assert bool((accepted == k).all())  # u * q < p with q = p and u < 1: always
    assert torch.equal(tokens[:, :k], drafts)
    assert tv(tokens[:, k], p) < tolerance(V)  # the bonus token from p_k


@pytest.mark.parametrize("rule", [accept_always, resample_from_p])
def test_the_statistic_catches_a_wrong_rule(rule):
    """The same statistic on wrong rules: accepting every draft emits q's distribution; resampling
    from p at a rejection emits min(p, q) + (1 - sum min(p, q)) p. Both exceed the tolerance."""
    name, p0, q1 = PAIRS[0]
    _, tokens, _ = first_tokens(p0, q1, rule=rule)
    distance = tv(tokens[:, 0], p0)
    print(f"{rule.__name__}: TV {distance:.4f} against tolerance {tolerance(V):.4f}")
    assert distance > 3 * tolerance(V)


# ---- the joint of the first two emitted tokens, drafts conditioned on what came before ------------
W = 5
P0 = dist(3, 0, 2, 4, 1)
P1 = torch.stack(
    [dist(1, 2, 0, 3, 1), dist(4, 1, 1, 0, 1), dist(0, 0, 5, 1, 1), dist(1, 1, 1, 1, 1), dist(2, 0, 0, 0, 3)]
)
Q1 = dist(1, 3, 1, 1, 0)  # mass where P0 has none (token 1), none where P0 has some (token 4)
Q2 = torch.stack(
    [dist(1, 0, 3, 1, 1), dist(1, 1, 1, 1, 1), dist(0, 2, 1, 0, 3), dist(5, 1, 0, 0, 1), dist(1, 1, 1, 3, 0)]
)


def one_round(context: torch.Tensor | None, g: torch.Generator, rule):
    """A verify round of 2 drafts: the target is a Markov chain (P0 first, then P1[previous]), the
    assistant another (Q1 first, then Q2[previous]); `context` the last token (None: the start)."""
    n = N
    q_first = Q1.expand(n, W) if context is None else Q2[context]
    p_first = P0.expand(n, W) if context is None else P1[context]
    d1 = torch.multinomial(q_first, 1, generator=g)[:, 0]
    d2 = torch.multinomial(Q2[d1], 1, generator=g)[:, 0]
    p = torch.stack([p_first, P1[d1], P1[d2]], 1)
    q = torch.stack([q_first, Q2[d1]], 1)
    return rule(p, q, torch.stack([d1, d2], 1), g)


def first_two(rule, seed: int = 0) -> torch.Tensor:
    """The first two emitted tokens of a drafted generation: from round 1 when it emitted two,
    else the second from a round 2 that starts at round 1's token."""
    g = torch.Generator().manual_seed(seed)
    accepted, tokens = one_round(None, g, rule)
    x = tokens[:, 0]
    _, again = one_round(x, g, rule)
    y = torch.where(accepted >= 1, tokens[:, 1], again[:, 0])
    return x * W + y


def test_the_first_two_emitted_tokens_are_distributed_as_the_target():
    joint = (P0[:, None] * P1).reshape(-1)  # P(x, y) = P0(x) P1(y | x)
    distance, limit = tv(first_two(verify_batch), joint), tolerance(W * W)
    wrong = tv(first_two(accept_always), joint)
    print(f"joint of two tokens: TV {distance:.4f} (tolerance {limit:.4f}); accept-always TV {wrong:.4f}")
    assert distance < limit
    assert wrong > 3 * limit  # the witness: the statistic fails a wrong rule here too


def test_top_p_supports_that_differ_stay_exact():
    """p and q from `runtime.sampling_probs` with top-p, so each excludes tokens the other keeps."""
    logits_p = torch.tensor([2.0, 1.5, 0.2, -1.0, 1.4, 0.1])
    logits_q = torch.tensor([-1.0, 1.6, 2.0, 1.0, 0.0, 0.3])
    sampling = Sampling(temperature=0.8, top_p=0.8)
    p0, q1 = sampling_probs(logits_p, sampling, 30.0), sampling_probs(logits_q, sampling, None)
    assert bool(((p0 == 0) & (q1 > 0)).any()) and bool(((q1 == 0) & (p0 > 0)).any())
    _, tokens, _ = first_tokens(p0.double(), q1.double())
    assert tv(tokens[:, 0], p0.double()) < tolerance(V)
    assert bool((p0[tokens[:, 0]] > 0).all())


def test_one_verify_step_and_its_edge_cases():
    p = torch.stack([dist(1, 1, 0, 0, 0, 0), dist(0, 0, 1, 0, 0, 0)])
    q = dist(0, 0, 0, 0, 1, 0)[None]  # q(x) = 1 on x = 4, p(4) = 0: rejected, residual = p
    verdict = verify_drafts(p, q, [4], torch.Generator().manual_seed(0))
    assert verdict.accepted == 0 and len(verdict.tokens) == 1 and verdict.tokens[0] in (0, 1)
    # q(x) = 0 for a drafted x with p(x) > 0 (a draft not from q): accepted, the ratio is infinite
    verdict = verify_drafts(p, dist(1, 0, 0, 0, 0, 0)[None], [1], torch.Generator().manual_seed(0))
    assert verdict.accepted == 1 and verdict.tokens == [1, 2]
    # a rejection whose residual max(0, p - q) is all zero (q >= p everywhere, as rounding can
    # leave it): the token comes from p, never from a zero or NaN row
    p_flat = torch.stack([dist(0, 1, 1, 0, 0, 0)] * 2)
    q_over = torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    for seed in range(20):
        verdict = verify_drafts(p_flat, q_over, [0], torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0 and verdict.tokens[0] in (1, 2)
    assert verify_drafts(p[:1], None, [], torch.Generator().manual_seed(0)).tokens[0] in (0, 1)  # no drafts


def test_mismatched_shapes_say_what_is_expected():
    with pytest.raises(SettingsError, match="2 drafts need 2 draft distributions"):
        verify_drafts(torch.ones(3, V) / V, torch.ones(1, V) / V, [0, 1])
    with pytest.raises(SettingsError, match="need the 2 distributions"):
        verify_drafts(torch.ones(3, V) / V, None, [0, 1])
