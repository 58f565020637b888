"""What ``posttrain compare`` shows first: the headline numbers with their intervals, stage to stage
and across seeds. Pure functions on the ``<stage>/<metric>`` values a pipeline run carries.

**Headline.** Per evaluation step (``eval-<stage>``) and evaluation set: strict and flexible
accuracy and the strict-format rate, each with its 95 % Wilson interval; below each, the change
from the evaluation before it in the run, with the paired interval the run logged (Newcombe's
paired score interval on the same questions, :func:`posttrain.evaluation.diff.stage_delta_metrics`)
and a ``*`` where that interval excludes zero; below the strict change, the minutes of training
and scoring it was bought with and the points per minute. Every other number (decode steps, load seconds,
tool calls, per-difficulty slices, in-training evaluations) is a counter, shown with ``--all``.

**Across seeds.** Runs of one config that differ only in ``seed`` share the tag
``posttrain.seed_group``. For each group with two or more seeds: per stage, set and metric, the
mean over the seeds, their standard deviation and range, and a Student t interval over the seeds'
values (:func:`posttrain.core.stats.t_interval`); the stage-to-stage change is taken within each
seed, then summarised the same way, marked ``*`` when its interval over seeds excludes zero. That
is the interval a claim "stage X improves on Y" needs: it includes the training noise a single
run's question-level interval cannot see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from posttrain.core.metric_names import interval_names, parse_metric_name
from posttrain.core.stats import Interval, format_percent, t_interval

__all__ = [
    "HEADLINE_METRICS",
    "STAGE_MINUTES",
    "SeedRun",
    "counter_names",
    "format_headline",
    "format_seed_groups",
    "headline_keys",
    "repeated_seeds",
    "seed_groups",
]

HEADLINE_METRICS = ("accuracy_strict", "accuracy_flexible", "strict_format_rate")
_LABELS = {"accuracy_strict": "strict", "accuracy_flexible": "flexible", "strict_format_rate": "format"}
_DELTA_PARTS = ("delta_", "fixed_", "broken_", "mcnemar_p_")
SIGNIFICANT = "*"
"""Marks a change whose 95 % interval excludes zero."""


def _split(name: str) -> tuple[str, str, str | None, int | None]:
    """``eval-sft/accuracy_strict/gsm8k`` → (stage, metric, set, ops)."""
    stage, _, rest = name.partition("/")
    metric, eval_set, ops = parse_metric_name(rest)
    return stage, metric, eval_set, ops


STAGE_MINUTES = "stage_minutes"
"""``eval-<stage>/stage_minutes``: wall time of the training and scoring steps the change was bought with."""


def _is_headline(name: str) -> bool:
    stage, metric, _, ops = _split(name)
    if not stage.startswith("eval-") or ops is not None:
        return False
    if metric == STAGE_MINUTES:
        return True
    for base in HEADLINE_METRICS:
        family = {base, *interval_names(base)}
        family |= {f"{part}{base}" for part in _DELTA_PARTS} | set(interval_names(f"delta_{base}"))
        if metric in family:
            return True
    return False


def counter_names(names: Sequence[str]) -> list[str]:
    """The metrics that are not headline numbers (``--all`` shows them), in the given order.

    >>> counter_names(["eval-sft/accuracy_strict", "eval-sft/accuracy_strict_ci_low", "eval-sft/seconds",
    ...                "eval-sft/accuracy_strict/ops_1", "grpo-x/accuracy", "eval-sft/delta_accuracy_strict"])
    ['eval-sft/seconds', 'eval-sft/accuracy_strict/ops_1', 'grpo-x/accuracy']
    """
    return [name for name in names if not _is_headline(name)]


def headline_keys(names: Sequence[str]) -> list[tuple[str, str | None]]:
    """(evaluation step, set) pairs that have headline numbers, steps in the given order, the primary
    set (None) first.

    >>> headline_keys(["eval-baseline/accuracy_strict", "eval-baseline/accuracy_strict/gsm8k",
    ...                "eval-sft/seconds", "eval-sft/accuracy_strict"])
    [('eval-baseline', None), ('eval-baseline', 'gsm8k'), ('eval-sft', None)]
    """
    keys: dict[tuple[str, str | None], None] = {}
    for name in names:
        stage, metric, eval_set, ops = _split(name)
        if stage.startswith("eval-") and ops is None and metric in HEADLINE_METRICS:
            keys[(stage, eval_set)] = None
    order = list(dict.fromkeys(stage for stage, _ in keys))
    return sorted(keys, key=lambda k: (order.index(k[0]), k[1] is not None))


def _name(stage: str, metric: str, eval_set: str | None) -> str:
    return f"{stage}/{metric}" + (f"/{eval_set}" if eval_set else "")


def _value_cell(metrics: Mapping[str, float], stage: str, metric: str, eval_set: str | None) -> str:
    value = metrics.get(_name(stage, metric, eval_set))
    if value is None:
        return "-"
    low, high = (metrics.get(_name(stage, bound, eval_set)) for bound in interval_names(metric))
    return format_percent(value, low, high)


def _delta_cell(metrics: Mapping[str, float], stage: str, metric: str, eval_set: str | None) -> str | None:
    """The paired change the run logged for this stage (None when it logged none)."""
    delta = metrics.get(_name(stage, f"delta_{metric}", eval_set))
    if delta is None:
        return None
    low, high = (metrics.get(_name(stage, bound, eval_set)) for bound in interval_names(f"delta_{metric}"))
    if low is None or high is None:
        return f"{100 * delta:+.1f}"
    change = Interval(delta, low, high, "paired")
    return change.points() + (f" {SIGNIFICANT}" if change.excludes(0) else "")


def _previous(
    keys: Sequence[tuple[str, str | None]], index: int, metrics: Mapping[str, float] | None = None
) -> str | None:
    """The evaluation before ``keys[index]`` on the same set: among every compared run's steps, or
    (``metrics``) among those one run evaluated, which its logged change was measured from."""
    stage, eval_set = keys[index]
    earlier = [
        s
        for s, e in keys[:index]
        if e == eval_set and s != stage and (metrics is None or _name(s, "accuracy_strict", e) in metrics)
    ]
    return earlier[-1] if earlier else None


def format_headline(
    columns: Sequence[Mapping[str, float]], names: Sequence[str]
) -> list[tuple[str, list[str]]]:
    """Headline rows, one cell per run (``columns``: each run's ``<stage>/<metric>`` values):
    each metric with its interval, and under it the change from the evaluation before it."""
    keys = headline_keys(names)
    rows: list[tuple[str, list[str]]] = []
    for index, (stage, eval_set) in enumerate(keys):
        where = stage + (f" [{eval_set}]" if eval_set else "")
        previous = _previous(keys, index)
        for metric in HEADLINE_METRICS:
            values = [_value_cell(m, stage, metric, eval_set) for m in columns]
            if all(v == "-" for v in values):
                continue
            rows.append((f"{where} {_LABELS[metric]}", values))
            deltas = [_delta_cell(m, stage, metric, eval_set) for m in columns]
            if previous is not None and any(d is not None for d in deltas):
                # A run without the step before (another stage list) measured its change from its
                # own previous evaluation: the row names the one most of its runs measured from,
                # and a cell measured from another says which.
                owns = [
                    _previous(keys, index, m) if d is not None else None
                    for m, d in zip(columns, deltas, strict=True)
                ]
                measured = [own for own in owns if own is not None]
                if measured and previous not in measured:
                    previous = max(measured, key=measured.count)
                label = f"  change from {previous.removeprefix('eval-')}"
                for i, own in enumerate(owns):
                    if deltas[i] is not None and own not in (None, previous):
                        deltas[i] = f"{deltas[i]} (from {own.removeprefix('eval-')})"
                rows.append((label, [d or "-" for d in deltas]))
                if metric == "accuracy_strict" and eval_set is None:
                    costs = [_cost_cell(m, stage) for m in columns]
                    if any(c != "-" for c in costs):
                        rows.append(("  bought with", costs))
    return rows


def _cost_cell(metrics: Mapping[str, float], stage: str) -> str:
    """``12.5 min, +0.40 points/min``: what the stage's strict change cost ("-" when not logged).

    >>> _cost_cell({"eval-x/stage_minutes": 12.5, "eval-x/delta_accuracy_strict": 0.05}, "eval-x")
    '12.5 min, +0.40 points/min'
    """
    minutes = metrics.get(f"{stage}/{STAGE_MINUTES}")
    if minutes is None:
        return "-"
    delta = metrics.get(f"{stage}/delta_accuracy_strict")
    if delta is None or minutes <= 0:
        return f"{minutes:.1f} min"
    return f"{minutes:.1f} min, {100 * delta / minutes:+.2f} points/min"


# --------------------------------------------------------------------------- across seeds


@dataclass(frozen=True)
class SeedRun:
    """One pipeline run of a seed group: its seed and its ``<stage>/<metric>`` values."""

    run_id: str
    seed: int
    metrics: Mapping[str, float]


def seed_groups(runs: Sequence[tuple[str | None, SeedRun]]) -> dict[str, list[SeedRun]]:
    """Runs by seed group (runs without one are left out), one run per seed (the last given wins:
    a rerun of a seed is the same measurement again), groups with fewer than two seeds dropped.

    >>> runs = [("g", SeedRun("a", 0, {})), ("g", SeedRun("b", 1, {})), ("g", SeedRun("c", 1, {})),
    ...         ("h", SeedRun("d", 0, {})), (None, SeedRun("e", 2, {}))]
    >>> {g: [r.run_id for r in rs] for g, rs in seed_groups(runs).items()}
    {'g': ['a', 'c']}
    """
    groups: dict[str, dict[int, SeedRun]] = {}
    for group, run in runs:
        if group:
            groups.setdefault(group, {})[run.seed] = run
    return {
        group: [by_seed[s] for s in sorted(by_seed)] for group, by_seed in groups.items() if len(by_seed) >= 2
    }


def _spread(values: Sequence[float], points: bool) -> list[str]:
    """mean, sd, min-max, interval over seeds (percent, or percentage points for changes)."""
    interval = t_interval(values)
    scale = 100.0
    fmt = "{:+.1f}" if points else "{:.1f}"
    sd = (sum((v - interval.estimate) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    mark = f" {SIGNIFICANT}" if points and interval.excludes(0) else ""
    bounds = f"[{fmt.format(scale * interval.low)}, {fmt.format(scale * interval.high)}]{mark}"
    if max(values) == min(values):
        # every seed gave the same value: a t interval of zero width, which claims a certainty a
        # few seeds cannot give (accuracies on a few hundred questions often repeat exactly)
        bounds = "- (no spread)"
    return [
        fmt.format(scale * interval.estimate) + ("" if points else "%"),
        f"{scale * sd:.1f}",
        f"{fmt.format(scale * min(values))} to {fmt.format(scale * max(values))}",
        bounds,
    ]


def _seed_value(run: SeedRun, stage: str, metric: str, eval_set: str | None) -> float | None:
    return run.metrics.get(_name(stage, metric, eval_set))


def _seed_delta(run: SeedRun, stage: str, previous: str, metric: str, eval_set: str | None) -> float | None:
    """This seed's change from ``previous`` to ``stage``: the paired one it logged, else the difference."""
    logged = run.metrics.get(_name(stage, f"delta_{metric}", eval_set))
    if logged is not None:
        return logged
    after, before = _seed_value(run, stage, metric, eval_set), _seed_value(run, previous, metric, eval_set)
    return None if after is None or before is None else after - before


def repeated_seeds(runs: Sequence[tuple[str | None, SeedRun]]) -> dict[str, list[str]]:
    """Per seed group, the runs :func:`seed_groups` leaves out because a run given after them has
    the same seed, as ``seed S: <left out> (used: <kept>)`` with 12-character run ids.

    >>> runs = [("g", SeedRun("a" * 16, 0, {})), ("g", SeedRun("b" * 16, 1, {})), ("g", SeedRun("c" * 16, 1, {}))]
    >>> repeated_seeds(runs)
    {'g': ['seed 1: bbbbbbbbbbbb (used: cccccccccccc)']}
    """
    # seed_groups' rule decides which run of a seed is used
    used = {group: {r.seed: r.run_id for r in rs} for group, rs in seed_groups(runs).items()}
    out: dict[str, list[str]] = {}
    for group, run in runs:
        kept = used.get(group or "", {}).get(run.seed)
        if kept is not None and kept != run.run_id:
            out.setdefault(group or "", []).append(f"seed {run.seed}: {run.run_id[:12]} (used: {kept[:12]})")
    return out


def format_seed_groups(
    groups: Mapping[str, Sequence[SeedRun]],
    names: Sequence[str],
    repeated: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """Text lines: per seed group, per headline stage, set and metric, the seeds' mean, sd, range and
    95 % t interval, and the same for each stage's change (``*``: its interval excludes zero).
    ``repeated``: the runs left out of a group for a rerun of their seed (:func:`repeated_seeds`),
    named under its title so that a dropped run is never a silent one."""
    lines: list[str] = []
    keys = headline_keys(names)
    for group, runs in groups.items():
        seeds = ", ".join(str(r.seed) for r in runs)
        lines += [
            "",
            f"across seeds: group {group} (seeds {seeds}): mean, sd, range and 95% t interval over the "
            f"{len(runs)} seeds ({SIGNIFICANT}: a change whose interval excludes 0)",
        ]
        if left_out := (repeated or {}).get(group):
            lines.append(f"  one run per seed, the last given; left out: {'; '.join(left_out)}")
        table: list[list[str]] = [["stage", "metric", "mean", "sd", "range", "95% CI over seeds"]]
        for index, (stage, eval_set) in enumerate(keys):
            where = stage + (f" [{eval_set}]" if eval_set else "")
            previous = _previous(keys, index)
            for metric in HEADLINE_METRICS:
                values = [v for r in runs if (v := _seed_value(r, stage, metric, eval_set)) is not None]
                if len(values) >= 2:
                    table.append([where, _LABELS[metric], *_spread(values, points=False)])
                if previous is None:
                    continue
                changes = [
                    d for r in runs if (d := _seed_delta(r, stage, previous, metric, eval_set)) is not None
                ]
                if len(changes) >= 2:
                    label = f"  change from {previous.removeprefix('eval-')}"
                    table.append([label, _LABELS[metric], *_spread(changes, points=True)])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines += [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table
        ]
    return lines
