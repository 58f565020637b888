"""Reward faults made visible: a reward that raises, returns the wrong shape, NaN or None.

TRL calls a reward with a batch of completions and takes what comes back on trust: an exception
ends training with a traceback that names neither the example nor the completion, a bare ``None``
or a short list fails deep inside TRL, and NaN/None scores are silently summed as 0. Every reward a
stage uses is wrapped in a :class:`GuardedReward`, which

* on an exception, calls the reward again one example at a time to find the failing ones, then
  follows the reward's ``on_error`` (``RewardSpec.on_error``): ``fail`` stops the stage with a
  one-line :class:`RewardError` naming the reward, the example index and the start of its
  completion; ``zero`` scores the failing examples 0.0; ``skip`` scores them None (TRL leaves
  them out of the weighted sum, like any None);
* refuses a result that is not one number (or None) per completion, naming the reward;
* counts NaN and None scores and reports their fraction as the metric
  ``rewards/<name>/invalid_frac`` (through TRL's ``log_metric``), which the GRPO health monitor
  alerts on and fails the stage above ``monitor.max_invalid_rewards``; NaN becomes None, which TRL
  and DPO's pair scoring both treat as "no score".
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.core.errors import StageError
from posttrain.core.parsing import completion_text
from posttrain.rewards.scaling import reward_name

logger = logging.getLogger(__name__)

__all__ = ["ON_ERROR", "GuardedReward", "RewardError", "invalid_metric"]

ON_ERROR = ("fail", "zero", "skip")
_PREVIEW_CHARS = 60


class RewardError(StageError):
    """A reward that failed in a way its ``on_error`` does not absorb (or returned nonsense)."""


def invalid_metric(name: str) -> str:
    """The metric a guarded reward logs: the fraction of its scores that were NaN or None."""
    return f"rewards/{name}/invalid_frac"


def _preview(completion: Any) -> str:
    text = " ".join(completion_text(completion).split())
    return text[:_PREVIEW_CHARS] + ("..." if len(text) > _PREVIEW_CHARS else "")


class GuardedReward:
    """``reward`` with the checks of the module docstring; TRL sees the same ``__name__``."""

    def __init__(self, reward: Callable[..., Any], on_error: str = "fail", label: str | None = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        self.reward = reward
        self.on_error = on_error
        self.__name__ = reward_name(reward)
        self.label = label or self.__name__
        self.failures = 0
        """Examples whose score came from ``on_error`` (zero/skip) so far."""
        self._warned = False

    def __repr__(self) -> str:
        return f"GuardedReward({self.reward!r}, on_error={self.on_error!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
        completions = kwargs["completions"] if "completions" in kwargs else args[0]
        n = len(completions)
        try:
            values = self.reward(*args, **kwargs)
        except Exception as exc:
            values = self._one_by_one(args, kwargs, completions, exc)
        scores = self._checked(values, n)
        invalid = sum(v is None for v in scores)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and n:
            log_metric(invalid_metric(self.__name__), invalid / n)
        if invalid and not self._warned:
            self._warned = True
            logger.warning(
                "reward %s returned NaN/None for %d of %d completions (metric %s)",
                self.label,
                invalid,
                n,
                invalid_metric(self.__name__),
            )
        return scores

    def _checked(self, values: Any, n: int) -> list[float | None]:
        if values is None or isinstance(values, str | bytes | numbers.Number):
            raise RewardError(
                f"reward {self.label!r} returned {values!r} instead of one score per completion"
            )
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"reward {self.label!r} returned a {type(values).__name__} instead of one score per completion"
            ) from None
        if len(values) != n:
            raise RewardError(f"reward {self.label!r} returned {len(values)} scores for {n} completions")
        scores: list[float | None] = []
        for i, value in enumerate(values):
            if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
                value = value.item()
            if value is None:
                scores.append(None)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                scores.append(None if math.isnan(float(value)) else float(value))
            else:
                raise RewardError(
                    f"reward {self.label!r} returned {value!r} for example {i}, not a number or None"
                )
        return scores

    def _one_by_one(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], completions: Sequence[Any], first: Exception
    ) -> list[float | None]:
        """Score each example alone: find the ones that raise and apply ``on_error`` to them."""
        n = len(completions)
        if args:  # TRL and DPO pass keywords only; a positional call cannot be sliced safely
            raise self._error(0, completions, first) from first
        scores: list[float | None] = []
        for i in range(n):
            single = {
                k: [v[i]] if isinstance(v, list | tuple) and len(v) == n else v for k, v in kwargs.items()
            }
            try:
                value = self._checked(self.reward(**single), 1)[0]
            except RewardError:
                raise
            except Exception as exc:
                if self.on_error == "fail":
                    raise self._error(i, completions, exc) from exc
                self.failures += 1
                value = 0.0 if self.on_error == "zero" else None
                logger.warning(
                    "%s; scored %s (on_error: %s)", self._error(i, completions, exc), value, self.on_error
                )
            scores.append(value)
        return scores

    def _error(self, index: int, completions: Sequence[Any], exc: Exception) -> RewardError:
        start = _preview(completions[index]) if index < len(completions) else ""
        return RewardError(
            f"reward {self.label!r} raised {type(exc).__name__}: {' '.join(str(exc).split())} on example {index} "
            f"(completion starts {start!r}); set on_error: zero or skip on this reward to score such "
            "examples instead of stopping"
        )
