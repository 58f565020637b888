"""Reward functions on hand-written completions, called the way TRL 1.16's GRPOTrainer calls them."""

import math
import pickle
import random
import statistics

import pytest

from posttrain.rewards import (
    correctness_reward,
    int_answer_reward,
    make_adaptive_scaler,
    make_length_reward,
    make_repetition_penalty,
    reasoning_steps_reward,
    soft_format_reward,
    strict_format_reward,
    xml_count_reward,
)

GOOD = "<reasoning>\nStep 1: 6 trays.\nStep 2: 6 * 7 = 42\n</reasoning>\n<answer>\n42\n</answer>"
WRONG = "<reasoning>\n6 + 7 = 13\n</reasoning>\n<answer>\n13\n</answer>"
INLINE = "<reasoning>6 * 7 = 42</reasoning> <answer>42</answer>"


def conv(text):
    """TRL's conversational completion form."""
    return [{"role": "assistant", "content": text}]


def trl_kwargs(n, answers):
    """Everything GRPOTrainer passes besides ``completions`` (TRL 1.16 `_calculate_rewards`)."""
    return {
        "prompts": ["q"] * n,
        "completion_ids": [[1, 2, 3]] * n,
        "answer": answers,
        "question": ["q"] * n,  # other dataset columns arrive as extra kwargs
        "trainer_state": None,
        "log_extra": lambda column, values: None,
        "log_metric": lambda name, value: None,
    }


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (GOOD, "42", 1.0),  # correct and formatted
        (conv(GOOD), "42", 1.0),  # conversational
        (WRONG, "42", 0.0),  # wrong answer
        ("The answer is 42", "42", 0.0),  # correct number but no answer block: strict parse, no fallback
        (INLINE, "42", 1.0),  # layout does not matter for correctness
        ("<answer>\n$42.00\n</answer>", "42", 1.0),  # normalized comparison
        ("<answer>42 muffins</answer>", "42", 1.0),  # last number inside the block
        ("<answer>1,000</answer>", "1000", 1.0),  # thousands comma
        ("<answer>-3</answer>", "-3", 1.0),  # negative gold
        ("<answer>42</answer>", "#### 42", 1.0),  # raw GSM8K gold
        ("<answer>42", "42", 0.0),  # truncated block
        ("", "42", 0.0),  # empty completion
        (GOOD, "", None),  # empty gold: not scorable
        (GOOD, "n/a", None),  # non-numeric gold: not scorable
    ],
)
def test_correctness_reward(completion, gold, expected):
    assert correctness_reward([completion], answer=[gold]) == [expected]


def test_correctness_reward_trl_call_and_log_extra():
    logged = {}
    kwargs = trl_kwargs(3, ["42", "42", "42"])
    kwargs["log_extra"] = lambda column, values: logged.__setitem__(column, values)
    rewards = correctness_reward(completions=[GOOD, WRONG, "x"], **kwargs)
    assert rewards == [1.0, 0.0, 0.0]
    assert logged == {"parsed_answer": ["42", "13", None]}


def test_correctness_reward_length_mismatch():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        correctness_reward([GOOD, GOOD], answer=["42"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>\n42\n</answer>", 0.5),  # integer
        ("<answer>-3</answer>", 0.5),  # negative integer
        ("<answer>$1,200</answer>", 0.5),  # formatted integer
        ("<answer>7.0</answer>", 0.5),  # integral decimal
        ("<answer>2.5</answer>", 0.0),  # non-integer
        ("<answer>42 apples</answer>", 0.0),  # words in the block
        ("<answer></answer>", 0.0),  # empty block
        ("42", 0.0),  # no block
        (conv("<answer>8</answer>"), 0.5),  # conversational
    ],
)
def test_int_answer_reward(completion, expected):
    assert int_answer_reward([completion], answer=["42"]) == [expected]


