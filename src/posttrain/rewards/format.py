"""Format rewards: teach the ``<reasoning>``/``<answer>`` layout the correctness reward reads.

Three levels of strictness so an untrained model gets a gradient long before it produces the exact
layout: ``xml_count_reward`` pays per well-placed tag (dense, partial credit), ``soft_format_reward``
pays for the two blocks in order anywhere, ``strict_format_reward`` only for the exact layout::

    <reasoning>
    ...
    </reasoning>
    <answer>
    42
    </answer>

All accept TRL's ``f(completions, **kwargs)`` call (the gold ``answer`` column arrives in ``kwargs``
and is ignored) and plain-string or conversational completions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from posttrain.core.parsing import TAGS, completion_text, is_soft_format, is_strict_format

logger = logging.getLogger(__name__)

__all__ = ["XML_TAIL_PENALTY_PER_CHAR", "strict_format_reward", "soft_format_reward", "xml_count_reward"]

# Per character after the last </answer>: small enough that a few stray characters barely matter,
# large enough that a model padding the tail with chatter loses the tag credit it earned.
XML_TAIL_PENALTY_PER_CHAR = 0.001
_XML_TAIL_PENALTY_CAP = 1.0


def strict_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly the trained layout, else 0.0.

    See :func:`~posttrain.core.parsing.is_strict_format` for the precise rule (one reasoning
    block then one answer block, tags on their own lines, nothing after ``</answer>``).

    >>> strict_format_reward(["<reasoning>\\nx\\n</reasoning>\\n<answer>\\n2\\n</answer>", "2"])
    [1.0, 0.0]
    """
    return [1.0 if is_strict_format(c) else 0.0 for c in completions]


def soft_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.5 when a ``<reasoning>`` block followed by an ``<answer>`` block appears anywhere, else 0.0.

    Half the strict scale on purpose: layout variants (inline tags, text around the blocks) earn
    something, but less than the exact layout the evaluator's strict metric is built around.

    >>> soft_format_reward(["Sure. <reasoning>x</reasoning><answer>2</answer>", "<answer>2</answer>"])
    [0.5, 0.0]
    """
    return [0.5 if is_soft_format(c) else 0.0 for c in completions]


def _xml_count_score(text: str) -> float:
    lines = [line.strip() for line in text.splitlines()]
    score = 0.25 * sum(1 for tag in TAGS if text.count(tag) == 1 and tag in lines)
    if "</answer>" in text:
        tail = text.rsplit("</answer>", 1)[1].strip()
        score -= min(len(tail) * XML_TAIL_PENALTY_PER_CHAR, _XML_TAIL_PENALTY_CAP)
    return score


def xml_count_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Partial credit per tag: 0.25 for each of the four tags appearing exactly once on its own line.

    Dense shaping so a model that gets only some tags right still sees a gradient (range 0.0-1.0).
    Characters after the last ``</answer>`` (ignoring surrounding whitespace) cost
    ``XML_TAIL_PENALTY_PER_CHAR`` (0.001) each, capped at 1.0, so trailing chatter after the answer
    is discouraged; the total can therefore dip below 0 for a long tail.

    >>> good = "<reasoning>\\nx\\n</reasoning>\\n<answer>\\n2\\n</answer>"
    >>> xml_count_reward([good, good + "\\nP.S. bye", "<reasoning>\\nx\\n</reasoning>\\n2", "2"])
    [1.0, 0.992, 0.5, 0.0]
    """
    return [_xml_count_score(completion_text(c)) for c in completions]
