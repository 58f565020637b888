"""What the data and evaluation steps run, and what every step reads: the base model, the prepared data.

Each step takes the resolved config, its inputs as paths/fingerprints, and the directory to write,
and returns a small frozen result (:mod:`posttrain.core.results`). The training stages' own calls
are their plan steps' ``train`` (:mod:`posttrain.pipeline.plan`), which also says which step runs
when. Callable without Prefect.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.cache.digests import fingerprint_tree
from posttrain.core.atomic import staging_dir, write_result
from posttrain.core.config import EvalConfig, PipelineConfig
from posttrain.core.errors import ConfigError
from posttrain.core.metric_names import qualify_metrics
from posttrain.core.prompts import select_few_shot
from posttrain.core.results import DataResult, EvalResult, ScoreResult
from posttrain.data.eval_sets import eval_set_info, load_eval_records
from posttrain.models.artifacts import fingerprint_model
from posttrain.models.loading import load_stage_model, load_tokenizer
from posttrain.models.resolve import resolve_model_path

if TYPE_CHECKING:
    from posttrain.data.prepare import PreparedData

# The modules that do a step's work (data preparation, evaluation, each training stage) import
# torch, transformers, datasets and TRL. They are imported inside the step that needs them, so a
# rerun served from cache, which only reads records and checks outputs, never loads them.

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRef:
    """A stage input: what to load and the fingerprint of its content."""

    path: str
    fingerprint: str


# --------------------------------------------------------------------------- steps


def base_model(cfg: PipelineConfig) -> ModelRef:
    """The pipeline's starting model, resolved (built-ins fetched/converted) and fingerprinted."""
    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    return ModelRef(path=path, fingerprint=fingerprint_model(path, cfg.model.cache_dir, cfg.model.revision))


def prepare_step(cfg: PipelineConfig, model: ModelRef, output_dir: str | Path) -> DataResult:
    """Load, split, decontaminate and filter the data; save both splits under ``output_dir``."""
    from posttrain.data.prepare import prepare_data  # heavy: datasets

    tokenizer = load_tokenizer(model.path, cfg.model.revision)
    eval_questions = [r["question"] for r in _external_eval_records(cfg)]
    prepared = prepare_data(
        cfg.data, tokenizer=tokenizer, eval_questions=eval_questions, stage_sources=cfg.stage_data_sources()
    )
    stats = {k: v for k, v in prepared.stats.items() if not isinstance(v, dict)}
    with staging_dir(output_dir) as tmp:
        prepared.save(tmp)
        result = DataResult(
            data_dir=str(Path(output_dir).resolve()),
            train_fingerprint=str(prepared.stats["train_fingerprint"]),
            eval_fingerprint=str(prepared.stats["eval_fingerprint"]),
            stats=stats,
            output_fingerprint=fingerprint_tree(tmp),
        )
        write_result(tmp, result)
    return result


def _set_records(
    cfg: PipelineConfig, eval_cfg: EvalConfig, data: DataResult | None = None
) -> list[dict[str, Any]]:
    """The questions of one evaluation set (``heldout`` ones need the prepared ``data``)."""
    if eval_cfg.data == "heldout":
        assert data is not None, "a held-out evaluation set needs the prepared data"
        heldout = load_data(data).eval
        limit = min(eval_cfg.limit or len(heldout), len(heldout))
        return [heldout[i] for i in range(limit)]
    return load_eval_records(
        eval_cfg.data,
        path=eval_cfg.path,
        limit=eval_cfg.limit,
        hub_id=cfg.data.hub_id,
        hub_config=cfg.data.hub_config,
        hub_split=eval_cfg.hub_split,
        synthetic_ops=eval_cfg.synthetic_ops(),
        synthetic_numbers=eval_cfg.numbers or "default",
        synthetic_themes=eval_cfg.themes,
    )