@pytest.mark.parametrize(
    ("completion", "strict", "soft"),
    [
        (GOOD, 1.0, 0.5),  # exact layout
        (conv(GOOD), 1.0, 0.5),  # conversational
        (GOOD + "\n", 1.0, 0.5),  # trailing newline
        (INLINE, 0.0, 0.5),  # inline tags
        ("Intro\n" + GOOD, 0.0, 0.5),  # preamble
        ("<answer>\n42\n</answer>", 0.0, 0.0),  # answer only
        ("42", 0.0, 0.0),  # bare
        ("", 0.0, 0.0),  # empty
    ],
)
def test_format_rewards(completion, strict, soft):
    kwargs = trl_kwargs(1, ["42"])
    assert strict_format_reward(completions=[completion], **kwargs) == [strict]
    assert soft_format_reward(completions=[completion], **kwargs) == [soft]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, 1.0),  # all four tags on their own lines
        (conv(GOOD), 1.0),  # conversational
        (GOOD + "\n", 1.0),  # trailing whitespace is free
        (GOOD + "\nbye", 0.997),  # 3 characters after </answer>
        (GOOD + "\n" + "x" * 5000, 0.0),  # tail penalty capped at 1.0
        ("<reasoning>\nx\n</reasoning>\n42", 0.5),  # reasoning tags only
        ("<reasoning>\nx\n</reasoning>\n<answer>42</answer>", 0.5),  # answer tags inline
        ("<reasoning>\nx\n</reasoning>\n" * 2 + "<answer>\n1\n</answer>", 0.5),  # reasoning tags twice
        ("<answer>\n1\n</answer>\n<answer>\n2\n</answer>", 0.0),  # answer tags twice
        ("", 0.0),  # empty
    ],
)
def test_xml_count_reward(completion, expected):
    assert xml_count_reward([completion]) == pytest.approx([expected])


def test_xml_count_reward_partial_credit_is_monotone():
    partial = [
        "",
        "<reasoning>\nx",
        "<reasoning>\nx\n</reasoning>",
        "<reasoning>\nx\n</reasoning>\n<answer>\n1",
    ]
    scores = xml_count_reward(partial + [GOOD])
    assert scores == sorted(scores) and len(set(scores)) == len(scores)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, 2 / 3),  # two "Step N" lines
        ("<reasoning>\nStep 1: a\nStep 2: b\nStep 3: c\nStep 4: d\n</reasoning>", 1.0),  # saturates at 1
        ("<reasoning>\n1. a\n2. b\n3. c\n</reasoning>", 1.0),  # numbered list
        ("<reasoning>\n- a\n- b\n</reasoning>", 2 / 3),  # bullets
        ("<reasoning>\nFirst, a.\nNext, b.\nFinally, c.\n</reasoning>", 1.0),  # transition words
        ("<reasoning>\n6 * 7 = 42\n42 - 2 = 40\n</reasoning>", 2 / 3),  # equations
        ("<reasoning>\nStep 1: a. Step 2: b. Step 3: c.\n</reasoning>", 1.0),  # inline step markers
        ("<reasoning>\n" + "6 * 7 = 42\n" * 3 + "</reasoning>", 1 / 3),  # duplicated line counts once
        ("Step 1: a\nStep 2: b", 2 / 3),  # no block: whole text
        ("<reasoning>\nI know it.\n</reasoning>\nStep 1: a", 0.0),  # block present: only the block counts
        ("I just know.", 0.0),  # no steps
        ("", 0.0),  # empty
        (conv("1. a\n2. b\n3. c"), 1.0),  # conversational
    ],
)
def test_reasoning_steps_reward(completion, expected):
    assert reasoning_steps_reward([completion]) == pytest.approx([expected], abs=1e-5)


@pytest.mark.parametrize(
    ("n_words", "expected"),
    [
        (0, 0.0),  # empty
        (5, 0.5),  # half of min
        (10, 1.0),  # at min
        (15, 1.0),  # inside
        (20, 1.0),  # at max
        (25, 0.5),  # half-way through the decay
        (30, 0.0),  # end of decay
        (100, 0.0),  # far beyond
    ],
)
def test_length_reward(n_words, expected):
    reward = make_length_reward(min_tokens=10, max_tokens=20, decay_tokens=10)
    assert reward.__name__ == "length_reward"
    assert reward([" ".join(["w"] * n_words)], answer=["1"]) == [expected]
    assert reward([conv(" ".join(["w"] * n_words))]) == [expected]


