"""Shaping rewards and reward wrappers that do not look at the gold answer.

Factories return small callable classes rather than closures because TRL's async GRPO rollout worker
pickles reward functions into a child process and closures cannot be pickled (TRL's own factories do
the same). Each instance carries a stable ``__name__``, which TRL uses as the metric name
(``rewards/<name>/mean``).

Lengths here are counted in whitespace-separated words, not tokenizer tokens: the rewards then mean
the same thing for every base model and can be checked by ``posttrain rewards check`` without
loading a tokenizer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.rewards.parsing import completion_text, reasoning_block

logger = logging.getLogger(__name__)

__all__ = [
    "AdaptiveScaler",
    "LengthReward",
    "RepetitionPenalty",
    "make_adaptive_scaler",
    "make_length_reward",
    "make_repetition_penalty",
    "reasoning_steps_reward",
    "reward_name",
]

_STEP_MARKER_RE = re.compile(r"\bstep\s*\d+", re.IGNORECASE)
_STEP_LINE_RE = re.compile(
    r"^(?:\d+\s*[.):]\s|[-*\u2022]\s|(?:first|second|third|next|then|finally|therefore|so)\b)", re.IGNORECASE
)
# An equation: something before "=" and a number after it, e.g. "6 * 7 = 42" or "x = 3 + 4".
_EQUATION_BOTH_SIDES_RE = re.compile(r"[\w)][^=\n]*=[^=\n]*\d")


def reward_name(fn: Callable[..., Any]) -> str:
    """Metric name TRL will use for ``fn`` (same rule as ``trl.trainer.utils.get_callable_name``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


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


class AdaptiveScaler:
    """Callable behind :func:`make_adaptive_scaler`; holds the running statistics.

    Attributes ``mean``, ``std`` and ``calls`` expose the current state; :meth:`reset` clears it.
    """

    def __init__(
        self, reward_fn: Callable[..., Any], momentum: float, eps: float, clip: float | None, suffix: str
    ) -> None:
        self.reward_fn = reward_fn
        self.__name__ = f"{reward_name(reward_fn)}{suffix}"
        self.suffix = suffix
        self.momentum = momentum
        self.eps = eps
        self.clip = clip
        self.reset()

    def reset(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.calls = 0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def _update(self, values: list[float]) -> None:
        batch_mean = sum(values) / len(values)
        batch_var = sum((v - batch_mean) ** 2 for v in values) / len(values)
        if self.calls == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            # Variance of the mixture "old stats with weight m, this batch with weight 1-m", which
            # keeps the between-batch spread of means instead of only averaging within-batch variances.
            m = self.momentum
            new_mean = m * self.mean + (1 - m) * batch_mean
            self.var = m * (self.var + (self.mean - new_mean) ** 2) + (1 - m) * (
                batch_var + (batch_mean - new_mean) ** 2
            )
            self.mean = new_mean
        self.calls += 1

    def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
        raw = list(self.reward_fn(*args, **kwargs))
        present = [float(r) for r in raw if r is not None and not math.isnan(float(r))]
        if present:
            self._update(present)
        scale = self.std + self.eps
        out: list[float | None] = []
        for r in raw:
            if r is None or math.isnan(float(r)):
                out.append(r)
                continue
            z = (float(r) - self.mean) / scale
            if self.clip is not None:
                z = min(max(z, -self.clip), self.clip)
            out.append(z)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and self.calls:
            log_metric(f"rewards/{self.__name__}/running_mean", self.mean)
            log_metric(f"rewards/{self.__name__}/running_std", self.std)
        return out

    def __repr__(self) -> str:
        return (
            f"AdaptiveScaler({self.reward_fn!r}, momentum={self.momentum}, eps={self.eps}, clip={self.clip}, "
            f"mean={self.mean:.4g}, std={self.std:.4g}, calls={self.calls})"
        )


def make_adaptive_scaler(
    reward_fn: Callable[..., Any],
    momentum: float = 0.99,
    eps: float = 1e-6,
    clip: float | None = 5.0,
    suffix: str = "_scaled",
) -> AdaptiveScaler:
    """Wrap a reward so it returns ``(r - running_mean) / (running_std + eps)``, clipped to +/-``clip``.

    Why: TRL sums ``weight * reward`` before GRPO's per-group normalisation, so a component with a
    large raw spread (e.g. a length reward) can drown a sparse one (correctness) regardless of the
    configured weights. Standardizing each component makes the weights mean what they say.

    Stateful across calls: the statistics are an exponential moving average updated once per call
    (one TRL reward batch) with ``momentum`` (window of roughly ``1 / (1 - momentum)`` calls), and
    the current batch is included before it is scaled (so the first batch is standardized by its
    own statistics). A batch whose rewards are all equal scales to 0. ``None`` (and NaN) values pass
    through untouched and do not enter the statistics. ``clip`` (``None`` to disable) bounds the
    spike a rare success produces while the running std is still near 0. State is per process: with
    several ranks, or TRL's async rollout worker, each copy keeps its own statistics. The wrapper is
    named ``<wrapped name><suffix>``, e.g. ``correctness_reward_scaled``; running mean/std are
    reported through TRL's ``log_metric`` when available.

    >>> from posttrain.rewards.accuracy import correctness_reward
    >>> scaled = make_adaptive_scaler(correctness_reward)
    >>> out = scaled(["<answer>1</answer>", "<answer>2</answer>", "x"], answer=["1", "1", ""])
    >>> [None if r is None else round(r, 3) for r in out], scaled.__name__
    ([1.0, -1.0, None], 'correctness_reward_scaled')
    """
    if not callable(reward_fn):
        raise ValueError(f"adaptive scaler needs a callable reward, got {reward_fn!r}")
    target = reward_fn.func if isinstance(reward_fn, functools.partial) else reward_fn
    call = target if inspect.isroutine(target) else type(target).__call__
    if inspect.iscoroutinefunction(call):
        raise ValueError(f"adaptive scaler cannot wrap async reward {reward_name(reward_fn)!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise ValueError(f"clip must be a positive number or None, got {clip!r}")
    if not isinstance(suffix, str) or not suffix:
        raise ValueError(f"suffix must be a non-empty string, got {suffix!r}")
    return AdaptiveScaler(
        reward_fn, float(momentum), float(eps), None if clip is None else float(clip), suffix
    )
