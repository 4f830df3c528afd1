"""The three checks every run reports, because none implies the others.

SEQ_MATCH: the compiled graph's tokens equal the host fp32 reference's, token for token. A confident
model (the trained fixtures answer with margins of 3-5 logits) hides logit errors of 0.1-0.3 behind
unchanged tokens, so:

LOGITS_MATCH: the device's logits at every generated position (the prefill's and each decode step's)
against the reference's for the same tokens (teacher forcing), within a tolerance taken from the
reference's own numerical spread on that sequence (`logits_tolerance`; NxD Inference's
`check_accuracy_logits` is the model for it).

Coherence: the decoded answer makes sense (a predicate on the text). It proves the reference is
right: a wrong chat template or PLE wiring shared by device and reference passes both equality
checks in silence. A run record carries all three (smoke runs: also on a random-weights witness);
`failed_checks` is the one verdict the command line, the fault lab and papermill share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import GraphFormError

if TYPE_CHECKING:  # torch is imported where logits are compared: the record verdict needs none
    import torch

Coherence = Callable[[str], bool]

# The tolerance rule: a device may differ from the reference by LOGITS_FACTOR times the largest
# |reference - higher-precision reference| seen on the same rows, never less than LOGITS_FLOOR.
# Measured (fp32, one thread): compiled and eager graphs differ from HF fp32 by 0.5-2.1x that
# spread on the ten tiny models (five variants, random and trained); a random E4B of other
# dimensions by 0.54x (2.37e-3 against HF's own 4.4e-3). 8x leaves room for other compilers'
# summation orders; the graph-level faults of the fault lab exceed it by >= 100x on the
# trained fixtures.
LOGITS_FACTOR = 8.0
# The floor keeps a near-exact spread (fp32 rounding that happens to cancel) from demanding more
# than fp32 can give: ~100 ulps of a logit of 10.
LOGITS_FLOOR = 1e-5


def seq_match(device: Sequence[int], reference: Sequence[int]) -> bool:
    return list(device) == list(reference)


def first_mismatch(device: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (a, b) in enumerate(zip(device, reference, strict=False)):
        if a != b:
            return i
    return None if len(device) == len(reference) else min(len(device), len(reference))


def expect_substring(expected: str) -> Coherence:
    """Coherent when the answer contains `expected` (e.g. 'Paris'), in any case."""

    def predicate(answer: str) -> bool:
        return expected.lower() in answer.lower()

    predicate.__name__ = f"contains({expected!r})"
    return predicate


# ---- LOGITS_MATCH --------------------------------------------------------------------------------


def logits_tolerance(spread: float, factor: float = LOGITS_FACTOR, floor: float = LOGITS_FLOOR) -> float:
    """Allowed max |device - reference| when the reference's own rounding moves it by `spread`."""
    return max(factor * spread, floor)


def phase_of(position: int) -> str:
    """Row 0 of the step logits is the prefill's (last prompt token); row i >= 1: decode step i."""
    return "prefill" if position == 0 else "decode"


