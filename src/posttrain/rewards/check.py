"""Pure logic behind ``posttrain rewards check CONFIG``: score canned completions before training.

A mis-weighted or mis-parsed reward wastes a whole GPU run before anyone notices. Scoring a few
hand-written completions (plus reference solutions from the dataset) with the configured rewards and
weights shows in seconds whether "correct and formatted" really earns the most. Rewards are called
exactly as TRL 1.16 calls them (one batch, same keyword arguments), so a reward that would crash in
the trainer crashes here first.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "EXAMPLE_COMPLETIONS",
    "EXAMPLE_GOLD",
    "EXAMPLE_QUESTION",
    "INTENDED_BEST",
    "RewardCheckRow",
    "Verdict",
    "judge",
    "ranks_as_intended",
    "score_examples",
]

EXAMPLE_QUESTION = "A baker fills 6 trays with 7 muffins each. How many muffins does the baker make?"
EXAMPLE_GOLD = "42"
INTENDED_BEST = "correct+formatted"
EXAMPLE_COMPLETIONS: dict[str, str] = {
    INTENDED_BEST: (
        "<reasoning>\nThe baker fills 6 trays.\nEach tray holds 7 muffins.\n6 * 7 = 42\n</reasoning>\n"
        "<answer>\n42\n</answer>"
    ),
    "correct unformatted": "The baker fills 6 trays with 7 muffins each, so 6 * 7 = 42. The answer is 42.",
    "wrong+formatted": (
        "<reasoning>\nThe baker fills 6 trays.\nEach tray holds 7 muffins.\n6 + 7 = 13\n</reasoning>\n"
        "<answer>\n13\n</answer>"
    ),
    "empty": "",
    "rambling": " ".join(["Let me think about this problem carefully before I answer it."] * 25),
}


@dataclass(frozen=True)
class RewardCheckRow:
    """One scored completion: per-reward scores (``None`` = reward not applicable) and weighted total."""

    label: str
    completion: str
    gold: str
    scores: dict[str, float | None] = field(default_factory=dict)
    total: float = 0.0


def _noop_log_extra(column: str, values: list) -> None:
    logger.debug("reward logged extra column %r: %r", column, values)


def _noop_log_metric(name: str, value: float) -> None:
    logger.debug("reward logged metric %r = %r", name, value)


def _pseudo_token_ids(texts: Sequence[str]) -> list[list[int]]:
    """One id per whitespace word (shared vocabulary), so id-based rewards run without a tokenizer."""
    vocab: dict[str, int] = {}
    return [[vocab.setdefault(word, len(vocab)) for word in text.split()] for text in texts]


def _as_score(label: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward {label!r} returned a non-number {value!r}") from exc
    return None if math.isnan(score) else score


def score_examples(
    rewards: Sequence[tuple[str, float, Callable[..., Any]]],
    references: Sequence[tuple[str, str]] = (),
) -> list[RewardCheckRow]:
    """Score the built-in examples (gold ``EXAMPLE_GOLD``) and ``references`` with every reward.

    ``rewards`` are ``(label, weight, fn)`` triples; ``references`` are ``(completion text, gold)``
    pairs, e.g. dataset solutions rendered in the trained format, labelled ``reference #1``,
    ``reference #2``... Each reward is called once on the whole batch with TRL's keyword arguments
    (``prompts``, ``completions``, ``completion_ids`` - one pseudo id per word, ``answer``,
    ``trainer_state=None``, no-op ``log_extra``/``log_metric``). The total is
    ``sum(weight * score)`` with ``None``/NaN scores counting as 0. Raises ``ValueError`` when a
    reward returns the wrong number of scores or a non-number, and re-raises other failures with
    the reward's label.

    >>> from posttrain.rewards.accuracy import correctness_reward
    >>> rows = score_examples([("correctness", 2.0, correctness_reward)], [("<answer>7</answer>", "7")])
    >>> [(r.label, r.total) for r in rows][:2], rows[-1].label, rows[-1].scores
    ([('correct+formatted', 2.0), ('correct unformatted', 0.0)], 'reference #1', {'correctness': 1.0})
    """
    labels = [label for label, _, _ in rewards]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"reward labels must be unique, got duplicates: {', '.join(duplicates)}")

    cases = [(label, text, EXAMPLE_GOLD, EXAMPLE_QUESTION) for label, text in EXAMPLE_COMPLETIONS.items()]
    for i, (text, gold) in enumerate(references, start=1):
        cases.append((f"reference #{i}", text, gold, ""))
    # Conversational, as the trainer passes them for posttrain's chat prompts (TRL's own rewards
    # read ``completion[0]["content"]``; posttrain's accept both shapes).
    completions = [[{"role": "assistant", "content": text}] for _, text, _, _ in cases]
    call_kwargs = {
        "prompts": [[{"role": "user", "content": prompt}] for _, _, _, prompt in cases],
        "completion_ids": _pseudo_token_ids([text for _, text, _, _ in cases]),
        "answer": [gold for _, _, gold, _ in cases],
        "trainer_state": None,
        "log_extra": _noop_log_extra,
        "log_metric": _noop_log_metric,
    }

    per_reward: dict[str, list[float | None]] = {}
    for label, _weight, fn in rewards:
        # Fresh list copies per reward, so one that mutates its inputs cannot skew the next.
        kwargs = {
            key: list(value) if isinstance(value, list) else value for key, value in call_kwargs.items()
        }
        try:
            raw = fn(completions=list(completions), **kwargs)
        except Exception as exc:
            raise RuntimeError(f"reward {label!r} failed on the check examples: {exc}") from exc
        raw = list(raw)
        if len(raw) != len(cases):
            raise ValueError(f"reward {label!r} returned {len(raw)} scores for {len(cases)} completions")
        per_reward[label] = [_as_score(label, value) for value in raw]

    rows = []
    for index, (case_label, text, gold, _) in enumerate(cases):
        scores = {label: per_reward[label][index] for label in labels}
        total = sum(float(weight) * (scores[label] or 0.0) for label, weight, _ in rewards)
        rows.append(RewardCheckRow(label=case_label, completion=text, gold=gold, scores=scores, total=total))
    return rows


def ranks_as_intended(rows: Sequence[RewardCheckRow]) -> bool:
    """True when ``correct+formatted`` has a strictly higher total than every other built-in example.

    References are ignored (their quality is the dataset's, not the reward design's). False when
    the built-in rows are missing.

    >>> from posttrain.rewards.format import strict_format_reward
    >>> ranks_as_intended(score_examples([("strict_format", 1.0, strict_format_reward)]))  # ties with wrong
    False
    """
    builtin = {row.label: row.total for row in rows if row.label in EXAMPLE_COMPLETIONS}
    if INTENDED_BEST not in builtin or len(builtin) < 2:
        return False
    best = builtin.pop(INTENDED_BEST)
    return all(best > total for total in builtin.values())


@dataclass(frozen=True)
class Verdict:
    """How a stage's rewards rank the examples: ``ok``, ``note`` (format-only stage) or ``warning``."""

    level: str
    message: str

    @property
    def failed(self) -> bool:
        return self.level == "warning"


def judge(rows: Sequence[RewardCheckRow]) -> Verdict:
    """The verdict ``posttrain rewards check`` prints for one stage's scored rows.

    A stage that only rewards format cannot tell right from wrong, so a tie between the correct and
    the wrong formatted answer is a note, not a failure; any other rival is a warning.

    >>> from posttrain.rewards.format import strict_format_reward
    >>> judge(score_examples([("strict_format", 1.0, strict_format_reward)])).level
    'note'
    """
    best = next(r for r in rows if r.label == INTENDED_BEST)
    rivals = [
        r.label
        for r in rows
        if r is not best and not r.label.startswith("reference") and r.total >= best.total
    ]
    if not rivals and ranks_as_intended(rows):
        return Verdict("ok", f"ok: '{INTENDED_BEST}' ranks strictly highest")
    if rivals == ["wrong+formatted"]:
        return Verdict(
            "note",
            f"note: '{INTENDED_BEST}' ties 'wrong+formatted': this stage rewards format, not correctness",
        )
    return Verdict("warning", f"WARNING: {', '.join(rivals)} score at least as high as '{INTENDED_BEST}'")
