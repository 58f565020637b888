"""The read side of :mod:`posttrain.tracking`: run comparison, figures and text tables.

:func:`compare_runs` reads pipeline runs back (parent params, stage runs' ``eval/*`` metrics, GRPO
reward histories) into plain dataclasses, so the CLI, a notebook or a test can use them without
MLflow objects.

Figures are bare ``matplotlib.figure.Figure`` objects, not pyplot ones: pyplot keeps global state
and picks an interactive backend, which is not available on a headless training machine;
``savefig`` on a bare figure renders with Agg. matplotlib is imported inside functions so
``posttrain validate`` stays fast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.core.config import TrackingConfig
from posttrain.core.errors import TrackingError
from posttrain.core.redact import redact_text
from posttrain.tracking.headline import (
    SeedRun,
    counter_names,
    format_headline,
    format_seed_groups,
    repeated_seeds,
    seed_groups,
)
from posttrain.tracking.mlflow_io import (
    ROLE_TAG,
    SEED_GROUP_TAG,
    STEP_KIND_TAG,
    STEPS_TAG,
    global_tracking_uri,
    mlflow_client,
    resolve_tracking_uri,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # heavy: deferred until needed

__all__ = [
    "Comparison",
    "RunSummary",
    "accuracy_by_stage_figure",
    "cell_text",
    "compare_runs",
    "eval_metrics_by_stage",
    "format_comparison",
    "in_plan_order",
    "is_curve_metric",
    "last_user_text",
    "pass_rate_figure",
    "plot_comparison",
    "reward_curves_figure",
    "reward_series",
]

Curves = Mapping[str, Sequence[tuple[int, float]]]


# --------------------------------------------------------------------------- reading runs back


@dataclass(frozen=True)
class RunSummary:
    """One pipeline run as ``posttrain compare`` shows it."""

    run_id: str
    name: str
    status: str
    start_time: datetime | None
    duration_s: float | None
    params: Mapping[str, str]
    stage_metrics: Mapping[str, float]
    """``<stage>/<metric>`` from each stage run's ``eval/*`` metrics, e.g. ``eval-sft/accuracy_strict``."""
    reward_curves: Mapping[str, list[tuple[int, float]]]
    """GRPO stage run name → its ``reward`` history as (step, value)."""
    seed: int | None = None
    """The config's ``seed`` (None for a run without the param)."""
    seed_group: str | None = None
    """Runs of one config that differ only in ``seed`` share it (the ``posttrain.seed_group`` tag)."""


@dataclass(frozen=True)
class Comparison:
    runs: list[RunSummary]
    """Oldest first."""
    param_diffs: dict[str, list[str | None]]
    """Only params whose values differ across the runs: key → value per run (None = absent)."""
    metric_names: list[str]
    """Every ``<stage>/<metric>`` seen, in stage order."""

    def seed_runs(self) -> list[tuple[str | None, SeedRun]]:
        """The compared runs that have a seed, in the order given, with their seed group."""
        return [
            (r.seed_group, SeedRun(r.run_id, r.seed, r.stage_metrics))
            for r in self.runs
            if r.seed is not None
        ]

    def seed_groups(self) -> dict[str, list[SeedRun]]:
        """The compared runs by seed group, one per seed, for groups of two or more seeds."""
        return seed_groups(self.seed_runs())

    def table(self) -> list[dict[str, Any]]:
        """Side-by-side rows, one per run: id, name, start, duration, differing params, stage metrics."""
        return [
            {
                "run_id": r.run_id,
                "name": r.name,
                "start_time": r.start_time,
                "duration_s": r.duration_s,
                **{k: vals[i] for k, vals in self.param_diffs.items()},
                **{m: r.stage_metrics.get(m) for m in self.metric_names},
            }
            for i, r in enumerate(self.runs)
        ]


def _stage_runs(client: Any, experiment_id: str, parent_run_id: str) -> list[Any]:
    return client.search_runs(
        [experiment_id],
        f"tags.mlflow.parentRunId = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"],
    )


def _evals(stage_runs: Sequence[Any]) -> dict[str, dict[str, float]]:
    return {
        r.info.run_name: {k[5:]: v for k, v in r.data.metrics.items() if k.startswith("eval/")}
        for r in stage_runs
    }