@dataclass(frozen=True)
class LogitsCheck:
    """LOGITS_MATCH for one run: per-step errors and the tolerance they were held to.

    Positions index the generated tokens: 0 is the prefill's prediction, i >= 1 decode step i
    (its logits predicted token i). Errors are on softcapped logits, the reference's own output.
    """

    passed: bool
    max_err: float
    tolerance: float
    spread: float  # max |reference - higher-precision reference| on the same rows
    precise_dtype: str
    factor: float
    floor: float
    worst_position: int
    worst_token_id: int  # the vocabulary entry with the largest error at the worst position
    first_failure: int | None  # first position over the tolerance
    prompt_tokens: int
    step_errors: list[float] = field(default_factory=list)

    @property
    def worst_phase(self) -> str:
        return phase_of(self.worst_position)

    @property
    def prefill_max_err(self) -> float:
        return self.step_errors[0]

    @property
    def decode_max_err(self) -> float | None:
        return max(self.step_errors[1:]) if len(self.step_errors) > 1 else None

    @property
    def rule(self) -> str:
        return (
            f"max(|device - reference|) <= max({self.factor:g} x spread, {self.floor:g}); "
            f"spread = max |reference - {self.precise_dtype} reference| = {self.spread:.3g}"
        )

    def _where(self, position: int) -> str:
        step = "prefill (last prompt token)" if position == 0 else f"decode step {position}"
        return f"{step}, sequence position {self.prompt_tokens - 1 + position}"

    def explain(self) -> str:
        """One sentence: what was compared, the worst error, the tolerance and its origin."""
        head = "LOGITS_MATCH passed" if self.passed else "LOGITS_MATCH failed"
        text = (
            f"{head}: max |device - reference| {self.max_err:.3g} at {self._where(self.worst_position)} (token id "
            f"{self.worst_token_id}) {'<=' if self.passed else '>'} tolerance {self.tolerance:.3g} = "
            f"max({self.factor:g} x spread {self.spread:.3g} [{self.precise_dtype} reference], floor {self.floor:g})"
        )
        first = self.first_failure
        if not self.passed and first is not None and first != self.worst_position:
            text += f"; first over the tolerance at {self._where(first)} ({self.step_errors[first]:.3g})"
        return text

    def record(self) -> dict[str, Any]:
        """The run record's `logits_*` keys (JSON-friendly)."""
        return {
            "logits_match": self.passed,
            "logits_max_err": self.max_err,
            "logits_tolerance": self.tolerance,
            "logits_worst_position": self.worst_position,
            "logits_worst_phase": self.worst_phase,
            "logits_first_failure": self.first_failure,
            "logits_prefill_max_err": self.prefill_max_err,
            "logits_decode_max_err": self.decode_max_err,
            "logits_spread": self.spread,
            "logits_rule": self.rule,
            "logits_step_errors": [float(e) for e in self.step_errors],
            "logits_explain": self.explain(),
        }


def compare_logits(
    device_raw: torch.Tensor,
    reference: torch.Tensor,
    spread: float,
    cap: float | None,
    prompt_tokens: int,
    precise_dtype: str = "float64",
    factor: float = LOGITS_FACTOR,
    floor: float = LOGITS_FLOOR,
) -> LogitsCheck:
    """LOGITS_MATCH from the device's raw step logits `[n, vocab]` (the graph leaves the softcap
    off) and the reference's softcapped ones for the same tokens: both compared softcapped."""
    import torch

    if device_raw.shape != reference.shape:
        raise GraphFormError(
            f"device logits {tuple(device_raw.shape)} and reference logits "
            f"{tuple(reference.shape)} cover different steps"
        )
    device = device_raw.to(torch.float64)
    if cap:
        device = cap * torch.tanh(device / cap)
    diff = (device - reference.to(torch.float64)).abs()
    per_step, worst_ids = diff.max(dim=-1)
    worst = int(per_step.argmax())
    tolerance = logits_tolerance(spread, factor, floor)
    over = (per_step > tolerance).nonzero()
    max_err = float(per_step[worst])
    return LogitsCheck(
        passed=max_err <= tolerance,
        max_err=max_err,
        tolerance=tolerance,
        spread=float(spread),
        precise_dtype=precise_dtype,
        factor=factor,
        floor=floor,
        worst_position=worst,
        worst_token_id=int(worst_ids[worst]),
        first_failure=int(over[0]) if len(over) else None,
        prompt_tokens=prompt_tokens,
        step_errors=per_step.tolist(),
    )


def check_logits(
    lm: torch.nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int], device_raw: torch.Tensor
) -> LogitsCheck:
    """Teacher-force `tokens` through the reference, measure its spread on those rows, compare."""
    from .reference import logits_spread, teacher_forced_logits

    tokens = list(tokens)
    reference = teacher_forced_logits(lm, prompt_ids, tokens)
    spread, precise = logits_spread(lm, prompt_ids, tokens, reference)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return compare_logits(device_raw[: len(tokens)], reference, spread, cap, len(prompt_ids), precise)


