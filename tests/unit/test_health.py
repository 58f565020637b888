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
    assert alert.message.endswith("the policy is paid for something other than right answers")


def test_no_signal_remedy_names_dynamic_sampling_and_easier_data():
    remedy = REMEDIES["no_signal"]
    assert "zero_signal: resample" in remedy and "data_filter.max_ops" in remedy


# --------------------------------------------------------------------------- exact values and messages
# (issue 15: each check at its boundary, the alert's value and message, the callback's failure path)

from types import SimpleNamespace  # noqa: E402

from posttrain.core.errors import StageError  # noqa: E402
from posttrain.training.health import _fitted_change  # noqa: E402


@pytest.mark.parametrize(
    "values, change",
    [
        ([0.0, 1.0, 2.0], 2.0),  # a straight line: its rise
        ([0.0, 0.0, 3.0], 3.0),  # slope 1.5 over a span of 2
        ([2.0, 1.0], -1.0),  # falling
        ([5.0, 5.0, 5.0, 5.0], 0.0),  # flat
        ([1.0, 3.0, 2.0, 4.0], 2.4),  # noisy rise: slope 0.8 over 3 steps
    ],
)
def test_fitted_change_is_the_least_squares_rise_over_the_span(values, change):
    assert _fitted_change(values) == pytest.approx(change)


def one_alert(stream, **cfg):
    [alert] = run(stream, **cfg)
    return alert


def test_non_finite_metrics_alert_with_what_diverged():
    alert = one_alert([{"loss": float("nan"), "grad_norm": float("inf"), "reward": 0.5}])
    assert (alert.kind, alert.value) == ("non_finite", 1.0)
    assert alert.message == "non-finite loss=nan, grad_norm=inf: training has diverged"
    assert alert.remedy == REMEDIES["non_finite"]
    nan = {"loss": float("nan")}
    # Once per episode; a step without any of the metrics leaves it open, a finite one closes it.
    assert [a.step for a in run([nan, {"kl": 0.1}, nan, {"loss": 1.0}, nan])] == [1, 5]


def test_invalid_reward_fractions_come_from_the_guarded_rewards_metrics():
    monitor = HealthMonitor(MonitorConfig())
    logs = {
        "rewards/correctness_reward/invalid_frac": 0.25,
        "rewards/correctness_reward/mean": 0.5,
        "completions/invalid_frac": 1.0,  # not a reward's
        "rewards/xml/invalid_frac": "n/a",  # not a number
    }
    assert monitor.invalid_fractions(logs) == {"correctness_reward": 0.25}


def test_invalid_reward_alert_names_each_reward_and_its_worst_fraction():
    logs = {"rewards/b/invalid_frac": 0.125, "rewards/a/invalid_frac": 0.5, "rewards/c/invalid_frac": 0.0}
    alert = one_alert([logs])
    assert (alert.kind, alert.value) == ("invalid_reward", 0.5)  # the worst reward's fraction
    assert alert.message == "rewards returned NaN/None for part of the completions: a 50%, b 12%"
    clean = {"rewards/a/invalid_frac": 0.0}
    assert run([clean]) == []
    assert [a.step for a in run([logs, logs, clean, logs])] == [1, 4]


def test_no_signal_from_reward_std_at_the_fp_noise_boundary():
    def alerts(std):
        return [a.kind for a in run([{"reward_std": std, "reward": 0.3}])]

    assert alerts(1e-9) == ["no_signal"]
    assert alerts(1e-8) == [] and alerts(0.5) == []
    alert = one_alert([{"reward_std": 0.0}])
    assert alert.value == 1.0
    assert alert.message == (
        "no learning signal: 100% of prompt groups had identical rewards over the last 1 reward step(s), "
        "so advantages and gradients are zero"
    )


def test_no_signal_message_says_what_all_scored_only_when_all_groups_tied():
    partial = one_alert([{"frac_reward_zero_std": 0.95, "reward": 0.2}])
    assert partial.value == 0.95 and "all scored" not in partial.message
    assert partial.message.startswith("no learning signal: 95% of prompt groups had identical rewards over")
    assert "(all scored 0.2)" in one_alert([{"frac_reward_zero_std": 1.0, "reward": 0.2}]).message


def test_values_are_rounded_and_messages_state_the_thresholds():
    kl = one_alert([{"kl": 1.23456789}])
    assert kl.value == 1.234568
    assert kl.message == "KL to the reference policy is 1.23 > 1: the policy is running away"
    entropy = one_alert([{"entropy": 0.01}])
    assert entropy.message == (
        "token entropy 0.01 < 0.05: generations are collapsing to a single output, so groups stop differing"
    )
    assert run([{"entropy": 0.05}]) == []  # at the minimum is still fine


def test_flat_reward_at_exactly_the_tolerance_alerts_with_the_mean():
    alert = one_alert([{"reward": 0.0}, {"reward": 0.5}], window=2, flat_reward_tolerance=0.5)
    assert (alert.kind, alert.step, alert.value) == ("flat_reward", 2, 0.5)
    assert (
        alert.message
        == "reward has not improved over the last 2 reward steps (fitted change +0.5, mean 0.25)"
    )
    assert run([{"reward": 0.0}, {"reward": 0.5}], window=2, flat_reward_tolerance=0.49) == []