def test_length_reward_default_decay_is_max_tokens():
    reward = make_length_reward(min_tokens=0, max_tokens=10)
    assert reward(["w " * 15, "w " * 20, ""]) == [0.5, 0.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_tokens": -1},  # negative min
        {"min_tokens": 20, "max_tokens": 10},  # max below min
        {"min_tokens": 0, "max_tokens": 0},  # empty range
        {"max_tokens": 2.5},  # non-integer
        {"decay_tokens": 0},  # zero decay
        {"min_tokens": True},  # bool is not an int here
    ],
)
def test_length_reward_rejects_bad_params(kwargs):
    with pytest.raises(ValueError):
        make_length_reward(**kwargs)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("the cat sat on the mat", 0.0),  # no repeated 3-gram
        ("a b", 0.0),  # shorter than n
        ("", 0.0),  # empty
        ("a b c a b c", -0.25),  # 4 trigrams, 3 unique
        ("A b c a B c", -0.25),  # case-insensitive
        (conv("a b c a b c"), -0.25),  # conversational
    ],
)
def test_repetition_penalty(completion, expected):
    penalty = make_repetition_penalty(ngram_size=3, max_penalty=-1.0)
    assert penalty.__name__ == "repetition_penalty"
    assert penalty([completion]) == pytest.approx([expected])


def test_repetition_penalty_is_monotone_in_repeats():
    penalty = make_repetition_penalty()
    base = "six trays of seven muffins make forty two muffins in total"
    texts = [" ".join([base] * k) for k in range(1, 8)]
    scores = penalty(texts)
    assert scores[0] == 0.0
    assert all(a > b for a, b in zip(scores, scores[1:], strict=False)), scores
    assert all(-1.0 <= s <= 0.0 for s in scores)


def test_repetition_penalty_scales_with_max_penalty():
    text = ["x y z x y z x y z"]
    assert make_repetition_penalty(max_penalty=-0.5)(text)[0] == pytest.approx(
        0.5 * make_repetition_penalty(max_penalty=-1.0)(text)[0]
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ngram_size": 0},  # n must be positive
        {"ngram_size": 2.0},  # n must be an int
        {"max_penalty": 0.5},  # penalty must be non-positive
        {"max_penalty": "big"},  # penalty must be a number
    ],
)
def test_repetition_penalty_rejects_bad_params(kwargs):
    with pytest.raises(ValueError):
        make_repetition_penalty(**kwargs)


def _noisy_reward(completions, **kwargs):
    """Module-level reward returning the floats (or None) passed as completions."""
    return list(completions)


def test_adaptive_scaler_standardizes_over_many_calls():
    rng = random.Random(0)
    scaled = make_adaptive_scaler(_noisy_reward, momentum=0.99)
    assert scaled.__name__ == "_noisy_reward_scaled"
    outputs = []
    for step in range(600):
        batch = [rng.gauss(5.0, 3.0) for _ in range(16)]
        out = scaled(batch, answer=["1"] * 16)
        if step >= 300:
            outputs.extend(out)
    assert statistics.fmean(outputs) == pytest.approx(0.0, abs=0.1)
    assert statistics.pstdev(outputs) == pytest.approx(1.0, abs=0.1)
    assert scaled.mean == pytest.approx(5.0, abs=0.5)
    assert scaled.std == pytest.approx(3.0, abs=0.5)


def test_adaptive_scaler_passes_none_through_and_is_stateful():
    scaled = make_adaptive_scaler(_noisy_reward, momentum=0.5)
    first = scaled([1.0, None, 3.0, float("nan")])
    assert first[1] is None and math.isnan(first[3])
    assert first[0] == pytest.approx(-1.0, abs=1e-4) and first[2] == pytest.approx(1.0, abs=1e-4)
    assert scaled.calls == 1 and scaled.mean == 2.0
    assert scaled([None, None]) == [None, None]  # all-None batch leaves the state alone
    assert scaled.calls == 1
    scaled([10.0, 10.0])
    assert scaled.calls == 2 and scaled.mean == pytest.approx(6.0)
    scaled.reset()
    assert scaled.calls == 0


