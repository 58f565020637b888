"""The pipeline's steps as plain functions: what each Prefect task runs, callable without Prefect.

Each step takes the resolved config, its inputs as paths/fingerprints, and the directory to write,
and returns a small frozen result. The cache key of each step (see `store.cache_key`) is computed
from the same inputs by the ``*_key`` functions here, so the Prefect flow, ``--dry-run`` and a plain
Python caller all agree on what a step depends on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config import PipelineConfig, stable_hash
from posttrain.store import cache_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRef:
    """A stage input: what to load and the fingerprint of its content."""

    path: str
    fingerprint: str


@dataclass(frozen=True)
class DataResult:
    data_dir: str
    train_fingerprint: str
    eval_fingerprint: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalResult:
    stage: str
    """The stage whose output was evaluated (`baseline`, `sft`, `grpo-format`, ...)."""
    report_dir: str
    summary: dict[str, float]
    timings: dict[str, float]
    model_fingerprint: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- keys


def _source_fingerprint(cfg: PipelineConfig) -> str:
    """Content hash of local data files (a path string says nothing about what is in the file)."""
    if cfg.data.source != "local" or not cfg.data.path:
        return "-"
    from posttrain.training.modeling import sha256_file

    root = Path(cfg.data.path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        if file.exists():
            digest.update(file.name.encode())
            digest.update(sha256_file(file).encode())
    return digest.hexdigest()[:16]


def data_key(cfg: PipelineConfig, model_fingerprint: str) -> str:
    # The tokenizer decides which prompts are too long, so the model's identity is an input.
    return cache_key(
        "data", stable_hash(cfg.data), {"source": _source_fingerprint(cfg), "tokenizer": model_fingerprint}
    )


def stage_section(cfg: PipelineConfig, stage: str):
    if stage == "sft":
        return cfg.sft
    if stage == "dpo":
        return cfg.dpo
    return next(s for s in cfg.grpo.stages if f"grpo-{s.name}" == stage)


def train_key(cfg: PipelineConfig, stage: str, model: ModelRef, data: DataResult) -> str:
    section = stage_section(cfg, stage)
    # trainer_options() includes posttrain's code-side defaults, which the section hash does not.
    config_hash = stable_hash(
        {
            "stage": stable_hash(section),
            "trainer": section.trainer_options(),
            "model": stable_hash(cfg.model),
            "seed": cfg.seed,
        }
    )
    return cache_key(stage, config_hash, {"model": model.fingerprint, "data": data.train_fingerprint})


def eval_key(cfg: PipelineConfig, stage: str, model: ModelRef, data: DataResult) -> str:
    config_hash = stable_hash({"eval": stable_hash(cfg.eval), "precision": cfg.model.precision})
    return cache_key(
        f"eval-{stage}", config_hash, {"model": model.fingerprint, "data": data.eval_fingerprint}
    )


# --------------------------------------------------------------------------- steps


def base_model(cfg: PipelineConfig) -> ModelRef:
    """The pipeline's starting model, resolved (built-ins fetched/converted) and fingerprinted."""
    from posttrain.training.modeling import resolve_model_path
    from posttrain.training.stage_io import fingerprint_model

    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    return ModelRef(path=path, fingerprint=fingerprint_model(path, cfg.model.cache_dir, cfg.model.revision))


def prepare_step(cfg: PipelineConfig, model: ModelRef, output_dir: str | Path) -> DataResult:
    """Load, split, decontaminate and filter the data; save both splits under ``output_dir``."""
    from posttrain.data.prepare import prepare_data
    from posttrain.training.modeling import load_tokenizer
    from posttrain.training.stage_io import staging_dir

    tokenizer = load_tokenizer(model.path, cfg.model.revision)
    eval_questions = [r["question"] for r in _external_eval_records(cfg)]
    prepared = prepare_data(cfg.data, tokenizer=tokenizer, eval_questions=eval_questions)
    with staging_dir(output_dir) as tmp:
        prepared.save(tmp)
    stats = {k: v for k, v in prepared.stats.items() if not isinstance(v, dict)}
    return DataResult(
        data_dir=str(Path(output_dir).resolve()),
        train_fingerprint=str(prepared.stats["train_fingerprint"]),
        eval_fingerprint=str(prepared.stats["eval_fingerprint"]),
        stats=stats,
    )


