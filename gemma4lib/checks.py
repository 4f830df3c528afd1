"""The two checks every run reports, because neither implies the other.

SEQ_MATCH: the compiled graph's tokens equal the host fp32 reference's, token for token. It proves
the compiler is faithful. Coherence: the decoded answer makes sense (a predicate on the text).
It proves the reference is right: a wrong chat template or PLE wiring shared by device and
reference passes SEQ_MATCH in silence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Coherence = Callable[[str], bool]


def seq_match(device: Sequence[int], reference: Sequence[int]) -> bool:
    return list(device) == list(reference)


def first_mismatch(device: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (a, b) in enumerate(zip(device, reference)):
        if a != b:
            return i
    return None if len(device) == len(reference) else min(len(device), len(reference))


def expect_substring(expected: str, case_sensitive: bool = False) -> Coherence:
    """Coherent when the answer contains `expected` (e.g. 'Paris')."""
    def predicate(answer: str) -> bool:
        return expected in answer if case_sensitive else expected.lower() in answer.lower()
    predicate.__name__ = f"contains({expected!r})"
    return predicate


def expect_exact(expected: str) -> Coherence:
    def predicate(answer: str) -> bool:
        return answer.strip() == expected.strip()
    predicate.__name__ = f"equals({expected!r})"
    return predicate


@dataclass(frozen=True)
class CheckReport:
    seq_match: bool
    coherent: bool | None  # None: no predicate applies (random weights can never be coherent)
    answer: str | None
    reference_answer: str | None
    first_mismatch: int | None
    coherence_rule: str | None

    @property
    def passed(self) -> bool:
        return self.seq_match and self.coherent is not False


def run_checks(device: Sequence[int], reference: Sequence[int], answer: str | None,
               reference_answer: str | None, coherence: Coherence | None) -> CheckReport:
    coherent = None if coherence is None or answer is None else bool(coherence(answer))
    return CheckReport(seq_match(device, reference), coherent, answer, reference_answer,
                       first_mismatch(device, reference), getattr(coherence, "__name__", None))
