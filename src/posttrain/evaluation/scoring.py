"""Scoring completions against GSM8K golds, and aggregating scores into report metrics.

All answer extraction goes through :mod:`posttrain.core.parsing`, the parser the GRPO rewards
use, so a reported accuracy and the training signal can never disagree about what a completion
answered. Two accuracies are reported side by side: *strict* reads only the ``<answer>`` block
(what the correctness reward pays for) and *flexible* reads the last number anywhere (how much is
lost purely to formatting).

pass@k uses the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained
on Code"): with ``n`` samples of which ``c`` are correct, ``1 - C(n-c, k) / C(n, k)``. Taking the
fraction of ``k`` samples that contain a correct one would be biased upward for small ``n``.

Every accuracy, format rate and pass@k comes with its 95 % interval (``accuracy_strict_ci_low`` /
``_ci_high``, see :mod:`posttrain.core.metric_names`): the Wilson score interval over the questions
(:func:`posttrain.core.stats.fraction_interval`). With one greedy sample per question that is the
Wilson interval of a proportion; with several samples (or pass@k) each question's score is a
fraction, and the same interval with the questions as ``n`` is conservative, since samples of one
question are not independent of each other.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from posttrain.core.metric_names import interval_names
from posttrain.core.sample_score import SampleScore, canonical_gold, score_completion
from posttrain.core.stats import fraction_interval

__all__ = [
    "BY_OPS_FIELDS",
    "INTERVAL_METRICS",
    "SampleScore",
    "answers_agree",
    "canonical_gold",
    "pass_at_k",
    "score_completion",
    "summarize",
    "summarize_by_ops",
    "with_intervals",
]


def answers_agree(a: Any, b: Any) -> bool | None:
    """Whether two scored completions of one question (:class:`SampleScore` or an evaluation report's
    record) gave the same (strict, flexible) answers; None when neither has any number, since two
    non-answers agree on nothing (an agreement rate over them would reward two runs failing alike).

    >>> right, wrong, silent = (score_completion(t, "42") for t in ("so 42", "so 41", "no idea"))
    >>> answers_agree(right, right), answers_agree(right, wrong), answers_agree(silent, right)
    (True, False, False)
    >>> answers_agree(silent, score_completion("still no idea", "42")) is None
    True
    """
    if a.flexible is None and b.flexible is None:  # no number at all (a strict answer is a number too)
        return None
    return (a.strict, a.flexible) == (b.strict, b.flexible)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (numerically stable product form).

    >>> pass_at_k(4, 0, 2), pass_at_k(4, 4, 2), pass_at_k(1, 1, 1)
    (0.0, 1.0, 1.0)
    >>> round(pass_at_k(4, 1, 2), 4)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    """
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


INTERVAL_METRICS = ("accuracy_strict", "accuracy_flexible", "strict_format_rate")
"""The rates that get a 95 % interval (besides every ``pass@k_*``)."""


