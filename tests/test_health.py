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
