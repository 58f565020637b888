"""The GRPO health monitor on crafted metric streams: each failure mode fires, a healthy run stays quiet."""

from __future__ import annotations

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from posttrain.core.config import MonitorConfig
from posttrain.training.health import REMEDIES, HealthCallback, HealthMonitor


def healthy(step: int) -> dict[str, float]:
    return {
        "reward": 0.1 + 0.05 * step,
        "reward_std": 0.3,
        "frac_reward_zero_std": 0.25,
        "kl": 0.02,
        "entropy": 1.2,
    }


def run(stream: list[dict[str, float]], **cfg) -> list:
    monitor = HealthMonitor(MonitorConfig(**cfg))
    for step, logs in enumerate(stream, start=1):
        monitor.observe(step, logs)
    return monitor.alerts


CASES = [
    # (name, stream, config, expected [(step, kind)])
    ("healthy run", [healthy(s) for s in range(30)], {}, []),
    (
        "untrained model: every completion scores 0",
        [{"reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}],
        {},
        [(1, "no_signal")],
    ),
    (
        "signal dies after a good start (and the reward stops moving)",
        [healthy(s) for s in range(5)] + [{**healthy(5), "frac_reward_zero_std": 1.0}] * 10,
        {"window": 5},
        [(10, "no_signal"), (10, "flat_reward")],
    ),
    ("zero reward_std without frac metric", [{"reward": 1.0, "reward_std": 0.0}], {}, [(1, "no_signal")]),
    ("KL blow-up", [healthy(s) for s in range(3)] + [{**healthy(3), "kl": 5.0}], {}, [(4, "kl_blowup")]),
    (
        "entropy collapse",
        [healthy(s) for s in range(3)] + [{**healthy(3), "entropy": 0.01}],
        {},
        [(4, "entropy")],
    ),
    ("flat reward", [{**healthy(0), "reward": 0.3}] * 6, {"window": 5}, [(5, "flat_reward")]),
    (
        "declining reward counts as not improving",
        [{**healthy(0), "reward": 0.5 - 0.05 * s} for s in range(5)],
        {"window": 5},
        [(5, "flat_reward")],
    ),
    (
        "steps without reward metrics are ignored by the reward checks",
        [{"loss": 0.1}] * 20 + [healthy(1)],
        {"window": 5},
        [],
    ),
    ("NaN metrics are ignored", [{"kl": float("nan"), "entropy": float("nan")}], {}, []),
    (
        "no_signal fires at the threshold exactly",
        [{**healthy(0), "frac_reward_zero_std": 0.5}],
        {"zero_std_threshold": 0.5},
        [(1, "no_signal")],
    ),
    (
        "no_signal stays quiet just under the threshold",
        [{**healthy(0), "frac_reward_zero_std": 0.49}],
        {"zero_std_threshold": 0.5},
        [],
    ),
    ("kl at the threshold is not a blow-up", [{**healthy(0), "kl": 1.0}], {"kl_threshold": 1.0}, []),
    (
        "kl just over the threshold is",
        [{**healthy(0), "kl": 1.01}],
        {"kl_threshold": 1.0},
        [(1, "kl_blowup")],
    ),
]


def evals(points: list[tuple[float | None, float]], every: int = 5) -> list[tuple[int, dict[str, float]]]:
    """(step, logs) as a stage with `eval_every: every` logs them: one reward row per step, and at each
    evaluation step an evaluation row after it. Each point is (the reward logged on the steps since the
    previous evaluation, accuracy); the first point is the step-0 evaluation (reward None)."""
    stream: list[tuple[int, dict[str, float]]] = []
    step = 0
    for reward, accuracy in points:
        if reward is not None:
            for _ in range(every):
                step += 1
                stream.append((step, {"reward": reward, "frac_reward_zero_std": 0.25}))
        stream.append((step, {"eval/accuracy": accuracy, "eval/format": 1.0}))
    return stream


def run_steps(stream: list[tuple[int, dict[str, float]]], **cfg) -> list:
    """The reward_hacking alerts of a stream (its constant rewards also raise flat_reward)."""
    monitor = HealthMonitor(MonitorConfig(**cfg))
    for step, logs in stream:
        monitor.observe(step, logs)
    return [a for a in monitor.alerts if a.kind == "reward_hacking"]


RISING = [(None, 0.40), (0.2, 0.40), (0.3, 0.35), (0.4, 0.30)]
HACKING_CASES = [
    # (name, evaluation points, config, expected [(step, kind)])
    ("reward up while accuracy down", RISING, {}, [(15, "reward_hacking")]),
    ("both up is learning", [(None, 0.3), (0.2, 0.32), (0.3, 0.4), (0.4, 0.5)], {}, []),
    ("accuracy down, reward flat: not hacking", [(None, 0.4), (0.3, 0.4), (0.3, 0.3), (0.3, 0.2)], {}, []),
    ("reward up, accuracy flat", [(None, 0.4), (0.2, 0.4), (0.3, 0.4), (0.4, 0.4)], {}, []),
    (
        "accuracy drop just under the threshold",
        [(None, 0.4), (0.2, 0.4), (0.3, 0.38), (0.4, 0.36)],
        {"hacking_accuracy_drop": 0.05},
        [],
    ),
    (
        "reward rise just under the threshold",
        [(None, 0.4), (0.2, 0.4), (0.22, 0.3), (0.24, 0.2)],
        {"hacking_reward_rise": 0.05},
        [],
    ),
    ("the step-0 evaluation has no reward to pair", RISING[:3], {"hacking_window": 3}, []),
    (
        "a window of two",
        [(None, 0.4), (0.2, 0.4), (0.3, 0.3)],
        {"hacking_window": 2},
        [(10, "reward_hacking")],
    ),
]


@pytest.mark.parametrize(
    "points, cfg, expected", [c[1:] for c in HACKING_CASES], ids=[c[0] for c in HACKING_CASES]
)
def test_reward_hacking_streams(points, cfg, expected):
    alerts = run_steps(evals(points), **cfg)
    assert [(a.step, a.kind) for a in alerts] == expected
    assert all(a.remedy == REMEDIES["reward_hacking"] for a in alerts)


no_signal_rows = [
    # resample filled the trained batch although most generated groups were flat: no alert
    (
        "resample filled the batch",
        [{"reward": 0.1, "frac_reward_zero_std": 0.95, "zero_signal/frac_signal": 1.0}],
        {},
        [],
    ),
    (
        "the trained batch had little signal",
        [{"reward": 0.1, "frac_reward_zero_std": 0.0, "zero_signal/frac_signal": 0.05}],
        {},
        [(1, "no_signal")],
    ),
    (
        "everything dropped: TRL's entropy of no tokens is not a collapse",
        [{**healthy(0), "entropy": 0.0, "zero_signal/frac_signal": 0.0}],
        {},
        [(1, "no_signal")],
    ),
]
CASES += no_signal_rows


@pytest.mark.parametrize("stream, cfg, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_monitor_streams(stream, cfg, expected):
    alerts = run(stream, **cfg)
    assert [(a.step, a.kind) for a in alerts] == expected
    for alert in alerts:
        assert alert.remedy == REMEDIES[alert.kind] and alert.message


def test_alert_fires_once_per_episode_and_rearms():
    bad = {**healthy(0), "kl": 3.0}
    stream = [bad, bad, bad, healthy(1), bad]
    assert [(a.step, a.kind) for a in run(stream)] == [(1, "kl_blowup"), (5, "kl_blowup")]


def test_alert_dict_has_the_recorded_fields():
    alert = run([{"reward": 0.0, "frac_reward_zero_std": 1.0}])[0]
    assert set(alert.as_dict()) == {"step", "kind", "value", "message", "remedy"}
    assert "all scored 0" in alert.message and "SFT first" in alert.remedy


@pytest.mark.parametrize("on_alert, stops", [("warn", False), ("stop", True)])
def test_callback_stops_training_only_when_asked(tmp_path, caplog, on_alert, stops):
    callback = HealthCallback(HealthMonitor(MonitorConfig()), on_alert=on_alert)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 1
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with caplog.at_level("WARNING"):
        control = callback.on_log(args, state, control, logs={"reward": 0.0, "frac_reward_zero_std": 1.0})
    assert control.should_training_stop is stops
    assert callback.alerts[0]["kind"] == "no_signal"
    assert "Remedy:" in caplog.text


def test_reward_hacking_fires_once_per_episode_and_rearms():
    # Still hacking at 20 (no second alert); accuracy recovers at 25 (clears); hacking again at 35.
    points = RISING + [(0.5, 0.25), (0.5, 0.45), (0.5, 0.5), (0.6, 0.3), (0.7, 0.2)]
    assert [(a.step, a.kind) for a in run_steps(evals(points))] == [
        (15, "reward_hacking"),
        (35, "reward_hacking"),
    ]


def test_reward_hacking_message_names_the_trends_and_the_steps():
    alert = run_steps(evals(RISING))[0]
    assert alert.value == pytest.approx(-0.1) and "reward rose by +0.2" in alert.message
    assert "fell by 10.0 points" in alert.message
    assert "steps 5, 10, 15" in alert.message  # the step-0 evaluation has no reward to pair with


def test_no_signal_remedy_names_dynamic_sampling_and_easier_data():
    remedy = REMEDIES["no_signal"]
    assert "zero_signal: resample" in remedy and "data_filter.max_ops" in remedy
