"""Reward registry: config names -> reward callables, with errors that say how to fix the config."""

import pytest

from posttrain.rewards import (
    correctness_reward,
    int_answer_reward,
    reasoning_steps_reward,
    soft_format_reward,
    strict_format_reward,
    xml_count_reward,
)
from posttrain.rewards.check import (
    EXAMPLE_COMPLETIONS,
    INTENDED_BEST,
    RewardCheckRow,
    ranks_as_intended,
    score_examples,
)
from posttrain.rewards.registry import (
    CUSTOM_CODE_ENV,
    build_reward,
    is_factory,
    reward_names,
    trl_reward_names,
)
from posttrain.rewards.scaling import AdaptiveScaler
from posttrain.rewards.shaping import LengthReward, RepetitionPenalty

GOOD = "<reasoning>\n6 * 7 = 42\n</reasoning>\n<answer>\n42\n</answer>"
WRONG = "<reasoning>\n6 + 7 = 13\n</reasoning>\n<answer>\n13\n</answer>"
ACCURACY_MOD = "posttrain.rewards.accuracy"
FORMAT_MOD = "posttrain.rewards.format"
SHAPING_MOD = "posttrain.rewards.shaping"
LENGTH_OK = "accepted params: min_tokens, max_tokens, decay_tokens"
SCALER_OK = "accepted: momentum, eps, clip, suffix"


POSTTRAIN_NAMES = [
    "arithmetic",
    "correctness",
    "int_answer",
    "length",
    "reasoning_steps",
    "repetition",
    "setup",
    "soft_format",
    "strict_format",
    "xml_count",
]
TRL_NAMES = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]


@pytest.fixture(autouse=True)
def custom_code_allowed(monkeypatch):
    """The registry's rules for custom names, with the opt-in given (its refusal: test_custom_code.py)."""
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")


def test_reward_names_sorted_and_complete():
    assert trl_reward_names() == TRL_NAMES  # what trl.rewards exports in TRL 1.16
    assert reward_names() == sorted(POSTTRAIN_NAMES + TRL_NAMES)
    assert is_factory("length") and is_factory("repetition") and not is_factory("correctness")
    assert is_factory("get_soft_overlong_punishment") and not is_factory("accuracy_reward")


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_trl_rewards_by_their_own_names():
    accuracy = build_reward("accuracy_reward")
    assert accuracy.__name__ == "accuracy_reward"  # metrics keep TRL's names: rewards/accuracy_reward/mean
    completions = [chat(r"so \boxed{42}"), chat(r"so \boxed{13}")]
    # posttrain's gold `answer` reaches TRL's `solution`; the worked solution column is not used
    assert accuracy(completions, answer=["42", "42"], solution=["#### 13", "#### 13"]) == [1.0, 0.0]
    think = build_reward("think_format_reward")
    assert think([chat("<think>\nhm\n</think>\n42"), chat("42")]) == [1.0, 0.0]
    overlong = build_reward(
        "get_soft_overlong_punishment", {"max_completion_len": 10, "soft_punish_cache": 4}
    )
    assert overlong.__name__ == "soft_overlong_punishment_reward"
    assert overlong(None, completion_ids=[[1] * 5, [1] * 8, [1] * 11]) == [0.0, -0.5, -1.0]
    assert build_reward("accuracy_reward", {"adaptive": True}).__name__ == "accuracy_reward_scaled"


@pytest.mark.parametrize(
    ("name", "params", "pattern"),
    [
        ("accuracy_reward", {"scale": 2}, r"TRL reward 'accuracy_reward' takes no params"),  # plain + params
        ("get_soft_overlong_punishment", {}, r"'get_soft_overlong_punishment': invalid params"),  # missing
        ("get_soft_overlong_punishment", {"max_len": 9}, r"unknown param\(s\) 'max_len'"),  # typo
        ("acuracy_reward", {}, r"unknown reward 'acuracy_reward' \(did you mean 'accuracy_reward'"),  # typo
    ],
)
def test_trl_reward_errors(name, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_reward(name, params)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("correctness", correctness_reward),  # gold match
        ("int_answer", int_answer_reward),  # integer answer
        ("strict_format", strict_format_reward),  # exact layout
        ("soft_format", soft_format_reward),  # blocks anywhere
        ("xml_count", xml_count_reward),  # per-tag credit
        ("reasoning_steps", reasoning_steps_reward),  # step count
        (" correctness ", correctness_reward),  # surrounding whitespace tolerated
    ],
)
def test_plain_rewards(name, expected):
    assert build_reward(name) is expected
    assert build_reward(name, {}) is expected
    assert build_reward(name, {"adaptive": False}) is expected


