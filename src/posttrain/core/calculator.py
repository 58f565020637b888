"""The inline calculator: which text calls it, what it computes, and worked solutions written for it.

GSM8K was released with the answer to arithmetic slips: its solutions carry calculator annotations
(``<<48/2=24>>``), and at test time "a calculator overrides sampling" after each ``=``
(openai/grade-school-math, ``calculator.py``). posttrain's calculator works on the text the model
writes in the trained format, ``48/2 = 24``: when a completion ends in an arithmetic expression
followed by ``=``, the calculator computes it and the generation engine writes the value for the
model (:mod:`posttrain.generation.tools`); the model continues from there. A model then only has to
set a problem up (which numbers, which operation); the arithmetic cannot slip.

Everything here is text in, text out, shared by three callers so they cannot drift apart:

* :func:`calculator_call` decides whether a text ends in a call and what the tool writes;
* :func:`evaluate_arithmetic` is the one safe evaluator (numbers, ``+ - * /``, parentheses; no
  names, calls or powers), also behind the ``arithmetic`` reward;
* :func:`render_calculator_form` writes a GSM8K worked solution so that every annotated step reads
  exactly as the calculator would complete it (the SFT targets of a stage with the calculator).

>>> calculator_call("She sold 48/2 =").insert
' 24'
>>> calculator_call("The answer is 7.") is None
True
"""

from __future__ import annotations

import ast
import operator
import re
import warnings
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

__all__ = [
    "CalculatorCall",
    "calculator",
    "MAX_EXPRESSION_CHARS",
    "calculator_call",
    "evaluate_arithmetic",
    "format_value",
    "render_calculator_form",
]

MAX_EXPRESSION_CHARS = 120
"""Longer candidates are not evaluated (``ast.parse`` of deeply nested input is not bounded)."""
MAX_VALUE = Fraction(10**12)
"""Results at or above this magnitude are refused: no grade-school step needs one, and the engine
would force every digit."""
DECIMALS = 4
"""Non-integer results are rounded to this many decimal places (half to even), trailing zeros dropped."""

