"""Confidence intervals and tests for the numbers posttrain compares: pure functions, no dependencies.

One evaluation of 200 questions cannot tell a 3-point gain from noise; every accuracy posttrain
reports therefore carries a 95 % interval, and every comparison says whether its interval excludes
zero. Which method, and why:

* **One proportion** (an accuracy over ``n`` questions): the Wilson score interval (Wilson 1927;
  method 3 of Newcombe 1998, "Two-sided confidence intervals for the single proportion"). Unlike
  the textbook ``p ± z·sqrt(p(1-p)/n)`` it never leaves [0, 1] and does not collapse to a point at
  0 % or 100 %, which small models and small sets hit all the time.
* **A mean of per-question fractions** (accuracy over several samples per question, pass@k): the
  same Wilson interval with the number of *questions* as ``n`` (:func:`fraction_interval`). Samples
  of one question are correlated, so questions are the independent unit; a per-question score in
  [0, 1] with mean ``p`` has variance at most ``p(1-p)`` (equality when every score is 0 or 1), so
  the interval is conservative, and exact in the one-sample case.
* **Two evaluations of the same questions** (before and after a stage): a paired comparison.
  The interval for the difference of the two accuracies is Newcombe's square-and-add interval for
  paired proportions (Newcombe 1998, "Improved confidence intervals for the difference between
  binomial proportions based on paired data", method 10), built from the two Wilson intervals and
  the correlation of the pairs; the p-value is McNemar's exact (conditional binomial) test on the
  questions that flipped. Pairing matters: most questions are answered alike before and after, and
  an unpaired interval would be several times too wide.
* **Several seeds**: a Student t interval over the seeds' values (:func:`t_interval`); with three
  seeds its multiplier is 4.30, not 1.96, which is the honest price of three runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "CONFIDENCE",
    "Interval",
    "PairedDifference",
    "format_percent",
    "fraction_interval",
    "mcnemar_exact_p",
    "paired_difference",
    "paired_mean_difference",
    "t_interval",
    "t_quantile",
    "wilson_interval",
    "z_value",
]

CONFIDENCE = 0.95
"""The confidence level of every interval posttrain reports."""


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval (same units), and how the interval was computed."""

    estimate: float
    low: float
    high: float
    method: str

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (a difference "significant" at its level).

        >>> Interval(0.1, 0.02, 0.18, "x").excludes(0), Interval(0.1, -0.02, 0.18, "x").excludes(0)
        (True, False)
        """
        return value < self.low or value > self.high

    def percent(self) -> str:
        """A proportion and its interval in percent: ``23.0% [17.7, 29.3]``.

        >>> Interval(0.23, 0.177, 0.2934, "x").percent()
        '23.0% [17.7, 29.3]'
        """
        return format_percent(self.estimate, self.low, self.high)

    def points(self) -> str:
        """A difference of proportions and its interval in percentage points: ``+5.0 [-0.3, +10.2]``.

        >>> Interval(0.05, -0.003, 0.102, "x").points(), Interval(0.0, -math.inf, math.inf, "x").points()
        ('+5.0 [-0.3, +10.2]', '+0.0 [-inf, +inf]')
        """
        return f"{100 * self.estimate:+.1f} [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"


def format_percent(value: float, low: float | None = None, high: float | None = None) -> str:
    """``23.0%``, or ``23.0% [17.7, 29.3]`` with its bounds.

    >>> format_percent(0.5), format_percent(0.5, 0.25, 0.75)
    ('50.0%', '50.0% [25.0, 75.0]')
    """
    if low is None or high is None:
        return f"{value:.1%}"
    return f"{value:.1%} [{100 * low:.1f}, {100 * high:.1f}]"


def z_value(confidence: float = CONFIDENCE) -> float:
    """The two-sided standard normal quantile for ``confidence``.

    >>> round(z_value(0.95), 6), round(z_value(0.99), 6)
    (1.959964, 2.575829)
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def wilson_interval(successes: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval for a proportion ``successes / n``; (0, 1) when ``n`` is 0.

    Values from Newcombe (1998), Table I, method 3:

    >>> [tuple(round(x, 4) for x in wilson_interval(k, n)) for k, n in ((81, 263), (15, 148), (0, 20), (1, 29))]
    [(0.2553, 0.3662), (0.0624, 0.1605), (0.0, 0.1611), (0.0061, 0.1718)]
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    z = z_value(confidence)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0 and 1 the bounds are exactly 0 and 1 (rounding would leave them a hair off)
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def fraction_interval(mean: float, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Interval for a mean of ``n`` per-question scores in [0, 1] (each question's fraction of correct
    samples, or its pass@k estimate): :func:`wilson_interval` with the questions as ``n``.

    Conservative (module docstring): the variance of a [0, 1] score with mean ``p`` is at most
    ``p(1-p)``; with one 0/1 score per question this is the Wilson interval itself.

    >>> fraction_interval(0.25, 8) == wilson_interval(2, 8)
    True
    """
    if not -1e-9 <= mean <= 1 + 1e-9:
        raise ValueError(f"a mean of fractions lies in [0, 1], got {mean}")
    return wilson_interval(min(max(mean, 0.0), 1.0) * n, n, confidence)


@dataclass(frozen=True)
class PairedDifference:
    """Accuracy of B minus accuracy of A on the same questions, with the questions that flipped."""

    interval: Interval
    """B - A as a fraction (0.05 = five points), with its confidence interval."""
    fixed: int
    """Wrong in A, right in B."""
    broken: int
    """Right in A, wrong in B."""
    n: int
    p_value: float | None
    """McNemar's exact test (None when the scores are not 0/1)."""


def mcnemar_exact_p(fixed: int, broken: int) -> float:
    """Two-sided p-value of McNemar's exact test: under "no change" each flipped question is equally
    likely to have flipped either way, so the smaller count is Binomial(fixed + broken, 1/2).

    1.0 when nothing flipped. Value from Fagerland, Lydersen and Laake (2017), Cavo et al. data:

    >>> round(mcnemar_exact_p(16, 6), 6), mcnemar_exact_p(0, 0), mcnemar_exact_p(5, 5)
    (0.052479, 1.0, 1.0)
    """
    if fixed < 0 or broken < 0:
        raise ValueError(f"counts must be >= 0, got {fixed}, {broken}")
    flipped = fixed + broken
    if flipped == 0:
        return 1.0
    tail = sum(math.comb(flipped, k) for k in range(min(fixed, broken) + 1)) / 2**flipped
    return min(1.0, 2 * tail)


def paired_difference(
    both: int, fixed: int, broken: int, neither: int, confidence: float = CONFIDENCE
) -> PairedDifference:
    """B - A for 0/1 scores of the same questions: Newcombe's paired square-and-add interval (method
    10, with his correction of the correlation term) and McNemar's exact p-value.

    ``both``: right in A and B; ``fixed``: wrong in A, right in B; ``broken``: right in A, wrong in
    B; ``neither``: wrong in both. Value from Fagerland, Lydersen and Laake (2017), Cavo et al. data
    (59 both, 6 only first, 16 only second, 80 neither; first minus second, here B = first):

    >>> d = paired_difference(59, 6, 16, 80)
    >>> round(d.interval.estimate, 4), round(d.interval.low, 4), round(d.interval.high, 4)
    (-0.0621, -0.1186, -0.0046)
    >>> paired_difference(3, 0, 0, 5).interval.low < 0 < paired_difference(3, 0, 0, 5).interval.high
    True
    """
    counts = (both, fixed, broken, neither)
    if min(counts) < 0:
        raise ValueError(f"counts must be >= 0, got {counts}")
    n = sum(counts)
    method = "Newcombe paired score interval"
    if n == 0:
        return PairedDifference(Interval(0.0, -1.0, 1.0, method), 0, 0, 0, 1.0)
    right_b, right_a = both + fixed, both + broken
    p_b, p_a = right_b / n, right_a / n
    low_b, high_b = wilson_interval(right_b, n, confidence)
    low_a, high_a = wilson_interval(right_a, n, confidence)
    # The correlation between the two accuracies, with Newcombe's correction: a small positive
    # association (below n/2 in ad - bc) counts as none, which keeps the interval from being too
    # narrow when the pairs agree by chance.
    margins = right_b * (n - right_b) * right_a * (n - right_a)
    cross = both * neither - fixed * broken
    if margins == 0:
        phi = 0.0
    elif cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(margins)
    elif cross >= 0:
        phi = 0.0
    else:
        phi = cross / math.sqrt(margins)
    estimate = p_b - p_a
    below = math.sqrt(
        max(0.0, (p_b - low_b) ** 2 - 2 * phi * (p_b - low_b) * (high_a - p_a) + (high_a - p_a) ** 2)
    )
    above = math.sqrt(
        max(0.0, (high_b - p_b) ** 2 - 2 * phi * (high_b - p_b) * (p_a - low_a) + (p_a - low_a) ** 2)
    )
    interval = Interval(estimate, max(-1.0, estimate - below), min(1.0, estimate + above), method)
    return PairedDifference(interval, fixed, broken, n, mcnemar_exact_p(fixed, broken))


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _t_cdf(t: float, df: int) -> float:
    """Student t distribution function for integer ``df`` (closed form, Abramowitz and Stegun 26.7.3-4)."""
    theta = math.atan2(t, math.sqrt(df))  # P(|T| < t) is a finite series in sin and cos of theta
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(3, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        inside = 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    else:
        term, total = 1.0, 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        inside = s * total
    return 0.5 + inside / 2


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on the
    closed-form distribution function; no scipy in the core).

    >>> [round(t_quantile(0.975, df), 4) for df in (1, 2, 4, 29)]
    [12.7062, 4.3027, 2.7764, 2.0452]
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if not 0 < probability < 1:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if probability < 0.5:
        return -t_quantile(1 - probability, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < probability:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if _t_cdf(middle, df) < probability:
            low = middle
        else:
            high = middle
        if high - low < 1e-12:
            break
    return (low + high) / 2


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean of ``values`` (one per seed) with a Student t interval: ``mean ± t·sd/sqrt(k)``.

    It treats the seeds as a sample of the seeds one could have run; with one value there is no
    spread to measure, and the interval is unbounded.

    >>> i = t_interval([0.20, 0.25, 0.30])
    >>> round(i.estimate, 3), round(i.low, 4), round(i.high, 4)
    (0.25, 0.1258, 0.3742)
    >>> t_interval([0.3]).low
    -inf
    """
    if not values:
        raise ValueError("a t interval needs at least one value")
    mean, sd = _mean_sd(values)
    method = f"t interval over {len(values)} values"
    if len(values) < 2:
        return Interval(mean, -math.inf, math.inf, method)
    half = t_quantile(1 - (1 - confidence) / 2, len(values) - 1) * sd / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, method)


def paired_mean_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """B - A for per-question scores that are fractions (several samples per question, pass@k): a
    t interval over the per-question differences, the questions being the independent unit; the
    flip counts say how many questions scored higher or lower. For 0/1 scores use
    :func:`paired_difference`.

    >>> d = paired_mean_difference([0.5, 0.25, 1.0, 0.0], [0.75, 0.25, 1.0, 0.5])
    >>> round(d.interval.estimate, 4), d.fixed, d.broken, d.p_value
    (0.1875, 2, 0, None)

    Questions that all changed alike have no spread to measure; the interval is then a bound that
    holds for any questions (never of zero width):

    >>> same = paired_mean_difference([0.5] * 100, [0.75] * 100).interval
    >>> round(same.low, 4), same.estimate, round(same.high, 4)
    (0.2038, 0.25, 0.2777)
    """
    if len(a) != len(b):
        raise ValueError(f"paired scores need equal lengths, got {len(a)} and {len(b)}")
    if not a:
        return PairedDifference(Interval(0.0, -1.0, 1.0, "t interval over questions"), 0, 0, 0, None)
    differences = [y - x for x, y in zip(a, b, strict=True)]
    spread = t_interval(differences, confidence)
    low, high = max(-1.0, spread.low), min(1.0, spread.high)
    method = f"t interval over {len(a)} questions' differences"
    if len(differences) > 1 and min(differences) == max(differences):
        # Every question changed by the same amount, so the t interval has zero width: a certainty
        # that n questions cannot give. Bound the mean instead by the share of questions that could
        # still change otherwise (Wilson's upper bound for none of n seen), each by as much as a
        # difference in [-1, 1] can move; an interval that holds whatever the questions look like.
        share = wilson_interval(0, len(differences), confidence)[1]
        change = spread.estimate
        low, high = change - share * (1 + change), change + share * (1 - change)
        method = f"bound over {len(a)} questions that all changed alike"
    interval = Interval(spread.estimate, low, high, method)
    fixed = sum(d > 0 for d in differences)
    broken = sum(d < 0 for d in differences)
    return PairedDifference(interval, fixed, broken, len(a), None)
