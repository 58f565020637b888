"""Plumbing shared by every stage: hardware checks, precision flags, policy loading, atomic saving.

Each stage module (sft, dpo, grpo) only builds its dataset and its TRL trainer; :func:`execute_stage`
wraps that in the same sequence everywhere, so every output directory is written the same way:

1. check the hardware the config asks for (before loading anything, so a GPU-only config fails in
   a second on a laptop);
2. fingerprint the input model and data (the lineage recorded in ``stage.json``);
3. train in the stage's durable working folder ``<output>.ckpt/``
   (:func:`posttrain.core.atomic.checkpoints_dir`), where the trainer writes its checkpoints;
   when that folder holds a complete checkpoint from a run that was killed or failed, training
   resumes from it through the trainer's own ``train(resume_from_checkpoint=...)``;
4. save the policy per ``model.adapter_policy``, the log history, ``stage.json`` and the result
   into a temporary directory (see :func:`posttrain.core.atomic.staging_dir`), rename it into
   place, then delete the checkpoints.

Resuming is the trainer's: it restores the weights, the optimizer, the scheduler, the gradient
scaler, the RNG states and the trainer state (step, log history, stateful callbacks), and skips the
batches already trained on, so a resumed stage ends at the configured step count having seen the
same data in the same order. Checkpoints are written every ``save_steps``
(``TRAINER_DEFAULTS``: a tenth of the stage, the last one kept) and never enter a cache key or an
output fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.atomic import RESULT_FILE, checkpoints_dir, staging_dir, write_result
from posttrain.core.config import ModelConfig
from posttrain.core.errors import StageError
from posttrain.core.hashing import stable_hash
from posttrain.core.results import StageResult
from posttrain.models.artifacts import (
    adapter_root,
    fingerprint_dataset,
    fingerprint_dir,
    fingerprint_model,
    save_policy,
    write_log_history,
    write_stage_json,
)
from posttrain.models.hardware import check_hardware, cuda_available, resolve_precision
from posttrain.models.loading import build_peft_config, load_stage_model
from posttrain.models.resolve import resolve_model_path
from posttrain.rewards.guard import GuardedReward
from posttrain.rewards.registry import build_reward
from posttrain.training import distributed
from posttrain.training.sharded import policy_to_save

logger = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    """What a stage's training function hands back to :func:`execute_stage`."""

    model: Any
    tokenizer: Any
    log_history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    selection: dict[str, Any] | None = None
    """With ``keep: best``: which step the output is and why (:func:`posttrain.training.selection.selection_record`)."""

    @classmethod
    def from_trainer(
        cls,
        trainer: Any,
        output: Any,
        tokenizer: Any = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        alerts: Sequence[dict[str, Any]] = (),
        samples: Sequence[str] = (),
        selection: Mapping[str, Any] | None = None,
    ) -> TrainOutcome:
        """The outcome of a finished TRL trainer: its model, log history and ``train()`` metrics,
        plus the stage's own ``metrics``.

        Every rank must call this: a model the ranks trained sharded (FSDP, ZeRO-3) is gathered
        here, and the model is then whole on the main process only (None on the others;
        :mod:`posttrain.training.sharded`). With a ``selection`` (``keep: best``), the step it chose
        and its score join the metrics as ``selected_step`` and ``selected_score``."""
        chosen = {}
        if selection is not None and selection.get("best_step") is not None:
            chosen = {"selected_step": selection["best_step"], "selected_score": selection["best_score"]}
        return cls(
            model=policy_to_save(trainer.model, trainer.accelerator, trainer.model_wrapped),
            tokenizer=tokenizer if tokenizer is not None else trainer.processing_class,
            log_history=trainer.state.log_history,
            metrics={
                **output.metrics,
                **(metrics or {}),
                "global_step": trainer.state.global_step,
                **chosen,
            },
            alerts=list(alerts),
            samples=list(samples),
            selection=dict(selection) if selection is not None else None,
        )


@dataclass(frozen=True)
class StageContext:
    """Everything a training function needs besides its own config section."""

    stage: str
    work_dir: Path
    """The trainer's ``output_dir``: the stage's durable working folder (``<output>.ckpt``), which
    keeps its checkpoints across a kill. What else a stage writes here (samples, DPO pairs) is
    copied into the output at the end."""
    precision: str
    """Resolved precision: fp32, bf16 or fp16."""
    seed: int
    report_to: str | list[str]
    resume_from: str | None = None
    """The checkpoint to resume from (:func:`train_resumable` passes it to the trainer), or None to
    start from the input model."""
    clock: Any = None
    """The stage's :class:`~posttrain.training.checkpoint_state.StageClock` (seconds across a kill)."""


