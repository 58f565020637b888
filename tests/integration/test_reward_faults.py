"""Reward faults: a reward that raises is named with the example and its completion; on_error
zero|skip absorbs it; a wrong shape is refused; NaN/None are counted, alerted and, above a
threshold, fail the stage."""

from __future__ import annotations

import math

import pytest

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, MonitorConfig, SyntheticConfig
from posttrain.core.errors import StageError
from posttrain.rewards.guard import GuardedReward, RewardError, invalid_metric
from posttrain.rewards.registry import PLAIN_REWARDS
from posttrain.training.health import HealthCallback, HealthMonitor

COMPLETIONS = [[{"role": "assistant", "content": f"answer number {i} " + "x" * 80}] for i in range(4)]


def flaky(completions, **kwargs):
    """Raises on the completion that mentions 2, like a parser meeting an input it did not expect."""
    out = []
    for c in completions:
        if "number 2" in c[0]["content"]:
            raise KeyError("missing 'answer' tag")
        out.append(1.0)
    return out


def call(reward, **extra):
    return reward(prompts=["p"] * 4, completions=COMPLETIONS, answer=["1"] * 4, **extra)


def test_a_raising_reward_names_itself_the_example_and_the_completion():
    with pytest.raises(RewardError) as info:
        call(GuardedReward(flaky, "fail", "flaky"))
    message = str(info.value)
    assert "reward 'flaky' raised KeyError" in message and "on example 2" in message
    assert "completion starts 'answer number 2 xxxx" in message and "on_error: zero or skip" in message
    assert "\n" not in message


def test_a_stages_custom_reward_is_named_in_its_errors_as_the_config_names_it(monkeypatch, tmp_path):
    """A custom reward's function may be called anything: the error names the config's entry."""
    import sys
    import uuid

    from posttrain.core.config import RewardSpec
    from posttrain.core.library_policy import CUSTOM_CODE_ENV
    from posttrain.training.stage_run import build_reward_funcs

    module = f"team_rewards_{uuid.uuid4().hex}"  # a new name each time, even when rerun in one process
    (tmp_path / f"{module}.py").write_text(
        "def check(completions, **kwargs):\n    raise KeyError('missing tag')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    (reward,), weights = build_reward_funcs([RewardSpec(name=f"{module}:check", weight=2.0)])
    del sys.modules[module]
    assert weights == [2.0] and reward.__name__ == "check"  # TRL's metric name: the function's
    with pytest.raises(RewardError, match=f"^reward '{module}:check' raised KeyError"):
        call(reward)


@pytest.mark.parametrize(
    ("on_error", "expected"), [("zero", [1.0, 1.0, 0.0, 1.0]), ("skip", [1.0, 1.0, None, 1.0])]
)
def test_on_error_zero_or_skip_scores_the_failing_example(on_error, expected):
    guarded = GuardedReward(flaky, on_error)
    logged = {}
    assert call(guarded, log_metric=logged.__setitem__) == expected
    assert guarded.failures == 1
    assert logged == {invalid_metric("flaky"): 0.25 if on_error == "skip" else 0.0}


@pytest.mark.parametrize(
    ("returned", "pattern"),
    [
        (None, r"returned None instead of one score per completion"),
        (0.5, r"returned 0.5 instead of one score per completion"),
        ([1.0, 1.0, 1.0], r"returned 3 scores for 4 completions"),
        ([1.0, "1", 1.0, 1.0], r"returned '1' for example 1, not a number or None"),
    ],
)
def test_a_wrong_shape_is_refused_naming_the_reward(returned, pattern):
    def bad(completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=rf"reward 'bad' {pattern}"):
        call(GuardedReward(bad))


def test_nan_and_none_are_counted_and_nan_becomes_none():
    def holes(completions, **kwargs):
        return [1.0, math.nan, None, 0.0]

    logged = {}
    guarded = GuardedReward(holes)
    assert call(guarded, log_metric=logged.__setitem__) == [1.0, None, None, 0.0]
    assert logged == {"rewards/holes/invalid_frac": 0.5}
    assert guarded.__name__ == "holes"  # TRL names the reward's metrics after it


def test_the_monitor_alerts_on_invalid_rewards_and_non_finite_metrics():
    monitor = HealthMonitor(MonitorConfig())
    alerts = monitor.observe(1, {"rewards/holes/invalid_frac": 0.25, "loss": 0.1})
    assert [a.kind for a in alerts] == ["invalid_reward"] and "holes 25%" in alerts[0].message
    alerts = monitor.observe(2, {"loss": math.nan, "rewards/holes/invalid_frac": 0.25})
    assert [a.kind for a in alerts] == ["non_finite"] and "loss=nan" in alerts[0].message


def test_the_callback_fails_the_stage_above_the_threshold():
    class State:
        global_step = 3

    class Control:
        should_training_stop = False

    callback = HealthCallback(HealthMonitor(MonitorConfig(max_invalid_rewards=0.5)), "warn", "grpo-s")
    callback.on_log(
        None, State(), Control(), logs={"rewards/holes/invalid_frac": 0.5}
    )  # at the limit: alert only
    with pytest.raises(
        StageError, match=r"\[grpo-s\] step 3: rewards could not score most completions \(holes 75%"
    ):
        callback.on_log(None, State(), Control(), logs={"rewards/holes/invalid_frac": 0.75})


# --------------------------------------------------------------------------- a real GRPO stage


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=24, max_ops=2), eval_size=4)
    return prepare_data(cfg, tiny_tokenizer).train