def test_adaptive_scaler_constant_rewards_scale_to_zero_and_clip():
    scaled = make_adaptive_scaler(_noisy_reward, momentum=0.99, clip=3.0)
    assert scaled([0.0] * 8) == [0.0] * 8  # no spread yet: everything is the mean
    spike = scaled([0.0] * 7 + [1.0])
    assert spike[-1] == 3.0  # rare success is clipped while the running std is still tiny
    unclipped = make_adaptive_scaler(_noisy_reward, clip=None)
    unclipped([0.0] * 8)
    assert unclipped([0.0] * 7 + [1.0])[-1] > 3.0


def test_adaptive_scaler_wraps_real_reward_and_logs_metrics():
    metrics = {}
    scaled = make_adaptive_scaler(correctness_reward)
    kwargs = trl_kwargs(2, ["42", "42"])
    kwargs["log_metric"] = lambda name, value: metrics.__setitem__(name, value)
    out = scaled(completions=[GOOD, WRONG], **kwargs)
    assert out == pytest.approx([1.0, -1.0], abs=1e-4)
    assert scaled.__name__ == "correctness_reward_scaled"
    assert metrics == {
        "rewards/correctness_reward_scaled/running_mean": 0.5,
        "rewards/correctness_reward_scaled/running_std": 0.5,
    }


def test_factories_pickle_for_trl_async_workers():
    for reward in (
        make_length_reward(),
        make_repetition_penalty(),
        make_adaptive_scaler(make_repetition_penalty()),
    ):
        clone = pickle.loads(pickle.dumps(reward))
        assert clone.__name__ == reward.__name__
        assert clone(["a b c a b c"]) == reward(["a b c a b c"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"momentum": 1.0},  # momentum must be < 1
        {"momentum": -0.1},  # momentum must be >= 0
        {"eps": 0},  # eps must be positive
        {"clip": -1},  # clip must be positive
        {"suffix": ""},  # suffix must be non-empty
    ],
)
def test_adaptive_scaler_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        make_adaptive_scaler(correctness_reward, **kwargs)


def test_adaptive_scaler_rejects_non_callable_and_async():
    async def async_reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="callable"):
        make_adaptive_scaler(42)
    with pytest.raises(ValueError, match="async"):
        make_adaptive_scaler(async_reward)


ALL_REWARDS = [
    correctness_reward,
    int_answer_reward,
    strict_format_reward,
    soft_format_reward,
    xml_count_reward,
    reasoning_steps_reward,
    make_length_reward(),
    make_repetition_penalty(),
    make_adaptive_scaler(correctness_reward),
]


@pytest.mark.parametrize("reward", ALL_REWARDS, ids=lambda r: r.__name__)
def test_every_reward_returns_one_value_per_completion(reward):
    completions = [GOOD, conv(WRONG), INLINE, "", "rambling " * 300]
    out = reward(completions=completions, **trl_kwargs(len(completions), ["42"] * len(completions)))
    assert len(out) == len(completions)
    assert all(v is None or isinstance(v, float) for v in out)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("<reasoning>\n72+23 = 95\n</reasoning>\n<answer>\n95\n</answer>", 1.0),
        ("<reasoning>\n72+23 = 105\n</reasoning>\n<answer>\n105\n</answer>", 0.0),
        ("96/2 = 48 bags, 48*3 = 144, then 144 - 4 = 141", 2 / 3),
        ("7 x 16 = 112 and 7 \u00d7 16 = 112", 1.0),
        ("$1,200 / 4 = $300", 1.0),
        ("10 / 4 = 2.5 but 10 / 3 = 3.33", 0.5),  # exact values: a rounded third is not a third
        ("5 / 0 = 0", 0.0),  # not checkable: no score from it, none at all here
        ("5 / 0 = 0 and 2 + 2 = 4", 1.0),  # ... and it does not count against the checkable ones
        ("7 \u00d7 16 = 112", 1.0),  # each way of writing an operation, alone
        ("7 x 16 = 112", 1.0),
        ("12 \u00f7 4 = 3", 1.0),
        ("6 / 1 = 6", 1.0),
        ("<reasoning>\n2+2 = 4\n</reasoning>\n<answer>\n2+2 = 5\n</answer>", 1.0),  # the reasoning only
        ("3 boxes * 4 = 12 and x = 12", 0.0),  # words in between: not a calculation
        ("42", 0.0),
    ],
)
def test_arithmetic_reward_checks_each_worked_calculation(text, score):
    from posttrain.rewards.accuracy import arithmetic_reward

    assert arithmetic_reward([text]) == [pytest.approx(score)]


