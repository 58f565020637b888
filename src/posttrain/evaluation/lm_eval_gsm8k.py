"""GSM8K accuracy as lm-evaluation-harness's ``gsm8k`` task (version 3.0) scores the same outputs.

Why: published GSM8K numbers mostly come from lm-eval's ``gsm8k`` task, and users compare posttrain's
reports with them. lm-eval reads answers differently from posttrain:

* ``strict-match`` takes the first ``#### N`` (the few-shot format of GSM8K's own solutions); a model
  trained to posttrain's ``<answer>`` block scores about 0 on it however right its answers are;
* ``flexible-extract`` takes the last number-like token (``(-?[$0-9.,]{2,})|(-?[0-9]+)``), close to
  posttrain's flexible accuracy but compared as *strings*: ``42.0`` does not match ``42``.

Both feed ``exact_match`` with ``ignore_case`` and ``regexes_to_ignore`` ``,``, ``\\$``, ``(?s).*#### ``
and ``\\.$``, applied to the prediction and to the reference (the whole solution, so only the number
after ``#### `` is left). Re-implemented here (a few regexes) rather than installing lm-eval and its
dependencies; the patterns are copied from the task's ``gsm8k.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["INVALID", "flexible_extract", "lm_eval_accuracy", "strict_match"]

INVALID = "[invalid]"
"""What lm-eval's regex filter returns when nothing matches (never equal to a reference)."""

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def strict_match(completion: str) -> str:
    """The ``strict-match`` filter: the first ``#### N`` (``take_first``).

    >>> strict_match("so 6*7=42\\n#### 42"), strict_match("<answer>\\n42\\n</answer>")
    ('42', '[invalid]')
    """
    found = _STRICT.findall(completion)
    return found[0].strip() if found else INVALID


def flexible_extract(completion: str) -> str:
    """The ``flexible-extract`` filter: the last number-like token (``group_select: -1``).

    >>> flexible_extract("<answer>\\n$1,234.\\n</answer>"), flexible_extract("7 apples"), flexible_extract("none")
    ('$1,234.', '7', '[invalid]')
    """
    found = _FLEXIBLE.findall(completion)
    if not found:
        return INVALID
    return next(group for group in found[-1] if group).strip()


def _normalize(text: str) -> str:
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text.lower()


def _exact_match(prediction: str, reference: str) -> bool:
    """lm-eval's ``exact_match`` with the task's options; ``reference`` is a solution or a number.

    >>> _exact_match("$1,234.", "so... #### 1234"), _exact_match("42.0", "42"), _exact_match(INVALID, "42")
    (True, False, False)
    """
    return prediction != INVALID and _normalize(prediction) == _normalize(reference)


def lm_eval_accuracy(samples: Sequence[Sequence[str]], references: Sequence[str]) -> dict[str, float]:
    """``lm_eval_strict_match`` and ``lm_eval_flexible_extract``: the mean over questions of the
    fraction of each question's completions that match (with one greedy sample: the plain accuracy).

    >>> ours = "<reasoning>\\n6*7 = 42\\n</reasoning>\\n<answer>\\n42\\n</answer>"
    >>> lm_eval_accuracy([[ours], ["#### 5"]], ["42", "#### 5"])
    {'lm_eval_strict_match': 0.5, 'lm_eval_flexible_extract': 1.0}
    """
    if len(samples) != len(references):
        raise ValueError(f"{len(samples)} questions but {len(references)} references")
    out = {}
    for name, extract in (("strict_match", strict_match), ("flexible_extract", flexible_extract)):
        per_question = [
            sum(_exact_match(extract(text), ref) for text in texts) / len(texts)
            for texts, ref in zip(samples, references, strict=True)
            if texts
        ]
        out[f"lm_eval_{name}"] = sum(per_question) / len(per_question) if per_question else 0.0
    return out
