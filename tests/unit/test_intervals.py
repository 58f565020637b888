"""Intervals on every accuracy and the paired change between two evaluations (no model).

Known values are published ones: Wilson intervals from Newcombe (1998, Table I, method 3), the
paired interval and McNemar's exact p-value from Fagerland, Lydersen and Laake (2017, chapter 8,
Cavo et al. data), Student t quantiles from any table.
"""

from __future__ import annotations

import math

import pytest

from posttrain.cli import main
from posttrain.core.stats import (
    fraction_interval,
    mcnemar_exact_p,
    paired_difference,
    paired_mean_difference,
    t_interval,
    t_quantile,
    wilson_interval,
)
from posttrain.evaluation import (
    EvalRecord,
    EvalReport,
    diff_reports,
    format_diff,
    score_completion,
    summarize,
)
from posttrain.evaluation.diff import stage_delta_metrics

RIGHT = "<reasoning>\n6 * 7 = 42\n</reasoning>\n<answer>\n42\n</answer>"
WRONG = RIGHT.replace("\n42\n</answer>", "\n41\n</answer>")


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [
        (81, 263, 0.2553, 0.3662),  # Newcombe (1998), Table I
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),  # none right: the interval still has width
        (1, 29, 0.0061, 0.1718),
        (29, 29, 0.8830, 1.0),  # all right: the mirror of 0 of 29
        (0, 0, 0.0, 1.0),  # nothing measured: anything is possible
    ],
)
def test_wilson_interval_matches_published_values(successes, n, low, high):
    assert wilson_interval(successes, n) == pytest.approx((low, high), abs=5e-5)


