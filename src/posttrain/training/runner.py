"""Plumbing shared by every stage: hardware checks, precision flags, policy loading, atomic saving.

Each stage module (sft, dpo, grpo) only builds its dataset and its TRL trainer; :func:`execute_stage`
wraps that in the same sequence everywhere, so every output directory is written the same way:

1. check the hardware the config asks for (before loading anything, so a GPU-only config fails in
   a second on a laptop);
2. fingerprint the input model and data (the lineage recorded in ``stage.json``);
3. train inside a temporary directory (see :func:`posttrain.core.atomic.staging_dir`);
4. save the policy per ``model.adapter_policy``, the log history and ``stage.json``, then rename.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.atomic import staging_dir
from posttrain.core.config import ModelConfig
from posttrain.core.errors import StageError
from posttrain.core.hashing import stable_hash
from posttrain.models.artifacts import (
    StageResult,
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
    ) -> TrainOutcome:
        """The outcome of a finished TRL trainer: its model, log history and ``train()`` metrics,
        plus the stage's own ``metrics``."""
        return cls(
            model=trainer.model,
            tokenizer=tokenizer if tokenizer is not None else trainer.processing_class,
            log_history=trainer.state.log_history,
            metrics={**output.metrics, **(metrics or {}), "global_step": trainer.state.global_step},
            alerts=list(alerts),
            samples=list(samples),
        )


@dataclass(frozen=True)
class StageContext:
    """Everything a training function needs besides its own config section."""

    stage: str
    work_dir: Path
    """Temporary output directory; the trainer's ``output_dir``."""
    precision: str
    """Resolved precision: fp32, bf16 or fp16."""
    seed: int
    report_to: str | list[str]


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
    """Run ``train_fn`` inside the standard stage sequence (module docstring) and return its result."""
    start = time.perf_counter()
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
    logger.info(
        "[%s] starting from %s (fingerprint %s) on %d examples, precision %s, output %s",
        stage,
        model_path,
        input_fp,
        len(train_dataset),
        precision,
        output_dir,
    )
    with staging_dir(output_dir) as work:
        ctx = StageContext(stage=stage, work_dir=work, precision=precision, seed=seed, report_to=report_to)
        outcome = train_fn(ctx)
        metrics = {**summarize_history(outcome.log_history), **outcome.metrics}
        artifact = save_policy(
            outcome.model, outcome.tokenizer, work, adapter_policy=model_cfg.adapter_policy
        )
        adapter = _adapter_record(model_path, model_cfg, input_fp) if artifact == "adapter" else None
        write_log_history(work, outcome.log_history)
        duration = time.perf_counter() - start
        write_stage_json(
            work,
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
            extra={"trainer_options": dict(options), "trainer_options_hash": options_hash},
        )
        output_fp = fingerprint_dir(work)
    final = Path(output_dir).resolve()
    logger.info("[%s] done in %.1f s: %s (%s)", stage, duration, final, artifact)
    return StageResult(
        stage=stage,
        output_dir=str(final),
        metrics=metrics,
        fingerprints={
            "input_model": input_fp,
            "data": data_fp,
            "config": config_hash,
            "trainer_options": options_hash,
            "output": output_fp,
        },
        alerts=tuple(outcome.alerts),
        duration_s=round(duration, 3),
        samples=tuple(outcome.samples),
        artifact=artifact,
        adapter_base=adapter["base"] if adapter else None,
    )
