"""Per-question comparison of two evaluation reports (e.g. before and after a training stage).

An accuracy that moves from 30% to 32% can hide 20 questions fixed and 18 broken; the second number
is what tells a regression from noise. Reports are matched by example id, so both must come from the
same data with the same ids (``limit N`` always takes the same first N); ids present in only one
report are listed, never silently dropped.

The change B - A comes with its 95 % interval on the same questions (a paired comparison, much
narrower than two separate intervals, since most questions are answered alike by both): with one
sample per question, Newcombe's paired score interval and McNemar's exact test on the questions
that flipped (:func:`posttrain.core.stats.paired_difference`); with several samples per question, a
t interval over the questions' differences. :func:`stage_delta_metrics` gives the same numbers as
metrics for the pipeline's stage-to-stage comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.metric_names import interval_names, qualify_metrics
from posttrain.core.stats import Interval, PairedDifference, paired_difference, paired_mean_difference
from posttrain.evaluation.report import REPORT_FILE, EvalRecord, EvalReport

logger = logging.getLogger(__name__)

__all__ = [
    "DELTA_METRICS",
    "STAGE_VALUE_COLUMNS",
    "STAGE_VALUE_TITLE",
    "ReportDiff",
    "diff_reports",
    "format_diff",
    "delta_metrics",
    "paired_scores",
    "setting_differences",
    "stage_delta_metrics",
    "stage_value_columns",
    "stage_value_rows",
    "stage_value_sets",
]

Pair = tuple[EvalRecord, EvalRecord]


def record_score(record: EvalRecord, metric: str) -> float:
    """One question's score for ``metric`` (``accuracy_strict``, ``accuracy_flexible`` or
    ``strict_format_rate``): 0/1 for one sample, the fraction of its samples otherwise."""
    if metric == "strict_format_rate":
        samples = record.samples
        return sum(s.strict_format for s in samples) / len(samples)
    mode = metric.removeprefix("accuracy_")
    if record.num_samples <= 1:
        return float(record.correct(mode))
    return getattr(record, f"num_correct_{mode}") / record.num_samples


def paired_scores(pairs: list[Pair], score: Callable[[EvalRecord], float]) -> PairedDifference:
    """B - A over matched questions: Newcombe's paired interval and McNemar's exact p when every
    score is 0 or 1, else a t interval over the questions' differences (module docstring)."""
    a = [score(rec_a) for rec_a, _ in pairs]
    b = [score(rec_b) for _, rec_b in pairs]
    if any(x not in (0.0, 1.0) for x in (*a, *b)):
        return paired_mean_difference(a, b)
    both = sum(1 for x, y in zip(a, b, strict=True) if x and y)
    fixed = sum(1 for x, y in zip(a, b, strict=True) if not x and y)
    broken = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    return paired_difference(both, fixed, broken, len(pairs) - both - fixed - broken)