def _set_info(cfg: PipelineConfig, eval_cfg: EvalConfig, count: int) -> dict[str, Any]:
    """Which dataset and split one evaluation set's ``count`` questions come from (its report's)."""
    training = {"hub": f"{cfg.data.hub_id} {cfg.data.split} split", "local": cfg.data.path}
    return eval_set_info(
        eval_cfg.data,
        count,
        path=eval_cfg.path,
        hub_id=cfg.data.hub_id,
        hub_split=eval_cfg.hub_split,
        synthetic_ops=eval_cfg.synthetic_ops(),
        synthetic_themes=eval_cfg.themes,
        trained_on=training.get(cfg.data.source, "posttrain synthetic problems"),
    )


def _external_eval_records(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Questions of every evaluation set that is not cut from the held-out slice: training must not
    overlap them (decontamination)."""
    sets = [set_cfg for _, set_cfg in cfg.eval.all_sets() if set_cfg.data != "heldout"]
    return [record for set_cfg in sets for record in _set_records(cfg, set_cfg)]


def load_data(data: DataResult) -> PreparedData:
    from posttrain.data.prepare import PreparedData  # heavy: datasets

    return PreparedData.load(data.data_dir)


def stage_selection_fingerprint(data: DataResult, stage: str) -> str:
    """The fingerprint of the selection slice training stage ``stage`` chooses its checkpoint by
    (in_training_records): its own slice's, else the run's, else ""."""
    return str(
        data.stats.get(f"{stage}.selection_fingerprint") or data.stats.get("selection_fingerprint", "")
    )


def stage_train_fingerprint(data: DataResult, stage: str) -> str:
    """The fingerprint of what training stage ``stage`` draws from (PreparedData.train_for): its own
    split's when the data step prepared one, else the train split's."""
    return str(data.stats.get(f"{stage}.train_fingerprint") or data.train_fingerprint)


def eval_step(
    cfg: PipelineConfig,
    stage: str,
    model: ModelRef,
    data: DataResult,
    output_dir: str | Path,
    *,
    server_command: Sequence[str] | None = None,
) -> EvalResult:
    """Evaluate one model on the configured evaluation sets: the primary set's report.json +
    examples.jsonl in ``output_dir``, each extra set's in ``output_dir/<name>``.

    With ``eval.backend: vllm_server`` the managed server runs for the whole step (every set) and
    is stopped before the reports are written, also when evaluation fails; its log is kept in
    ``output_dir``. ``server_command`` replaces ``trl vllm-serve`` (tests).
    """
    from posttrain.evaluation.evaluator import evaluate  # heavy: torch, transformers
    from posttrain.evaluation.report import report_metrics
    from posttrain.evaluation.served import eval_server

    with staging_dir(output_dir) as tmp:
        with contextlib.ExitStack() as stack:
            server = None
            # Adapter outputs are merged onto their base (in memory for hf, into a folder for the
            # server); vLLM loads from a path itself. Loaded once for every set.
            if cfg.eval.backend == "vllm_server":
                if cfg.vllm_server is None:
                    raise ConfigError("eval.backend: vllm_server needs the vllm_server: section")
                server, loaded = stack.enter_context(
                    eval_server(cfg.vllm_server, cfg.model, model.path, tmp, command=server_command)
                )
            elif cfg.eval.backend == "vllm":
                loaded = model.path
            else:
                loaded = load_stage_model(
                    model.path, cfg.model.precision, cfg.model.cache_dir, revision=cfg.model.revision
                )
            reports = {}
            for name, set_cfg in cfg.eval.all_sets():
                records = _set_records(cfg, set_cfg, data)
                reports[name] = evaluate(
                    loaded,
                    records,
                    set_cfg,
                    precision=cfg.model.precision,
                    data_name=set_cfg.data if name is None else f"{name} ({set_cfg.data})",
                    data_info=_set_info(cfg, set_cfg, len(records)),
                    progress=True,
                    system_prompt=cfg.data.system_prompt or None,
                    few_shot=select_few_shot(cfg.data.few_shot),
                    server=server,
                )
        for name, report in reports.items():
            report.save(Path(tmp, name) if name else tmp)
        primary = reports[None]
        result = EvalResult(
            stage=stage,
            report_dir=str(Path(output_dir).resolve()),
            summary=report_metrics(primary),
            timings={
                **primary.timings,
                **{
                    k: v
                    for name, r in reports.items()
                    if name
                    for k, v in qualify_metrics(r.timings, name).items()
                },
            },
            model_fingerprint=model.fingerprint,
            output_fingerprint=fingerprint_tree(tmp),
            sets={name: report_metrics(r) for name, r in reports.items() if name},
        )
        write_result(tmp, result)
    return result


def score_step(
    cfg: PipelineConfig, stage: str, model: ModelRef, data: DataResult, output_dir: str | Path
) -> ScoreResult:
    """Pass rates of GRPO stage ``stage``'s candidate prompts under ``model`` (the model the stage starts
    from): ``pass_rates.json`` and the k samples' report (``report.json``, ``examples.jsonl``)."""
    from posttrain.cache.keys import stage_section
    from posttrain.evaluation.pass_rate import score_pass_rates  # heavy: torch, transformers

    start = time.perf_counter()
    section = stage_section(cfg, stage)
    rows = scoring_candidates(load_data(data), stage, section)
    loaded = load_stage_model(
        model.path, cfg.model.precision, cfg.model.cache_dir, revision=cfg.model.revision
    )
    scoring = score_pass_rates(
        loaded,
        rows,
        section,
        seed=cfg.seed,
        precision=cfg.model.precision,
        system_prompt=cfg.data.system_prompt or None,
        few_shot=select_few_shot(cfg.data.few_shot),
        progress=True,
    )
    rates = scoring.rates
    with staging_dir(output_dir) as tmp:
        scoring.report.save(tmp)
        rates.save(tmp)
        mean = sum(rates.correct.values()) / max(1, len(rates.correct)) / rates.samples
        result = ScoreResult(
            stage=stage,
            output_dir=str(Path(output_dir).resolve()),
            summary={
                "prompts": len(rates.correct),
                "samples": rates.samples,
                "mean_pass_rate": round(mean, 4),
                "never_solved": rates.histogram()[0],
                "always_solved": rates.histogram()[-1],
                **{k: v for k, v in scoring.report.timings.items() if isinstance(v, int | float)},
                "duration_s": round(time.perf_counter() - start, 3),  # loading and scoring: its cost
            },
            model_fingerprint=model.fingerprint,
            output_fingerprint=fingerprint_tree(tmp),
        )
        write_result(tmp, result)
    return result


