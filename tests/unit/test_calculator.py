"""The calculator's text rules: what is a call, what it writes, and solutions written for it."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from posttrain.core.calculator import (
    MAX_EXPRESSION_CHARS,
    calculator_call,
    evaluate_arithmetic,
    format_value,
    render_calculator_form,
)
from posttrain.core.prompts import format_sft_target


@pytest.mark.parametrize(
    ("text", "expression", "insert"),
    [
        ("She sold 48/2 =", "48/2", " 24"),  # the trained form: a space, then the value
        ("She sold 48/2 = ", "48/2", "24"),  # the space already written
        ("He writes 3*2=", "3*2", "6"),  # glued '=': glued value
        ("Total: (40 - 5) / 5 =", "(40 - 5) / 5", " 7"),  # parentheses
        ("Maila read 12 x 2 =", "12 x 2", " 24"),  # GSM8K's spaced 'x'
        ("pays $72 + $23 =", "$72 + $23", " 95"),  # dollars
        ("That is 1,200/4 =", "1,200/4", " 300"),  # thousands comma
        ("7/2 =", "7/2", " 3.5"),  # a decimal
        ("10/3 =", "10/3", " 3.3333"),  # rounded to four places
        ("5 - 8 =", "5 - 8", " -3"),  # a negative value
        ("3 + 4 = 7 + 2 =", "7 + 2", " 9"),  # a chain: only the last clause
        ("He has 2 apples and 3 * 5 =", "3 * 5", " 15"),  # words before the expression
        ("first.\n9*21 =", "9*21", " 189"),  # a new line starts a clause
        ("<<48/2=", "48/2", "24>>"),  # an open GSM8K annotation closes itself
    ],
)
def test_calls_and_what_the_calculator_writes(text, expression, insert):
    call = calculator_call(text)
    assert call is not None and call.ok
    assert (call.expression, call.insert) == (expression, insert)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("2**99 =", id="power"),
        pytest.param("__import__ =", id="name"),
        pytest.param("1/0 =", id="division-by-zero"),
        pytest.param("25% * 80 =", id="percent-is-no-operator"),
        pytest.param("9999999 * 9999999 =", id="too-large-for-a-step"),
        pytest.param("2 + =", id="malformed"),
        pytest.param("(" * 70 + "1" + ")" * 70 + " + 1 =", id="longer-than-any-step"),
    ],
)
def test_failed_calls_are_calls_without_a_value(text):
    call = calculator_call(text)
    assert call is not None and not call.ok and call.insert == ""


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 7.",  # no '='
        "Total cost =",  # words
        "x =",  # a variable
        "5 =",  # no operation
        "a == b",  # comparison
        "3 <= 4",  # comparison
        "<<48/2=24>>24 and",  # a closed annotation, no '=' at the end
        "",
    ],
)
def test_texts_without_a_call(text):
    assert calculator_call(text) is None


def test_evaluator_refuses_everything_but_the_four_operations():
    for expression in ("2**3", "a+1", "f(2)", "-3", "2 < 3", "1 if 2 else 3", "[1]", "1e5 + 1"):
        assert evaluate_arithmetic(expression) is None, expression
    assert evaluate_arithmetic("1+" * (MAX_EXPRESSION_CHARS // 2) + "1") is None
    assert evaluate_arithmetic("0.2 x 50") == Fraction(10)


def test_format_value_rounds_half_to_even_and_refuses_huge_values():
    assert format_value(Fraction(1, 8)) == "0.125"
    assert format_value(Fraction(1, 80000)) == "0"  # 0.0000125 rounds to 0.0000
    assert format_value(Fraction(10**12)) is None


@pytest.mark.parametrize(
    ("solution", "rendered"),
    [
        ("She sold 48/2 = <<48/2=24>>24 clips.", "She sold 48/2 = 24 clips."),  # unchanged text
        ("Betty has 100 / 2 = $<<100/2=50>>50.", "Betty has 100 / 2 = 50."),  # '$' after '=' goes
        (
            "He buys 3 shirts for $<<3*5=15>>15.",
            "He buys 3 shirts for $3*5 = 15.",
        ),  # result only: expression written
        (
            "2 wheels * 10ml per wheel = <<2*10=20>>20ml",
            "2 wheels * 10ml per wheel = 2*10 = 20ml",
        ),  # units: chained
        ("Green = <<156=156>>156 cm", "Green = 156 cm"),  # no operation: the text stays
        ("6*2=<<6*2=12>>12 pages", "6*2=12 pages"),  # glued stays glued
    ],
)
def test_render_calculator_form(solution, rendered):
    assert render_calculator_form(solution) == rendered


def test_sft_targets_in_calculator_form_keep_the_expressions():
    solution = "He paid <<3*5=15>>15 dollars.\n#### 15"
    assert "He paid 15 dollars." in format_sft_target(solution)
    assert "He paid 3*5 = 15 dollars." in format_sft_target(solution, calculator=True)


def test_nearly_every_gsm8k_step_reads_as_the_calculator_completes_it(gsm8k_train_path):
    """On the real train split, each annotated step of a rendered solution is a call whose value the
    calculator writes exactly where the solution has it: at least 98 % of the steps of the first 1,000
    solutions (degenerate annotations such as ``<<60=60>>`` are no calculation)."""
    annotation = re.compile(r"<<[^<>]*>>")
    steps = reproduced = 0
    with open(gsm8k_train_path) as fh:
        for line in list(fh)[:1000]:
            body = json.loads(line)["answer"].rsplit("####", 1)[0]
            steps += len(annotation.findall(body))
            text = render_calculator_form(body)
            assert "<<" not in text
            for end in (i + 1 for i, ch in enumerate(text) if ch == "="):
                call = calculator_call(text[:end])
                reproduced += bool(call and call.ok and text[end:].startswith(call.insert))
    assert reproduced / steps >= 0.98
