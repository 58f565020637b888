"""The trainer side of ``keep: best`` and of the in-training evaluation of SFT, DPO and GRPO stages.

:func:`attach_evaluation` adds a stage's :class:`~posttrain.training.eval_callback.HeldoutEval` to its
trainer. With ``keep: best`` (:mod:`posttrain.core.keep_best`) it also becomes the trainer's
``evaluate``, and transformers does the rest: ``eval_strategy``/``eval_steps`` decide when it runs,
``save_steps`` writes a checkpoint at each evaluation, ``_determine_best_metric`` remembers the best
(``state.best_metric``, ``state.best_global_step``, kept in every checkpoint's trainer state, so a
resumed stage still knows it), ``load_best_model_at_end`` loads that checkpoint's weights when
training ends, and ``EarlyStoppingCallback`` stops after ``patience`` evaluations without a new best.
Replacing ``evaluate`` is the override point transformers documents for custom evaluation; its own
evaluation loop computes a loss on ``eval_dataset``, which says nothing about answering questions.

The trainer refuses ``eval_strategy`` without an ``eval_dataset`` (``Trainer.__init__``), which the
replaced ``evaluate`` never reads: :func:`eval_dataset_kwargs` passes the evaluated records in the
trainer's own row format (SFT and GRPO), and DPO, whose rows are preference pairs the slice does
not have, one of its own pairs.

:func:`selection_record` is what ``stage.json`` and MLflow keep: which step won, its score, every
evaluation's score, and whether the stage stopped early.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from posttrain.core.keep_best import SELECT_METRICS
from posttrain.training.eval_callback import HeldoutEval, heldout_slice

logger = logging.getLogger(__name__)

__all__ = [
    "attach_evaluation",
    "eval_dataset_kwargs",
    "evaluation_records",
    "records_dataset",
    "selection_record",
    "stage_evaluation",
]


class _NoFilter:
    min_ops = max_ops = None


def evaluation_records(source: Any, limit: int, data_filter: Any = None) -> list[dict[str, Any]]:
    """The first ``limit`` records of ``source`` (the selection slice, else the held-out split) in the
    stage's ``data_filter`` ops range (SFT and DPO have none)."""
    return heldout_slice(source, data_filter or _NoFilter(), limit)


def eval_dataset_kwargs(section: Any, rows: Any) -> dict[str, Any]:
    """``{"eval_dataset": rows}`` for a stage that keeps its best checkpoint (the trainer needs one
    to evaluate on a schedule; see the module docstring), else nothing."""
    return {"eval_dataset": rows} if section.keep == "best" else {}


def records_dataset(records: Sequence[Mapping[str, Any]]) -> Any:
    """``records`` as a ``datasets.Dataset`` (what a trainer takes as ``eval_dataset``)."""
    from datasets import Dataset  # heavy: deferred until needed

    return Dataset.from_list([dict(r) for r in records])


@dataclass(frozen=True)
class _InlineTools:
    """SFT's and DPO's ``tools`` (inline tools only) in the shape a GRPO stage's tool settings have."""

    tools: tuple[str, ...]
    tool_protocol: str = "inline"
    environment_factory: str | None = None


def _tools_of(section: Any) -> Any:
    """The tool settings the stage's evaluation uses: the tools its generations use."""
    if hasattr(section, "tool_protocol"):
        return section
    tools = tuple(getattr(section, "tools", ()))
    return _InlineTools(tools) if tools else None


def attach_evaluation(
    trainer: Any,
    section: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    stage: str,
    max_new_tokens: int | None = None,
) -> HeldoutEval:
    """Evaluate ``trainer``'s policy on ``records`` at the start and every ``section.eval_every``
    steps; with ``keep: best`` on the trainer's own schedule, as its ``evaluate``, with early stopping
    after ``section.patience`` evaluations without a new best."""
    best = section.keep == "best"
    evaluation = HeldoutEval(
        trainer,
        records,
        section.eval_every,
        stage,
        tools=_tools_of(section),
        max_new_tokens=max_new_tokens,
        scheduled=not best,
    )
    trainer.add_callback(evaluation)
    if best:
        trainer.evaluate = evaluation.evaluate
        if section.patience is not None:
            trainer.add_callback(_resumable_early_stopping()(early_stopping_patience=section.patience))
    return evaluation


@cache
def _resumable_early_stopping() -> type:
    """transformers' ``EarlyStoppingCallback`` that takes back its count of evaluations without a new
    best from the checkpoint it resumes from. The count is saved in every checkpoint, but transformers
    restores it only with ``restore_callback_states_from_checkpoint``, which is off by default, so a
    stage killed one evaluation before its patience ran out would start counting again."""
    from transformers import EarlyStoppingCallback  # heavy: deferred until needed

    class ResumableEarlyStopping(EarlyStoppingCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            saved = (state.stateful_callbacks or {}).get(type(self).__name__)
            attributes = saved.get("attributes") if isinstance(saved, dict) else None
            count = (
                attributes.get("early_stopping_patience_counter") if isinstance(attributes, dict) else None
            )
            if state.global_step > 0 and type(count) is int and 0 <= count < self.early_stopping_patience:
                self.early_stopping_patience_counter = count

    return ResumableEarlyStopping


def stage_evaluation(trainer: Any) -> HeldoutEval | None:
    """The in-training evaluation :func:`attach_evaluation` gave ``trainer``, if any."""
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HeldoutEval)), None)


def selection_record(section: Any, trainer: Any) -> dict[str, Any] | None:
    """What ``keep: best`` chose, from the trainer's state: ``best_step`` and ``best_score``, the
    score of every evaluation (step 0, the stage's input, is shown but is not a candidate: it was
    never a checkpoint of this stage), whether the chosen one scored above that input
    (``beat_input``; a warning when not), the last step and whether training stopped early. None for
    ``keep: last``."""
    evaluation = stage_evaluation(trainer)
    if section.keep != "best" or evaluation is None:
        return None
    state = trainer.state
    key = SELECT_METRICS[section.select_metric]
    scores = [[int(row["step"]), float(row[key])] for row in state.log_history if key in row]
    if state.best_model_checkpoint is None:
        logger.warning("keep: best found no evaluated checkpoint; the stage's output is its last step")
    start = next((score for step, score in scores if step == 0), None)
    beat_input = None if start is None or state.best_metric is None else state.best_metric > start
    if beat_input is False and trainer.is_world_process_zero():  # every rank has the same record
        logger.warning(
            "[%s] keep: best: no checkpoint scored above the stage's input on the %d selection questions "
            "(%s %.3f at step 0, best %.3f at step %s): the slice saw no gain from this stage, and its "
            "output is the first checkpoint with the best score; raise data.selection_size to tell "
            "checkpoints apart (a GRPO stage with a data: source of its own can choose by a slice of "
            "that source: its data.selection_size), or use keep: last",
            evaluation.stage,
            len(evaluation.golds),
            section.select_metric,
            start,
            state.best_metric,
            state.best_global_step,
        )
    return {
        "keep": "best",
        "select_metric": section.select_metric,
        "best_step": state.best_global_step if state.best_model_checkpoint is not None else None,
        "best_score": state.best_metric,
        "beat_input": beat_input,
        "last_step": state.global_step,
        "max_steps": state.max_steps,
        "stopped_early": state.global_step < state.max_steps,
        "patience": section.patience,
        "questions": len(evaluation.golds),
        "scores": scores,
    }