@dataclass(frozen=True)
class ReportDiff:
    """Questions of A and B grouped by how their correctness changed (pairs are (record A, record B))."""

    model_a: str
    model_b: str
    mode: str
    """Which correctness flag is compared: ``strict`` or ``flexible``."""
    fixed: tuple[Pair, ...]
    broken: tuple[Pair, ...]
    stayed_right: tuple[Pair, ...]
    stayed_wrong: tuple[Pair, ...]
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    """Generation settings that differ between the reports (see :func:`setting_differences`)."""
    difference: PairedDifference | None = None
    """Accuracy of B minus A on the matched questions, with its interval (module docstring)."""

    @property
    def counts(self) -> dict[str, int]:
        return {
            "fixed": len(self.fixed),
            "broken": len(self.broken),
            "stayed_right": len(self.stayed_right),
            "stayed_wrong": len(self.stayed_wrong),
            "only_in_a": len(self.only_in_a),
            "only_in_b": len(self.only_in_b),
        }

    @property
    def matched(self) -> int:
        return len(self.fixed) + len(self.broken) + len(self.stayed_right) + len(self.stayed_wrong)

    @property
    def net(self) -> int:
        """Questions gained minus questions lost."""
        return len(self.fixed) - len(self.broken)

    def by_ops(self) -> dict[int, dict[str, float]]:
        """Per number of operations (A's record's ``ops``), easiest first: ``n`` matched questions,
        ``accuracy_a``, ``accuracy_b``, the ``fixed`` / ``broken`` counts and the interval of B - A
        (``delta_ci_low``, ``delta_ci_high``: Newcombe's paired interval on sample 0's flags).
        Empty without ``ops``."""
        rows: dict[int, dict[str, float]] = {}
        for group, (right_a, right_b) in (
            ("fixed", (0, 1)),
            ("broken", (1, 0)),
            ("stayed_right", (1, 1)),
            ("stayed_wrong", (0, 0)),
        ):
            for rec_a, rec_b in getattr(self, group):
                ops = rec_a.ops if rec_a.ops is not None else rec_b.ops
                if ops is None:
                    continue
                row = rows.setdefault(ops, {"n": 0, "right_a": 0, "right_b": 0, "fixed": 0, "broken": 0})
                row["n"] += 1
                row["right_a"] += right_a
                row["right_b"] += right_b
                if group in ("fixed", "broken"):
                    row[group] += 1
        out = {}
        for ops, row in sorted(rows.items()):
            both = row["right_a"] - row["broken"]
            change = paired_difference(
                both, row["fixed"], row["broken"], row["n"] - both - row["fixed"] - row["broken"]
            ).interval
            out[ops] = {
                "n": row["n"],
                "accuracy_a": row["right_a"] / row["n"],
                "accuracy_b": row["right_b"] / row["n"],
                "fixed": row["fixed"],
                "broken": row["broken"],
                "delta_ci_low": change.low,
                "delta_ci_high": change.high,
            }
        return out


GENERATION_SETTINGS = (
    "system_prompt",
    "few_shot",
    "max_completion_length",
    "temperature",
    "pass_k",
    "seed",
    "backend",
    "tools",
)
"""Report ``config`` keys that change completions even when the model is the same."""

BATCH_SETTINGS = ("batch_size", "refill_at")
"""Keys that change completions only below fp32: the batch decides each prompt's padding and row,
and bf16 attention rounds differently with them (docs/evaluation.md, "Precision and batch size")."""


_OLD_SETTING_NAMES = {"max_completion_length": "max_new_tokens"}
"""Report ``config`` keys under the name reports written before the config key was renamed use."""


def _setting(report: EvalReport, key: str) -> Any:
    value = report.config.get(key)
    return (
        report.config.get(_OLD_SETTING_NAMES[key]) if value is None and key in _OLD_SETTING_NAMES else value
    )


def setting_differences(a: EvalReport, b: EvalReport) -> tuple[str, ...]:
    """``key: A -> B`` for every generation setting two reports differ in, so a diff is not read as
    the model's doing when the settings alone moved the completions. Keys a report lacks are skipped."""
    dtype_a, dtype_b = a.meta.get("dtype"), b.meta.get("dtype")
    values = {"dtype": (dtype_a, dtype_b)}
    values |= {key: (_setting(a, key), _setting(b, key)) for key in GENERATION_SETTINGS}
    # a report without tools may predate the key: no key is no tool
    values["tools"] = (a.config.get("tools") or [], b.config.get("tools") or [])
    if not a.config.get("temperature") and not b.config.get("temperature"):
        del values["seed"]  # greedy: the seed draws nothing
    if "float32" not in (dtype_a, dtype_b):
        values |= {key: (a.config.get(key), b.config.get(key)) for key in BATCH_SETTINGS}
    return tuple(
        f"{key}: {_shorten(str(x), 40)} -> {_shorten(str(y), 40)}"
        for key, (x, y) in values.items()
        if x is not None and y is not None and x != y
    )


