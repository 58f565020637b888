"""What each kind of step returns: small frozen results naming their output folder and its content hash.

The data step returns :class:`DataResult`, an evaluation :class:`EvalResult`, a training stage
:class:`StageResult`, a GRPO stage's pass-rate scoring :class:`ScoreResult`. Cache records and every output's ``.result.json`` hold them as JSON, rebuilt
field by field (``posttrain.cache.records``); a process hands them to another pickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.metric_names import qualify_metrics

__all__ = ["DataResult", "EvalResult", "ScoreResult", "StageResult"]


@dataclass(frozen=True)
class DataResult:
    data_dir: str
    train_fingerprint: str
    eval_fingerprint: str
    stats: dict[str, Any] = field(default_factory=dict)
    output_fingerprint: str = ""
    """Content hash of ``data_dir`` when written."""


@dataclass(frozen=True)
class EvalResult:
    stage: str
    """The stage whose output was evaluated (`baseline`, `sft`, `grpo-format`, ...)."""
    report_dir: str
    summary: dict[str, float]
    """The primary set's metrics: its report's summary plus accuracy per number of operations."""
    timings: dict[str, float]
    model_fingerprint: str
    output_fingerprint: str = ""
    """Content hash of ``report_dir`` (extra sets' reports included) when written."""
    sets: dict[str, dict[str, float]] = field(default_factory=dict)
    """Extra set name → its metrics, named as the primary's are; its report is ``report_dir/<name>``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        """Every set's metrics under their final names: ``accuracy_strict``, ``accuracy_strict/ops_1``,
        ``accuracy_strict/<set>``, ... (see :mod:`posttrain.core.metric_names`)."""
        out = {}
        for name, _, metrics in self.reports():
            out.update(qualify_metrics(metrics, name))
        return out

    def reports(self) -> list[tuple[str | None, str, dict[str, float]]]:
        """(set name, None for the primary; its report folder; its metrics) of every evaluation set."""
        extra = [(name, str(Path(self.report_dir) / name), m) for name, m in self.sets.items()]
        return [(None, self.report_dir, self.summary), *extra]


@dataclass(frozen=True)
class StageResult:
    stage: str
    """`sft`, `dpo`, `grpo-<name>` or `rft-<name>`."""
    output_dir: str
    metrics: Mapping[str, float | int]
    fingerprints: Mapping[str, str]
    """`input_model`, `data`, `config` (the stage section) and `output` (the policy written)."""
    alerts: tuple[Mapping[str, Any], ...] = ()
    duration_s: float = 0.0
    samples: tuple[str, ...] = ()
    """Sample-completion files, relative to ``output_dir`` (GRPO only)."""
    artifact: str = "merged"
    """`merged` (LoRA folded in), `full` (full fine-tuning) or `adapter` (needs ``adapter_base``)."""
    adapter_base: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScoreResult:
    """A ``score-<stage>`` step's output: per-prompt pass rates (``pass_rates.json``) and the k samples'
    report they were counted from, measured on the model the stage starts from."""

    stage: str
    """The GRPO stage the prompts are scored for: ``grpo-<name>``."""
    output_dir: str
    summary: Mapping[str, float | int]
    """``prompts``, ``samples``, ``kept``, ``kept_share``, ``mean_pass_rate`` and the timings."""
    model_fingerprint: str
    output_fingerprint: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