def _external_eval_records(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Evaluation records that do not come from the held-out slice (used for decontamination too)."""
    if cfg.eval.data == "heldout":
        return []
    from posttrain.evaluation.data import load_eval_records

    return load_eval_records(
        cfg.eval.data,
        path=cfg.eval.path,
        limit=cfg.eval.limit,
        hub_id=cfg.data.hub_id,
        hub_config=cfg.data.hub_config,
        hub_split=cfg.eval.hub_split,
    )


def load_data(data: DataResult):
    from posttrain.data.prepare import PreparedData

    return PreparedData.load(data.data_dir)


def eval_records(cfg: PipelineConfig, data: DataResult) -> list[dict[str, Any]]:
    if cfg.eval.data != "heldout":
        return _external_eval_records(cfg)
    heldout = load_data(data).eval
    limit = min(cfg.eval.limit or len(heldout), len(heldout))
    return [heldout[i] for i in range(limit)]


def eval_step(
    cfg: PipelineConfig, stage: str, model: ModelRef, data: DataResult, output_dir: str | Path
) -> EvalResult:
    """Evaluate one model on the configured evaluation set; write report.json + examples.jsonl."""
    from posttrain.data.prompts import select_few_shot
    from posttrain.evaluation import evaluate
    from posttrain.training.stage_io import load_stage_model, staging_dir

    records = eval_records(cfg, data)
    # Adapter outputs are merged onto their base here; vLLM loads from a path itself.
    loaded = (
        model.path
        if cfg.eval.backend == "vllm"
        else load_stage_model(model.path, cfg.model.precision, cfg.model.cache_dir)
    )
    report = evaluate(
        loaded,
        records,
        cfg.eval,
        precision=cfg.model.precision,
        data_name=cfg.eval.data,
        progress=True,
        system_prompt=cfg.data.system_prompt or None,
        few_shot=select_few_shot(cfg.data.few_shot),
    )
    with staging_dir(output_dir) as tmp:
        report.save(tmp)
    return EvalResult(
        stage=stage,
        report_dir=str(Path(output_dir).resolve()),
        summary=dict(report.summary),
        timings=dict(report.timings),
        model_fingerprint=model.fingerprint,
    )


def train_step(
    cfg: PipelineConfig,
    stage: str,
    model: ModelRef,
    data: DataResult,
    output_dir: str | Path,
    report_to: str | list[str] = "none",
):
    """Run one training stage (`sft`, `dpo` or `grpo-<name>`) from ``model`` into ``output_dir``."""
    train = load_data(data).train
    common = {"seed": cfg.seed, "report_to": report_to}
    if stage == "sft":
        from posttrain.training.sft import run_sft

        return run_sft(cfg.sft, cfg.model, model.path, train, output_dir, **common)
    if stage == "dpo":
        from posttrain.training.dpo import run_dpo

        return run_dpo(cfg.dpo, cfg.model, model.path, train, output_dir, **common)
    from posttrain.training.grpo import run_grpo_stage

    return run_grpo_stage(stage_section(cfg, stage), cfg.model, model.path, train, output_dir, **common)


def output_is_valid(result: Any) -> bool:
    """A cached result still stands only if its output exists with the fingerprint it was cached with."""
    from posttrain.training.stage_io import fingerprint_dir, is_complete_stage

    if isinstance(result, DataResult):
        return Path(result.data_dir, "stats.json").exists()
    if isinstance(result, EvalResult):
        return Path(result.report_dir, "report.json").exists()
    out = Path(result.output_dir)
    return is_complete_stage(out) and fingerprint_dir(out) == result.fingerprints.get("output")
