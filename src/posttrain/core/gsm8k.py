"""GSM8K records: the one schema every source is validated into, and the final-answer rules.

Every later stage (prompt building, rewards, evaluation, lineage) relies on each record having a
clean, already-normalized final answer, so validation happens once, at load time: a record whose
solution has no ``#### <number>`` line is reported instead of turning into a silent zero reward
hours later. A record is a plain dict::

    {"id": "train-00042", "question": "...", "solution": "...worked solution...\\n#### 72",
     "answer": "72", "ops": 2, "source": "train.jsonl"}

``answer`` is the canonical number string of :func:`posttrain.core.parsing.normalize_number`, the
same function the rewards and the evaluator apply to model output, so the two sides compare equal
exactly when the numbers are equal. ``ops`` counts the ``<<a*b=c>>`` calculator annotations (arithmetic operations): a
cheap, consistent difficulty proxy used for curriculum stages.
"""

from __future__ import annotations

from typing import Any

from posttrain.core.errors import DataError
from posttrain.core.parsing import ANNOTATION_RE, final_line, normalize_number

__all__ = ["RECORD_FIELDS", "count_ops", "extract_final_answer", "make_record"]

RECORD_FIELDS = ("id", "question", "solution", "answer", "ops", "source")


def extract_final_answer(solution: str) -> str:
    """Normalized number after the last ``####`` of a GSM8K worked solution.

    >>> extract_final_answer("48/2 = <<48/2=24>>24\\n#### 1,234")
    '1234'
    >>> extract_final_answer("#### $5"), extract_final_answer("#### -3"), extract_final_answer("#### 2.50")
    ('5', '-3', '2.5')
    >>> extract_final_answer("no final line")
    Traceback (most recent call last):
    ...
    posttrain.core.errors.DataError: answer has no '#### <number>' final line
    """
    raw = final_line(solution)
    if raw is None:
        raise DataError("answer has no '#### <number>' final line")
    value = normalize_number(raw) if raw else None
    if value is None:
        raise DataError(f"final answer {raw!r} after '####' is not a number")
    return value


def count_ops(solution: str) -> int:
    """Number of ``<<...>>`` calculator annotations, GSM8K's own count of arithmetic operations.

    >>> count_ops("48/2 = <<48/2=24>>24\\n48+24 = <<48+24=72>>72\\n#### 72")
    2
    """
    return len(ANNOTATION_RE.findall(solution))


def make_record(raw: Any, *, record_id: str, source: str) -> dict[str, Any]:
    """Validate one raw GSM8K row (``{"question", "answer"}``) into the record schema.

    Raises :class:`DataError` with the bare problem; callers prefix the location.
    """
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    for key in ("question", "answer"):
        if key not in raw:
            raise DataError(f"missing field '{key}'")
        if not isinstance(raw[key], str):
            raise DataError(f"field '{key}' must be a string, got {type(raw[key]).__name__}")
    question, solution = raw["question"].strip(), raw["answer"]
    if not question:
        raise DataError("field 'question' is empty")
    answer = extract_final_answer(solution)
    return {
        "id": record_id,
        "question": question,
        "solution": solution.strip(),
        "answer": answer,
        "ops": count_ops(solution),
        "source": source,
    }
