"""Supervised fine-tuning on GSM8K worked solutions rewritten into the trained XML format.

SFT comes first because GRPO cannot invent a format it never produces: from an untrained small
model every completion scores 0 on the format rewards and GRPO gets no gradient at all (see
training/health.py). A few dozen steps of SFT make the ``<reasoning>``/``<answer>`` layout
reachable, so later stages have differences between completions to learn from.

Data is prompt/completion in chat form, so TRL computes the loss on the completion only (the
model is not taught to reproduce the system prompt and the question).

With ``eval_every`` the stage answers a slice of the selection (else held-out) records greedily as
it trains, and with ``keep: best`` its output is the checkpoint that answered best
(:mod:`posttrain.training.selection`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.core.config import ModelConfig, SFTStageConfig
from posttrain.core.errors import StageError
from posttrain.core.keep_best import selection_trainer_options
from posttrain.core.results import StageResult
from posttrain.data.builders import build_sft_dataset
from posttrain.models.artifacts import write_train_data
from posttrain.training import distributed
from posttrain.training.selection import (
    attach_evaluation,
    evaluation_records,
    records_dataset,
    selection_record,
)
from posttrain.training.stage_run import (
    StageContext,
    TrainOutcome,
    execute_stage,
    load_policy,
    train_resumable,
    trainer_arguments,
)
from posttrain.training.trl_compat import carry_token_count, compact_fused_head_on_cpu

logger = logging.getLogger(__name__)

__all__ = ["make_sft_trainer", "run_sft", "sft_dataset"]


def sft_dataset(train_dataset: Any, limit: int | None = None, *, calculator: bool = False):
    """Prompt/completion conversational rows; prepared data (with ``solution``) is converted first,
    with each annotated step written for the inline calculator when ``calculator``."""
    ds = train_dataset
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    if "completion" not in ds.column_names:
        ds = build_sft_dataset(ds, calculator=calculator)
    extra = [c for c in ds.column_names if c not in ("prompt", "completion")]
    return ds.remove_columns(extra) if extra else ds


def make_sft_trainer(
    sft_cfg: SFTStageConfig,
    model_cfg: ModelConfig,
    model_path: str | Path,
    train_dataset: Any,
    ctx: StageContext,
    *,
    eval_dataset: Any = None,
    callbacks: Sequence[Any] = (),
    selection: Any = None,
    eval_max_new_tokens: int | None = None,
    stage: str = "sft",
):
    """The stage's ``SFTTrainer``, ready to ``train()``: ``(trainer, tokenizer, train rows)``
    (shared with benchmarks/sft_throughput.py, which measures it against TRL's defaults).

    ``selection`` (prepared records: the selection slice, else the held-out split) feeds the stage's
    ``eval_every`` evaluation, generating up to ``eval_max_new_tokens``."""
    from trl import SFTConfig, SFTTrainer  # heavy: deferred until needed

    from posttrain.training.console import quiet_console

    compact_fused_head_on_cpu()
    calculator = "calculator" in sft_cfg.tools
    data = sft_dataset(train_dataset, sft_cfg.limit, calculator=calculator)
    model, tokenizer, peft_config = load_policy(model_cfg, str(model_path))
    options = sft_cfg.trainer_options()
    best = selection_trainer_options("sft", sft_cfg.keep, sft_cfg.eval_every, sft_cfg.select_metric, options)
    args = SFTConfig(**trainer_arguments(ctx, {**options, **best}))
    records = _evaluation_records(sft_cfg, selection)
    if records is not None and sft_cfg.keep == "best" and eval_dataset is None:
        eval_dataset = records_dataset(records)  # the trainer needs one to evaluate on a schedule
    eval_data = sft_dataset(eval_dataset, calculator=calculator) if eval_dataset is not None else None
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=list(callbacks),
    )
    quiet_console(trainer)
    if records is not None:
        attach_evaluation(trainer, sft_cfg, records, stage=stage, max_new_tokens=eval_max_new_tokens)
    return trainer, tokenizer, data


def _evaluation_records(sft_cfg: SFTStageConfig, selection: Any) -> list[dict[str, Any]] | None:
    if sft_cfg.eval_every is None:
        return None
    if selection is None:
        if sft_cfg.keep == "best":
            raise StageError("sft: keep: best needs the selection slice (data.selection_size)")
        logger.warning("[sft] eval_every is set but no evaluation records were given: not evaluating")
        return None
    return evaluation_records(selection, sft_cfg.eval_limit)


def run_sft(
    sft_cfg: SFTStageConfig,
    model_cfg: ModelConfig,
    model_path: str | Path,
    train_dataset: Any,
    output_dir: str | Path,
    *,
    seed: int = 0,
    report_to: str | list[str] = "none",
    eval_dataset: Any = None,
    selection: Any = None,
    eval_max_new_tokens: int | None = None,
    stage: str = "sft",
    kind: str = "sft",
    metrics: Mapping[str, Any] | None = None,
    recorded_cfg: Any = None,
    keep_data: bool = False,
) -> StageResult:
    """Fine-tune ``model_path`` on ``train_dataset`` (prepared data or prompt/completion rows).

    ``sft_cfg.limit`` keeps the first N examples; TRL options come from
    ``sft_cfg.trainer_options()``. ``selection`` is what ``eval_every`` evaluates (and ``keep: best``
    chooses by). ``stage`` and ``kind`` name the step that fine-tunes (an ``rft-<name>`` stage runs
    here too), ``metrics`` joins its result's, and ``recorded_cfg`` is the section ``stage.json``
    keeps (default ``sft_cfg``: an ``rft:`` stage keeps its whole stage, scoring and replay included).
    ``keep_data`` keeps ``train_dataset``'s rows beside the policy (``train_data.jsonl``), for data
    that exists nowhere else in the store.
    Returns the stage summary; the policy is in ``output_dir``.
    """
    options = sft_cfg.trainer_options()

    def train(ctx: StageContext) -> TrainOutcome:
        if keep_data and distributed.is_main_process():  # the output copies the working folder's files
            write_train_data(ctx.work_dir, train_dataset)
        trainer, tokenizer, data = make_sft_trainer(
            sft_cfg,
            model_cfg,
            model_path,
            train_dataset,
            ctx,
            eval_dataset=eval_dataset,
            selection=selection,
            eval_max_new_tokens=eval_max_new_tokens,
            stage=stage,
        )
        carry_token_count(trainer, ctx.resume_from)
        output = train_resumable(trainer, ctx)
        return TrainOutcome.from_trainer(
            trainer,
            output,
            tokenizer,
            metrics={"train_examples": len(data), **(metrics or {})},
            selection=selection_record(sft_cfg, trainer),
        )

    return execute_stage(
        stage=stage,
        kind=kind,
        stage_cfg=recorded_cfg if recorded_cfg is not None else sft_cfg,
        model_cfg=model_cfg,
        model_path=model_path,
        train_dataset=train_dataset,
        output_dir=output_dir,
        seed=seed,
        report_to=report_to,
        options=options,
        train_fn=train,
    )