# --------------------------------------------------------------------------- boundaries, messages, exact statistics
# (issue 15: the values at each boundary and the error each bad setting gives)


def test_correctness_reward_warns_how_many_golds_are_not_numbers(caplog):
    with caplog.at_level("WARNING"):
        out = correctness_reward([GOOD, GOOD, GOOD, GOOD], answer=["42", "", "n/a", "42"])
    assert out == [1.0, None, None, 1.0]
    assert caplog.messages == [
        "correctness_reward: 2 of 4 gold answers are not numbers (first: ''); those completions get no "
        "correctness reward"
    ]


def test_reasoning_steps_count_distinct_lines_whatever_their_case_or_blank_lines_between():
    text = "<reasoning>\nStep 1: add\n\nstep 1: ADD\n\nThen 2 + 2 = 4\n</reasoning>"
    assert reasoning_steps_reward([text]) == pytest.approx([2 / 3])


@pytest.mark.parametrize(
    ("kwargs", "n_words", "expected"),
    [
        ({"min_tokens": 2, "max_tokens": 4}, 4, 1.0),  # at max_tokens: still in range
        ({"min_tokens": 2, "max_tokens": 2}, 2, 1.0),  # a one-length range is allowed
        ({"min_tokens": 0, "max_tokens": 1}, 2, 0.0),  # default decay = max_tokens = 1 word
        ({"min_tokens": 0, "max_tokens": 4, "decay_tokens": 1}, 5, 0.0),  # the shortest decay
    ],
)
def test_length_reward_boundaries(kwargs, n_words, expected):
    assert make_length_reward(**kwargs)(["w " * n_words]) == [expected]


def test_length_and_repetition_defaults():
    assert repr(make_length_reward()) == "LengthReward(min_tokens=20, max_tokens=300, decay_tokens=300)"
    assert repr(make_repetition_penalty()) == "RepetitionPenalty(ngram_size=3, max_penalty=-1.0)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_tokens": -1}, "min_tokens must be a non-negative integer, got -1"),
        ({"max_tokens": 2.5}, "max_tokens must be a non-negative integer, got 2.5"),
        (
            {"min_tokens": 20, "max_tokens": 10},
            "need 0 < max_tokens >= min_tokens, got min_tokens=20, max_tokens=10",
        ),
        ({"decay_tokens": True}, "decay_tokens must be a positive integer or None, got True"),
        ({"decay_tokens": 0}, "decay_tokens must be a positive integer or None, got 0"),
    ],
)
def test_length_reward_bad_params_are_named(kwargs, message):
    with pytest.raises(ValueError) as error:
        make_length_reward(**kwargs)
    assert str(error.value) == message


def test_repetition_penalty_limits_are_valid():
    assert make_repetition_penalty(ngram_size=1)(["a a"]) == [-0.5]  # unigrams: one of two repeats
    assert make_repetition_penalty(max_penalty=0)(["a b a b"]) == [0.0]  # a disabled penalty


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ngram_size": 0}, "ngram_size must be a positive integer, got 0"),
        ({"max_penalty": 0.5}, "max_penalty must be a number <= 0, got 0.5"),
    ],
)
def test_repetition_penalty_bad_params_are_named(kwargs, message):
    with pytest.raises(ValueError) as error:
        make_repetition_penalty(**kwargs)
    assert str(error.value) == message


def _constant(value):
    def reward(completions, **kwargs):
        return [value(i) for i in range(len(completions))]

    return reward


def test_adaptive_scaler_mixes_the_spread_of_batch_means_into_its_variance():
    scaler = make_adaptive_scaler(_constant(lambda i: [0.0, 2.0][i]), momentum=0.5)
    assert (scaler.mean, scaler.std, scaler.calls) == (0.0, 0.0, 0)
    scaler(["a", "b"])
    assert (scaler.mean, scaler.std) == (1.0, 1.0)
    scaler.reward_fn = _constant(lambda i: 4.0)
    scaler(["a", "b"])
    # mean 0.5 * 1 + 0.5 * 4; var 0.5 * (1 + 1.5**2) + 0.5 * (0 + 1.5**2)
    assert scaler.mean == 2.5 and scaler.std == pytest.approx(math.sqrt(2.75))
    scaler.reset()
    assert (scaler.mean, scaler.std, scaler.calls) == (0.0, 0.0, 0)