def test_wilson_interval_narrows_with_more_questions_and_stays_in_bounds():
    widths = [hi - lo for lo, hi in (wilson_interval(n // 4, n) for n in (8, 80, 800))]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 0.07
    assert fraction_interval(0.25, 8) == wilson_interval(2, 8)  # one sample a question: the same
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


@pytest.mark.parametrize(
    ("df", "quantile"),
    [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622), (29, 2.0452), (200, 1.9719)],
)
def test_t_quantile_matches_tables(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-4)


def test_t_interval_over_seeds():
    three = t_interval([0.20, 0.25, 0.30])  # sd 0.05: mean ± 4.3027 * 0.05 / sqrt(3)
    assert (three.estimate, three.low, three.high) == pytest.approx((0.25, 0.12579, 0.37421), abs=1e-5)
    assert t_interval([0.1, 0.1, 0.1]).low == pytest.approx(0.1)  # no spread, no width
    assert math.isinf(t_interval([0.3]).high)  # one seed says nothing about the spread


def test_mcnemar_exact_p_values():
    assert mcnemar_exact_p(16, 6) == pytest.approx(0.052479, abs=1e-6)  # Cavo et al.
    assert mcnemar_exact_p(6, 16) == mcnemar_exact_p(16, 6)  # two-sided
    assert mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(0, 0) == 1.0


def _report(name: str, right: dict[str, bool]) -> EvalReport:
    records = tuple(
        EvalRecord.from_samples(i, f"question {i}?", "42", [score_completion(RIGHT if ok else WRONG, "42")])
        for i, ok in right.items()
    )
    return EvalReport(model=name, summary=summarize([r.samples for r in records]), records=records)


def _pair(both: int, fixed: int, broken: int, neither: int) -> tuple[EvalReport, EvalReport]:
    """Two reports on the same questions: ``both`` right in A and B, ``fixed`` right in B only,
    ``broken`` right in A only, ``neither`` right in neither."""
    kinds = (
        [(True, True)] * both
        + [(False, True)] * fixed
        + [(True, False)] * broken
        + [(False, False)] * neither
    )
    a = _report("A", {f"q{i}": x for i, (x, _) in enumerate(kinds)})
    b = _report("B", {f"q{i}": y for i, (_, y) in enumerate(kinds)})
    return a, b


def test_paired_difference_of_two_hand_made_reports_with_flips_both_ways():
    # Cavo et al.'s table as two reports: 59 right in both, 6 fixed, 16 broken, 80 wrong in both
    a, b = _pair(59, 6, 16, 80)
    diff = diff_reports(a, b)
    assert diff.counts["fixed"] == 6 and diff.counts["broken"] == 16 and diff.net == -10
    change = diff.difference
    assert (change.fixed, change.broken, change.n) == (6, 16, 161)
    assert change.interval.estimate == pytest.approx(-10 / 161)
    assert (change.interval.low, change.interval.high) == pytest.approx((-0.1186, -0.0046), abs=5e-5)
    assert change.p_value == pytest.approx(0.052479, abs=1e-6)
    assert change.interval.excludes(0)  # the interval and the exact test disagree at the margin
    text = format_diff(diff)
    assert "B - A: -6.2 [-11.9, -0.5] percentage points" in text
    assert "Newcombe paired score interval" in text and "McNemar's exact test p = 0.0525" in text


def test_paired_interval_is_narrower_than_two_separate_intervals():
    # 30 of 100 before, 40 after, and only the 10 fixed questions changed: a clear gain when paired
    a, b = _pair(30, 10, 0, 60)
    change = diff_reports(a, b).difference.interval
    assert change.excludes(0)
    low_a, high_a = wilson_interval(30, 100)
    low_b, high_b = wilson_interval(40, 100)
    assert high_a > low_b  # the two separate intervals overlap: read alone they would say "noise"
    assert change.high - change.low < (high_b - low_b)


def test_no_flips_gives_zero_change_with_an_interval_around_it():
    a, b = _pair(3, 0, 0, 5)
    change = diff_reports(a, b).difference
    assert change.interval.estimate == 0 and change.interval.low < 0 < change.interval.high
    assert change.p_value == 1.0


def test_several_samples_per_question_use_a_t_interval_over_questions():
    def sampled(name: str, texts: dict[str, list[str]]) -> EvalReport:
        records = tuple(
            EvalRecord.from_samples(i, f"q {i}?", "42", [score_completion(t, "42") for t in ts])
            for i, ts in texts.items()
        )
        return EvalReport(model=name, summary={}, records=records)

    a = sampled("A", {"q1": [WRONG, WRONG], "q2": [RIGHT, WRONG], "q3": [RIGHT, RIGHT]})
    b = sampled("B", {"q1": [RIGHT, WRONG], "q2": [RIGHT, RIGHT], "q3": [RIGHT, RIGHT]})
    change = diff_reports(a, b).difference
    assert change.interval.estimate == pytest.approx(1 / 3)  # (0.5 + 0.5 + 0) / 3
    assert change.p_value is None and "t interval" in change.interval.method
    assert (change.fixed, change.broken) == (2, 0)
    # the text says which count is which: the net change over all samples, the groups by sample 0
    text = format_diff(diff_reports(a, b))
    assert "net change +2 (questions scoring higher in B minus lower, over all samples)" in text
    assert "by each question's first sample:\n  fixed              1" in text


@pytest.mark.parametrize("before, after", [(0.5, 0.75), (0.5, 0.5), (1.0, 0.0)])
def test_questions_that_all_changed_alike_still_get_an_interval_of_some_width(before, after):
    """Several samples per question, every question's difference the same: a t interval over the
    differences would have zero width (and mark a change of a quarter significant with certainty)."""
    change = paired_mean_difference([before] * 40, [after] * 40).interval
    assert change.estimate == pytest.approx(after - before)
    assert -1.0 <= change.low <= change.estimate <= change.high <= 1.0 and change.low < change.high
    # as wide as Newcombe's paired interval for 0/1 scores that did not change, within a factor of two
    width = change.high - change.low
    unchanged = paired_difference(20, 0, 0, 20).interval
    assert 0.5 < width / (unchanged.high - unchanged.low) < 2.0


def test_stage_delta_metrics_cover_every_set(tmp_path):
    a, b = _pair(2, 3, 1, 4)
    a.save(tmp_path / "before")
    b.save(tmp_path / "after")
    extra_a, extra_b = _pair(1, 0, 2, 1)
    extra_a.save(tmp_path / "before" / "gsm8k")
    extra_b.save(tmp_path / "after" / "gsm8k")
    metrics = stage_delta_metrics(tmp_path / "before", tmp_path / "after")
    assert metrics["delta_accuracy_strict"] == pytest.approx(0.2)
    assert metrics["fixed_accuracy_strict"] == 3 and metrics["broken_accuracy_strict"] == 1
    assert metrics["delta_accuracy_strict_ci_low"] < 0.2 < metrics["delta_accuracy_strict_ci_high"]
    assert metrics["mcnemar_p_accuracy_strict"] == pytest.approx(mcnemar_exact_p(3, 1))
    assert metrics["delta_accuracy_strict/gsm8k"] == pytest.approx(-0.5)
    assert metrics["broken_accuracy_strict/gsm8k"] == 2
    expected = paired_difference(2, 3, 1, 4).interval
    assert metrics["delta_accuracy_strict_ci_high"] == pytest.approx(expected.high)


def test_eval_diff_prints_the_paired_change(tmp_path, capsys):
    a, b = _pair(59, 6, 16, 80)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    assert main(["eval", "--diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "fixed              6" in out and "broken            16" in out
    assert "B - A: -6.2 [-11.9, -0.5] percentage points" in out