def train_resumable(trainer: Any, ctx: StageContext) -> Any:
    """``trainer.train()``, from ``ctx``'s checkpoint when there is one, with the stage's clock in
    the trainer's callbacks so its checkpoints carry the seconds spent so far.

    A checkpoint that marks the end of training (the last step, or a stop: early stopping,
    ``on_alert: stop``) is one a kill left while the output was written: the trainer would train one
    step more from it, so it is loaded and stopped before that step, and finished as ``train()``
    finishes (the best checkpoint loaded for ``keep: best``)."""
    if ctx.clock is not None:
        trainer.add_callback(ctx.clock)
    if ctx.resume_from is None or not training_finished(Path(ctx.resume_from)):
        return trainer.train(resume_from_checkpoint=ctx.resume_from)
    from transformers import TrainerCallback
    from transformers.trainer_utils import TrainOutput

    from posttrain.generation.transformers_compat import load_best_checkpoint

    class Finished(BaseException):
        """Raised before the first step of a resumed run that had already finished."""

    class StopBeforeTheStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise Finished

    trainer.add_callback(StopBeforeTheStep())
    with contextlib.suppress(Finished):
        trainer.train(resume_from_checkpoint=ctx.resume_from)
    logger.info(
        "[%s] the checkpoint of step %d had finished training: not training again",
        ctx.stage,
        trainer.state.global_step,
    )
    if trainer.args.load_best_model_at_end and trainer.state.best_model_checkpoint is not None:
        load_best_checkpoint(trainer)
    return TrainOutput(trainer.state.global_step, 0.0, {})