def diff_reports(a: EvalReport, b: EvalReport, mode: str = "strict") -> ReportDiff:
    """Group the questions both reports share by (correct in A, correct in B), in A's order."""
    if mode not in ("strict", "flexible"):
        raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")
    by_id = {r.id: r for r in b.records}
    groups: dict[tuple[bool, bool], list[Pair]] = {(x, y): [] for x in (True, False) for y in (True, False)}
    for rec_a in a.records:
        rec_b = by_id.get(rec_a.id)
        if rec_b is not None:
            groups[(rec_a.correct(mode), rec_b.correct(mode))].append((rec_a, rec_b))
    ids_a = {r.id for r in a.records}
    only_a = tuple(r.id for r in a.records if r.id not in by_id)
    only_b = tuple(r.id for r in b.records if r.id not in ids_a)
    if only_a or only_b:
        logger.warning(
            "reports cover different questions: %d only in A, %d only in B", len(only_a), len(only_b)
        )
    settings = setting_differences(a, b)
    if settings:
        logger.warning("reports were generated with different settings: %s", "; ".join(settings))
    matched = [pair for group in groups.values() for pair in group]
    return ReportDiff(
        model_a=a.model,
        model_b=b.model,
        mode=mode,
        fixed=tuple(groups[(False, True)]),
        broken=tuple(groups[(True, False)]),
        stayed_right=tuple(groups[(True, True)]),
        stayed_wrong=tuple(groups[(False, False)]),
        only_in_a=only_a,
        only_in_b=only_b,
        settings=settings,
        difference=paired_scores(matched, lambda r: record_score(r, f"accuracy_{mode}")),
    )


DELTA_METRICS = ("accuracy_strict", "accuracy_flexible", "strict_format_rate")
"""The metrics whose stage-to-stage change :func:`stage_delta_metrics` measures."""


def delta_metrics(a: EvalReport, b: EvalReport) -> dict[str, float]:
    """B - A on the questions both reports share, per :data:`DELTA_METRICS`: ``delta_<m>`` with its
    interval (``delta_<m>_ci_low`` / ``_ci_high``), ``fixed_<m>`` and ``broken_<m>`` (questions
    that scored higher / lower in B) and, for 0/1 scores, McNemar's ``mcnemar_p_<m>``."""
    by_id = {r.id: r for r in b.records}
    pairs = [(rec, by_id[rec.id]) for rec in a.records if rec.id in by_id]
    out: dict[str, float] = {}
    for metric in DELTA_METRICS:
        change = paired_scores(pairs, lambda r, m=metric: record_score(r, m))
        low, high = interval_names(f"delta_{metric}")
        out[f"delta_{metric}"] = change.interval.estimate
        out[low], out[high] = change.interval.low, change.interval.high
        out[f"fixed_{metric}"], out[f"broken_{metric}"] = change.fixed, change.broken
        if change.p_value is not None:
            out[f"mcnemar_p_{metric}"] = change.p_value
    return out


STAGE_VALUE_TITLE = "what each stage bought (strict accuracy, paired 95% interval on the same questions)"
STAGE_VALUE_COLUMNS = ("stage", "minutes", "change (points)", "points per minute")


def stage_value_sets(changes: Mapping[str, float]) -> list[str]:
    """The extra evaluation sets that ``changes`` holds a paired change of, in order of appearance.

    >>> stage_value_sets({"eval-sft/delta_accuracy_strict": 0.1, "eval-sft/delta_accuracy_strict/unseen": 0.2,
    ...                   "eval-sft/delta_accuracy_strict_ci_low/unseen": 0.1})
    ['unseen']
    """
    sets: list[str] = []
    for key in changes:
        _, _, metric = key.partition("/")
        name, _, eval_set = metric.partition("/")
        if name == "delta_accuracy_strict" and eval_set and "/" not in eval_set and eval_set not in sets:
            sets.append(eval_set)
    return sets


def stage_value_columns(changes: Mapping[str, float]) -> tuple[str, ...]:
    """:data:`STAGE_VALUE_COLUMNS`, then one change column per extra set (:func:`stage_value_sets`)."""
    return (*STAGE_VALUE_COLUMNS, *(f"{name} change" for name in stage_value_sets(changes)))


