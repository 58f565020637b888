"""The one answer parser shared by the GRPO rewards and the GSM8K evaluator.

Training reward and reported accuracy must agree on what "the model answered X" means; if the
evaluator had its own regexes, a reward could be optimised that the metric does not see (or vice
versa). Everything that turns completion text into a comparable number lives here.

Conventions:

* Numbers are compared as canonical strings (see :func:`normalize_number`), built with
  :class:`decimal.Decimal` so ``"1,234.00"``, ``"$1234"`` and ``"1234"`` are the same answer and no
  float rounding or ``1E+3`` notation can make equal numbers differ.
* *Strict* extraction reads only the last ``<answer>...</answer>`` block: it is what the
  correctness reward pays for, so the model is pushed to state its answer in the trained format.
* *Flexible* extraction takes the last number anywhere (lm-eval-harness GSM8K "flexible-extract"
  convention); it tells evaluation how much accuracy is lost purely to formatting.

>>> parse_strict("<reasoning>\\n6 * 7 = 42\\n</reasoning>\\n<answer>\\n$42.00\\n</answer>")
'42'
>>> parse_flexible("6 * 7 = 42, so 42 muffins.")
'42'
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from decimal import Decimal, DivisionByZero, InvalidOperation
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ANNOTATION_RE",
    "ParsedAnswer",
    "answer_block",
    "answers_match",
    "completion_text",
    "final_line",
    "is_soft_format",
    "is_strict_format",
    "normalize_gold",
    "normalize_number",
    "parse_answers",
    "parse_flexible",
    "parse_strict",
    "reasoning_block",
]

# Minus-like characters models emit (unicode minus, en dash, small/fullwidth hyphen-minus).
_MINUS_CHARS = "\u2212\u2013\ufe63\uff0d"
_MINUS_TABLE = str.maketrans(dict.fromkeys(_MINUS_CHARS, "-"))
_CURRENCY_RE = re.compile(r"[$€£¥]")
# A plain decimal number after cleanup; thousands groups may use commas or spaces but must be proper
# groups ("1,234" / "1 234", not "3,4" or "3 4").
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
# "a/b" and the mixed number "w a/b".
_FRACTION_RE = re.compile(r"([+-]?)(?:(\d+) )?(\d+) ?/ ?(\d+)")

# A number inside free text. The minus sign only counts when it is not glued to a preceding word or
# digit ("3-4" is a range, not 3 and -4). A "$" may sit between the sign and the digits ("-$5").
# Decimal points need a digit after them, so a sentence-final "42." yields "42".
_NUMBER_IN_TEXT_RE = re.compile(
    rf"(?:(?<![\w)])[-{_MINUS_CHARS}])?\$?"
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)"
)

# GSM8K's calculator annotations, ``<<48/2=24>>``: counted as steps, stripped from SFT targets.
ANNOTATION_RE = re.compile(r"<<[^<>]*>>")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_REASONING_RE = re.compile(r"<reasoning>(.*?)</reasoning>", re.DOTALL)
_SOFT_FORMAT_RE = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
# Each tag alone on its line (trailing spaces and \r tolerated), exactly one newline between blocks.
_STRICT_FORMAT_RE = re.compile(
    r"<reasoning>[ \t\r]*\n(?P<reasoning>.*?)\n[ \t]*</reasoning>[ \t\r]*\n"
    r"[ \t]*<answer>[ \t\r]*\n(?P<answer>.*?)\n[ \t]*</answer>",
    re.DOTALL,
)
TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")


def _message_content(message: Any) -> str:
    """Text of one chat message; multimodal-style content lists are flattened to their text parts."""
    content = message.get("content", "") if isinstance(message, Mapping) else message
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        return "".join(
            part.get("text", "") or "" if isinstance(part, Mapping) else str(part) for part in content
        )
    return str(content)


def completion_text(completion: Any) -> str:
    """Plain text of a completion in any form TRL hands to reward functions.

    TRL passes a plain string for standard datasets and a list of message dicts for conversational
    ones; rewards call this first so they work for both. In a message list the assistant contents
    are joined (messages without a role count as assistant; other roles, e.g. tool results, are
    skipped since the model did not write them). ``None`` becomes ``""``.

    >>> completion_text([{"role": "assistant", "content": "<answer>\\n7\\n</answer>"}])
    '<answer>\\n7\\n</answer>'
    >>> completion_text({"content": "hi"}), completion_text(None)
    ('hi', '')
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _message_content(completion)
    if isinstance(completion, (list, tuple)):
        parts = []
        for message in completion:
            if isinstance(message, Mapping) and message.get("role", "assistant") != "assistant":
                continue
            parts.append(_message_content(message))
        return "".join(parts)
    return str(completion)


