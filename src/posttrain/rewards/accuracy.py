"""Answer-correctness rewards: the verifiable signal GRPO is actually optimising.

Both read the answer with :func:`~posttrain.core.parsing.parse_strict` / ``answer_block``, the
same parser the evaluator uses, so the training reward and the reported strict accuracy cannot
drift apart. There is deliberately no fallback to "last number anywhere": paying for a correct
number outside ``<answer>`` would teach the model that the format is optional.

Signatures follow TRL 1.16: ``f(completions, answer, **kwargs) -> list[float | None]`` where
``answer`` is the dataset's gold column, one entry per completion.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from posttrain.core.calculator import evaluate_arithmetic
from posttrain.core.parsing import (
    ANNOTATION_RE,
    answer_block,
    completion_text,
    normalize_gold,
    normalize_number,
    parse_strict,
    reasoning_block,
)

logger = logging.getLogger(__name__)

__all__ = ["arithmetic_reward", "correctness_reward", "int_answer_reward", "setup_reward"]


def correctness_reward(
    completions: Sequence[Any],
    answer: Sequence[Any],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the last ``<answer>`` block holds the gold number, else 0.0.

    The answer is read strictly (see module docstring); numbers compare after normalization, so
    ``$1,234.00`` matches gold ``1234``. A gold answer that is not a number (empty, malformed) gives
    ``None``: TRL then skips this reward for that completion instead of teaching from a wrong label.
    A raw GSM8K solution ending in ``#### N`` is accepted as gold. When run inside the trainer,
    the parsed answer is added to the completions table as column ``parsed_answer``.

    >>> done = "<reasoning>\\n6*7=42\\n</reasoning>\\n<answer>\\n42\\n</answer>"
    >>> correctness_reward([done, "The answer is 42", [{"role": "assistant", "content": done}], done],
    ...                    answer=["42", "42", "42.0", ""])
    [1.0, 0.0, 1.0, None]
    """
    if len(completions) != len(answer):
        raise ValueError(f"correctness_reward got {len(completions)} completions but {len(answer)} answers")
    rewards: list[float | None] = []
    parsed: list[str | None] = []
    unscorable = 0
    for completion, gold in zip(completions, answer, strict=True):
        gold_n = normalize_gold(gold)
        pred = parse_strict(completion)
        parsed.append(pred)
        if gold_n is None:
            unscorable += 1
            rewards.append(None)
        else:
            rewards.append(1.0 if pred == gold_n else 0.0)
    if unscorable:
        logger.warning(
            "correctness_reward: %d of %d gold answers are not numbers (first: %r); those completions "
            "get no correctness reward",
            unscorable,
            len(answer),
            next(g for g in answer if normalize_gold(g) is None),
        )
    if callable(log_extra):
        log_extra("parsed_answer", parsed)
    return rewards