@pytest.mark.parametrize(
    ("name", "params", "cls", "metric_name"),
    [
        ("length", None, LengthReward, "length_reward"),  # defaults
        ("length", {"min_tokens": 5, "max_tokens": 50}, LengthReward, "length_reward"),  # custom range
        ("repetition", {}, RepetitionPenalty, "repetition_penalty"),  # defaults
        ("repetition", {"ngram_size": 2, "max_penalty": -0.5}, RepetitionPenalty, "repetition_penalty"),
    ],
)
def test_factories(name, params, cls, metric_name):
    reward = build_reward(name, params)
    assert isinstance(reward, cls)
    assert reward.__name__ == metric_name
    for key, value in (params or {}).items():
        assert getattr(reward, key) == value


def test_factories_return_fresh_instances():
    assert build_reward("length") is not build_reward("length")


def test_factory_params_are_applied():
    reward = build_reward("length", {"min_tokens": 2, "max_tokens": 4, "decay_tokens": 2})
    assert reward(["a", "a b c", "a b c d e"]) == [0.5, 1.0, 0.5]


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError) as info:
        build_reward("foo")
    message = str(info.value)
    assert message.startswith(
        "unknown reward 'foo'; valid rewards: accuracy_reward, arithmetic, correctness,"
    )
    for name in reward_names():
        assert name in message
    assert "package.module:function" in message


