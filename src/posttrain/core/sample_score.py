"""Scoring one completion against a gold answer: the pure part evaluation and training both use.

The GSM8K evaluator (:mod:`posttrain.evaluation.scoring` aggregates these into report metrics) and
the in-training evaluation of GRPO stages (:mod:`posttrain.training.eval_callback`) score with the
same function, on the parser the rewards use (:mod:`posttrain.core.parsing`), so a reported
accuracy, the curve logged during training and the training signal agree on what a completion
answered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from posttrain.core.parsing import answers_match, normalize_gold, parse_answers

__all__ = ["SampleScore", "canonical_gold", "score_completion"]


@dataclass(frozen=True)
class SampleScore:
    """One completion of one question, as scored."""

    completion: str
    strict: str | None
    """Answer in the last ``<answer>`` block (normalized), or None."""
    flexible: str | None
    """Last number anywhere (normalized), or None."""
    correct_strict: bool
    correct_flexible: bool
    strict_format: bool
    tokens: int
    """Generated tokens up to and including the stop token."""
    truncated: bool
    """Hit ``max_new_tokens`` without a stop token."""
    tool_calls: int = 0
    """Calls the completion made to an engine tool (the calculator), failed ones included."""
    tool_failures: int = 0
    """Calls whose input the tool could not use (malformed or unsafe)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def canonical_gold(answer: Any) -> str:
    """The gold answer as the parser normalizes it (raw strings kept if they are not numbers)."""
    value = normalize_gold(answer)
    return value if value is not None else str(answer)


def score_completion(
    completion: str,
    gold: Any,
    *,
    tokens: int = 0,
    truncated: bool = False,
    tool_calls: int = 0,
    tool_failures: int = 0,
) -> SampleScore:
    """Score one completion text against a gold answer (a number or a ``#### N`` solution).

    >>> s = score_completion("<reasoning>\\n6*7\\n</reasoning>\\n<answer>\\n42\\n</answer>", "42")
    >>> s.correct_strict, s.correct_flexible, s.strict_format
    (True, True, True)
    >>> s = score_completion("6*7 = 42", "42")
    >>> s.strict, s.correct_strict, s.correct_flexible
    (None, False, True)
    """
    parsed = parse_answers(completion)
    return SampleScore(
        completion=completion,
        strict=parsed.strict,
        flexible=parsed.flexible,
        correct_strict=answers_match(parsed.strict, gold),
        correct_flexible=answers_match(parsed.flexible, gold),
        strict_format=parsed.strict_format,
        tokens=tokens,
        truncated=truncated,
        tool_calls=tool_calls,
        tool_failures=tool_failures,
    )
