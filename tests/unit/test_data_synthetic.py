"""Synthetic problems: exact GSM8K format, correct arithmetic, requested difficulty, determinism."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from typing import get_args

import pytest

from posttrain.core.config import SyntheticTheme
from posttrain.core.errors import DataError
from posttrain.core.gsm8k import RECORD_FIELDS, count_ops, extract_final_answer
from posttrain.core.prompts import format_sft_target
from posttrain.data.synthetic import THEME_NAMES, THEMES, generate_problems

ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> Fraction:
    """Exact value of an annotation's arithmetic (numbers and + - * / only)."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return walk(node.left) / walk(node.right)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise AssertionError(f"unexpected syntax in annotation {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.fixture(scope="module", params=["default", "small"])
def problems(request):
    return generate_problems(5000, min_ops=1, max_ops=8, seed=123, numbers=request.param)


def test_arithmetic_and_format_round_trip(problems):
    for p in problems:
        solution = p["solution"]
        annotations = ANNOTATION.findall(solution)
        assert len(annotations) == p["ops"] == count_ops(solution), solution
        for expression, result in annotations:
            value = evaluate(expression)
            assert value == Fraction(result) and value.denominator == 1 and value > 0, (expression, result)
            assert f"<<{expression}={result}>>{result}" in solution  # result also shown after the annotation
        assert annotations[-1][1] == p["answer"]  # the last step produces the answer
        assert solution.splitlines()[-1] == f"#### {p['answer']}"
        assert extract_final_answer(solution) == p["answer"]
        assert p["answer"].isdigit() and int(p["answer"]) > 0
        assert (
            "{" not in p["question"] + solution and "}" not in p["question"] + solution
        )  # no template leftovers
        assert p["question"].rstrip().endswith("?")
        format_sft_target(solution)  # also valid SFT material


def test_record_schema(problems):
    assert all(tuple(p) == RECORD_FIELDS for p in problems)
    prefix = "synthetic-small" if problems[0]["id"].startswith("synthetic-small-") else "synthetic"
    assert [p["id"] for p in problems[:3]] == [f"{prefix}-s123-{i}" for i in range(3)]
    assert {p["source"] for p in problems} == {"synthetic"}


def test_steps_cover_requested_range(problems):
    assert set(Counter(p["ops"] for p in problems)) == set(range(1, 9))
    narrow = generate_problems(300, min_ops=3, max_ops=3, seed=1)
    assert {p["ops"] for p in narrow} == {3}


def test_variety_of_themes_and_operations(problems):
    assert len(THEMES) >= 8
    operators = Counter(
        op for p in problems for e, _ in ANNOTATION.findall(p["solution"]) for op in "+-*/" if op in e
    )
    assert set(operators) == set("+-*/")
    assert min(operators.values()) > 500
    # every theme is used: its closing question or one of its finals shows up
    for theme in THEMES:
        endings = [theme.question.split("{")[0]] + [f[1].split("{")[0] for f in theme.finals]
        assert any(any(e.strip() and e.strip() in p["question"] for e in endings) for p in problems), (
            theme.name
        )
    assert len({p["question"] for p in problems}) == len(problems)  # no duplicate problems


def test_deterministic_and_prefix_stable():
    assert generate_problems(50, 1, 4, seed=5) == generate_problems(50, 1, 4, seed=5)
    assert generate_problems(50, 1, 4, seed=5)[:10] == generate_problems(
        10, 1, 4, seed=5
    )  # limit = truncation
    assert generate_problems(20, seed=5) != generate_problems(20, seed=6)


def test_deterministic_across_processes():
    code = (
        "import hashlib, json; from posttrain.data.synthetic import generate_problems; "
        "print(hashlib.sha256(json.dumps(generate_problems(200, 1, 6, seed=9)).encode()).hexdigest())"
    )
    here = hashlib.sha256(json.dumps(generate_problems(200, 1, 6, seed=9)).encode()).hexdigest()
    for hash_seed in ("1", "2"):  # str hashing differs between these processes; output must not
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 1, 2), "num_examples"),  # negative count
        ((5, 0, 2), "min_ops"),  # zero steps
        ((5, 3, 2), "min_ops"),  # inverted range
        ((5, 1, 2, 0, "tiny"), "numbers must be one of default, small"),
        ((5, 1, 2, 0, "small", ["farm", "pirates"]), "themes must be some of shopping, savings"),
        ((5, 1, 2, 0, "small", []), "themes must be some of"),
        ((5, 30, 30, 0, "default", ["ages", "scores"]), "cannot tell a 30-operation problem"),
    ],
)
def test_invalid_arguments(args, message):
    with pytest.raises(DataError, match=message):
        generate_problems(*args)


def test_long_chains_still_valid():
    for p in generate_problems(200, min_ops=15, max_ops=20, seed=2):
        assert count_ops(p["solution"]) == p["ops"]
        assert all(evaluate(e) == Fraction(r) for e, r in ANNOTATION.findall(p["solution"]))


def test_small_numbers_stay_small_and_are_other_problems():
    """Every quantity in a ``small`` problem (question and worked steps) is below 121, while the
    default ranges go far above; the same seed gives (nearly all) different problems."""
    small = generate_problems(2000, 1, 4, seed=5, numbers="small")
    default = generate_problems(2000, 1, 4, seed=5)

    def largest(p):
        return max(int(n) for n in re.findall(r"\d+", p["question"] + p["solution"]))

    assert max(largest(p) for p in small) <= 120
    assert max(largest(p) for p in default) > 500
    shared = {p["question"] for p in small} & {p["question"] for p in default}
    assert len(shared) < 0.05 * len(small)  # a few short ones (ages, scores) can be drawn by both
    assert Counter(p["ops"] for p in small) == Counter(p["ops"] for p in default)  # same difficulty draw


# A word only that story's templates use, so a question says which story it came from.
_STORY_WORDS = {"farm": "apple", "travel": "mile", "fundraiser": "club"}


@pytest.mark.parametrize("numbers", ["default", "small"])
def test_themes_keep_their_stories_and_leave_out_the_others(numbers):
    """Training on some stories and evaluating on the rest needs sets that share no story: a kept
    story's word is in every question, a left-out story's in none."""
    kept = generate_problems(600, 1, 3, seed=4, numbers=numbers, themes=["travel", "farm", "fundraiser"])
    others = [name for name in THEME_NAMES if name not in _STORY_WORDS]
    rest = generate_problems(600, 1, 3, seed=4, numbers=numbers, themes=others)
    assert all(any(word in p["question"] for word in _STORY_WORDS.values()) for p in kept)
    assert {word for p in kept for word in _STORY_WORDS.values() if word in p["question"]} == set(
        _STORY_WORDS.values()
    )
    assert not any(word in p["question"] for p in rest for word in _STORY_WORDS.values())
    assert {p["question"] for p in kept}.isdisjoint(p["question"] for p in rest)
    assert all(p["id"].split("-s4-")[0].endswith("travel+farm+fundraiser") for p in kept)


def test_naming_every_story_or_one_in_another_order_changes_nothing():
    assert generate_problems(50, seed=3, themes=list(reversed(THEME_NAMES))) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3, themes=["farm", "ages"]) == generate_problems(
        50, seed=3, themes=["ages", "farm"]
    )


def test_the_configs_story_names_are_the_generators():
    assert get_args(SyntheticTheme) == THEME_NAMES