def _canonical(value: Decimal) -> str:
    """Fixed-point string without trailing zeros, so equal values give equal strings."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "", "+0") else text


def normalize_number(text: Any) -> str | None:
    """Canonical string for a number written the way models and GSM8K write them, else ``None``.

    Drops ``$``/``€``/``£``/``¥``, surrounding whitespace, thousands separators, a trailing ``.``
    or ``%`` (the number of percent is kept, not divided by 100, matching how GSM8K golds state
    percentages), and maps unicode minus signs to ``-``. Thousands separators (comma or space) must
    form proper groups so ``"3,4"`` is not read as 34. Fractions ``a/b`` and mixed numbers ``w a/b``
    ARE supported (exact value; a non-terminating decimal keeps Decimal's 28 significant digits,
    still deterministic). The whole input must be one number: ``"42 apples"`` is ``None`` (see
    :func:`parse_strict` for the fallback). Idempotent: ``normalize_number(normalize_number(x))``
    equals ``normalize_number(x)``.

    >>> [normalize_number(s) for s in ["1,234.00", "3.50", "\u22127", "$1,000", "1/2", "50%", "0.0"]]
    ['1234', '3.5', '-7', '1000', '0.5', '50', '0']
    >>> normalize_number("forty-two") is None, normalize_number("3,4") is None
    (True, True)
    """
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, (int, Decimal)):
        return _canonical(Decimal(text))
    if isinstance(text, float):
        return _canonical(Decimal(repr(text))) if text == text and abs(text) != float("inf") else None
    cleaned = _CURRENCY_RE.sub("", str(text).translate(_MINUS_TABLE))
    # Collapse every whitespace run to one space, then drop it around the sign ("- 5", "$ 5").
    cleaned = " ".join(cleaned.split())
    cleaned = re.sub(r"^([+-]) ", r"\1", cleaned).rstrip(".%").rstrip(" .")
    try:
        if _PLAIN_NUMBER_RE.fullmatch(cleaned):
            return _canonical(Decimal(cleaned.replace(",", "").replace(" ", "")))
        fraction = _FRACTION_RE.fullmatch(cleaned)
        if fraction:
            sign, whole, num, den = fraction.groups()
            value = Decimal(whole or 0) + Decimal(num) / Decimal(den)
            return _canonical(-value if sign == "-" else value)
    except (InvalidOperation, DivisionByZero, ZeroDivisionError):
        return None
    return None


def normalize_gold(gold: Any) -> str | None:
    """Canonical gold answer; also accepts a raw GSM8K solution ending in ``#### <number>``.

    Accepting the raw solution means a dataset column that was not pre-extracted still scores
    correctly instead of silently yielding no signal.

    >>> normalize_gold("72"), normalize_gold("She sold 48/2 = 24 clips.\\n#### 72"), normalize_gold("")
    ('72', '72', None)
    """
    if isinstance(gold, str) and "####" in gold:
        gold = final_line(gold)
    return normalize_number(gold)


def final_line(solution: Any) -> str | None:
    """The raw text after the last ``####`` of a GSM8K worked solution, or None without one.

    >>> final_line("48/2 = 24\\n#### 1,234 "), final_line("no marker")
    ('1,234', None)
    """
    if not isinstance(solution, str) or "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip()


def _last_number(text: str) -> str | None:
    """Normalized last number in free text (see :data:`_NUMBER_IN_TEXT_RE` for what counts)."""
    for match in reversed(_NUMBER_IN_TEXT_RE.findall(text)):
        value = normalize_number(match)
        if value is not None:
            return value
    return None


def answer_block(text: Any) -> str | None:
    """Raw content (stripped) of the LAST complete ``<answer>...</answer>`` block, else ``None``.

    The last block wins because models that "correct themselves" restate the answer at the end. An
    ``<answer>`` never closed (truncated generation) does not count.

    >>> answer_block("<answer>1</answer> no wait <answer> 2 </answer>")
    '2'
    """
    blocks = _ANSWER_RE.findall(completion_text(text))
    return blocks[-1].strip() if blocks else None


def reasoning_block(text: Any) -> str | None:
    """Raw content (stripped) of the first ``<reasoning>...</reasoning>`` block, else ``None``."""
    match = _REASONING_RE.search(completion_text(text))
    return match.group(1).strip() if match else None


def parse_strict(text: Any) -> str | None:
    """Normalized answer from the last ``<answer>`` block; ``None`` without one.

    If the block content as a whole is a number (``"$1,234"``, ``"1/2"``) that number is used;
    otherwise the last number inside the block (``"42 muffins"`` -> ``"42"``, ``"\\\\boxed{7}"`` ->
    ``"7"``). Text outside the block is never read, so a correct number in the reasoning with a
    wrong or missing answer block scores as wrong.

    >>> parse_strict("<answer>\\nThe total is $1,234.50.\\n</answer>")
    '1234.5'
    >>> parse_strict("I think 42") is None
    True
    """
    content = answer_block(text)
    if content is None:
        return None
    value = normalize_number(content)
    return value if value is not None else _last_number(content)


def parse_flexible(text: Any) -> str | None:
    """Normalized last number anywhere in the completion (lm-eval GSM8K "flexible-extract").

    Deliberately simple: no attempt to skip step numbers or units, so "step 3" at the very end would
    be read as 3. Handles ``$1,234``, ``-3``, ``2.5``, ``1,000,000`` and a sentence-final period.
    Fractions are NOT recognised here (``1/2`` reads as 2), matching the harness convention.

    >>> parse_flexible("Step 1: 3 - 5 = -2. So the loss is -$1,000,000.")
    '-1000000'
    >>> parse_flexible("no digits") is None
    True
    """
    return _last_number(completion_text(text))


def is_strict_format(text: Any) -> bool:
    """True when the completion is exactly one reasoning block then one answer block, as trained.

    Leading/trailing whitespace of the whole completion is ignored; each tag must sit alone on its
    line (trailing spaces tolerated), blocks are separated by a single newline, both contents are
    non-empty and contain no other tags, and nothing follows ``</answer>``.

    >>> is_strict_format("<reasoning>\\n6*7=42\\n</reasoning>\\n<answer>\\n42\\n</answer>\\n")
    True
    >>> is_strict_format("<reasoning>6*7=42</reasoning><answer>42</answer>")
    False
    """
    match = _STRICT_FORMAT_RE.fullmatch(completion_text(text).strip())
    if match is None:
        return False
    for part in (match.group("reasoning"), match.group("answer")):
        if not part.strip() or any(tag in part for tag in TAGS):
            return False
    return True


def is_soft_format(text: Any) -> bool:
    """True when a ``<reasoning>`` block followed by an ``<answer>`` block appears anywhere.

    >>> is_soft_format("sure! <reasoning>x</reasoning> <answer>1</answer> bye")
    True
    """
    return _SOFT_FORMAT_RE.search(completion_text(text)) is not None


def answers_match(pred: Any, gold: Any) -> bool:
    """Whether a predicted and a gold answer are the same number (``None`` never matches).

    Both sides go through the same normalization (gold via :func:`normalize_gold`), so callers may
    pass raw strings or already-normalized ones.

    >>> answers_match("1,234.00", "1234"), answers_match(None, "1"), answers_match("0.5", "1/2")
    (True, False, True)
    """
    pred_n = normalize_number(pred)
    gold_n = normalize_gold(gold)
    return pred_n is not None and pred_n == gold_n


@dataclass(frozen=True)
class ParsedAnswer:
    """Everything the evaluator records about one completion, computed by the shared parser."""

    strict: str | None
    flexible: str | None
    strict_format: bool
    soft_format: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_answers(completion: Any) -> ParsedAnswer:
    """Strict and flexible answers plus format flags for one completion (any TRL form).

    >>> parse_answers("<reasoning>\\nx\\n</reasoning>\\n<answer>\\n5\\n</answer>").as_dict()
    {'strict': '5', 'flexible': '5', 'strict_format': True, 'soft_format': True}
    """
    text = completion_text(completion)
    return ParsedAnswer(
        strict=parse_strict(text),
        flexible=parse_flexible(text),
        strict_format=is_strict_format(text),
        soft_format=is_soft_format(text),
    )