def stage_value_rows(
    outcomes: Sequence[Mapping[str, Any]], changes: Mapping[str, float]
) -> list[tuple[str, ...]]:
    """What each training stage bought, one row per evaluation that follows training (the run
    summary's ``outcomes`` and ``changes``): the stages it evaluates, their minutes (training and
    scoring, the producer's when cached), the paired change in strict accuracy on the primary set
    with its 95 % interval, and points per minute (:data:`STAGE_VALUE_COLUMNS`), then its change on
    each extra evaluation set (:func:`stage_value_columns`): a stage trained for problems the primary
    set does not hold shows its gain there. An evaluation whose change or cost is unknown has no row.

    >>> stage_value_rows([{"step": "sft", "kind": "sft"}, {"step": "eval-sft", "kind": "eval"}],
    ...     {"eval-sft/stage_minutes": 4.0, "eval-sft/delta_accuracy_strict": 0.1,
    ...      "eval-sft/delta_accuracy_strict_ci_low": 0.05, "eval-sft/delta_accuracy_strict_ci_high": 0.15})
    [('sft', '4.0', '+10.0 [+5.0, +15.0]', '+2.50')]
    >>> stage_value_rows([{"step": "sft", "kind": "sft"}, {"step": "eval-sft", "kind": "eval"}],
    ...     {"eval-sft/stage_minutes": 4.0, "eval-sft/delta_accuracy_strict": 0.1,
    ...      "eval-sft/delta_accuracy_strict/unseen": 0.25, "eval-sft/delta_accuracy_strict_ci_low/unseen": 0.2,
    ...      "eval-sft/delta_accuracy_strict_ci_high/unseen": 0.3})
    [('sft', '4.0', '+10.0', '+2.50', '+25.0 [+20.0, +30.0]')]

    Stages with no evaluation between them (``eval.after_each_stage: false``) share one row:

    >>> steps = [{"step": "eval-baseline", "kind": "eval"}, {"step": "sft", "kind": "sft"},
    ...          {"step": "grpo-x", "kind": "grpo"}, {"step": "eval-grpo-x", "kind": "eval"}]
    >>> stage_value_rows(steps, {"eval-grpo-x/stage_minutes": 60.0, "eval-grpo-x/delta_accuracy_strict": 0.12})
    [('sft + grpo-x', '60.0', '+12.0', '+0.20')]
    """
    low_name, high_name = interval_names("delta_accuracy_strict")
    sets = stage_value_sets(changes)

    def change_text(step: str, eval_set: str | None) -> str:
        suffix = f"/{eval_set}" if eval_set else ""
        delta = changes.get(f"{step}/delta_accuracy_strict{suffix}")
        if delta is None:
            return ""
        low, high = changes.get(f"{step}/{low_name}{suffix}"), changes.get(f"{step}/{high_name}{suffix}")
        if low is None or high is None:
            return f"{100 * delta:+.1f}"
        return Interval(delta, low, high, "paired").points()

    rows, trained = [], []
    for outcome in outcomes:
        step = outcome["step"]
        if outcome["kind"] in ("sft", "dpo", "grpo", "rft"):
            trained.append(step)
        if outcome["kind"] != "eval":
            continue
        # The stages since the evaluation before, together: with eval.after_each_stage off the
        # final evaluation's change is all of them, not the last one's.
        stages, trained = " + ".join(trained) or step.removeprefix("eval-"), []
        minutes, delta = changes.get(f"{step}/stage_minutes"), changes.get(f"{step}/delta_accuracy_strict")
        if minutes is None or delta is None:
            continue
        per_minute = f"{100 * delta / minutes:+.2f}" if minutes > 0 else ""
        extra = tuple(change_text(step, name) for name in sets)
        rows.append((stages, f"{minutes:.1f}", change_text(step, None), per_minute, *extra))
    return rows