def scoring_candidates(prepared: PreparedData, stage: str, section: Any) -> Any:
    """The prompts stage ``stage``'s scoring step scores: the first ``pass_rate.candidates`` of the
    stage's data (its own split, else the train split) after its ``data_filter``."""
    from posttrain.data.prepare import select_stage_data  # heavy: datasets

    assert section.pass_rate is not None, f"{stage} has no pass_rate: section"
    rows = select_stage_data(prepared.train_for(stage), section.data_filter)
    if section.pass_rate.candidates is not None and section.pass_rate.candidates < len(rows):
        rows = rows.select(range(section.pass_rate.candidates))
    return rows


def in_training_records(prepared: PreparedData, section: Any, stage: str | None = None) -> Any:
    """What a stage with ``eval_every`` evaluates as it trains: PreparedData.selection_for training
    stage ``stage``, in the stage's ``data_filter`` operation range where it has one (an ``rft:``
    stage's fine-tuning reads them as they are); None without ``eval_every``."""
    if getattr(section, "eval_every", None) is None:
        return None
    records = prepared.selection_for(stage)
    data_filter = getattr(section, "data_filter", None)
    if data_filter is None:
        return records
    from posttrain.data.prepare import records_in_ops_range  # heavy: datasets

    return records_in_ops_range(records, data_filter)


def evaluation_inputs(cfg: PipelineConfig, section: Any, prepared: PreparedData) -> dict[str, Any]:
    """SFT's and DPO's in-training evaluation: its records and generation limit (the final evaluation's)."""
    return {
        "selection": in_training_records(prepared, section),
        "eval_max_new_tokens": cfg.eval.max_completion_length,
    }