def _log(callback, logs, step=3):
    state, control = TrainerState(), TrainerControl()
    state.global_step = step
    return callback.on_log(None, state, control, logs=logs)


def test_callback_logs_each_alert_with_its_stage_and_remedy(caplog):
    callback = HealthCallback(HealthMonitor(MonitorConfig()), on_alert="stop", stage="grpo-format")
    with caplog.at_level("WARNING"):
        control = _log(callback, {"kl": 5.0})
    assert control.should_training_stop
    assert caplog.messages == [
        "[grpo-format] step 3 health alert kl_blowup: KL to the reference policy is 5 > 1: the policy is "
        f"running away. Remedy: {REMEDIES['kl_blowup']}",
        "[grpo-format] stopping training (monitor.on_alert: stop)",
    ]
    caplog.clear()
    default = HealthCallback(HealthMonitor(MonitorConfig()))
    with caplog.at_level("WARNING"):
        assert not _log(default, {"kl": 5.0}).should_training_stop
    assert caplog.messages[0].startswith("[grpo] step 3 health alert kl_blowup")
    assert _log(default, {}) is not None and _log(default, None) is not None  # nothing logged: no-op


def test_only_rank_0_says_an_alert_and_every_rank_stops(caplog, monkeypatch):
    """Every rank's monitor sees the same logged row: the others' copies go to DEBUG."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    callback = HealthCallback(HealthMonitor(MonitorConfig()), on_alert="stop", stage="grpo-format")
    with caplog.at_level("DEBUG", logger="posttrain.training.health"):
        assert _log(callback, {"kl": 5.0}).should_training_stop
    assert [r.levelname for r in caplog.records] == ["DEBUG", "DEBUG"]


def test_callback_fails_the_stage_when_a_reward_mostly_cannot_score():
    callback = HealthCallback(HealthMonitor(MonitorConfig(max_invalid_rewards=0.5)), stage="grpo-x")
    _log(callback, {"rewards/ok/invalid_frac": 0.5})  # at the limit: an alert, not a failure
    with pytest.raises(StageError) as failed:
        _log(callback, {"rewards/b/invalid_frac": 0.75, "rewards/a/invalid_frac": 0.625}, step=7)
    assert str(failed.value) == (
        "[grpo-x] step 7: rewards could not score most completions (a 62%, b 75% NaN/None > "
        f"monitor.max_invalid_rewards 0.5); {REMEDIES['invalid_reward']}"
    )


def test_callback_without_a_limit_in_its_config_fails_nothing():
    cfg = SimpleNamespace(
        **{k: v for k, v in MonitorConfig().model_dump().items() if k != "max_invalid_rewards"}
    )
    callback = HealthCallback(HealthMonitor(cfg))
    _log(callback, {"rewards/a/invalid_frac": 1.0})  # the default limit is 1.0: never exceeded
    assert callback.alerts[0]["kind"] == "invalid_reward"


def test_reward_hacking_fires_at_exactly_its_thresholds():
    rise = _fitted_change([0.2, 0.3, 0.4])  # the rewards and accuracies of RISING's evaluations
    drop = -_fitted_change([0.40, 0.35, 0.30])
    at = run_steps(evals(RISING), hacking_reward_rise=rise, hacking_accuracy_drop=drop)
    assert [(a.step, a.kind) for a in at] == [(15, "reward_hacking")]
    assert run_steps(evals(RISING), hacking_reward_rise=rise + 1e-9, hacking_accuracy_drop=drop) == []
    assert run_steps(evals(RISING), hacking_reward_rise=rise, hacking_accuracy_drop=drop + 1e-9) == []


def test_a_resumed_stage_replays_its_log_history_into_the_monitor(tmp_path):
    """Resumed at step 9 of a stream that raised no_signal at step 1 and is ten steps into a flat
    reward: the alert from before the kill is kept, and flat_reward fires at step 10 as it does
    uninterrupted, not ten steps after the resume."""
    flat = {"reward": 0.5, "reward_std": 0.2, "frac_reward_zero_std": 0.25, "kl": 0.02, "entropy": 1.2}
    stream = [{"reward": 0.0, "frac_reward_zero_std": 1.0}] + [flat] * 11
    uninterrupted = [(a.step, a.kind) for a in run(stream)]
    assert (1, "no_signal") in uninterrupted and any(kind == "flat_reward" for _, kind in uninterrupted)

    callback = HealthCallback(HealthMonitor(MonitorConfig()), stage="grpo-x")
    state, control = TrainerState(), TrainerControl()
    state.global_step = 9
    state.log_history = [{**logs, "step": step} for step, logs in enumerate(stream[:9], start=1)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    callback.on_train_begin(args, state, control)
    for step, logs in enumerate(stream[9:], start=10):
        state.global_step = step
        callback.on_log(args, state, control, logs=logs)
    assert [(a["step"], a["kind"]) for a in callback.alerts] == uninterrupted
