"""The evaluation report: per-example records, summary metrics, and how they were produced.

A report is written as two files so that both humans and tools can use it: ``report.json`` (model,
summary, config, timings, environment; small enough to read or log as an artifact) and
``examples.jsonl`` (one line per question, greppable, and what :mod:`posttrain.evaluation.diff`
matches by id to show which questions a training stage fixed or broke).

Accuracy is also broken down by difficulty, the number of arithmetic operations of each question
(``ops``: the synthetic generator's count, GSM8K's calculator annotations), in ``report.json``'s
``by_ops``, and as metrics named by :mod:`posttrain.core.metric_names` (``accuracy_strict/ops_2``).

Every accuracy carries its 95 % interval (``accuracy_strict_ci_low`` / ``_ci_high``, overall and per
number of operations; :mod:`posttrain.evaluation.scoring` says which interval), in ``report.json``,
in the metrics and in the printed tables.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.metric_names import interval_names, is_interval_metric, metric_name
from posttrain.core.stats import format_percent
from posttrain.core.untrusted import UntrustedContentError, read_json_bounded, read_jsonl_bounded
from posttrain.evaluation.scoring import SampleScore, summarize_by_ops

logger = logging.getLogger(__name__)

__all__ = [
    "BY_OPS_METRICS",
    "EXAMPLES_FILE",
    "REPORT_FILE",
    "EvalRecord",
    "EvalReport",
    "format_by_ops",
    "format_summary_table",
    "rate_text",
    "report_metrics",
]

REPORT_FILE = "report.json"
EXAMPLES_FILE = "examples.jsonl"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class EvalRecord:
    """One question: its first completion's scores, plus the other samples when pass@k sampled more.

    The flat fields describe sample 0 (the greedy completion in the default setting), so the common
    case reads without indirection; ``num_correct_*`` count over all ``num_samples`` samples.
    """

    id: str
    question: str
    gold: str
    completion: str
    strict: str | None
    flexible: str | None
    correct_strict: bool
    correct_flexible: bool
    strict_format: bool
    tokens: int
    truncated: bool
    ops: int | None = None
    """Arithmetic operations in the question (difficulty), when its source says."""
    tool_calls: int = 0
    """Calls sample 0 made to an engine tool (the calculator), failed ones included."""
    tool_failures: int = 0
    num_samples: int = 1
    num_correct_strict: int = 0
    num_correct_flexible: int = 0
    extra_samples: tuple[SampleScore, ...] = ()

    @classmethod
    def from_samples(
        cls, id: str, question: str, gold: str, samples: Sequence[SampleScore], ops: int | None = None
    ) -> EvalRecord:
        first = samples[0]
        return cls(
            id=id,
            question=question,
            gold=gold,
            completion=first.completion,
            strict=first.strict,
            flexible=first.flexible,
            correct_strict=first.correct_strict,
            correct_flexible=first.correct_flexible,
            strict_format=first.strict_format,
            tokens=first.tokens,
            truncated=first.truncated,
            ops=ops,
            tool_calls=first.tool_calls,
            tool_failures=first.tool_failures,
            num_samples=len(samples),
            num_correct_strict=sum(s.correct_strict for s in samples),
            num_correct_flexible=sum(s.correct_flexible for s in samples),
            extra_samples=tuple(samples[1:]),
        )

    @property
    def samples(self) -> tuple[SampleScore, ...]:
        first = SampleScore(
            self.completion,
            self.strict,
            self.flexible,
            self.correct_strict,
            self.correct_flexible,
            self.strict_format,
            self.tokens,
            self.truncated,
            self.tool_calls,
            self.tool_failures,
        )
        return (first, *self.extra_samples)

    def correct(self, mode: str = "strict") -> bool:
        """Whether sample 0 is correct under ``mode`` (``strict`` or ``flexible``)."""
        if mode not in ("strict", "flexible"):
            raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")
        return self.correct_strict if mode == "strict" else self.correct_flexible

    def as_dict(self) -> dict[str, Any]:
        """Fields as JSON types; ``ops`` right after the gold answer (it leads the MLflow table's columns)."""
        data = asdict(self)
        if not self.extra_samples:
            del data["extra_samples"]
        head = {k: data.pop(k) for k in ("id", "question", "gold", "ops")}
        return {**head, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalRecord:
        data = dict(data)
        data["extra_samples"] = tuple(SampleScore(**s) for s in data.get("extra_samples", ()))
        return cls(**data)


@dataclass(frozen=True)
class EvalReport:
    """Summary metrics and per-example records of one evaluation of one model on one dataset."""

    model: str
    summary: dict[str, float]
    records: tuple[EvalRecord, ...]
    config: dict[str, Any] = field(default_factory=dict)
    """The evaluation settings (EvalConfig fields, data source, system prompt, precision, backend)."""
    timings: dict[str, float] = field(default_factory=dict)
    """seconds, tokens_per_second, generated/prompt tokens, load time, engine counters."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Environment: library versions, dtype, device, creation time."""

    def __post_init__(self) -> None:
        ids = [r.id for r in self.records]
        if len(set(ids)) != len(ids):
            raise ValueError("example ids in a report must be unique (reports are diffed by id)")

    @property
    def by_ops(self) -> dict[str, dict[str, float]]:
        """``{"<ops>": {"n", "accuracy_strict", "accuracy_flexible", "strict_format_rate"}}`` over
        every sample (plus pass@k when the evaluation sampled ``pass_k > 1``), from the records
        (empty when no record has an ``ops``)."""
        k = int(self.config.get("pass_k", 1))
        return summarize_by_ops([r.samples for r in self.records], [r.ops for r in self.records], k)

    def save(self, directory: str | Path) -> Path:
        """Write ``report.json`` and ``examples.jsonl`` into ``directory`` (created); return it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        head = {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "summary": self.summary,
            "by_ops": self.by_ops,
            "config": self.config,
            "timings": self.timings,
            "meta": self.meta,
        }
        (directory / REPORT_FILE).write_text(json.dumps(head, indent=2, sort_keys=False, default=str) + "\n")
        with (directory / EXAMPLES_FILE).open("w", encoding="utf-8") as fh:
            for record in self.records:
                fh.write(json.dumps(record.as_dict(), ensure_ascii=False) + "\n")
        logger.info("wrote evaluation report (%d examples) to %s", len(self.records), directory)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> EvalReport:
        """Read a report written by :meth:`save`. A report is read back like any store content
        (:mod:`posttrain.core.untrusted`): a damaged one is an ``UntrustedContentError`` naming the file."""
        directory = Path(directory)
        try:
            head = read_json_bounded(directory / REPORT_FILE, expect=dict)
            rows = read_jsonl_bounded(directory / EXAMPLES_FILE)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{directory} is not an evaluation report: {exc.filename} is missing"
            ) from None
        if (version := head.get("format_version", FORMAT_VERSION)) != FORMAT_VERSION:
            raise UntrustedContentError(
                f"{directory / REPORT_FILE}: format_version {version!r}; this posttrain reads {FORMAT_VERSION}"
            )
        try:
            if not isinstance(head["model"], str) or not isinstance(head["summary"], dict):
                raise TypeError("model must be a string and summary a mapping")
            return cls(
                model=head["model"],
                summary=head["summary"],
                records=tuple(EvalRecord.from_dict(row) for row in rows),
                config=head.get("config", {}),
                timings=head.get("timings", {}),
                meta=head.get("meta", {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UntrustedContentError(
                f"{directory / REPORT_FILE}: not an evaluation report ({type(exc).__name__}: {exc})"
            ) from None


BY_OPS_METRICS = ("accuracy_strict", *interval_names("accuracy_strict"))
"""The per-difficulty numbers that also become metrics (``accuracy_strict/ops_<n>`` and its interval),
with pass@k when the evaluation sampled it (``pass@8_strict/ops_2``); report.json has all."""


def report_metrics(report: EvalReport) -> dict[str, float]:
    """The report's summary plus :data:`BY_OPS_METRICS` and pass@k per difficulty (``accuracy_strict/ops_2``),
    each with its interval."""
    by_ops = {
        metric_name(metric, ops=ops): value
        for ops, values in report.by_ops.items()
        for metric, value in values.items()
        if metric in BY_OPS_METRICS or metric.startswith("pass@")
    }
    return {**report.summary, **by_ops}


def rate_text(metrics: Mapping[str, float], metric: str) -> str:
    """A rate of ``metrics`` in percent, with its interval when ``metrics`` holds it (reports written
    before there were intervals do not).

    >>> rate_text({"accuracy_strict": 0.5, "accuracy_strict_ci_low": 0.25, "accuracy_strict_ci_high": 0.75},
    ...           "accuracy_strict"), rate_text({"accuracy_strict": 0.5}, "accuracy_strict")
    ('50.0% [25.0, 75.0]', '50.0%')
    """
    low, high = interval_names(metric)
    return format_percent(metrics.get(metric, 0.0), metrics.get(low), metrics.get(high))


def format_by_ops(by_ops: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table of accuracy and format per number of operations ("" when there is none);
    strict accuracy (and pass@k) with its 95 % interval."""
    if not by_ops:
        return ""
    passes = [
        key for key in next(iter(by_ops.values())) if key.startswith("pass@") and not is_interval_metric(key)
    ]
    header = "".join(f"  {key.replace('_', ' '):>24}" for key in passes)
    lines = [f"{'ops':>4}  {'n':>5}  {'strict [95% CI]':>20}  {'flexible':>8}  {'format':>7}{header}"]
    for ops, m in by_ops.items():
        lines.append(
            f"{ops:>4}  {int(m['n']):>5}  {rate_text(m, 'accuracy_strict'):>20}  "
            f"{m['accuracy_flexible']:>8.1%}  {m['strict_format_rate']:>7.1%}"
            + "".join(f"  {rate_text(m, key):>24}" for key in passes)
        )
    return "\n".join(lines)


def _metric_rows(summary: Mapping[str, float]) -> list[tuple[str, str]]:
    rows = [
        ("accuracy (strict, <answer>)", rate_text(summary, "accuracy_strict")),
        ("accuracy (flexible, last number)", rate_text(summary, "accuracy_flexible")),
        ("strict format", rate_text(summary, "strict_format_rate")),
        ("mean completion tokens", f"{summary.get('mean_completion_tokens', 0.0):.1f}"),
        ("truncated (no EOS)", f"{summary.get('truncation_rate', 0.0):.1%}"),
    ]
    if "tool_calls_per_completion" in summary:
        rows += [
            ("tool calls per completion", f"{summary['tool_calls_per_completion']:.2f}"),
            ("failed tool calls per completion", f"{summary['tool_failed_calls_per_completion']:.2f}"),
        ]
    rows += [
        (f"{key.split('_')[0]} ({key.split('_')[1]})", rate_text(summary, key))
        for key in summary
        if key.startswith("pass@") and not is_interval_metric(key)
    ]
    return rows


def format_summary_table(report: EvalReport) -> str:
    """A small plain-text table of the report's headline numbers (what `posttrain eval` prints)."""
    s = report.summary
    samples = int(s.get("samples_per_example", 1))
    source = report.config.get("data_source", report.config.get("data", "?"))
    data = f"{source}, {int(s.get('num_examples', 0))} examples"
    if isinstance(info := report.config.get("dataset"), dict) and isinstance(info.get("label"), str):
        data = info["label"]  # the dataset and split, with the count: what a GSM8K number is on
    title = f"model: {report.model}\ndata: {data}"
    if samples > 1:
        title += f" x {samples} samples (temperature {report.config.get('temperature')})"
    if tools := report.config.get("tools"):
        title += f"\ntools: {', '.join(tools)} (accuracy with the tool; compare only with runs that used it)"
    rows = _metric_rows(s)
    if report.timings:
        rows.append(
            (
                "throughput",
                f"{report.timings.get('tokens_per_second', 0.0):.0f} tok/s, "
                f"{report.timings.get('seconds', 0.0):.1f} s generating",
            )
        )
    width = max(len(name) for name, _ in rows)
    if interval_names("accuracy_strict")[0] in s:
        title += "\n[brackets]: 95% Wilson score intervals over the questions"
    lines = [title, "-" * (width + 22)] + [f"{name:<{width}}  {value:>20}" for name, value in rows]
    if by_ops := format_by_ops(report.by_ops):
        lines += ["", "by number of operations:", by_ops]
    return "\n".join(lines)