# ---- one report per run --------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckReport:
    seq_match: bool
    coherent: bool | None  # None: no predicate applies (random weights can never be coherent)
    answer: str | None
    reference_answer: str | None
    first_mismatch: int | None
    coherence_rule: str | None
    logits: LogitsCheck | None = None  # None: the run kept no per-step logits

    @property
    def logits_match(self) -> bool | None:
        return None if self.logits is None else self.logits.passed

    @property
    def passed(self) -> bool:
        return self.seq_match and self.coherent is not False and self.logits_match is not False


def run_checks(
    device: Sequence[int],
    reference: Sequence[int],
    answer: str | None,
    reference_answer: str | None,
    coherence: Coherence | None,
    logits: LogitsCheck | None = None,
) -> CheckReport:
    coherent = None if coherence is None or answer is None else bool(coherence(answer))
    return CheckReport(
        seq_match(device, reference),
        coherent,
        answer,
        reference_answer,
        first_mismatch(device, reference),
        getattr(coherence, "__name__", None),
        logits,
    )


def answer_text(tokenizer: Any, tokens: Sequence[int]) -> str | None:
    """The decoded answer a person reads (special tokens dropped); None without a tokenizer."""
    if tokenizer is None:
        return None
    return tokenizer.decode(list(tokens), skip_special_tokens=True).strip()


def evaluate(
    lm: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    reference: Sequence[int],
    *,
    expect: str | None = None,
    step_logits: Any = None,
) -> CheckReport:
    """The three checks of one device run, built in one place for every caller: SEQ_MATCH (`tokens`
    against `reference`), LOGITS_MATCH when the run kept its `step_logits`, coherence (the answer
    contains `expect`) when there is a tokenizer to read it with."""
    coherence = expect_substring(expect) if expect and tokenizer is not None else None
    logits = check_logits(lm, list(prompt_ids), list(tokens), step_logits) if step_logits is not None else None
    return run_checks(
        list(tokens),
        list(reference),
        answer_text(tokenizer, tokens),
        answer_text(tokenizer, reference),
        coherence,
        logits,
    )


# ---- the verdict of a run record -----------------------------------------------------------------


def failed_checks(record: Mapping[str, Any]) -> list[str]:
    """Names of the checks a run record failed: seq_match, logits_match, coherence, and the
    witness's `witness.seq_match` / `witness.logits_match`. Empty: the run passed."""
    own = (("seq_match", "seq_match"), ("logits_match", "logits_match"), ("coherence", "coherent"))
    failed = [name for name, key in own if record.get(key) is False]
    witness = record.get("witness") or {}
    failed += [f"witness.{name}" for name in ("seq_match", "logits_match") if witness.get(name) is False]
    if record.get("draft") and record.get("hf_assisted_match") is False:  # drafting: == HF's assisted generate
        failed.append("hf_assisted_match")
    return failed


def failure_reasons(record: Mapping[str, Any]) -> list[str]:
    """One line per failed check, each saying where (the row, with a batch) and by how much."""
    reasons = []
    for prefix, run in (("", record), ("witness: ", record.get("witness") or {})):
        for row in run.get("rows") or [run]:
            where = f"{prefix}row {row['row']}: " if "row" in row else prefix
            if row.get("seq_match") is False:
                at = row.get("first_mismatch")
                reasons.append(f"{where}SEQ_MATCH failed" + ("" if at is None else f" (first mismatch at token {at})"))
            if row.get("logits_match") is False:
                reasons.append(where + str(row.get("logits_explain") or _logits_failure(row)))
            if row.get("coherent") is False:
                reasons.append(f"{where}incoherent answer {row.get('answer')!r} ({record.get('coherence_rule')})")
    if record.get("draft") and record.get("hf_assisted_match") is False:
        reasons.append("tokens differ from transformers' generate(assistant_model=...) with the same assistant")
    return reasons


def _logits_failure(row: Mapping[str, Any]) -> str:
    if row.get("logits_max_err") is None:
        return "LOGITS_MATCH failed"
    err, tolerance = row["logits_max_err"], row["logits_tolerance"]
    return f"LOGITS_MATCH failed: max |device - reference| {err:.3g} > tolerance {tolerance:.3g}"


def record_passed(record: Mapping[str, Any]) -> bool:
    return not failed_checks(record)
