"""Answer parser: the single definition of "what the model answered" for rewards and evaluation."""

from decimal import Decimal

import pytest

from posttrain.core.parsing import (
    ParsedAnswer,
    answer_block,
    answers_match,
    completion_text,
    is_soft_format,
    is_strict_format,
    normalize_gold,
    normalize_number,
    parse_answers,
    parse_flexible,
    parse_strict,
    reasoning_block,
)

GOOD = "<reasoning>\n6 * 7 = 42\n</reasoning>\n<answer>\n42\n</answer>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),  # plain integer
        ("  42\n", "42"),  # surrounding whitespace
        ("1,234.00", "1234"),  # thousands comma and trailing .00
        ("3.50", "3.5"),  # trailing zero in decimal
        ("0.0", "0"),  # zero with decimals
        ("-0", "0"),  # negative zero is zero
        ("0.000", "0"),  # all-zero decimals
        ("007", "7"),  # leading zeros
        ("-7", "-7"),  # negative
        ("\u22127", "-7"),  # unicode minus sign
        ("\u20137", "-7"),  # en dash used as minus
        ("+5", "5"),  # explicit plus
        ("- 5", "-5"),  # space after the sign
        ("$1,234", "1234"),  # dollars with comma
        ("-$5", "-5"),  # negative dollars
        ("$ 5", "5"),  # space after the currency sign
        ("€12.50", "12.5"),  # other currency sign
        ("42.", "42"),  # sentence-final period
        ("50%", "50"),  # percent keeps the number of percent
        (".5", "0.5"),  # bare leading decimal point
        ("-.5", "-0.5"),  # negative bare decimal
        ("1,234,567.890", "1234567.89"),  # several comma groups
        ("1 234", "1234"),  # space as thousands separator
        ("1\u202f234", "1234"),  # narrow no-break space as thousands separator
        ("1/2", "0.5"),  # fraction
        ("12/4", "3"),  # fraction that is an integer
        ("2 3/4", "2.75"),  # mixed number
        ("-2 3/4", "-2.75"),  # negative mixed number
        ("1000000", "1000000"),  # no exponent notation in the canonical form
        ("3,4", None),  # comma not in thousands position
        ("1,2345", None),  # malformed thousands group
        ("3 4", None),  # two numbers separated by a space
        ("1/0", None),  # division by zero
        ("1e3", None),  # scientific notation is not a GSM8K answer
        ("42 apples", None),  # words: not a bare number (parse_strict handles this)
        ("forty-two", None),  # spelled out
        ("", None),  # empty
        (".", None),  # lone period
        ("$", None),  # lone currency sign
        (None, None),  # missing
        (True, None),  # bool is not a number here
        (7, "7"),  # int input
        (2.50, "2.5"),  # float input
        (float("nan"), None),  # nan input
        (Decimal("1E+3"), "1000"),  # Decimal exponent form is expanded
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize("text", ["1,234.00", "-3.50", "$7", "1/4", "0"])  # idempotence on assorted forms
def test_normalize_number_is_idempotent(text):
    once = normalize_number(text)
    assert normalize_number(once) == once


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        ("72", "72"),  # pre-extracted gold
        ("1,000", "1000"),  # gold with comma
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),  # raw GSM8K solution
        ("#### -5", "-5"),  # raw solution, negative
        ("", None),  # empty gold
        ("#### ", None),  # marker without number
        (None, None),  # missing gold
    ],
)
def test_normalize_gold(gold, expected):
    assert normalize_gold(gold) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("plain", "plain"),  # standard string
        ([{"role": "assistant", "content": "hi"}], "hi"),  # conversational
        ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "ab"),  # joined
        ([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], "y"),  # tool skipped
        ([{"content": "no role"}], "no role"),  # role missing counts as assistant
        ({"role": "assistant", "content": "single"}, "single"),  # single dict
        ([{"role": "assistant", "content": [{"type": "text", "text": "parts"}]}], "parts"),  # content parts
        ([{"role": "assistant", "content": None}], ""),  # None content
        ([], ""),  # empty conversation
        (None, ""),  # None
    ],
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD, "42"),  # trained format
        ("<answer>\n$1,234.00\n</answer>", "1234"),  # dollars and trailing zeros
        ("<answer>-3</answer>", "-3"),  # negative, inline tags
        ("<answer>2.50</answer>", "2.5"),  # decimal
        ("<answer>1/2</answer>", "0.5"),  # fraction as a whole
        ("<answer>The total is 18 dollars.</answer>", "18"),  # words: last number inside the block
        ("<answer>\\boxed{7}</answer>", "7"),  # latex box inside the block
        ("<answer>**18**</answer>", "18"),  # markdown bold
        ("<answer>1</answer> wait <answer>2</answer>", "2"),  # multiple blocks: last wins
        ("<answer>1<answer>2</answer>", "2"),  # nested opening tag
        ("reasoning says 42 <answer>41</answer>", "41"),  # outside numbers are ignored
        ("The answer is 42", None),  # no answer block
        ("<answer>42", None),  # unclosed (truncated) block
        ("<answer></answer>", None),  # empty block
        ("<answer>unknown</answer>", None),  # no number in block
        ("<ANSWER>5</ANSWER>", None),  # tags are case-sensitive
        ([{"role": "assistant", "content": GOOD}], "42"),  # conversational completion
    ],
)
def test_parse_strict(text, expected):
    assert parse_strict(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),  # sentence-final period
        ("It costs $1,234 in total", "1234"),  # dollars with comma
        ("Loss of -3 points", "-3"),  # negative
        ("x = 2.5", "2.5"),  # decimal
        ("a 1,000,000 b", "1000000"),  # several comma groups
        ("costs -$5", "-5"),  # negative dollars
        ("The result: \u22123", "-3"),  # unicode minus
        ("3-4 apples", "4"),  # hyphen between numbers is not a minus
        ("x = 10 - 5", "5"),  # spaced binary minus is not a sign
        ("6 * 7 = 42, so 42 muffins", "42"),  # last of several
        ("step 1: 5\nstep 2", "2"),  # documented: no step-number skipping
        ("1/2", "2"),  # documented: fractions not recognised in free text
        ("ages 3,4", "4"),  # comma not in thousands position
        (GOOD, "42"),  # formatted completion
        ([{"role": "assistant", "content": "so 9"}], "9"),  # conversational
        ("no digits", None),  # no number
        ("", None),  # empty
    ],
)
def test_parse_flexible(text, expected):
    assert parse_flexible(text) == expected