def stage_delta_metrics(before: str | Path, after: str | Path) -> dict[str, float]:
    """:func:`delta_metrics` of two pipeline evaluations (report folders): the primary set's under
    plain names, each extra set both hold under its own (``delta_accuracy_strict/gsm8k``)."""
    before, after = Path(before), Path(after)
    out = delta_metrics(EvalReport.load(before), EvalReport.load(after))
    for folder in sorted(p for p in before.iterdir() if (p / REPORT_FILE).is_file()):
        if (after / folder.name / REPORT_FILE).is_file():
            deltas = delta_metrics(EvalReport.load(folder), EvalReport.load(after / folder.name))
            out.update(qualify_metrics(deltas, folder.name))
    return out


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _pair_lines(pair: Pair, mode: str) -> list[str]:
    rec_a, rec_b = pair
    answer_a = rec_a.strict if mode == "strict" else rec_a.flexible
    answer_b = rec_b.strict if mode == "strict" else rec_b.flexible
    return [
        f"  [{rec_a.id}] {_shorten(rec_a.question, 100)}",
        f"    gold {rec_a.gold} | A answered {answer_a} | B answered {answer_b}",
        f"    B: {_shorten(rec_b.completion, 160)}",
    ]


def format_diff(diff: ReportDiff, n_examples: int = 3) -> str:
    """Counts per group, then up to ``n_examples`` questions each of fixed and broken."""
    total = max(diff.matched, 1)
    groups = (diff.fixed, diff.broken, diff.stayed_right, diff.stayed_wrong)
    sampled = any(rec.num_samples > 1 for group in groups for pair in group for rec in pair)
    net = diff.net
    if sampled and diff.difference is not None:
        # B - A averages every sample; so does the net change, as questions scoring higher minus lower
        net = diff.difference.fixed - diff.difference.broken
    lines = [
        f"A: {diff.model_a}",
        f"B: {diff.model_b}",
        f"{diff.matched} questions in both reports ({diff.mode} scoring); net change {net:+d}"
        + (" (questions scoring higher in B minus lower, over all samples)" if sampled else ""),
    ]
    if diff.difference is not None and diff.matched:
        change = diff.difference
        test = "" if change.p_value is None else f"; McNemar's exact test p = {change.p_value:.3g}"
        lines.append(
            f"  B - A: {change.interval.points()} percentage points (95% {change.interval.method}{test})"
        )
    if sampled:
        lines.append("  by each question's first sample:")
    for name in ("fixed", "broken", "stayed_right", "stayed_wrong"):
        count = len(getattr(diff, name))
        lines.append(f"  {name.replace('_', ' '):<13} {count:>6}  ({count / total:.1%})")
    if diff.only_in_a or diff.only_in_b:
        lines.append(f"  unmatched: {len(diff.only_in_a)} only in A, {len(diff.only_in_b)} only in B")
    if diff.settings:
        lines.append("  generated with different settings, which change completions by themselves:")
        lines += [f"    {setting}" for setting in diff.settings]
    if by_ops := diff.by_ops():
        lines.append(f"\nby number of operations ({diff.mode}):")
        lines.append(
            f"  {'ops':>4}  {'n':>5}  {'A':>6}  {'B':>6}  {'fixed':>5}  {'broken':>6}  {'B - A [95% CI]':>22}"
        )
        for ops, row in by_ops.items():
            change = f"{100 * (row['accuracy_b'] - row['accuracy_a']):+.1f} " + (
                f"[{100 * row['delta_ci_low']:+.1f}, {100 * row['delta_ci_high']:+.1f}]"
            )
            lines.append(
                f"  {ops:>4}  {row['n']:>5}  {row['accuracy_a']:>6.1%}  {row['accuracy_b']:>6.1%}  "
                f"{row['fixed']:>5}  {row['broken']:>6}  {change:>22}"
            )
    for name, label in (
        ("fixed", "fixed (wrong in A, right in B)"),
        ("broken", "broken (right in A, wrong in B)"),
    ):
        pairs = getattr(diff, name)
        if pairs and n_examples > 0:
            lines.append(f"\n{label}, {min(n_examples, len(pairs))} of {len(pairs)}:")
            for pair in pairs[:n_examples]:
                lines += _pair_lines(pair, diff.mode)
    return "\n".join(lines)