def eval_metrics_by_stage(client: Any, experiment_id: str, parent_run_id: str) -> dict[str, dict[str, float]]:
    """Stage run name → its ``eval/*`` metrics (prefix dropped), in start order."""
    return _evals(_stage_runs(client, experiment_id, parent_run_id))


def compare_runs(
    experiment: str | None = None,
    last: int | None = None,
    run_ids: Sequence[str] = (),
    *,
    tracking_uri: str | None = None,
) -> Comparison:
    """Compare pipeline runs: the given ids, else the ``last`` (default 2) in ``experiment`` (or any).

    The table is one ``mlflow.search_runs`` query: a pipeline run carries its params and, mirrored
    from its evaluation runs, every ``<stage>/<metric>``. Pipeline runs are recognised by their
    ``posttrain.role=pipeline`` tag, so stage runs never show up as candidates. The reward curves
    for the plot take one more search (the GRPO stage runs of all compared runs) and one metric
    history per GRPO stage run. ``tracking_uri`` defaults like
    :func:`posttrain.tracking.resolve_tracking_uri`.
    """
    uri = tracking_uri or resolve_tracking_uri(TrackingConfig())
    run_ids = [r.lower() for r in run_ids]  # MLflow writes them in lower case
    if malformed := [r for r in run_ids if not _RUN_ID.fullmatch(r)]:
        raise TrackingError(f"{malformed[0]!r} is not an MLflow run id (32 hexadecimal characters)")
    client = mlflow_client(uri)
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise TrackingError(f"no MLflow experiment named {experiment!r} at {redact_text(uri)}")
        ids = [found.experiment_id]
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    if run_ids:
        quoted = ", ".join(f"'{r}'" for r in run_ids)
        query, limit = f"attributes.run_id IN ({quoted})", len(run_ids)
        if experiment is None:
            ids = [e.experiment_id for e in client.search_experiments(view_type=_ALL)]
    else:
        query, limit = f"tags.`{ROLE_TAG}` = 'pipeline'", last or 2
    frame = _search_runs(uri, ids, query, limit)
    rows = frame.to_dict("records")
    if run_ids:
        by_id = {row["run_id"]: row for row in rows}
        missing = [r for r in run_ids if r not in by_id]
        if missing:
            raise TrackingError(f"no MLflow run {missing[0]!r} at {redact_text(uri)}")
        rows = [by_id[r] for r in run_ids]
        if others := [r for r in rows if r.get(f"tags.{ROLE_TAG}") != "pipeline"]:
            parent = others[0].get("tags.mlflow.parentRunId")
            what = (
                f"a step's run; its pipeline run is {parent}"
                if isinstance(parent, str)
                else "not posttrain's"
            )
            raise TrackingError(f"run {others[0]['run_id']} is not a pipeline run ({what})")
    else:
        rows = rows[::-1]  # oldest first
    curves = _reward_curves(client, ids, rows)
    summaries = [_summarize(row, curves.get(row["run_id"], {})) for row in rows]
    keys = sorted({k for s in summaries for k in s.params})
    diffs = {k: vals for k in keys if len(set(vals := [s.params.get(k) for s in summaries])) > 1}
    metric_names = _ordered_metrics(summaries, rows)
    return Comparison(summaries, diffs, metric_names)


_RUN_ID = re.compile(r"[0-9a-f]{32}")
_ALL = 3  # mlflow.entities.ViewType.ALL: explicit run ids may sit in a deleted experiment


def _search_runs(uri: str, experiment_ids: Sequence[str], query: str, limit: int) -> Any:
    """``mlflow.search_runs`` against ``uri`` (the fluent API reads the global URI)."""
    import mlflow  # heavy: deferred until needed

    with global_tracking_uri(uri):
        return mlflow.search_runs(
            experiment_ids=list(experiment_ids),
            filter_string=query,
            max_results=limit,
            order_by=["attributes.start_time DESC"],
            output_format="pandas",
        )


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _timestamp(value: Any) -> datetime | None:
    if not _present(value):
        return None
    if hasattr(value, "to_pydatetime"):
        value = value.to_pydatetime()
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(float(value) / 1000, tz=timezone.utc)