@pytest.mark.parametrize(
    ("name", "params", "pattern"),
    [
        ("correctness", {"scale": 2}, r"reward 'correctness' takes no params .*'scale'"),  # plain + params
        ("xml_count", {"penalty": 0.01}, r"reward 'xml_count' takes no params"),  # plain + params
        ("length", {"max_len": 10}, rf"'length' got unknown param\(s\) 'max_len'; {LENGTH_OK}"),  # typo
        ("repetition", {"n": 2, "size": 3}, r"param\(s\) 'n', 'size'; .*ngram_size, max_penalty"),  # two bad
        ("repetition", {"max_penalty": 1.0}, r"'repetition': invalid params .*max_penalty"),  # bad value
        ("length", {"min_tokens": 10, "max_tokens": 5}, r"reward 'length': invalid params"),  # bad range
        ("correctness", ["not", "a", "mapping"], r"params must be a mapping"),  # params type
        ("correctness", {"adaptive": "yes"}, r"'adaptive' must be true/false or a mapping"),  # adaptive type
        ("correctness", {"adaptive": {"window": 5}}, rf"adaptive setting\(s\) 'window'; {SCALER_OK}"),  # typo
        ("correctness", {"adaptive": {"momentum": 2}}, r"invalid adaptive settings .*momentum"),  # bad value
        ("", None, r"non-empty string"),  # empty name
        (None, None, r"non-empty string"),  # missing name
    ],
)
def test_param_errors(name, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_reward(name, params)


@pytest.mark.parametrize(
    ("name", "params", "metric_name"),
    [
        ("correctness", {"adaptive": True}, "correctness_reward_scaled"),  # default scaler
        ("correctness", {"adaptive": {}}, "correctness_reward_scaled"),  # empty settings = defaults
        ("xml_count", {"adaptive": {"momentum": 0.9, "clip": None}}, "xml_count_reward_scaled"),  # settings
        ("length", {"max_tokens": 50, "adaptive": True}, "length_reward_scaled"),  # factory + scaler
        ("strict_format", {"adaptive": {"suffix": "_z"}}, "strict_format_reward_z"),  # custom suffix
        (f"{FORMAT_MOD}:soft_format_reward", {"adaptive": True}, "soft_format_reward_scaled"),  # custom
    ],
)
def test_adaptive_param_wraps_any_reward(name, params, metric_name):
    reward = build_reward(name, params)
    assert isinstance(reward, AdaptiveScaler)
    assert reward.__name__ == metric_name
    for key, value in (params["adaptive"] if isinstance(params["adaptive"], dict) else {}).items():
        assert getattr(reward, key) == value


def test_adaptive_scalers_do_not_share_state():
    first = build_reward("correctness", {"adaptive": True})
    second = build_reward("correctness", {"adaptive": True})
    first([GOOD, "x"], answer=["42", "42"])
    assert first.calls == 1 and second.calls == 0


def test_params_mapping_is_not_mutated():
    params = {"max_tokens": 50, "adaptive": True}
    build_reward("length", params)
    assert params == {"max_tokens": 50, "adaptive": True}


def test_custom_reward_by_import_path():
    reward = build_reward("posttrain.rewards.accuracy:correctness_reward")
    assert reward is correctness_reward
    assert reward([GOOD], answer=["42"]) == [1.0]


def test_custom_factory_by_import_path_with_params():
    reward = build_reward("posttrain.rewards.shaping:make_length_reward", {"min_tokens": 1, "max_tokens": 3})
    assert isinstance(reward, LengthReward) and reward.max_tokens == 3


def test_custom_nested_attribute():
    reward = build_reward("posttrain.rewards.shaping:LengthReward.__call__")
    assert callable(reward)


@pytest.mark.parametrize(
    ("name", "params", "pattern"),
    [
        ("no_such_pkg_xyz.mod:fn", None, r"cannot import module 'no_such_pkg_xyz.mod'"),  # missing module
        (f"{ACCURACY_MOD}:nope", None, rf"module '{ACCURACY_MOD}' has no attribute 'nope'"),  # missing attr
        ("math:pi", None, r"custom reward 'math:pi' is not callable \(it is a float\)"),  # non-callable
        (":fn", None, r"must look like 'package.module:function'"),  # missing module part
        ("math:", None, r"must look like 'package.module:function'"),  # missing attribute part
        (f"{SHAPING_MOD}:make_length_reward", {"bogus": 1}, rf"param\(s\) 'bogus'; {LENGTH_OK}"),  # bad param
        ("os.path:join", {"a": "x"}, r"returned str, not a reward function"),  # factory returns non-callable
        ("math:floor", {"x": 1.5}, r"unknown param\(s\) 'x'; accepted params: \(none\)"),  # positional-only
    ],
)
def test_custom_reward_errors(name, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_reward(name, params)


# `posttrain rewards check`: rewards built from config names, scored on canned completions.


def test_check_rows_and_ranking():
    config = [("correctness", 2.0), ("strict_format", 0.5), ("xml_count", 0.5), ("repetition", 1.0)]
    rewards = [(name, weight, build_reward(name)) for name, weight in config]
    rows = score_examples(rewards, references=[(GOOD, "42"), (WRONG, "")])
    labels = [row.label for row in rows]
    assert labels == [*EXAMPLE_COMPLETIONS, "reference #1", "reference #2"]
    by_label = {row.label: row for row in rows}
    best = by_label[INTENDED_BEST]
    assert best.scores["correctness"] == 1.0 and best.total == pytest.approx(3.0)  # 2 + 0.5 + 0.5 + 0
    assert by_label["reference #1"].total == pytest.approx(3.0)
    assert by_label["reference #2"].scores["correctness"] is None  # None counts as 0 in the total
    assert by_label["reference #2"].total == pytest.approx(1.0)
    assert by_label["rambling"].scores["repetition"] < -0.5
    assert ranks_as_intended(rows)


def test_check_detects_format_only_config():
    rows = score_examples([("strict_format", 1.0, strict_format_reward)])
    assert not ranks_as_intended(rows)  # wrong+formatted ties with correct+formatted
    assert not ranks_as_intended([])
    assert not ranks_as_intended([RewardCheckRow(INTENDED_BEST, "", "42", {}, 1.0)])


def test_check_reports_broken_rewards():
    with pytest.raises(ValueError, match="returned 1 scores"):
        score_examples([("short", 1.0, lambda completions, **kw: [0.0])])
    with pytest.raises(ValueError, match="non-number"):
        score_examples([("text", 1.0, lambda completions, **kw: ["high"] * len(completions))])
    with pytest.raises(RuntimeError, match="'needs_solution' failed"):
        score_examples([("needs_solution", 1.0, lambda completions, solution, **kw: [0.0])])
    with pytest.raises(ValueError, match="duplicates: a"):
        score_examples([("a", 1.0, strict_format_reward), ("a", 1.0, soft_format_reward)])


def test_check_passes_trl_keyword_arguments():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer)
        log_extra("col", [1] * len(completions))
        log_metric("m", 1.0)
        return [None] * len(completions)

    rows = score_examples([("spy", 1.0, spy)], references=[("<answer>7</answer>", "7")])
    assert len(seen["prompts"]) == len(rows) == len(EXAMPLE_COMPLETIONS) + 1
    assert seen["answer"][-1] == "7"
    assert seen["ids"][list(EXAMPLE_COMPLETIONS).index("empty")] == []  # no words, no pseudo ids
    assert all(row.total == 0.0 for row in rows)


def test_check_all_registry_rewards_at_unit_weight_rank_as_intended():
    rows = score_examples([(name, 1.0, build_reward(name)) for name in POSTTRAIN_NAMES])
    assert ranks_as_intended(rows)
    assert all(set(row.scores) == set(POSTTRAIN_NAMES) for row in rows)


def test_check_calls_trl_rewards_as_the_trainer_does():
    """Conversational completions, as the trainer passes them: TRL's rewards index ``[0]["content"]``."""
    rows = score_examples([("accuracy_reward", 1.0, build_reward("accuracy_reward"))])
    assert {row.scores["accuracy_reward"] for row in rows} == {0.0}  # no \\boxed{} answer in the examples


# --------------------------------------------------------------------------- exact messages for custom rewards
# (issue 15: each signature problem named as such; TRL rewards get only the columns they take)


def _sig_cases():
    import types

    module = types.ModuleType("sig_cases")

    def no_kwargs(completions):
        return [0.0]

    def no_completions(texts, **kwargs):
        return [0.0]

    def needs_gold(completions, gold, tone, **kwargs):
        return [0.0]

    def gold_optional(completions, gold=None, **kwargs):
        return [0.0]

    def takes_answer(completions, answer, **kwargs):
        return [0.0]

    def positional_answer(answer, /, completions, **kwargs):
        return [0.0]

    module.__dict__.update(
        no_kwargs=no_kwargs,
        no_completions=no_completions,
        needs_gold=needs_gold,
        gold_optional=gold_optional,
        takes_answer=takes_answer,
        positional_answer=positional_answer,
        builtin=min,
    )
    return module


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        ("builtin", "its signature cannot be read"),
        ("no_kwargs", "it does not take **kwargs (TRL passes every dataset column as a keyword)"),
        ("no_completions", "it has no `completions` parameter"),
        ("needs_gold", "it requires 'gold', 'tone', which TRL never passes"),
        ("positional_answer", "it requires 'answer', which TRL never passes"),  # TRL passes keywords only
        ("gold_optional", None),
        ("takes_answer", None),  # a dataset column TRL passes
    ],
)
def test_custom_reward_signature_problems_are_named(function, problem, monkeypatch):
    import sys

    from posttrain.rewards.registry import check_reward

    monkeypatch.setitem(sys.modules, "sig_cases", _sig_cases())
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    if problem is None:
        check_reward(f"sig_cases:{function}")
        return
    with pytest.raises(ValueError) as error:
        check_reward(f"sig_cases:{function}")
    assert str(error.value) == (
        f"custom reward 'sig_cases:{function}' is not a reward function f(completions, **kwargs): {problem} "
        "(give `params` to use it as a factory)"
    )


