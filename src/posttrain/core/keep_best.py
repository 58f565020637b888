"""Keeping the best checkpoint of a stage: the config side (names, rules, the trainer options it sets).

A stage's reward keeps rising while its task accuracy can fall (reward hacking, over-training); a
16-step stage can end below its own 8-step self. With ``keep: best`` a stage evaluates its policy
on a *selection slice* every ``eval_every`` steps, keeps a checkpoint at each evaluation, and
outputs the one that scored highest on ``select_metric``; ``patience: N`` stops training after N
evaluations without improvement. The slice is ``data.selection_size`` training records set aside
before training (never trained on, decontaminated against every evaluation set), never the final
evaluation set: choosing on the numbers one reports would overstate the gain.

Among equal scores the first checkpoint wins (transformers needs a strict improvement), and the
stage's input (step 0) is evaluated but is not a candidate. So when the slice is too small or too
easy to separate checkpoints, every score ties and the output is the first checkpoint, not a better
one: the selection record says so (``beat_input: false``) and the stage logs a warning.

The machinery is transformers': ``eval_strategy``/``eval_steps``, ``save_steps`` at every
evaluation, ``load_best_model_at_end`` with ``metric_for_best_model``, and ``EarlyStoppingCallback``
(see :func:`selection_trainer_options` and :mod:`posttrain.training.selection`), so the best
checkpoint survives a kill and a resumed stage selects from every evaluation it made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "SELECTION_MANAGED_OPTIONS",
    "SELECT_METRICS",
    "SelectMetric",
    "check_selection",
    "selection_trainer_options",
]

SelectMetric = Literal["accuracy", "accuracy_flexible", "format"]
SELECT_METRICS: dict[str, str] = {
    "accuracy": "eval/accuracy",
    "accuracy_flexible": "eval/accuracy_flexible",
    "format": "eval/format",
}
"""``select_metric`` → the in-training evaluation's metric it reads (higher is better for all)."""

SELECTION_MANAGED_OPTIONS = (
    "eval_strategy",
    "eval_steps",
    "save_strategy",
    "save_steps",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
)
"""Trainer options ``keep: best`` sets itself (a stage that keeps its best may not set them)."""


def check_selection(
    keep: str, eval_every: int | None, patience: int | None, trainer: Mapping[str, Any]
) -> None:
    """Refuse a stage's selection settings that cannot work, naming the key (ValueError).

    >>> check_selection("best", None, None, {})
    Traceback (most recent call last):
    ...
    ValueError: keep: best needs eval_every (how often the selection slice is evaluated; each evaluation is a candidate checkpoint)
    >>> check_selection("last", 4, 2, {})
    Traceback (most recent call last):
    ...
    ValueError: patience stops a stage that keeps its best checkpoint: set keep: best
    """
    if keep == "best" and eval_every is None:
        raise ValueError(
            "keep: best needs eval_every (how often the selection slice is evaluated; each evaluation "
            "is a candidate checkpoint)"
        )
    if patience is not None and keep != "best":
        raise ValueError("patience stops a stage that keeps its best checkpoint: set keep: best")
    if keep == "best":
        for key in SELECTION_MANAGED_OPTIONS:
            if key in trainer:
                raise ValueError(
                    f"trainer.{key}: keep: best sets it (an evaluation and a checkpoint every eval_every "
                    "steps, the best one loaded at the end); remove it"
                )


def selection_trainer_options(
    kind: str, keep: str, eval_every: int | None, select_metric: str, options: Mapping[str, Any]
) -> dict[str, Any]:
    """The TRL/transformers options that make a stage keep its best checkpoint ({} for ``keep: last``).

    An evaluation and a checkpoint every ``eval_every`` steps (and at the last step); the checkpoint
    that scored highest on ``eval_<metric>`` is loaded at the end (ties keep the earlier one). At
    least two checkpoints are kept, the best and the newest: with one, the trainer deletes the newest
    when training ends, and a kill before the output is written would resume from the best, and
    train its later steps again. GRPO checks its evaluation batch against ``num_generations`` even
    though posttrain's evaluation does not use it, so the batch is set to one group.

    >>> selection_trainer_options("sft", "best", 4, "accuracy", {})["metric_for_best_model"]
    'eval_accuracy'
    >>> selection_trainer_options("grpo", "best", 4, "format", {"num_generations": 6})["per_device_eval_batch_size"]
    6
    >>> selection_trainer_options("grpo", "last", 4, "accuracy", {})
    {}
    """
    if keep != "best":
        return {}
    assert eval_every is not None, "check_selection refuses keep: best without eval_every"
    out: dict[str, Any] = {
        "eval_strategy": "steps",
        "eval_steps": eval_every,
        "save_strategy": "steps",
        "save_steps": eval_every,
        "load_best_model_at_end": True,
        "metric_for_best_model": "eval_" + SELECT_METRICS[select_metric].removeprefix("eval/"),
        "greater_is_better": True,
    }
    limit = options.get("save_total_limit")
    if limit is not None:
        out["save_total_limit"] = max(2, int(limit))
    if kind == "grpo":
        out["per_device_eval_batch_size"] = options.get("num_generations_eval") or options.get(
            "num_generations", 8
        )
    return out
