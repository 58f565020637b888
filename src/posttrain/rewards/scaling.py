"""Reward scaling: an adaptive wrapper that standardizes any reward by its running mean and std.

Rewards on very different scales (a 0/1 correctness next to a word-count shaping term) make the
YAML weights hard to read; the scaler puts each on a comparable scale as training goes. It is a
stateful callable class rather than a closure so TRL's async rollout worker can pickle it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

__all__ = ["AdaptiveScaler", "make_adaptive_scaler", "reward_name"]


def reward_name(fn: Callable[..., Any]) -> str:
    """Metric name TRL will use for ``fn`` (same rule as ``trl.trainer.utils.get_callable_name``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


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
