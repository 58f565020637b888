"""lm-evaluation-harness's gsm8k scoring, as posttrain re-implements it (evaluation/lm_eval_gsm8k.py):
the patterns of the task's gsm8k.yaml, applied to posttrain's own completions."""

from __future__ import annotations

import pytest

from posttrain.evaluation.lm_eval_gsm8k import INVALID, flexible_extract, lm_eval_accuracy, strict_match

OURS = "<reasoning>\n6*7 = 42\n</reasoning>\n<answer>\n42\n</answer>"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        pytest.param("so 6*7=42\n#### 42", "42", id="hash-answer"),
        pytest.param("#### -1,234.5 then #### 7", "-1,234.5", id="first-of-two"),
        pytest.param("#### 12 ", "12", id="trailing-space"),
        pytest.param("####42", INVALID, id="needs-the-space"),
        pytest.param(OURS, INVALID, id="answer-block-is-invalid"),
    ],
)
def test_strict_match_takes_the_first_hash_answer(completion, expected):
    assert strict_match(completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        pytest.param(OURS, "42", id="last-number"),
        pytest.param("<answer>\n$1,234.\n</answer>", "$1,234.", id="money-with-comma-and-dot"),
        pytest.param("7 apples", "7", id="one-digit"),
        pytest.param("-5 and then -3", "-3", id="negative-last"),
        pytest.param("none", INVALID, id="no-number"),
    ],
)
def test_flexible_extract_takes_the_last_number_like_token(completion, expected):
    assert flexible_extract(completion) == expected


@pytest.mark.parametrize(
    ("samples", "references", "strict", "flexible"),
    [
        pytest.param([[OURS], ["#### 5"]], ["42", "#### 5"], 0.5, 1.0, id="ours-and-lm-evals-format"),
        pytest.param([["#### 1,234."]], ["Step... #### 1234"], 1.0, 1.0, id="comma-and-final-dot-ignored"),
        pytest.param([["costs $1,234."]], ["#### 1234"], 0.0, 1.0, id="dollar-ignored"),
        pytest.param([["#### 42.0"]], ["42"], 0.0, 0.0, id="compared-as-strings"),
        pytest.param([["#### ABC 4"]], ["4"], 0.0, 1.0, id="strict-needs-digits"),
        pytest.param([["#### 4", "#### 5", "no", "#### 4"]], ["4"], 0.5, 0.5, id="share-of-samples"),
        pytest.param([[], ["#### 4"]], ["1", "4"], 1.0, 1.0, id="no-samples-skipped"),
        pytest.param([[]], ["1"], 0.0, 0.0, id="nothing-sampled"),
        pytest.param([["#### 4"], ["#### 9"], ["#### 7"], ["x"]], ["4", "9", "1", "2"], 0.5, 0.5, id="mean"),
    ],
)
def test_accuracy_is_the_mean_share_of_matching_samples(samples, references, strict, flexible):
    assert lm_eval_accuracy(samples, references) == {
        "lm_eval_strict_match": strict,
        "lm_eval_flexible_extract": flexible,
    }


def test_an_invalid_answer_never_matches():
    assert lm_eval_accuracy([["nothing"]], [INVALID]) == {
        "lm_eval_strict_match": 0.0,
        "lm_eval_flexible_extract": 0.0,
    }


def test_questions_and_references_must_pair_up():
    with pytest.raises(ValueError, match=r"^2 questions but 1 references$"):
        lm_eval_accuracy([["#### 1"], ["#### 2"]], ["1"])