def test_custom_factory_with_bad_params_is_named(monkeypatch):
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    with pytest.raises(ValueError) as error:
        build_reward(f"{SHAPING_MOD}:make_length_reward", {"max_tokens": -1})
    assert str(error.value).startswith(
        f"custom reward factory '{SHAPING_MOD}:make_length_reward': invalid params {{'max_tokens': -1}}: "
    )


def test_trl_reward_without_params_lists_what_it_got():
    with pytest.raises(ValueError) as error:
        build_reward("think_format_reward", {"x": 1, "y": 2})
    assert (
        str(error.value) == "TRL reward 'think_format_reward' takes no params (only 'adaptive'), got 'x', 'y'"
    )


def test_unknown_scaler_settings_are_listed():
    with pytest.raises(ValueError) as error:
        build_reward("correctness", {"adaptive": {"speed": 1, "colour": 2}})
    assert str(error.value) == (
        f"reward 'correctness': unknown adaptive setting(s) 'colour', 'speed'; {SCALER_OK}"
    )


def test_a_trl_reward_gets_the_gold_as_solution_only_if_it_takes_one():
    from posttrain.rewards.registry import TrlReward

    seen = {}

    def plain(completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    def graded(completions, solution, **kwargs):
        seen["solution"] = solution
        return [0.0] * len(completions)

    TrlReward(plain)(["c"], answer=["42"])
    assert seen == {"answer": ["42"]}
    seen.clear()
    TrlReward(graded)(["c"], answer=["42"])
    assert seen == {"solution": ["42"]}


def test_a_factory_without_a_readable_signature_is_simply_called(monkeypatch):
    """Builtins have no signature to check params against: the call itself decides."""
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    with pytest.raises(ValueError) as error:
        build_reward("builtins:min", {"default": 0})
    assert str(error.value).startswith(
        "custom reward factory 'builtins:min': invalid params {'default': 0}: "
    )


@pytest.mark.parametrize(
    ("value", "allowed"),
    [("1", True), ("true", True), (" TRUE ", True), ("Yes", True), ("0", False), ("no", False), ("", False)],
)
def test_the_custom_code_opt_in_values(value, allowed, monkeypatch):
    from posttrain.rewards.registry import custom_code_allowed

    monkeypatch.setenv(CUSTOM_CODE_ENV, value)
    assert custom_code_allowed() is allowed


def _message(call, *args) -> str:
    with pytest.raises(ValueError) as error:
        call(*args)
    return str(error.value)


def test_validation_checks_params_and_scaler_settings_like_building_does(monkeypatch):
    import sys

    from posttrain.rewards.registry import check_reward

    assert _message(check_reward, "correctness", {"adaptive": {"momentum": 2.0}}) == (
        "reward 'correctness': invalid adaptive settings {'momentum': 2.0}: momentum must be in [0, 1), got 2.0"
    )
    assert _message(check_reward, "length", {"max_tokens": -1}).startswith(
        "reward 'length': invalid params {'max_tokens': -1}: "
    )
    check_reward("length", {"max_tokens": 40, "adaptive": True})
    monkeypatch.setitem(sys.modules, "sig_cases", _sig_cases())
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    check_reward("sig_cases:takes_answer", {"adaptive": {"clip": 2.0}})  # a custom reward can be scaled
    assert _message(check_reward, "sig_cases:takes_answer", {"adaptive": {"bogus": 1}}) == (
        f"reward 'sig_cases:takes_answer': unknown adaptive setting(s) 'bogus'; {SCALER_OK}"
    )


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("correctness", ["x"], "reward 'correctness': params must be a mapping, got list"),
        (
            "correctness",
            {"adaptive": "yes"},
            "reward 'correctness': param 'adaptive' must be true/false or a mapping of scaler settings "
            "(momentum, eps, clip, suffix), got 'yes'",
        ),
        (
            "correctness",
            {"a": 1, "b": 2},
            "reward 'correctness' takes no params (only 'adaptive'), got 'a', 'b'",
        ),
        (
            "format",
            None,
            "unknown reward 'format' (did you mean 'soft_format', 'strict_format'?); valid rewards: "
            + ", ".join(reward_names())
            + " (or a custom 'package.module:function')",
        ),
    ],
)
def test_build_and_check_name_the_problem_exactly(name, params, message):
    from posttrain.rewards.registry import check_reward

    assert _message(build_reward, name, params) == message
    assert _message(check_reward, name, params) == message


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("math:pi", None, "custom reward 'math:pi' is not callable (it is a float)"),
        (
            f"{ACCURACY_MOD}:correctness_reward:extra",
            None,
            f"custom reward '{ACCURACY_MOD}:correctness_reward:extra': module '{ACCURACY_MOD}' has no attribute "
            "'correctness_reward:extra'",
        ),
        (
            "sig_cases:two_params",
            {"b": 1, "a": 2},
            "custom reward factory 'sig_cases:two_params' got unknown param(s) 'a', 'b'; "
            "accepted params: low, high",
        ),
        (
            "sig_cases:no_params",
            {"a": 1},
            "custom reward factory 'sig_cases:no_params' got unknown param(s) 'a'; accepted params: (none)",
        ),
        (
            "sig_cases:two_params",
            {"low": 1},
            "custom reward factory 'sig_cases:two_params': params ['low'] do not fit: missing a required "
            "argument: 'high'",
        ),
    ],
)
def test_custom_reward_validation_messages(name, params, message, monkeypatch):
    import sys

    from posttrain.rewards.registry import check_reward

    cases = _sig_cases()
    cases.no_params = lambda: None
    cases.two_params = lambda low, high: None
    monkeypatch.setitem(sys.modules, "sig_cases", cases)
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    assert _message(check_reward, name, params) == message


def test_building_a_reward_is_logged_at_debug_level(caplog):
    with caplog.at_level("DEBUG", logger="posttrain.rewards.registry"):
        build_reward("length", {"max_tokens": 40})
    assert "built reward 'length' as length_reward" in caplog.messages