_ARITHMETIC_CHARS = re.compile(r"[\d\s.+\-*/()]*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_arithmetic(expression: str) -> Fraction | None:
    """The exact value of ``+ - * /`` over non-negative numbers and parentheses; None for anything else.

    ``$`` and thousands commas are dropped; ``x``, ``×`` and ``÷`` read as ``*`` and ``/``. Names,
    calls, powers, comparisons and division by zero all give None, as does an expression longer
    than :data:`MAX_EXPRESSION_CHARS`: the expression comes from model output and is never run.

    >>> evaluate_arithmetic("(40 - 5) / 5"), evaluate_arithmetic("$1,200 x 2"), evaluate_arithmetic("7/2")
    (Fraction(7, 1), Fraction(2400, 1), Fraction(7, 2))
    >>> [evaluate_arithmetic(e) for e in ("2**99", "__import__('os')", "1/0", "2 +")]
    [None, None, None, None]
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    text = expression.replace("$", "").replace(",", "").replace("\u00d7", "*").replace("x", "*")
    text = text.replace("\u00f7", "/")
    if not _ARITHMETIC_CHARS.fullmatch(text):  # no names, exponents (1e5) or brackets reach the parser
        return None
    try:
        with warnings.catch_warnings():  # "10ml" is an invalid decimal literal: a refusal, not news
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return _OPS[type(node.op)](left, right)
        raise ValueError(type(node).__name__)

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def format_value(value: Fraction) -> str | None:
    """The text the calculator writes for ``value``; None when it is too large to be a step's result.

    >>> [format_value(Fraction(n, d)) for n, d in ((24, 1), (7, 2), (1, 3), (-3, 1), (2, 3))]
    ['24', '3.5', '0.3333', '-3', '0.6667']
    """
    if abs(value) >= MAX_VALUE:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    exact = Decimal(value.numerator) / Decimal(value.denominator)
    text = format(exact.quantize(Decimal(1).scaleb(-DECIMALS), rounding=ROUND_HALF_EVEN), "f")
    text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


@dataclass(frozen=True)
class CalculatorCall:
    """A call the text ends with: the expression and what the calculator writes after the ``=``."""

    expression: str
    value: Fraction | None
    """None: malformed, unsafe or too large; the model continues on its own (a failed call)."""
    insert: str
    """The text written for the model (``" 24"``, ``"24"`` after ``= ``, ``"24>>"`` in an annotation);
    empty for a failed call."""

    @property
    def ok(self) -> bool:
        return self.value is not None


_TRAILING_EQUALS = re.compile(r"(?<![=<>!])=([ \t]*)$")
# A clause ends at a line break, another "=", ":" or ";", or sentence punctuation before a space.
_CLAUSE_BOUNDARY = re.compile(r"\n|=|:|;|>>|[,.?!](?=\s)")
# The longest tail made of numbers, operators, parentheses, "$" and a spaced-out "x" (GSM8K writes
# "12 x 2"); searched on one clause, so its cost is bounded by the clause's length.
_EXPRESSION_TAIL = re.compile(r"(?:[\d\s.,+\-*/()$\u00d7\u00f7]|(?<= )x(?= ))*$")
_OPERATION = re.compile(r"[\d)]\s*(?:[-+*/\u00d7\u00f7]|x )")
_LEADING_WORDS = re.compile(r"^(?:[A-Za-z']+\s+)+")
# Text that is no number but was clearly meant as one to compute ("__import__", "2^8", "25% * 80").
_CODE_LIKE = re.compile(r"[_()\[\]{}^%*/+]")
MAX_CLAUSE_CHARS = 200


def _candidate(clause: str) -> str | None:
    """The expression a clause ends with, if it is meant as one (malformed ones included)."""
    clause = clause[-MAX_CLAUSE_CHARS:]
    tail = _EXPRESSION_TAIL.search(clause)
    pure = tail.group().strip() if tail else ""
    if _OPERATION.search(pure):
        return pure
    rest = _LEADING_WORDS.sub("", clause).strip()
    return rest if rest and _CODE_LIKE.search(rest) else None


def calculator_call(text: str) -> CalculatorCall | None:
    """The call ``text`` ends with: an arithmetic expression followed by ``=`` (and spaces), or an
    open GSM8K annotation ``<<expr=``; None when it ends in no call.

    The value is written the way the text spaces its ``=``: ``" 24"`` after ``48/2 =``, ``"24"``
    after ``48/2 = `` or ``48/2=``, and ``"24>>"`` inside ``<<48/2=``. A candidate that cannot be
    computed safely is still a call, with ``value`` None, so it can be counted.

    >>> [calculator_call(t).insert for t in ("He has 9*21 =", "$72 + $23 = ", "<<12 x 2=", "3*2=")]
    [' 189', '95', '24>>', '6']
    >>> [calculator_call(t).ok for t in ("2**99 =", "__import__ =", "1/0 =")]
    [False, False, False]
    >>> [calculator_call(t) for t in ("Total cost =", "x =", "5 =", "a == b", "no equals")]
    [None, None, None, None, None]
    """
    end = _TRAILING_EQUALS.search(text)
    if end is None:
        return None
    head, spacing = text[: end.start()], end.group(1)
    opened = head.rfind("<<")
    if opened != -1 and ">>" not in head[opened:] and "\n" not in head[opened:]:
        expression = head[opened + 2 :].strip()
        if not expression:
            return None
        value = evaluate_arithmetic(expression) if len(expression) <= MAX_EXPRESSION_CHARS else None
        written = format_value(value) if value is not None else None
        return CalculatorCall(expression, value if written else None, f"{written}>>" if written else "")
    expression = _candidate(_CLAUSE_BOUNDARY.split(head)[-1])
    if expression is None:
        return None
    value = evaluate_arithmetic(expression)
    written = format_value(value) if value is not None else None
    if written is None:
        return CalculatorCall(expression, None, "")
    glued = not spacing and not head[-1:].isspace()  # "3*2=" is completed as "3*2=6"
    return CalculatorCall(expression, value, written if spacing or glued else f" {written}")


_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_VISIBLE_EQUALS = re.compile(r"=[ \t]*\$?[ \t]*$")
_VISIBLE_RESULT = re.compile(r"[ \t]*\$?[ \t]*(?:-?\d[\d,]*(?:\.\d+)?|-?\.\d+)")


def render_calculator_form(solution: str) -> str:
    """A GSM8K worked solution with each annotated step written as the calculator completes it.

    ``48/2 = <<48/2=24>>24`` becomes ``48/2 = 24``, ``costs 100 / 2 = $<<100/2=50>>50`` becomes
    ``costs 100 / 2 = 50`` (the calculator writes the number right after the ``=``), and a step that
    shows only its result, ``for <<3*5=15>>15 dollars``, becomes ``for 3*5 = 15 dollars``: the model
    learns to write the expression and let the tool fill in the value. A step the calculator would
    not complete to the annotated value keeps its text, without the annotation.

    >>> print(render_calculator_form("She sold 48/2 = <<48/2=24>>24 clips.\\nHe paid $<<3*5=15>>15."))
    She sold 48/2 = 24 clips.
    He paid $3*5 = 15.
    >>> render_calculator_form("Half is 12 x 2 = $<<12*2=24>>24 and 10/3 = <<10/3=3.33>>3.33")
    'Half is 12 x 2 = 24 and 10/3 = 3.3333'
    """
    out: list[str] = []
    position = 0
    for match in _ANNOTATION.finditer(solution):
        before = "".join(out) + solution[position : match.start()]
        visible = _VISIBLE_RESULT.match(solution, match.end())
        expression, annotated = match.group(1), evaluate_arithmetic(match.group(1))
        equals = _VISIBLE_EQUALS.search(before)
        if equals:
            spaced = before[equals.start() + 1 : equals.start() + 2] == " "
            shown = before[: equals.start()] + ("= " if spaced else "=")
            # the text's own expression if the calculator reads it, else the annotation's after it
            prompts = [shown, f"{before[: equals.start()].rstrip()} = {expression} ="]
        else:
            sep = "" if not before or before[-1].isspace() or before[-1] in "($" else " "
            prompts = [f"{before}{sep}{expression} ="]
        for prompt in prompts:
            call = calculator_call(prompt)
            if call is not None and call.ok and annotated is not None and call.value == annotated:
                out = [prompt + call.insert]
                position = visible.end() if visible else match.end()
                break
        else:  # keep the text as GSM8K shows it, without the annotation
            out = [before]
            position = match.end()
    out.append(solution[position:])
    return "".join(out)


# The built-in tool for models that call tools through their chat template (TRL's
# ``GRPOTrainer(tools=...)``; posttrain's evaluation runs the same protocol). transformers builds the
# tool's JSON schema, which the model reads in its prompt, from this signature and docstring: the
# docstring is written for the model.
def calculator(expression: str) -> str:
    """Computes an arithmetic expression of numbers with + - * / and parentheses.

    Args:
        expression: The expression to compute, for example "48/2" or "(40 - 5) * 3".

    Returns:
        The value, rounded to four decimal places.
    """
    value = evaluate_arithmetic(expression)
    written = format_value(value) if value is not None else None
    if written is None:
        raise ValueError(f"cannot compute {expression!r}: use numbers, + - * / and parentheses")
    return written
