"""GSM8K evaluation: a continuous-batching generation engine, strict/flexible scoring, reports and diffs.

Entry points: :func:`evaluate` (model + records -> :class:`EvalReport`), :func:`run_eval` (what
``posttrain eval`` calls), :func:`diff_reports` / :func:`format_diff` (``posttrain eval --diff``),
:func:`format_summary_table`, and :func:`load_eval_records` for the eval data sources. Accuracy per
number of operations: ``EvalReport.by_ops``; metric names of sets and difficulties: :mod:`posttrain.core.metric_names`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each public name lives. The package imports them on first use (PEP 562), so importing a
# light submodule (``posttrain.evaluation.report``, which a cached rerun reads) does not load the
# engine and with it torch.
_SOURCES = {
    "eval_records_for": "posttrain.data.eval_sets",
    "load_eval_records": "posttrain.data.eval_sets",
    "ReportDiff": "posttrain.evaluation.diff",
    "diff_reports": "posttrain.evaluation.diff",
    "format_diff": "posttrain.evaluation.diff",
    "evaluate": "posttrain.evaluation.evaluator",
    "run_eval": "posttrain.evaluation.evaluator",
    "EvalRecord": "posttrain.evaluation.report",
    "EvalReport": "posttrain.evaluation.report",
    "format_by_ops": "posttrain.evaluation.report",
    "format_summary_table": "posttrain.evaluation.report",
    "report_metrics": "posttrain.evaluation.report",
    "SampleScore": "posttrain.evaluation.scoring",
    "pass_at_k": "posttrain.evaluation.scoring",
    "score_completion": "posttrain.evaluation.scoring",
    "summarize": "posttrain.evaluation.scoring",
    "summarize_by_ops": "posttrain.evaluation.scoring",
    "Completion": "posttrain.generation.engine",
    "GenerationStats": "posttrain.generation.engine",
    "generate_continuous": "posttrain.generation.engine",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