def test_adaptive_scaler_divides_by_std_plus_eps_and_clips_at_five_by_default():
    scaler = make_adaptive_scaler(_constant(lambda i: [0.0, 2.0][i]), eps=1.0)
    assert scaler(["a", "b"]) == [-0.5, 0.5]  # (r - 1) / (1 + 1)
    rare = make_adaptive_scaler(_constant(lambda i: float(i == 99)))
    assert max(rare(["x"] * 100)) == 5.0


def test_adaptive_scaler_accepts_the_edges_of_its_ranges():
    make_adaptive_scaler(correctness_reward, momentum=0.0, clip=0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
        ({"momentum": "0.5"}, "momentum must be in [0, 1), got '0.5'"),
        ({"eps": True}, "eps must be a positive number, got True"),
        ({"eps": 0}, "eps must be a positive number, got 0"),
        ({"clip": True}, "clip must be a positive number or None, got True"),
        ({"clip": 0}, "clip must be a positive number or None, got 0"),
        ({"suffix": ""}, "suffix must be a non-empty string, got ''"),
    ],
)
def test_adaptive_scaler_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError) as error:
        make_adaptive_scaler(correctness_reward, **kwargs)
    assert str(error.value) == message


def test_adaptive_scaler_names_and_refuses_async_callables_in_any_wrapping():
    import functools

    from posttrain.rewards.scaling import reward_name

    async def graded(completions, **kwargs):
        return [0.0] * len(completions)

    class AsyncReward:
        async def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    for wrapped in (functools.partial(graded, extra=1), AsyncReward()):
        with pytest.raises(ValueError, match="cannot wrap async reward"):
            make_adaptive_scaler(wrapped)
    assert reward_name(functools.partial(functools.partial(graded))) == "graded"
    assert reward_name(AsyncReward()) == "AsyncReward"
    with pytest.raises(ValueError, match="cannot wrap async reward 'graded'"):
        make_adaptive_scaler(functools.partial(graded))
    length = make_adaptive_scaler(make_length_reward(min_tokens=1, max_tokens=2))  # a callable object
    assert length.__name__ == "length_reward_scaled"
    assert length(["a", "a b c d"]) == pytest.approx([1.0, -1.0], rel=1e-4)


SOLUTION = "Sofia has 7*5 = <<7*5=35>>35 pencils.\nEach gets 35/5 = <<35/5=7>>7.\n#### 7"


@pytest.mark.parametrize(
    ("completion", "solution", "score"),
    [
        (
            "<reasoning>\n7*5 = 35\n35/5 = 7\n</reasoning>\n<answer>\n7\n</answer>",
            SOLUTION,
            1.0,
        ),  # set up right
        ("<reasoning>\n7*5 = 35\n35-5 = 30\n</reasoning>", SOLUTION, 0.5),  # first step right
        ("<reasoning>\n7+5 = 12\n12/5 = 2.4\n</reasoning>", SOLUTION, 0.0),  # wrong operation first
        ("The answer is 35 and then 7.", SOLUTION, 0.0),  # values not computed after '=' earn nothing
        ("7*5 = 35, 7*5 = 35", SOLUTION, 0.5),  # a value computed twice counts once
        ("2+2 = 4", "She has 4 apples.\n#### 4", None),  # no annotated step: nothing to compare
        ([{"role": "assistant", "content": "7*5 = $35\n35/5 = 7"}], SOLUTION, 1.0),  # conversational, dollars
        ("1,200/4 = 300", "It is 1200/4 = <<1200/4=300>>300.\n#### 300", 1.0),  # thousands comma
    ],
)
def test_setup_reward_pays_for_each_reference_step_computed(completion, solution, score):
    from posttrain.rewards.accuracy import setup_reward

    assert setup_reward([completion], solution=[solution]) == [score]


def test_setup_reward_refuses_mismatched_columns():
    from posttrain.rewards.accuracy import setup_reward

    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        setup_reward(["a", "b"], solution=[SOLUTION])