def _summarize(row: Mapping[str, Any], curves: Mapping[str, list[tuple[int, float]]]) -> RunSummary:
    start, end = _timestamp(row.get("start_time")), _timestamp(row.get("end_time"))
    return RunSummary(
        run_id=row["run_id"],
        name=row.get("tags.mlflow.runName") or "",
        status=row.get("status") or "",
        start_time=start,
        duration_s=(end - start).total_seconds() if start and end else None,
        params={k[7:]: v for k, v in row.items() if k.startswith("params.") and _present(v)},
        stage_metrics={
            k[8:]: float(v) for k, v in row.items() if k.startswith("metrics.") and "/" in k and _present(v)
        },
        reward_curves={k: v for k, v in curves.items() if v},
        seed=_seed(row.get("params.seed")),
        seed_group=row.get(f"tags.{SEED_GROUP_TAG}") if _present(row.get(f"tags.{SEED_GROUP_TAG}")) else None,
    )


def _seed(value: Any) -> int | None:
    try:
        return int(value) if _present(value) else None
    except (TypeError, ValueError):
        return None


def _ordered_metrics(summaries: Sequence[RunSummary], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every ``<stage>/<metric>``, stages in the plan's order (the runs' ``posttrain.steps`` tags)."""
    steps = [str(row.get(f"tags.{STEPS_TAG}") or "") for row in rows]
    return in_plan_order({m for s in summaries for m in s.stage_metrics}, steps)


def in_plan_order(names: Iterable[str], steps_tags: Iterable[str]) -> list[str]:
    """``<stage>/<metric>`` names sorted by their stage's place in the runs' ``posttrain.steps`` tags
    (comma-separated step names, the first run's order first), then by name.

    >>> in_plan_order(["eval-sft/a", "eval-baseline/a", "eval-sft/a/ops_1"], ["eval-baseline,sft,eval-sft"])
    ['eval-baseline/a', 'eval-sft/a', 'eval-sft/a/ops_1']
    """
    order: dict[str, int] = {}
    for tag in steps_tags:
        for step in tag.split(","):
            if step:
                order.setdefault(step, len(order))
    # A metric's name has slashes of its own (accuracy_strict/gsm8k/ops_2); the stage is the first part.
    return sorted(set(names), key=lambda m: (order.get(m.split("/", 1)[0], len(order)), m))


def _reward_curves(
    client: Any, experiment_ids: Sequence[str], rows: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Pipeline run id → GRPO stage name → its ``reward`` history.

    MLflow's filter has no ``IN`` for tags, so the GRPO stage runs started since the oldest compared
    run are found in one search and matched to their parents here.
    """
    parents = {row["run_id"] for row in rows}
    starts = [s for row in rows if (s := _timestamp(row.get("start_time"))) is not None]
    if not parents:
        return {}
    since = f" AND attributes.start_time >= {int(min(starts).timestamp() * 1000)}" if starts else ""
    stages = client.search_runs(
        list(experiment_ids),
        f"tags.`{STEP_KIND_TAG}` = 'grpo'{since}",
        order_by=["attributes.start_time ASC"],
    )
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for stage in stages:
        parent = stage.data.tags.get("mlflow.parentRunId")
        if parent in parents:
            history = client.get_metric_history(stage.info.run_id, "reward")
            curves.setdefault(parent, {})[stage.info.run_name] = [(m.step, m.value) for m in history]
    return curves


def cell_text(cell: Any) -> Any:
    """Chat messages (lists of role/content dicts, numpy arrays from parquet) as readable text.

    TRL's completion tables hold conversations; MLflow's table viewer shows them as raw JSON.
    """
    if hasattr(cell, "tolist"):
        cell = cell.tolist()
    if isinstance(cell, Mapping):
        cell = [cell]
    if isinstance(cell, list) and cell and all(isinstance(m, Mapping) for m in cell):
        if len(cell) == 1:
            return str(cell[0].get("content", ""))
        return "\n\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in cell)
    return cell if isinstance(cell, str | int | float | bool) or cell is None else str(cell)


def last_user_text(cell: Any) -> str | None:
    """The last user message of a conversation cell (the question, which in the table's prompt column
    comes after the same long system prompt on every row), or None for a plain-text prompt.

    >>> last_user_text([{"role": "system", "content": "fmt"}, {"role": "user", "content": "1+1?"}])
    '1+1?'
    >>> last_user_text("1+1?") is None
    True
    """
    if hasattr(cell, "tolist"):
        cell = cell.tolist()
    if not isinstance(cell, list):
        return None
    users = [m for m in cell if isinstance(m, Mapping) and m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else None


# --------------------------------------------------------------------------- figures


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, list[Any]]:
    from matplotlib.figure import Figure  # heavy: deferred until needed

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def is_curve_metric(key: str) -> bool:
    """Whether a stage's metric belongs on its curve plot: ``reward``, each ``rewards/<fn>/mean``, and
    ``eval/accuracy`` (the in-training held-out evaluation), so reward hacking shows as curves parting.

    >>> [k for k in ("reward", "rewards/correctness/mean", "rewards/correctness/std", "eval/accuracy",
    ...              "eval/format", "loss") if is_curve_metric(k)]
    ['reward', 'rewards/correctness/mean', 'eval/accuracy']
    """
    return key in ("reward", "eval/accuracy") or (key.startswith("rewards/") and key.endswith("/mean"))


def reward_series(
    history: Sequence[Mapping[str, Any]], step_key: str = "step"
) -> dict[str, list[tuple[int, float]]]:
    """The :func:`is_curve_metric` series from trainer log dicts; steps without them are skipped.

    TRL logs rewards only on steps that generate, and the evaluation runs every N steps, so the series
    may be sparse.
    """
    curves: dict[str, list[tuple[int, float]]] = {}
    for index, row in enumerate(history):
        for key, value in row.items():
            if is_curve_metric(key) and isinstance(value, int | float) and not isinstance(value, bool):
                curves.setdefault(key, []).append((int(row.get(step_key, index)), float(value)))
    return dict(sorted(curves.items()))


def _draw_curves(ax: Any, curves: Curves, bold: str | None = None) -> None:
    for label, points in curves.items():
        if points:
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(
                steps,
                values,
                marker="o" if len(points) < 30 else None,
                markersize=3,
                linewidth=2.5 if label == bold else 1.2,
                label=label,
            )
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers


def reward_curves_figure(curves: Curves, title: str = "rewards") -> Figure:
    """One line per reward function (``rewards/<fn>/mean``) plus the weighted total ``reward`` in bold,
    and the in-training held-out ``eval/accuracy`` when the stage evaluated (same 0-1 axis)."""
    fig, (ax,) = _figure(7, 4)
    _draw_curves(ax, curves, bold="reward")
    ylabel = "mean reward / accuracy" if "eval/accuracy" in curves else "mean reward"
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def pass_rate_figure(histogram: Sequence[int], band: tuple[float, float], title: str) -> Figure:
    """Bars of prompts by correct completions out of k (``histogram[i]``: prompts with i correct), the
    kept ones (pass rate strictly inside ``band``) in colour, the dropped ones grey."""
    k = len(histogram) - 1
    fig, (ax,) = _figure(6, 3.5)
    kept = [band[0] < i / k < band[1] for i in range(k + 1)]  # PassRateConfig.keeps, per bar
    bars = ax.bar(range(k + 1), histogram, color=["tab:blue" if keep else "lightgrey" for keep in kept])
    ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(k + 1), [f"{i}/{k}" for i in range(k + 1)])
    ax.set(title=title, xlabel="correct completions", ylabel="prompts")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _grouped_bars(ax: Any, groups: Sequence[str], series: Mapping[str, Sequence[float | None]]) -> None:
    """Bars per group (x) and series (colour); a missing value leaves a gap."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [math.nan if v is None else v for v in values]
        bars = ax.bar(xs, heights, width=width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.grid(axis="y", alpha=0.3)


def accuracy_by_stage_figure(per_stage: Mapping[str, Mapping[str, float]]) -> Figure:
    """Grouped bars: x = evaluation stage (in run order), one bar per metric (e.g. accuracy_strict)."""
    stages = list(per_stage)
    metrics = list(dict.fromkeys(m for values in per_stage.values() for m in values))
    fig, (ax,) = _figure(max(5.0, 1.2 * len(stages) + 3), 4)
    _grouped_bars(ax, stages, {m: [per_stage[s].get(m) for s in stages] for m in metrics})
    ax.set(title="accuracy by stage", ylabel="value", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    return fig


def _short(run_id: str, name: str) -> str:
    return f"{name} ({run_id[:8]})"


def plot_comparison(
    comparison: Comparison, png_path: str | Path, accuracy_metric: str = "accuracy_strict"
) -> Path:
    """Reward curves of every GRPO stage (one line per run and stage) and accuracy by stage.

    ``accuracy_metric`` picks the evaluation metric for the bars; when no run has it, the first
    metric containing "accuracy" is used.
    """
    fig, (left, right) = _figure(13, 4.5, ncols=2)
    curves = {
        f"{_short(r.run_id, r.name)} {stage}": points
        for r in comparison.runs
        for stage, points in r.reward_curves.items()
    }
    _draw_curves(left, curves)
    left.set(title="reward by GRPO step", xlabel="step", ylabel="reward")
    left.grid(alpha=0.3)
    if curves:
        left.legend(fontsize=7)
    else:
        left.text(0.5, 0.5, "no GRPO reward history", ha="center", va="center", transform=left.transAxes)

    names = comparison.metric_names
    metric = (
        accuracy_metric
        if any(m.split("/", 1)[-1] == accuracy_metric for m in names)
        else next((m.split("/", 1)[1] for m in names if "accuracy" in m), accuracy_metric)
    )
    stages = [stage for m in names if (stage := m.split("/", 1)[0]) and m == f"{stage}/{metric}"]
    _grouped_bars(
        right,
        stages,
        {
            _short(r.run_id, r.name): [r.stage_metrics.get(f"{s}/{metric}") for s in stages]
            for r in comparison.runs
        },
    )
    right.set(title=f"{metric} by stage", ylabel=metric, ylim=(0, 1.05))
    if comparison.runs:
        right.legend(fontsize=7)
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _cell(value: Any, width: int = 32) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif hasattr(value, "strftime"):
        text = value.strftime("%Y-%m-%d %H:%M")
    else:
        text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_comparison(comparison: Comparison, *, show_all: bool = False) -> str:
    """A side-by-side text table, one column per run: attributes, config differences, the headline
    (accuracies and format with their 95 % intervals, and each stage's paired change; see
    :mod:`posttrain.tracking.headline`), the other metrics with ``show_all``, then, for runs that
    differ only in their seed, the numbers across seeds."""
    runs = comparison.runs
    if not runs:
        return "no runs to compare"
    rows: list[tuple[str, list[Any]]] = [
        ("run id", [r.run_id[:12] for r in runs]),
        ("name", [r.name for r in runs]),
        ("status", [r.status for r in runs]),
        ("start", [r.start_time for r in runs]),
        ("duration (s)", [None if r.duration_s is None else round(r.duration_s, 1) for r in runs]),
    ]
    counters = counter_names(comparison.metric_names)
    headline = format_headline([r.stage_metrics for r in runs], comparison.metric_names)
    sections: list[tuple[str, list[tuple[str, list[Any]]]]] = [
        ("config differences", list(comparison.param_diffs.items())),
        (
            "evaluation by stage [95% intervals; changes in points, paired on the same questions; "
            "* excludes 0]",
            [(label, list(cells)) for label, cells in headline],
        ),
    ]
    if show_all:
        sections.append(("other metrics", [(m, [r.stage_metrics.get(m) for r in runs]) for m in counters]))
    label_width = max([len(k) for k, _ in rows] + [len(k) for _, items in sections for k, _ in items])
    label_width = min(label_width, 60)
    cells = [[_cell(v) for v in values] for _, values in rows] + [
        [_cell(v) for v in values] for _, items in sections for _, values in items
    ]
    widths = [max([len(c[i]) for c in cells] + [4]) for i in range(len(runs))]

    def line(label: str, values: Sequence[Any]) -> str:
        texts = [_cell(v).ljust(w) for v, w in zip(values, widths, strict=True)]
        return "  ".join([_cell(label, label_width).ljust(label_width), *texts]).rstrip()

    out = [line(label, values) for label, values in rows]
    for title, items in sections:
        out.append("")
        out.append(f"{title}:" if items else f"{title}: none")
        out += [line(key, values) for key, values in items]
    if counters and not show_all:
        out += ["", f"{len(counters)} more metrics per run (decode steps, timings, per difficulty...): --all"]
    out += format_seed_groups(
        comparison.seed_groups(), comparison.metric_names, repeated_seeds(comparison.seed_runs())
    )
    return "\n".join(out)