def training_finished(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s trainer state says training was over when it was saved: its step is
    the last, or the trainer had been told to stop (early stopping, a stopping alert)."""
    try:
        state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict):
        return False
    step, most = state.get("global_step"), state.get("max_steps")
    if type(step) is int and type(most) is int and 0 < most <= step:
        return True
    control = (state.get("stateful_callbacks") or {}).get("TrainerControl")
    stop = control.get("args", {}).get("should_training_stop") if isinstance(control, dict) else None
    return stop is True


def precision_flags(precision: str) -> dict[str, Any]:
    """TRL/transformers flags for a resolved precision on this machine.

    On a CPU, ``use_cpu=True, bf16=True`` makes the Trainer autocast matmuls to bf16 while the
    master weights and optimizer state stay fp32 (weights are loaded fp32 for training); TRL's
    default bf16 without ``use_cpu`` fails on a CPU.
    """
    if cuda_available():
        return {"bf16": precision == "bf16", "fp16": precision == "fp16"}
    return {"use_cpu": True, "bf16": precision == "bf16", "fp16": False}


def trainer_arguments(ctx: StageContext, options: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's TRL options plus the keys posttrain manages (output dir, seed, precision, tracking)."""
    return {
        **options,
        **precision_flags(ctx.precision),
        "output_dir": str(ctx.work_dir),
        "seed": ctx.seed,
        "report_to": ctx.report_to,
    }


def load_policy(model_cfg: ModelConfig, model_path: str):
    """Load the stage's starting policy for training: ``(model, tokenizer, peft_config or None)``.

    Adapter-policy inputs are merged into their base in memory; a fresh LoRA is then added for this
    stage, so the adapter-disabled model (TRL's reference for DPO and GRPO's KL) is exactly the
    stage's input policy.
    """
    model, tokenizer = load_stage_model(
        model_path,
        model_cfg.precision,
        model_cfg.cache_dir,
        for_training=True,
        quantization=model_cfg.quantization,
        attn_implementation=model_cfg.attn_implementation,
        revision=model_cfg.revision,
    )
    peft_config = build_peft_config(model_cfg.lora) if model_cfg.lora is not None else None
    distributed.record_inputs(model)
    return model, tokenizer, peft_config


def frozen_reference(model: Any) -> Any:
    """An eval-mode copy of the policy for full fine-tuning.

    TRL would otherwise reload the reference from ``config._name_or_path``, which for a policy merged
    from an adapter chain is the bottom base model, not this stage's input.
    """
    ref = copy.deepcopy(model).eval()
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref


def summarize_history(log_history: list[Mapping[str, Any]]) -> dict[str, float | int]:
    """Last logged value of every numeric metric, plus the first reward (to read a trend at a glance)."""
    summary: dict[str, float | int] = {}
    for row in log_history:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                summary[key] = value
    rewards = [row["reward"] for row in log_history if isinstance(row.get("reward"), (int, float))]
    if rewards:
        summary["reward_first"] = rewards[0]
    return summary


def build_reward_funcs(specs) -> tuple[list[Any], list[float]]:
    """Reward callables and their weights from a stage's ``rewards:`` list (names must be distinct).

    Each is wrapped in a :class:`~posttrain.rewards.guard.GuardedReward` with the spec's
    ``on_error``: a reward that raises, returns the wrong shape, NaN or None is named, handled and
    counted instead of crashing TRL or vanishing into a zero.
    """
    funcs = [
        GuardedReward(
            build_reward(spec.name, dict(spec.params)), getattr(spec, "on_error", "fail"), spec.name
        )
        for spec in specs
    ]
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise StageError(
            f"rewards {dupes} appear twice in one stage: TRL would merge their "
            "metrics; give the second a distinct factory setting or drop it"
        )
    return funcs, [float(spec.weight) for spec in specs]


def _adapter_record(model_path: str, model_cfg: ModelConfig, input_fp: str) -> dict[str, Any]:
    base = model_path if Path(model_path).is_dir() else resolve_model_path(model_path, model_cfg.cache_dir)
    base = str(Path(base).resolve()) if Path(base).is_dir() else base
    return {"base": base, "base_fingerprint": input_fp, "root": adapter_root(base)}


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE_FILE = "trainer_state.json"


def last_checkpoint(folder: Path, required: Sequence[str] = ()) -> tuple[Path, int] | None:
    """The newest complete trainer checkpoint in ``folder`` and its step, or None.

    The trainer writes ``trainer_state.json`` last into a checkpoint (after the weights, optimizer,
    scheduler and RNG states), so a checkpoint whose state file parses and names the checkpoint's
    own step is complete; one a kill interrupted mid-save is passed over. ``required`` names JSON
    files a trainer writes after that state (:data:`LATE_CHECKPOINT_FILES`): each must parse too.
    """
    found = []
    for path in folder.iterdir() if folder.is_dir() else ():
        match = _CHECKPOINT.match(path.name)
        if match is None or not path.is_dir():
            continue
        try:
            state = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        own_step = isinstance(state, dict) and state.get("global_step") == int(match.group(1))
        if own_step and all(_parses(path / name) for name in required):
            found.append((int(match.group(1)), path))
    if not found:
        return None
    step, path = max(found)
    return path, step


def best_checkpoint(checkpoint: Path) -> Path | None:
    """The best checkpoint ``checkpoint``'s trainer state names (``keep: best``), when it is a
    checkpoint folder beside it; None otherwise."""
    try:
        state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    if not isinstance(best, str) or not _CHECKPOINT.match(Path(best).name):
        return None
    path = checkpoint.parent / Path(best).name
    return path if path.is_dir() else None


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


LATE_CHECKPOINT_FILES = {"use_adaptive_entropy": "entropy_ctrl_state.json"}
"""Trainer option → the file the trainer writes into a checkpoint after its state (TRL's GRPO writes
its adaptive entropy coefficient after the trainer state and the rotation of old checkpoints): a
checkpoint without it is not complete, or the resumed stage would restart that coefficient."""


def late_checkpoint_files(options: Mapping[str, Any]) -> tuple[str, ...]:
    """What :func:`last_checkpoint` must also find in a checkpoint of a stage with these options."""
    return tuple(name for option, name in LATE_CHECKPOINT_FILES.items() if options.get(option))


def prepare_work_dir(folder: Path, required: Sequence[str] = ()) -> tuple[str | None, int]:
    """Ready a stage's working folder: ``(checkpoint to resume from or None, its step)``.

    With a complete checkpoint, the newest one is kept with what the interrupted run wrote beside
    it (sample files of the steps before it, DPO pairs), and so is the best checkpoint its trainer
    state names (``keep: best`` chooses among every evaluation, before and after the kill); any
    other checkpoint is deleted. Without one the folder is emptied, so a fresh start never mixes in
    a killed run's files.
    """
    found = last_checkpoint(folder, required)
    if found is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return None, 0
    keep, step = found
    best = best_checkpoint(keep)
    for path in folder.iterdir():
        if _CHECKPOINT.match(path.name) and path not in (keep, best):
            shutil.rmtree(path, ignore_errors=True)
    return str(keep), step


def _copy_run_files(work: Path, out: Path) -> None:
    """Copy what the trainer and the stage wrote in the working folder, checkpoints aside, into
    the staging output (copied, not moved: a kill now still leaves the working folder whole)."""
    for path in sorted(work.iterdir()):
        if _CHECKPOINT.match(path.name):
            continue
        if path.is_dir():
            shutil.copytree(path, out / path.name)
        else:
            shutil.copy2(path, out / path.name)


def execute_stage(
    *,
    stage: str,
    kind: str,
    stage_cfg: Any,
    model_cfg: ModelConfig,
    model_path: str | Path,
    train_dataset: Any,
    output_dir: str | Path,
    seed: int,
    report_to: str | list[str],
    options: Mapping[str, Any],
    train_fn: Callable[[StageContext], TrainOutcome],
) -> StageResult:
    """Run ``train_fn`` inside the standard stage sequence (module docstring) and return its result.

    If the run dies or raises, ``<output_dir>.ckpt`` keeps the trainer's last checkpoint and the
    next call with the same ``output_dir`` resumes from it; it is deleted once the output is in
    place (or at once, when training failed before its first checkpoint).

    Under several processes (posttrain.training.distributed) every rank trains; rank 0 alone
    readies the working folder and writes the output, and the others return its result.
    """
    start = time.perf_counter()
    distributed.start()
    main = distributed.is_main_process()
    model_path = str(model_path)
    check_hardware(
        model_cfg.precision,
        model_cfg.quantization,
        options.get("optim"),
        bool(options.get("use_vllm", False)),
    )
    precision = resolve_precision(model_cfg.precision)
    input_fp = fingerprint_model(model_path, model_cfg.cache_dir, model_cfg.revision)
    data_fp = fingerprint_dataset(train_dataset)
    config_hash = stable_hash(stage_cfg)
    # TRAINER_DEFAULTS live in code, outside the stage section: hash what actually reaches TRL too.
    options_hash = stable_hash(dict(options))
    final = Path(output_dir).resolve()
    work = checkpoints_dir(final)
    required = late_checkpoint_files(options)
    resume_from, resume_step = prepare_work_dir(work, required) if main else (None, 0)
    distributed.barrier()
    if not main and (found := last_checkpoint(work, required)) is not None:  # the one rank 0 kept
        resume_from, resume_step = str(found[0]), found[1]
    logger.info(
        "[%s] starting from %s (fingerprint %s) on %d examples, precision %s, output %s",
        stage,
        model_path,
        input_fp,
        len(train_dataset),
        precision,
        final,
    )
    if resume_from is not None:
        logger.info(
            "[%s] resuming from step %d (%s), left by an interrupted run", stage, resume_step, resume_from
        )
    from posttrain.training.checkpoint_state import StageClock  # heavy: transformers

    clock = StageClock(start)
    ctx = StageContext(
        stage=stage,
        work_dir=work,
        precision=precision,
        seed=seed,
        report_to=report_to,
        resume_from=resume_from,
        clock=clock,
    )
    try:
        outcome = train_fn(ctx)
    except BaseException:
        if main and last_checkpoint(work, required) is None:  # nothing to resume from: leave nothing behind
            shutil.rmtree(work, ignore_errors=True)
        raise
    if not main:
        distributed.barrier()  # rank 0 writes the output
        return _written_result(final)
    metrics = {**summarize_history(outcome.log_history), **outcome.metrics}
    if resume_from is not None:
        metrics["resumed_from_step"] = resume_step
    with staging_dir(final) as out:
        _copy_run_files(work, out)
        artifact = save_policy(outcome.model, outcome.tokenizer, out, adapter_policy=model_cfg.adapter_policy)
        adapter = _adapter_record(model_path, model_cfg, input_fp) if artifact == "adapter" else None
        write_log_history(out, outcome.log_history)
        duration = clock.seconds()  # with the seconds before a kill, when resumed
        write_stage_json(
            out,
            stage=stage,
            kind=kind,
            config=stage_cfg.model_dump(mode="json"),
            config_hash=config_hash,
            model_config_hash=stable_hash(model_cfg),
            input_model=model_path,
            input_fingerprint=input_fp,
            data_fingerprint=data_fp,
            seed=seed,
            precision=precision,
            metrics=metrics,
            alerts=outcome.alerts,
            samples=outcome.samples,
            artifact=artifact,
            adapter=adapter,
            duration_s=duration,
            extra={
                "trainer_options": dict(options),
                "trainer_options_hash": options_hash,
                **({"selection": outcome.selection} if outcome.selection is not None else {}),
            },
        )
        result = StageResult(
            stage=stage,
            output_dir=str(final),
            metrics=metrics,
            fingerprints={
                "input_model": input_fp,
                "data": data_fp,
                "config": config_hash,
                "trainer_options": options_hash,
                "output": fingerprint_dir(out),
            },
            alerts=tuple(outcome.alerts),
            duration_s=round(duration, 3),
            samples=tuple(outcome.samples),
            artifact=artifact,
            adapter_base=adapter["base"] if adapter else None,
        )
        write_result(out, result)
    shutil.rmtree(work, ignore_errors=True)
    logger.info("[%s] done in %.1f s: %s (%s)", stage, duration, final, artifact)
    distributed.barrier()
    return result


def _written_result(output: Path) -> StageResult:
    """The result rank 0 wrote into ``output`` (what the other ranks return)."""
    from pydantic import TypeAdapter

    data = json.loads((output / RESULT_FILE).read_text(encoding="utf-8"))
    return TypeAdapter(StageResult).validate_python(data)
