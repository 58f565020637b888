"""Shaping rewards: scores for how a completion is written (steps, length, repetition), not for
whether its answer is right.

Factories return small callable classes rather than closures because TRL's async GRPO rollout worker
pickles reward functions into a child process and closures cannot be pickled (TRL's own factories do
the same). Each instance carries a stable ``__name__``, which TRL uses as the metric name
(``rewards/<name>/mean``).

Lengths here are counted in whitespace-separated words, not tokenizer tokens: the rewards then mean
the same thing for every base model and can be checked by ``posttrain rewards check`` without
loading a tokenizer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from posttrain.core.parsing import completion_text, reasoning_block

logger = logging.getLogger(__name__)

__all__ = [
    "LengthReward",
    "RepetitionPenalty",
    "make_length_reward",
    "make_repetition_penalty",
    "reasoning_steps_reward",
]

_STEP_MARKER_RE = re.compile(r"\bstep\s*\d+", re.IGNORECASE)
_STEP_LINE_RE = re.compile(
    r"^(?:\d+\s*[.):]\s|[-*\u2022]\s|(?:first|second|third|next|then|finally|therefore|so)\b)", re.IGNORECASE
)
# An equation: something before "=" and a number after it, e.g. "6 * 7 = 42" or "x = 3 + 4".
_EQUATION_BOTH_SIDES_RE = re.compile(r"[\w)][^=\n]*=[^=\n]*\d")


def _count_steps(text: str) -> int:
    count = 0
    seen: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.lower() in seen:  # repeating a line is not another step
            continue
        seen.add(line.lower())
        markers = len(_STEP_MARKER_RE.findall(line))
        is_step = bool(_STEP_LINE_RE.match(line) or _EQUATION_BOTH_SIDES_RE.search(line))
        count += max(markers, int(is_step))
    return count


def reasoning_steps_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """``min(steps / 3, 1.0)``: rewards visibly multi-step reasoning, saturating at three steps.

    Counted inside the ``<reasoning>`` block when there is one (else the whole completion), one per
    distinct non-empty line that is a numbered/bulleted item, starts with a transition word
    (First, Next, Then, Finally, So, Therefore), or is an equation with a number after ``=``; a
    line with several "Step N" markers counts each. Duplicate lines count once, so copying one
    line many times earns nothing beyond the first copy.

    >>> reasoning_steps_reward([
    ...     "<reasoning>\\nStep 1: 6 trays.\\nStep 2: 6 * 7 = 42\\nSo 42 muffins.\\n</reasoning>",
    ...     "<reasoning>\\n6 * 7 = 42\\n</reasoning>",
    ...     "I just know it.",
    ... ])
    [1.0, 0.3333333333333333, 0.0]
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        block = reasoning_block(text)
        steps = _count_steps(block if block is not None else text)
        rewards.append(min(steps / 3.0, 1.0))
    return rewards


class LengthReward:
    """Callable behind :func:`make_length_reward` (a class so it pickles; see module docstring)."""

    def __init__(self, min_tokens: int, max_tokens: int, decay_tokens: int | None) -> None:
        self.__name__ = "length_reward"
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.decay_tokens = decay_tokens if decay_tokens is not None else max(max_tokens, 1)

    def score(self, n_words: int) -> float:
        if n_words < self.min_tokens:
            return n_words / self.min_tokens
        if n_words <= self.max_tokens:
            return 1.0
        return max(0.0, 1.0 - (n_words - self.max_tokens) / self.decay_tokens)

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [self.score(len(completion_text(c).split())) for c in completions]

    def __repr__(self) -> str:
        return (
            f"LengthReward(min_tokens={self.min_tokens}, max_tokens={self.max_tokens}, "
            f"decay_tokens={self.decay_tokens})"
        )


def make_length_reward(
    min_tokens: int = 20, max_tokens: int = 300, decay_tokens: int | None = None
) -> LengthReward:
    """Reward a target length range, named ``length_reward``; length = whitespace-separated words.

    1.0 for ``min_tokens <= words <= max_tokens``; below, a linear ramp ``words / min_tokens`` (an
    empty completion gets 0.0); above, a linear decay reaching 0.0 at ``max_tokens + decay_tokens``
    (``decay_tokens`` defaults to ``max_tokens``). Guards against both one-word guesses and
    rambling until the generation limit.

    >>> length = make_length_reward(min_tokens=4, max_tokens=8, decay_tokens=4)
    >>> length(["two words", "five words is in range", "a " * 10, "a " * 20]), length.__name__
    ([0.5, 1.0, 0.5, 0.0], 'length_reward')
    """
    for key, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    if max_tokens < min_tokens or max_tokens == 0:
        raise ValueError(
            f"need 0 < max_tokens >= min_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}"
        )
    if decay_tokens is not None and (
        isinstance(decay_tokens, bool) or not isinstance(decay_tokens, int) or decay_tokens <= 0
    ):
        raise ValueError(f"decay_tokens must be a positive integer or None, got {decay_tokens!r}")
    return LengthReward(min_tokens, max_tokens, decay_tokens)


class RepetitionPenalty:
    """Callable behind :func:`make_repetition_penalty` (a class so it pickles)."""

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.__name__ = "repetition_penalty"
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def score(self, text: str) -> float:
        words = text.lower().split()
        if len(words) < self.ngram_size:
            return 0.0
        ngrams = [tuple(words[i : i + self.ngram_size]) for i in range(len(words) - self.ngram_size + 1)]
        repeated_fraction = 1.0 - len(set(ngrams)) / len(ngrams)
        return repeated_fraction * self.max_penalty if repeated_fraction else 0.0

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [self.score(completion_text(c)) for c in completions]

    def __repr__(self) -> str:
        return f"RepetitionPenalty(ngram_size={self.ngram_size}, max_penalty={self.max_penalty})"


def make_repetition_penalty(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """Penalty ``max_penalty * (1 - unique n-grams / total n-grams)``, named ``repetition_penalty``.

    N-grams are over lower-cased whitespace-separated words. Degenerate loops are the usual way a
    policy games length- and format-shaping rewards; this makes them cost. 0.0 for text without a
    repeated n-gram or shorter than ``ngram_size`` words; approaches ``max_penalty`` (must be
    <= 0) as the text becomes one repeated phrase.

    >>> penalty = make_repetition_penalty(ngram_size=2)
    >>> penalty(["a b c d", "a a a a a"])
    [0.0, -0.75]
    """
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(f"ngram_size must be a positive integer, got {ngram_size!r}")
    if isinstance(max_penalty, bool) or not isinstance(max_penalty, (int, float)) or max_penalty > 0:
        raise ValueError(f"max_penalty must be a number <= 0, got {max_penalty!r}")
    return RepetitionPenalty(ngram_size, float(max_penalty))