@pytest.mark.parametrize(
    ("text", "strict", "soft"),
    [
        (GOOD, True, True),  # exact trained layout
        ("\n  " + GOOD + "\n\n", True, True),  # outer whitespace ignored
        (GOOD.replace("\n", "\r\n"), True, True),  # windows newlines
        ("<reasoning>  \nx\n</reasoning>\n<answer>\n2\n</answer>", True, True),  # trailing spaces on tag line
        ("<reasoning>\na\nb\n</reasoning>\n<answer>\n2\n</answer>", True, True),  # multi-line reasoning
        (GOOD + " done", False, True),  # text after </answer>
        ("Sure!\n" + GOOD, False, True),  # text before <reasoning>
        ("<reasoning>6*7=42</reasoning><answer>42</answer>", False, True),  # tags not on own lines
        ("<reasoning>\nx\n</reasoning>\n\n<answer>\n2\n</answer>", False, True),  # blank line between blocks
        ("<reasoning>\n\n</reasoning>\n<answer>\n2\n</answer>", False, True),  # empty reasoning
        ("<reasoning>\nx\n</reasoning>\n<answer>\n \n</answer>", False, True),  # empty answer
        (GOOD + "\n<answer>\n2\n</answer>", False, True),  # two answer blocks
        ("<reasoning>\n<answer>\n1\n</answer>\n</reasoning>\n<answer>\n2\n</answer>", False, True),  # nested
        ("<answer>\n2\n</answer>\n<reasoning>\nx\n</reasoning>", False, False),  # wrong order
        ("<answer>\n2\n</answer>", False, False),  # answer only
        ("<reasoning>\nx\n</reasoning>", False, False),  # reasoning only
        ("<reasoning>\nx\n</reasoning>\n<answer>\n2", False, False),  # truncated
        ("42", False, False),  # bare answer
        ([{"role": "assistant", "content": GOOD}], True, True),  # conversational
    ],
)
def test_format_checks(text, strict, soft):
    assert is_strict_format(text) is strict
    assert is_soft_format(text) is soft


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("42", "42", True),  # identical
        ("1,234.00", "1234", True),  # formatting differs
        ("0.5", "1/2", True),  # fraction gold
        ("-7", "\u22127", True),  # unicode minus gold
        ("42", "#### 42", True),  # raw GSM8K gold
        ("42", "43", False),  # different number
        ("4.2", "42", False),  # decimal point matters
        (None, "42", False),  # no prediction
        ("42", None, False),  # no gold
        (None, None, False),  # None never matches None
        ("", "", False),  # empty never matches empty
    ],
)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


def test_answer_and_reasoning_blocks():
    assert answer_block(GOOD) == "42"
    assert reasoning_block(GOOD) == "6 * 7 = 42"
    assert answer_block("none") is None
    assert reasoning_block("none") is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, ParsedAnswer("42", "42", True, True)),  # formatted
        ("I think 41, no 42", ParsedAnswer(None, "42", False, False)),  # unformatted
        ("<answer>7</answer> or 8", ParsedAnswer("7", "8", False, False)),  # strict and flexible disagree
        ([{"role": "assistant", "content": GOOD}], ParsedAnswer("42", "42", True, True)),  # conversational
    ],
)
def test_parse_answers(completion, expected):
    parsed = parse_answers(completion)
    assert parsed == expected
    assert parsed.as_dict() == {
        "strict": expected.strict,
        "flexible": expected.flexible,
        "strict_format": expected.strict_format,
        "soft_format": expected.soft_format,
    }


# --------------------------------------------------------------------------- every completion form, exactly
# (issue 15: the shapes TRL and chat templates hand over, each mapped to its text)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (["a", {"role": "assistant", "content": "b"}], "ab"),  # bare strings in a message list
        ([{"role": "assistant"}], ""),  # a message without content
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "ab",
        ),
        ([{"role": "assistant", "content": ["a", {"type": "text", "text": "b"}]}], "ab"),  # mixed parts
        (
            [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": None}]}],
            "",
        ),  # no text
        ([{"role": "assistant", "content": 42}], "42"),  # a non-text content
        (42, "42"),  # anything else: its str
    ],
)
def test_completion_text_of_every_message_shape(completion, expected):
    assert completion_text(completion) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42X", None),  # trailing letters: not a number
        ("X42", None),  # leading letters: not a number
        ("100.50", "100.5"),  # trailing zeros of the fraction dropped
        ("-0.0", "0"),  # no negative zero
    ],
)
def test_normalize_number_edges(text, expected):
    assert normalize_number(text) == expected
