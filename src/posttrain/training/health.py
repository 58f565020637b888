"""GRPO health monitor: recognise the usual ways a GRPO run silently stops learning, and say why.

GRPO learns only from differences between the completions of one prompt. When every completion of
every prompt earns the same reward the advantages are all zero, the loss is 0 and the gradient is
0: the run burns CPU for nothing while the logs look normal. From an untrained SmolLM2 with format
rewards this happens on the very first step (``frac_reward_zero_std`` = 1), so that check
fires on the first logged step instead of waiting for a window. The other checks:

==============  =======================================  ========================================
kind            condition                                usual remedy
==============  =======================================  ========================================
no_signal       share of prompt groups without signal    ``zero_signal: resample`` (or ``drop``);
                >= ``zero_std_threshold`` (mean of the   easier data (``data_filter.max_ops``);
                recent reward steps): ``1 -              more generations / higher temperature;
                zero_signal/frac_signal`` when the       partial-credit rewards; SFT first
                stage sets ``zero_signal``, else
                ``frac_reward_zero_std``
kl_blowup       ``kl`` > ``kl_threshold``                raise ``beta`` or lower the learning rate
entropy         ``entropy`` < ``min_entropy``            raise temperature; lower the learning rate
flat_reward     fitted ``reward`` change over            check the rewards pay anything; add
                ``window`` reward steps <= tolerance     partial credit; SFT first; raise the lr
invalid_        a reward scored NaN/None                 fix the reward (``posttrain rewards
reward          (``rewards/<fn>/invalid_frac`` > 0)      check``); ``on_error`` per reward
non_finite      ``loss``, ``grad_norm`` or ``reward``    lower the learning rate; check the
                is NaN or infinite                       rewards and the precision
reward_hacking  over the last ``hacking_window``         read the samples for what the reward
                evaluations (``eval_every``), the mean   pays; a stricter reward or a lower
                ``reward`` between them rose by >=       weight for the exploited one; raise
                ``hacking_reward_rise`` while            ``beta``; keep the model from before
                ``eval/accuracy`` fell by >=             accuracy fell
                ``hacking_accuracy_drop`` (fitted
                changes)
==============  =======================================  ========================================

With ``zero_signal`` set, ``zero_signal/frac_signal`` is the share of the *trained* batch's groups
with signal, so ``resample`` that fills its batches keeps ``no_signal`` quiet while ``drop`` (or a
``resample`` budget too small for the data) still raises it. ``reward_hacking`` pairs each evaluation
with the mean ``reward`` logged since the previous one (the step-0 evaluation has none and is not used
by it); a small slice is noisy (one question of 64 is 1.6 points), hence fitted trends and thresholds.

NaN in a metric is never silently skipped: ``non_finite`` fires on it. ``invalid_reward`` counts
the scores a reward could not give (:mod:`posttrain.rewards.guard` logs the fraction per reward);
above ``monitor.max_invalid_rewards`` the :class:`HealthCallback` fails the stage with a
:class:`~posttrain.core.errors.StageError`, whatever ``on_alert`` says.

Each kind alerts once when its condition starts and re-arms once it clears, so a long bad stretch
produces one alert, not one per step. :class:`HealthMonitor` is pure logic over metric dicts (tested
on crafted streams); :class:`HealthCallback` feeds it TRL's logs and can stop training.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from transformers import TrainerCallback

from posttrain.core.errors import StageError
from posttrain.training import distributed
from posttrain.training.zero_signal import ZERO_STD

logger = logging.getLogger(__name__)

REMEDIES = {
    "no_signal": "set the stage's zero_signal: resample (or drop) so groups without signal are replaced "
    "or left out of the loss; train on easier data first (data_filter.max_ops) so some answers are right; "
    "raise num_generations or temperature so completions differ; add partial-credit rewards "
    "(xml_count, soft_format); run SFT first so the format is reachable",
    "kl_blowup": "raise beta or lower the learning rate",
    "entropy": "raise temperature or lower the learning rate; the policy is collapsing onto one output",
    "flat_reward": "check that the reward functions can pay (posttrain rewards check); add partial-credit "
    "rewards; run SFT first; or raise the learning rate",
    "invalid_reward": "fix the reward so it scores every completion, or give it on_error: zero|skip; "
    "NaN/None scores are left out of the sum and teach nothing",
    "non_finite": "lower the learning rate, check the rewards for huge values, or train in fp32",
    "reward_hacking": "read the stage's sample completions (completions/*.parquet) for what the reward "
    "pays; make it stricter or lower the exploited reward's weight; raise beta; keep the model from "
    "before accuracy fell (fewer steps)",
}
_INVALID_SUFFIX = "/invalid_frac"
_FINITE_KEYS = ("loss", "grad_norm", "reward")
_ACCURACY = "eval/accuracy"
_FRAC_SIGNAL = "zero_signal/frac_signal"


@dataclass(frozen=True)
class Alert:
    step: int
    kind: str
    value: float
    message: str
    remedy: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _number(logs: Mapping[str, Any], key: str) -> float | None:
    value = logs.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _fitted_change(values: list[float]) -> float:
    """Least-squares slope times the span: how much the trend moved across ``values``."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    var_x = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / var_x
    return slope * (n - 1)