def int_answer_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.5 when the whole ``<answer>`` block is an integer, else 0.0 (gold is not consulted).

    A dense, easy-to-earn nudge towards answers that look like GSM8K golds (which are integers):
    the entire block content must normalize to a whole number, so ``"42"``, ``"-3"``, ``"$1,200"``
    and ``"7.0"`` qualify while ``"42 apples"``, ``"2.5"`` or a missing block do not. Scale: 0.5.

    >>> blocks = ["<answer>\\n42\\n</answer>", "<answer>2.5</answer>", "<answer>4 cats</answer>", "4"]
    >>> int_answer_reward(blocks)
    [0.5, 0.0, 0.0, 0.0]
    """
    rewards = []
    for completion in completions:
        content = answer_block(completion)
        value = normalize_number(content) if content is not None else None
        rewards.append(0.5 if value is not None and "." not in value else 0.0)
    return rewards


# One worked calculation: an expression of numbers and + - * / x (at least one operator), "=", a
# number, e.g. "9*21 = 189", "$72 + $23 = $95", "(40 - 5) / 5 = 7". Units or words between them break
# the match, so "3 boxes * 4 = 12" is not checked (neither paid nor penalised).
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
_OPERAND = rf"\(?\$?{_NUMBER}\)?"
_CALC_RE = re.compile(
    rf"(?<![\w.])({_OPERAND}(?:\s*[-+*/x\u00d7\u00f7]\s*{_OPERAND})+)\s*=\s*\$?(-?{_NUMBER})"
)


def arithmetic_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The share of the reasoning's worked calculations (``a op b = c``) whose result is right.

    A calculator check, not an answer check: small models set problems up correctly and then
    write ``9*21 = 181``; this pays for each right step, so GRPO gets a graded signal on problems
    whose final answer the model never reaches. A completion with no checkable calculation scores
    0.0. Values compare exactly (fractions), after dropping ``$`` and thousands commas.

    >>> arithmetic_reward([
    ...     "<reasoning>\\nShe has 9*21 = 189 pencils.\\nThen 189 - 9 = 180.\\n</reasoning>",
    ...     "He has 9*21 = 181 pencils, then $181 + $19 = $200.",
    ...     "No numbers worked out here.",
    ...     "(40 - 5) / 5 = 7 and 1,200/4 = 300",
    ... ])
    [1.0, 0.5, 0.0, 1.0]
    """
    scores = []
    for completion in completions:
        text = reasoning_block(completion) or completion_text(completion)
        checks = []
        for expression, result in _CALC_RE.findall(text):
            got, claimed = evaluate_arithmetic(expression), normalize_number(result)
            if got is not None and claimed is not None:
                checks.append(got == Fraction(claimed))
        scores.append(sum(checks) / len(checks) if checks else 0.0)
    return scores


_RESULT_RE = re.compile(rf"=\s*\$?\s*(-?{_NUMBER})")


def _reference_results(solution: Any) -> list[str]:
    """The values of a worked solution's calculator annotations (``<<48/2=24>>`` -> ``24``), normalized."""
    values = []
    for annotation in ANNOTATION_RE.findall(solution if isinstance(solution, str) else ""):
        value = normalize_number(annotation[2:-2].rpartition("=")[2])
        if value is not None:
            values.append(value)
    return values


def setup_reward(
    completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """The share of the reference solution's intermediate results the completion computes.

    A problem set up right computes the same intermediate values as the worked solution, whatever
    the words around them: ``48/2 = 24`` then ``48+24 = 72`` for Natalia's clips. With the inline
    calculator every computed value is exact, so a matching value means that step's numbers and
    operation were chosen right; the score gives partial credit to a three-step solution with two
    right steps, where the correctness reward gives 0 to both it and a blank. Values are read after
    each ``=`` of the reasoning and matched to the ``<<a*b=c>>`` annotations of the dataset's
    ``solution`` column as multisets (a value computed twice counts once unless the reference has it
    twice). None where the solution has no annotation: nothing to compare with (TRL skips it).

    >>> reference = "She sold 48/2 = <<48/2=24>>24 clips.\\nIn all 48+24 = <<48+24=72>>72.\\n#### 72"
    >>> setup_reward(["<reasoning>\\n48/2 = 24\\n48+24 = 72\\n</reasoning>", "48/2 = 24, 24+24 = 48",
    ...               "no work shown"], solution=[reference] * 3)
    [1.0, 0.5, 0.0]
    >>> setup_reward(["1+1 = 2"], solution=["#### 2"])
    [None]
    """
    solutions = list(solution) if solution is not None else [None] * len(completions)
    if len(solutions) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(solutions)} solutions")
    scores: list[float | None] = []
    for completion, reference in zip(completions, solutions, strict=True):
        wanted = _reference_results(reference)
        if not wanted:
            scores.append(None)
            continue
        text = reasoning_block(completion) or completion_text(completion)
        computed = [v for v in (normalize_number(m) for m in _RESULT_RE.findall(text)) if v is not None]
        matched = 0
        for value in wanted:
            if value in computed:
                computed.remove(value)
                matched += 1
        scores.append(matched / len(wanted))
    return scores