def with_intervals(metrics: dict[str, float], n: int) -> dict[str, float]:
    """``metrics`` with ``<m>_ci_low`` and ``<m>_ci_high`` right after each of :data:`INTERVAL_METRICS`
    and every ``pass@k_*``, over ``n`` questions.

    >>> with_intervals({"accuracy_strict": 0.5, "mean_completion_tokens": 9.0}, 4)  # doctest: +ELLIPSIS
    {'accuracy_strict': 0.5, 'accuracy_strict_ci_low': 0.15..., 'accuracy_strict_ci_high': 0.84..., 'mean_completion_tokens': 9.0}
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        out[key] = value
        if key in INTERVAL_METRICS or key.startswith("pass@"):
            low_name, high_name = interval_names(key)
            out[low_name], out[high_name] = fraction_interval(value, n)
    return out


def summarize(
    samples: Sequence[Sequence[SampleScore]], k: int = 1, *, tools: bool = False
) -> dict[str, float]:
    """Report metrics from the scored samples of each question (outer list: questions).

    Accuracies are the mean over questions of the fraction of correct samples, i.e. pass@1
    estimated from all samples; with one greedy sample per question that is the plain accuracy.
    Format, length and truncation rates are over all samples. Accuracies, the format rate and
    pass@k come with their 95 % intervals (:func:`with_intervals`). With ``tools`` (the evaluation ran
    an engine tool) the calls are counted too: ``tool_calls_per_completion``,
    ``tool_failed_calls_per_completion`` and ``completions_with_tool_calls`` (a fraction).

    >>> ok = score_completion("<reasoning>\\nx\\n</reasoning>\\n<answer>\\n1\\n</answer>", "1", tokens=10)
    >>> bad = score_completion("2", "1", tokens=30, truncated=True)
    >>> m = summarize([[ok], [bad]])
    >>> m["accuracy_strict"], m["strict_format_rate"], m["mean_completion_tokens"], m["truncation_rate"]
    (0.5, 0.5, 20.0, 0.5)
    """
    flat = [s for group in samples for s in group]
    metrics: dict[str, float] = {
        "num_examples": len(samples),
        "samples_per_example": len(samples[0]) if samples else 0,
        "accuracy_strict": _mean([_mean([s.correct_strict for s in g]) for g in samples]),
        "accuracy_flexible": _mean([_mean([s.correct_flexible for s in g]) for g in samples]),
        "strict_format_rate": _mean([s.strict_format for s in flat]),
        "mean_completion_tokens": _mean([s.tokens for s in flat]),
        "truncation_rate": _mean([s.truncated for s in flat]),
    }
    if tools:
        metrics["tool_calls_per_completion"] = _mean([s.tool_calls for s in flat])
        metrics["tool_failed_calls_per_completion"] = _mean([s.tool_failures for s in flat])
        metrics["completions_with_tool_calls"] = _mean([s.tool_calls > 0 for s in flat])
    if k > 1:
        for mode in ("strict", "flexible"):
            metrics[f"pass@{k}_{mode}"] = _mean(
                [pass_at_k(len(g), sum(getattr(s, f"correct_{mode}") for s in g), k) for g in samples]
            )
    return with_intervals(metrics, len(samples))


BY_OPS_FIELDS = ("accuracy_strict", "accuracy_flexible", "strict_format_rate")
"""The metrics reported per difficulty, besides the count ``n`` of questions."""


def summarize_by_ops(
    samples: Sequence[Sequence[SampleScore]], ops: Sequence[int | None], k: int = 1
) -> dict[str, dict[str, float]]:
    """Accuracy and format per difficulty, with their intervals: ``{"<ops>": {"n", "accuracy_strict",
    "accuracy_strict_ci_low", ...}}``, easiest first.

    ``ops`` is each question's number of arithmetic operations (synthetic problems' own count,
    GSM8K's calculator annotations); questions without one (None) are left out. With ``k > 1``
    each difficulty also gets ``pass@<k>_strict`` and ``pass@<k>_flexible``: whether training
    made more problems of that difficulty solvable at all, or only made the solvable ones likelier.

    >>> ok = score_completion("<reasoning>\\nx\\n</reasoning>\\n<answer>\\n1\\n</answer>", "1")
    >>> bad = score_completion("1", "1")
    >>> by_ops = summarize_by_ops([[ok], [bad], [ok]], [2, 1, 2])
    >>> {k: by_ops["1"][k] for k in ("n", "accuracy_strict", "accuracy_flexible", "strict_format_rate")}
    {'n': 1, 'accuracy_strict': 0.0, 'accuracy_flexible': 1.0, 'strict_format_rate': 0.0}
    >>> round(by_ops["1"]["accuracy_flexible_ci_low"], 4), by_ops["1"]["accuracy_flexible_ci_high"]
    (0.2065, 1.0)
    >>> list(by_ops), by_ops["2"]["n"], by_ops["2"]["accuracy_strict"]
    (['1', '2'], 2, 1.0)
    """
    if len(samples) != len(ops):
        raise ValueError(f"{len(samples)} questions but {len(ops)} ops values")
    groups: dict[int, list[Sequence[SampleScore]]] = defaultdict(list)
    for group, n in zip(samples, ops, strict=True):
        if n is not None:
            groups[int(n)].append(group)
    fields = (*BY_OPS_FIELDS, f"pass@{k}_strict", f"pass@{k}_flexible") if k > 1 else BY_OPS_FIELDS
    out = {}
    for n, group in sorted(groups.items()):
        metrics = summarize(group, k)
        out[str(n)] = with_intervals({field: metrics[field] for field in fields}, len(group))
        out[str(n)] = {"n": len(group), **out[str(n)]}
    return out