class HealthMonitor:
    """Consumes logged metric dicts step by step and returns the alerts each step raises.

    ``cfg`` is a :class:`posttrain.core.config.MonitorConfig` (or anything with the same attributes).
    Steps without reward metrics (TRL logs rewards only on steps that generate) only feed the KL
    and entropy checks.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.alerts: list[Alert] = []
        self._zero_std: deque[float] = deque(maxlen=cfg.window)
        self._rewards: deque[float] = deque(maxlen=cfg.window)
        self._active: set[str] = set()
        self._step = 0
        self._since_eval: list[float] = []  # rewards logged since the last evaluation
        self._eval_points: deque[tuple[int, float, float]] = deque(maxlen=cfg.hacking_window)

    def observe(self, step: int, logs: Mapping[str, Any]) -> list[Alert]:
        raised = []
        self._step = step
        for kind, firing in self._checks(logs):
            if firing is None:  # metric absent this step: leave the state as it is
                continue
            if firing is False:
                self._active.discard(kind)
            elif kind not in self._active:
                self._active.add(kind)
                value, message = firing
                raised.append(Alert(step, kind, round(value, 6), message, REMEDIES[kind]))
        self.alerts.extend(raised)
        return raised

    def _checks(self, logs: Mapping[str, Any]):
        yield "non_finite", self._check_finite(logs)
        yield "invalid_reward", self._check_invalid(logs)
        yield "no_signal", self._check_no_signal(logs)
        yield "kl_blowup", self._check_kl(logs)
        yield "entropy", self._check_entropy(logs)
        yield "flat_reward", self._check_flat(logs)
        yield "reward_hacking", self._check_hacking(logs)

    def _check_finite(self, logs: Mapping[str, Any]):
        seen = {k: logs[k] for k in _FINITE_KEYS if isinstance(logs.get(k), int | float)}
        if not seen:
            return None
        bad = {k: v for k, v in seen.items() if not math.isfinite(v)}
        if not bad:
            return False
        return 1.0, "non-finite " + ", ".join(f"{k}={v}" for k, v in bad.items()) + ": training has diverged"

    def invalid_fractions(self, logs: Mapping[str, Any]) -> dict[str, float]:
        """Reward name → fraction of its scores that were NaN/None in this log (guarded rewards only)."""
        return {
            key[len("rewards/") : -len(_INVALID_SUFFIX)]: float(value)
            for key, value in logs.items()
            if key.startswith("rewards/") and key.endswith(_INVALID_SUFFIX) and isinstance(value, int | float)
        }

    def _check_invalid(self, logs: Mapping[str, Any]):
        fractions = self.invalid_fractions(logs)
        if not fractions:
            return None
        bad = {name: frac for name, frac in fractions.items() if frac > 0}
        if not bad:
            return False
        worst = max(bad, key=bad.__getitem__)
        listed = ", ".join(f"{name} {frac:.0%}" for name, frac in sorted(bad.items()))
        return bad[worst], f"rewards returned NaN/None for part of the completions: {listed}"

    def _check_no_signal(self, logs: Mapping[str, Any]):
        signal = _number(logs, _FRAC_SIGNAL)  # the trained batch's share, when zero_signal is set
        frac = 1.0 - signal if signal is not None else _number(logs, "frac_reward_zero_std")
        if frac is None:
            std = _number(logs, "reward_std")
            if std is None:
                return None
            frac = 1.0 if std < ZERO_STD else 0.0
        self._zero_std.append(frac)
        # Mean over the reward steps seen so far (at most `window`): on the first step it is the step's
        # own value, so a run that starts without any signal is flagged at once.
        mean = sum(self._zero_std) / len(self._zero_std)
        if mean < self.cfg.zero_std_threshold:
            return False
        reward = _number(logs, "reward")
        same = f" (all scored {reward:g})" if reward is not None and frac == 1.0 else ""
        return mean, (
            f"no learning signal: {mean:.0%} of prompt groups had identical rewards{same} over the "
            f"last {len(self._zero_std)} reward step(s), so advantages and gradients are zero"
        )

    def _check_kl(self, logs: Mapping[str, Any]):
        kl = _number(logs, "kl")
        if kl is None:
            return None
        if kl <= self.cfg.kl_threshold:
            return False
        return (
            kl,
            f"KL to the reference policy is {kl:.3g} > {self.cfg.kl_threshold:g}: the policy is running away",
        )

    def _check_entropy(self, logs: Mapping[str, Any]):
        entropy = _number(logs, "entropy")
        if entropy is None or _number(logs, _FRAC_SIGNAL) == 0.0:
            return None  # zero_signal dropped every completion: TRL's masked mean reads 0
        if entropy >= self.cfg.min_entropy:
            return False
        return entropy, (
            f"token entropy {entropy:.3g} < {self.cfg.min_entropy:g}: generations are collapsing "
            "to a single output, so groups stop differing"
        )

    def _check_flat(self, logs: Mapping[str, Any]):
        reward = _number(logs, "reward")
        if reward is None:
            return None
        self._rewards.append(reward)
        if len(self._rewards) < self.cfg.window:
            return None
        change = _fitted_change(list(self._rewards))
        if change > self.cfg.flat_reward_tolerance:
            return False
        return change, (
            f"reward has not improved over the last {self.cfg.window} reward steps (fitted change "
            f"{change:+.3g}, mean {sum(self._rewards) / len(self._rewards):.3g})"
        )

    def _check_hacking(self, logs: Mapping[str, Any]):
        reward = _number(logs, "reward")
        if reward is not None:
            self._since_eval.append(reward)
        accuracy = _number(logs, _ACCURACY)
        if accuracy is None:
            return None
        if self._since_eval:
            mean_reward = sum(self._since_eval) / len(self._since_eval)
            self._eval_points.append((self._step, mean_reward, accuracy))
        self._since_eval = []
        if len(self._eval_points) < self.cfg.hacking_window:
            return None
        steps, rewards, accuracies = zip(*self._eval_points, strict=True)
        rise, fall = _fitted_change(list(rewards)), -_fitted_change(list(accuracies))
        if rise < self.cfg.hacking_reward_rise or fall < self.cfg.hacking_accuracy_drop:
            return False
        return -fall, (
            f"reward rose by {rise:+.3g} while held-out accuracy fell by {100 * fall:.1f} points over the "
            f"evaluations at steps {', '.join(map(str, steps))} (fitted trends): the policy is paid for "
            "something other than right answers"
        )


class HealthCallback(TrainerCallback):
    """Feeds every log to a :class:`HealthMonitor`; logs each alert with its remedy, optionally stops."""

    def __init__(self, monitor: HealthMonitor, on_alert: str = "warn", stage: str = "grpo") -> None:
        self.monitor = monitor
        self.on_alert = on_alert
        self.stage = stage

    def on_train_begin(self, args, state, control, **kwargs):
        """On resume, replay the restored log history into a fresh monitor: its windows, active
        alerts and the alerts raised before the kill are then what the uninterrupted run's were."""
        if state.global_step == 0 or self.monitor.alerts or self.monitor._step:
            return control
        for row in state.log_history:
            step = row.get("step")
            if isinstance(row, dict) and type(step) is int and 0 < step <= state.global_step:
                self.monitor.observe(step, row)
        if self.monitor.alerts:
            logger.info(
                "[%s] %d health alerts from before the resume: %s",
                self.stage,
                len(self.monitor.alerts),
                ", ".join(f"{a.kind} at step {a.step}" for a in self.monitor.alerts),
            )
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return control
        limit = getattr(self.monitor.cfg, "max_invalid_rewards", 1.0)
        over = {n: f for n, f in self.monitor.invalid_fractions(logs).items() if f > limit}
        # Every rank sees the same logged row and raises the same alerts; rank 0 says them.
        say = logger.warning if distributed.is_main_process() else logger.debug
        for alert in self.monitor.observe(state.global_step, logs):
            say(
                "[%s] step %d health alert %s: %s. Remedy: %s",
                self.stage,
                alert.step,
                alert.kind,
                alert.message,
                alert.remedy,
            )
            if self.on_alert == "stop":
                say("[%s] stopping training (monitor.on_alert: stop)", self.stage)
                control.should_training_stop = True
        if over:
            listed = ", ".join(f"{name} {frac:.0%}" for name, frac in sorted(over.items()))
            raise StageError(
                f"[{self.stage}] step {state.global_step}: rewards could not score most completions "
                f"({listed} NaN/None > monitor.max_invalid_rewards {limit:g}); "
                f"{REMEDIES['invalid_reward']}"
            )
        return control

    @property
    def alerts(self) -> list[dict[str, Any]]:
        return [a.as_dict() for a in self.monitor.alerts]
