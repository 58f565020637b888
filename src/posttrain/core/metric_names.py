"""Names of evaluation metrics sliced by evaluation set and by difficulty, and how to read them back.

The metric comes first and its slices after it: ``accuracy_strict`` (the primary evaluation set, all
questions), ``accuracy_strict/ops_2`` (its questions with two arithmetic operations),
``accuracy_strict/gsm8k`` (the extra evaluation set ``gsm8k``), ``accuracy_strict/gsm8k/ops_2``.
Sorted lists of metrics (MLflow's compare view, ``posttrain compare``) then keep one metric's slices
together, and the primary set keeps the names it had before there were extra sets. Set names never
contain ``/`` nor look like ``ops_<n>`` (``EvalSetConfig`` refuses them), so a name reads back
unambiguously. Evaluation writes these names; tracking and the command line read them, which is why
they live here and not in the (heavy) evaluation package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "INTERVAL_SUFFIXES",
    "interval_names",
    "is_interval_metric",
    "is_ops_slice",
    "metric_name",
    "parse_metric_name",
    "qualify_metrics",
    "slices_of",
]

INTERVAL_SUFFIXES = ("_ci_low", "_ci_high")
"""A metric's 95 % interval is two more metrics, named after it: ``accuracy_strict_ci_low`` and
``accuracy_strict_ci_high`` (sliced like it: ``accuracy_strict_ci_low/gsm8k/ops_2``), so MLflow
shows, sorts and compares them beside the value."""

_OPS_PART = re.compile(r"^ops_(\d+)$")


def is_ops_slice(part: str) -> bool:
    """Whether one part of a metric name is a difficulty slice (``ops_3``), which no set may be named."""
    return _OPS_PART.match(part) is not None


def interval_names(metric: str) -> tuple[str, str]:
    """The names of ``metric``'s interval bounds (before any slice is added).

    >>> interval_names("accuracy_strict")
    ('accuracy_strict_ci_low', 'accuracy_strict_ci_high')
    """
    low, high = INTERVAL_SUFFIXES
    return f"{metric}{low}", f"{metric}{high}"


def is_interval_metric(name: str) -> bool:
    """Whether a (sliced) metric name is an interval bound.

    >>> is_interval_metric("accuracy_strict_ci_low/gsm8k"), is_interval_metric("accuracy_strict/ops_1")
    (True, False)
    """
    return parse_metric_name(name)[0].endswith(INTERVAL_SUFFIXES)


def metric_name(metric: str, eval_set: str | None = None, ops: int | str | None = None) -> str:
    """The name of ``metric`` on extra set ``eval_set`` (None: the primary set), for questions with
    ``ops`` operations (None: all questions).

    >>> metric_name("accuracy_strict"), metric_name("accuracy_strict", ops=2)
    ('accuracy_strict', 'accuracy_strict/ops_2')
    >>> metric_name("accuracy_strict", "gsm8k"), metric_name("accuracy_strict", "gsm8k", 3)
    ('accuracy_strict/gsm8k', 'accuracy_strict/gsm8k/ops_3')
    """
    return "/".join([metric, *([eval_set] if eval_set else []), *([f"ops_{ops}"] if ops is not None else [])])


def parse_metric_name(name: str) -> tuple[str, str | None, int | None]:
    """(metric, extra set or None, ops or None): the inverse of :func:`metric_name`.

    >>> parse_metric_name("accuracy_strict/gsm8k/ops_3"), parse_metric_name("accuracy_strict/ops_1")
    (('accuracy_strict', 'gsm8k', 3), ('accuracy_strict', None, 1))
    """
    metric, *rest = name.split("/")
    ops = None
    if rest and is_ops_slice(rest[-1]):
        ops = int(rest.pop().removeprefix("ops_"))
    return metric, ("/".join(rest) or None), ops


def qualify_metrics(metrics: Mapping[str, float], eval_set: str | None) -> dict[str, float]:
    """Metrics of one set under their names for extra set ``eval_set`` (unchanged for the primary).

    >>> qualify_metrics({"accuracy_strict": 0.5, "accuracy_strict/ops_1": 1.0}, "gsm8k")
    {'accuracy_strict/gsm8k': 0.5, 'accuracy_strict/gsm8k/ops_1': 1.0}
    """
    if not eval_set:
        return dict(metrics)
    out = {}
    for name, value in metrics.items():
        metric, _, ops = parse_metric_name(name)
        out[metric_name(metric, eval_set, ops)] = value
    return out


def slices_of(
    metrics: Mapping[str, Any], metric: str = "accuracy_strict"
) -> dict[str | None, dict[int | None, float]]:
    """One metric's values by evaluation set (None: the primary) and number of operations (None: all
    questions), read back from metric names, sets in first-seen order, operations ascending.

    >>> slices_of({"accuracy_strict": 0.5, "accuracy_strict/ops_2": 0.25, "accuracy_strict/ops_1": 0.75,
    ...            "accuracy_strict/gsm8k": 0.0, "strict_format_rate": 1.0})
    {None: {None: 0.5, 1: 0.75, 2: 0.25}, 'gsm8k': {None: 0.0}}
    """
    out: dict[str | None, dict[int | None, float]] = {}
    for name, value in metrics.items():
        base, eval_set, ops = parse_metric_name(name)
        if base == metric and isinstance(value, int | float):
            out.setdefault(eval_set, {})[ops] = float(value)
    return {
        eval_set: dict(sorted(values.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
        for eval_set, values in out.items()
    }
