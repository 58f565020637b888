"""GSM8K evaluation: a continuous-batching generation engine, strict/flexible scoring, reports and diffs.

Entry points: :func:`evaluate` (model + records -> :class:`EvalReport`), :func:`run_eval` (what
``posttrain eval`` calls), :func:`diff_reports` / :func:`format_diff` (``posttrain eval --diff``),
:func:`format_summary_table`, and :func:`load_eval_records` for the eval data sources. Accuracy per
number of operations: ``EvalReport.by_ops``; metric names of sets and difficulties: :mod:`posttrain.core.metric_names`.
"""

from posttrain.data.eval_sets import eval_records_for, load_eval_records
from posttrain.evaluation.diff import ReportDiff, diff_reports, format_diff
from posttrain.evaluation.evaluator import evaluate, run_eval
from posttrain.evaluation.report import (
    EvalRecord,
    EvalReport,
    format_by_ops,
    format_summary_table,
    report_metrics,
)
from posttrain.evaluation.scoring import SampleScore, pass_at_k, score_completion, summarize, summarize_by_ops
from posttrain.generation.engine import Completion, GenerationStats, generate_continuous

__all__ = [
    "Completion",
    "EvalRecord",
    "EvalReport",
    "GenerationStats",
    "ReportDiff",
    "SampleScore",
    "diff_reports",
    "eval_records_for",
    "evaluate",
    "format_by_ops",
    "format_diff",
    "format_summary_table",
    "generate_continuous",
    "load_eval_records",
    "pass_at_k",
    "report_metrics",
    "run_eval",
    "score_completion",
    "summarize",
    "summarize_by_ops",
]