def always_raises(completions, **kwargs):
    raise ValueError("reward service said no")


def always_nan(completions, **kwargs):
    return [math.nan] * len(completions)


@pytest.mark.parametrize(
    ("reward", "on_error", "pattern"),
    [
        (
            always_raises,
            "fail",
            r"reward 'always_raises' raised ValueError: reward service said no on example 0",
        ),
        (always_raises, "skip", r"rewards could not score most completions \(always_raises 100%"),
        (always_nan, "fail", r"rewards could not score most completions \(always_nan 100%"),
    ],
)
def test_a_grpo_stage_stops_in_one_line_on_a_broken_reward(
    reward, on_error, pattern, tiny_model_dir, data, tmp_path, monkeypatch
):
    from posttrain.training.grpo import run_grpo_stage

    monkeypatch.setitem(PLAIN_REWARDS, reward.__name__, reward)
    stage = GRPOStageConfig(
        name="broken",
        rewards=[{"name": "xml_count"}, {"name": reward.__name__, "on_error": on_error}],
        trainer={
            "max_steps": 2,
            "per_device_train_batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 8,
        },
    )
    model = ModelConfig(name=str(tiny_model_dir), precision="fp32")
    with pytest.raises(StageError, match=pattern):
        run_grpo_stage(stage, model, str(tiny_model_dir), data, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []  # nothing half-written left


# --------------------------------------------------------------------------- exact messages, edges of the guard
# (issue 15: what the guard says and scores, checked without training)

import logging  # noqa: E402

from posttrain.rewards.guard import _preview  # noqa: E402


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a" * 60, "a" * 60),  # exactly the preview length: whole
        ("a" * 61, "a" * 60 + "..."),  # longer: cut and marked
        ("two\n  lines", "two lines"),  # whitespace collapsed
    ],
)
def test_the_completion_preview(text, shown):
    assert _preview([{"role": "assistant", "content": text}]) == shown


def test_a_raising_reward_message_in_full():
    def fails(completions, **kwargs):
        raise ValueError("no\n  tag")

    with pytest.raises(RewardError) as info:
        GuardedReward(fails, "fail", "my-label")(completions=["short"], answer=["1"])
    assert str(info.value) == (
        "reward 'my-label' raised ValueError: no tag on example 0 (completion starts 'short'); set on_error: "
        "zero or skip on this reward to score such examples instead of stopping"
    )


def test_positional_calls_are_scored_and_a_raising_one_is_not_sliced():
    assert GuardedReward(lambda completions: [1.0] * len(completions))(COMPLETIONS) == [1.0] * 4
    with pytest.raises(
        RewardError, match=r"reward 'flaky' raised KeyError: .* on example 0 \(completion starts 'answer"
    ):
        GuardedReward(flaky, "zero")(COMPLETIONS)
    with pytest.raises(
        RewardError, match=r"raised ValueError: reward service said no on example 0 \(completion starts ''\)"
    ):
        GuardedReward(always_raises, "zero")([])  # nothing to show from an empty batch


def test_skipped_examples_are_logged_once_per_call_with_their_score(caplog):
    guarded = GuardedReward(flaky, "skip")
    with caplog.at_level(logging.WARNING):
        call(guarded)
        call(guarded)
    skipped = [m for m in caplog.messages if "on_error: skip" in m]
    assert len(skipped) == 2 and skipped[0].endswith("; scored None (on_error: skip)")
    assert skipped[0].startswith("reward 'flaky' raised KeyError: \"missing 'answer' tag\" on example 2 ")
    invalid = [m for m in caplog.messages if "returned NaN/None" in m]
    assert invalid == [
        "reward flaky returned NaN/None for 1 of 4 completions (metric rewards/flaky/invalid_frac)"
    ]
    assert guarded.failures == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        call(GuardedReward(flaky, "zero"))
    assert caplog.messages[0].endswith("; scored 0.0 (on_error: zero)")


def test_scores_are_plain_floats_and_bad_settings_are_named():
    import numpy as np
    import torch

    def scalars(completions, **kwargs):
        return [np.float32(0.5), 1, np.float64("nan"), 0.0]

    assert call(GuardedReward(scalars)) == [0.5, 1.0, None, 0.0]

    def tensors(completions, **kwargs):
        return [torch.tensor(0.25), torch.tensor(1), torch.tensor(float("nan")), torch.tensor(0.0)]

    assert call(GuardedReward(tensors)) == [0.25, 1.0, None, 0.0]  # 0-d tensors read as numbers
    with pytest.raises(RewardError, match=r"returned tensor\(\[0.5000\]\) for example 0, not a number"):
        call(
            GuardedReward(lambda completions, **kw: [torch.tensor([0.5])] * 4)
        )  # a 1-d tensor is not a score
    with pytest.raises(
        RewardError, match=r"reward 'bools' returned True for example 0, not a number or None"
    ):
        call(GuardedReward(lambda completions, **kw: [True] * 4, label="bools"))
    with pytest.raises(
        RewardError, match=r"reward 'odd' returned a object instead of one score per completion"
    ):
        call(GuardedReward(lambda completions, **kw: object(), label="odd"))
    with pytest.raises(ValueError) as error:
        GuardedReward(flaky, "ignore")
    assert str(error.value) == "on_error must be one of fail, zero, skip, got 'ignore'"
    assert repr(GuardedReward(flaky, "zero")).startswith("GuardedReward(<function flaky") and repr(
        GuardedReward(flaky, "zero")
    ).endswith(", on_error='zero')")
