"""The pipeline as one typed plan of steps, built once from the config.

:func:`build_plan` turns a config into an ordered tuple of :class:`Step` objects: prepare the data,
evaluate the base model, then each training stage followed by its evaluation. Everything that
needs the pipeline's shape reads this one object: the Prefect flow runs it (``flows/pipeline_flow.py``),
``--dry-run`` prints it (:func:`preview`), tracking names its nested runs after ``Step.name`` and
tags them with ``Step.kind``, and ``--force`` checks its step names. Adding a kind of training stage
is one :class:`TrainStep` subclass in :data:`TRAIN_KINDS` whose ``train`` calls its stage function.

:meth:`Plan.walk` visits the steps in order with each step's inputs and cache key: the current
model (the base model, then each training stage's output) and the prepared data. A visitor that
cannot produce a step's result (the dry run, for a step that would run) returns None; the keys of
the steps that consume that output cannot be known then, and they are visited with ``key=None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from posttrain.cache import keys
from posttrain.cache.digests import fingerprint_tree, remembered_digests
from posttrain.cache.planner import dry_run
from posttrain.cache.records import StoreRecords
from posttrain.cache.store import Store
from posttrain.core.config import PipelineConfig
from posttrain.core.errors import ConfigError, PosttrainError
from posttrain.core.results import DataResult, EvalResult, ScoreResult, StageResult
from posttrain.core.untrusted import note_unreadable
from posttrain.evaluation.report import EvalReport
from posttrain.models.artifacts import fingerprint_dir, is_complete_stage, read_stage_json
from posttrain.pipeline import steps
from posttrain.pipeline.launcher import launch_stage, world_size
from posttrain.pipeline.steps import (
    ModelRef,
    evaluation_inputs,
    in_training_records,
    load_data,
    scoring_candidates,
    stage_selection_fingerprint,
    stage_train_fingerprint,
)

logger = logging.getLogger(__name__)

__all__ = [
    "TRAIN_KINDS",
    "DataStep",
    "EvalStep",
    "Plan",
    "RFTStep",
    "ScoreStep",
    "Step",
    "StepInputs",
    "TrainStep",
    "build_plan",
    "preview",
]


@dataclass(frozen=True)
class StepInputs:
    """What a step consumes: the current model and, after the data step, the prepared data; a GRPO
    stage with ``pass_rate:`` also its scoring step's result."""

    model: ModelRef
    data: DataResult | None = None
    scores: ScoreResult | None = None


class Step:
    """One step of the plan: its identity, cache key, output location, how to run and verify it."""

    kind: ClassVar[str]
    """`data`, `sft`, `dpo`, `grpo`, `rft`, `score` or `eval`: tags the MLflow run, names the Prefect task."""
    feeds_downstream: ClassVar[bool] = True
    """False for evaluations: nothing downstream consumes their output."""
    name: str

    def section(self, cfg: PipelineConfig) -> Any:
        """The config section this step depends on (logged as the stage run's params)."""
        raise NotImplementedError

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        """What the step's cache key is made of (config, inputs, code)."""
        raise NotImplementedError

    def key(self, cfg: PipelineConfig, inputs: StepInputs) -> str:
        return self.identity(cfg, inputs).key

    def output_dir(self, store: Store, key: str) -> Path:
        raise NotImplementedError

    def run(self, cfg: PipelineConfig, inputs: StepInputs, output_dir: str, report_to: Any = "none") -> Any:
        raise NotImplementedError

    def output_is_valid(self, result: Any) -> bool:
        """A cached result still stands only if its output is there, unmodified."""
        raise NotImplementedError

    def made_from(self, result: Any, inputs: StepInputs) -> bool:
        """Whether ``result`` was computed from ``inputs`` (checked before adopting an output that
        has no cache record: its folder name holds only the start of the key)."""
        return True

    def advance(self, inputs: StepInputs, result: Any) -> StepInputs:
        """The inputs of the steps after this one, given this step's result."""
        return inputs

    @staticmethod
    def output_of(result: Any) -> str:
        raise NotImplementedError

    @staticmethod
    def metrics_of(result: Any) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class DataStep(Step):
    kind: ClassVar[str] = "data"
    name: str = "data"

    def section(self, cfg: PipelineConfig) -> Any:
        return cfg.data

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        return keys.data_identity(cfg, inputs.model.fingerprint)

    def output_dir(self, store: Store, key: str) -> Path:
        return store.data_dir(key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> DataResult:
        return steps.prepare_step(cfg, inputs.model, output_dir)

    def output_is_valid(self, result: Any) -> bool:
        return isinstance(result, DataResult) and _intact(result.data_dir, result.output_fingerprint)

    def advance(self, inputs: StepInputs, result: DataResult) -> StepInputs:
        return StepInputs(inputs.model, result)

    @staticmethod
    def output_of(result: DataResult) -> str:
        return result.data_dir

    @staticmethod
    def metrics_of(result: DataResult) -> dict[str, Any]:
        return dict(result.stats)


@dataclass(frozen=True)
class TrainStep(Step):
    """A training stage: ``sft``, ``dpo``, ``grpo-<name>`` or ``rft-<name>`` (see :data:`TRAIN_KINDS`)."""

    kind: ClassVar[str] = "train"
    name: str = ""

    def section(self, cfg: PipelineConfig) -> Any:
        return keys.stage_section(cfg, self.name)

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        assert inputs.data is not None, "a training step runs after the data step"
        data = inputs.data
        selection = stage_selection_fingerprint(data, self.name)
        processes = world_size(cfg, self.section(cfg))
        return keys.train_identity(
            cfg,
            self.name,
            inputs.model.fingerprint,
            stage_train_fingerprint(data, self.name),
            selection,
            processes,
        )

    def output_dir(self, store: Store, key: str) -> Path:
        return store.stage_dir(self.name, key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> StageResult:
        """Train in this process, or under ``accelerate launch`` (``launch.launcher``), whose
        processes run :meth:`train` themselves (posttrain.pipeline.stage_main)."""
        assert inputs.data is not None
        if cfg.launch_of(self.section(cfg)).launcher == "accelerate":
            return launch_stage(cfg, self.name, self.kind, self.section(cfg), inputs, str(output_dir))
        scored = {"scores": inputs.scores} if inputs.scores is not None else {}
        return self.train(cfg, inputs.model, inputs.data, output_dir, report_to, **scored)

    def train(self, cfg, model: ModelRef, data: DataResult, output_dir: str, report_to: Any) -> StageResult:
        raise NotImplementedError

    def output_is_valid(self, result: Any) -> bool:
        """Complete, unmodified, and an adapter's ``stage.json`` names the base its result does
        (loading follows ``stage.json``, which is outside the fingerprint)."""
        if not isinstance(result, StageResult):
            return False
        out = Path(result.output_dir)
        if not is_complete_stage(out) or fingerprint_dir(out) != result.fingerprints.get("output"):
            return False
        if result.artifact != "adapter":
            return True
        return (read_stage_json(out).get("adapter") or {}).get("base") == result.adapter_base

    def made_from(self, result: Any, inputs: StepInputs) -> bool:
        """Trained from ``inputs``; an adapter's base is that input model, nothing else on the machine."""
        if result.fingerprints.get("input_model") != inputs.model.fingerprint:
            return False
        return result.adapter_base is None or _same_place(result.adapter_base, inputs.model.path)

    def advance(self, inputs: StepInputs, result: StageResult) -> StepInputs:
        return StepInputs(ModelRef(result.output_dir, result.fingerprints["output"]), inputs.data)

    @staticmethod
    def output_of(result: StageResult) -> str:
        return result.output_dir

    @staticmethod
    def metrics_of(result: StageResult) -> dict[str, Any]:
        return dict(result.metrics)


@dataclass(frozen=True)
class SFTStep(TrainStep):
    kind: ClassVar[str] = "sft"
    name: str = "sft"

    def train(self, cfg, model, data, output_dir, report_to):
        """Supervised fine-tuning on the prepared train split, from ``model`` into ``output_dir``."""
        from posttrain.training.sft import run_sft  # heavy: torch, transformers, TRL

        prepared = load_data(data)
        return run_sft(
            cfg.sft,
            cfg.model_for(cfg.sft),
            model.path,
            prepared.train,
            output_dir,
            seed=cfg.seed,
            report_to=report_to,
            **evaluation_inputs(cfg, cfg.sft, prepared),
        )


@dataclass(frozen=True)
class DPOStep(TrainStep):
    kind: ClassVar[str] = "dpo"
    name: str = "dpo"

    def train(self, cfg, model, data, output_dir, report_to):
        """DPO on pairs sampled from ``model`` itself (on-policy), into ``output_dir``."""
        from posttrain.training.dpo import run_dpo  # heavy: torch, transformers, TRL

        prepared = load_data(data)
        return run_dpo(
            cfg.dpo,
            cfg.model_for(cfg.dpo),
            model.path,
            prepared.train,
            output_dir,
            seed=cfg.seed,
            report_to=report_to,
            **evaluation_inputs(cfg, cfg.dpo, prepared),
        )


@dataclass(frozen=True)
class GRPOStep(TrainStep):
    kind: ClassVar[str] = "grpo"

    def train(self, cfg, model, data, output_dir, report_to, scores: ScoreResult | None = None):
        """One GRPO stage, from ``model`` (the previous stage's output) into ``output_dir``.

        With ``eval_every`` the stage also reads the selection slice, else the held-out split (cut
        from the same records as the run's train split, whose fingerprint is in the stage's key; ``keep:
        best`` adds the selection slice's own, see posttrain.cache.keys). It draws its prompts from
        its own split when it has a ``data:`` source (PreparedData.train_for).
        """
        from posttrain.data.pass_rates import PassRates
        from posttrain.training.grpo import run_grpo_stage  # heavy: torch, transformers, TRL

        stage_cfg, prepared = self.section(cfg), load_data(data)
        return run_grpo_stage(
            stage_cfg,
            cfg.model_for(stage_cfg),
            model.path,
            prepared.train_for(self.name),
            output_dir,
            seed=cfg.seed,
            report_to=report_to,
            heldout=in_training_records(prepared, stage_cfg, self.name),
            vllm_server_cfg=cfg.vllm_server,
            pass_rates=PassRates.load(scores.output_dir) if scores is not None else None,
        )

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        """A stage that chooses its prompts by pass rate also depends on the pass rates it chose by;
        one with a ``data:`` source of its own trains on its own split (the ``data`` input), replays or
        evaluates itself on the run's records, whose train split then stands for them, and chooses its
        checkpoint by its own selection slice when it has one (the ``selection`` input)."""
        identity = super().identity(cfg, inputs)
        added = {}
        if self.section(cfg).pass_rate is not None:
            assert inputs.scores is not None, "a stage with pass_rate: runs after its scoring step"
            added["pass_rates"] = inputs.scores.output_fingerprint
        assert inputs.data is not None
        if self.section(cfg).data is not None:
            added["run_train"] = inputs.data.train_fingerprint
        if not added:
            return identity
        return keys.StepIdentity(
            identity.step, identity.config_hash, {**identity.inputs, **added}, identity.code
        )


@dataclass(frozen=True)
class RFTStep(GRPOStep):
    """A stage of the ``grpo:`` section that sets ``rft:`` (``rft-<name>``): after the same scoring step
    and with the same inputs as a GRPO stage, it fine-tunes on what the scoring found correct. Its
    key holds the run's train split, which it replays from: as its data when the stage has no
    source of its own, else as ``run_train`` (GRPOStep.identity)."""

    kind: ClassVar[str] = "rft"

    def train(self, cfg, model, data, output_dir, report_to, scores: ScoreResult | None = None):
        """SFT from ``model`` on the distinct correct completions of the stage's scoring, mixed with
        ``rft.replay`` worked solutions per completion from the run's train split, into ``output_dir``."""
        from posttrain.data.builders import build_rft_dataset  # heavy: datasets
        from posttrain.evaluation.pass_rate import correct_completions  # heavy: torch, transformers
        from posttrain.training.sft import run_sft  # heavy: torch, transformers, TRL

        assert scores is not None, "an rft: stage runs after its scoring step"
        stage_cfg, prepared = self.section(cfg), load_data(data)
        assert stage_cfg.rft is not None
        rows = scoring_candidates(prepared, self.name, stage_cfg)
        answers = {str(row["id"]): row["answer"] for row in rows}
        report = EvalReport.load(scores.output_dir)
        unknown = [r.id for r in report.records if r.id not in answers]
        if unknown:
            raise PosttrainError(
                f"{self.name}: its scoring at {scores.output_dir} holds prompts the stage's data has not "
                f"({len(unknown)}, e.g. {unknown[0]}); rerun it with --force score-{self.name}"
            )
        rft = build_rft_dataset(
            rows,
            correct_completions(report, answers),
            prepared.train,
            replay_ratio=stage_cfg.rft.replay,
            seed=cfg.seed,
            calculator="calculator" in stage_cfg.tools,
        )
        logger.info(
            "[%s] fine-tuning on %d correct completions of %d prompts and %d replayed worked solutions",
            self.name,
            rft.completions,
            rft.prompts,
            rft.replayed,
        )
        return run_sft(
            stage_cfg.rft_section(),
            cfg.model_for(stage_cfg),
            model.path,
            rft.dataset,
            output_dir,
            seed=cfg.seed,
            report_to=report_to,
            selection=in_training_records(prepared, stage_cfg, self.name),
            eval_max_new_tokens=int(stage_cfg.trainer_options()["max_completion_length"]),
            stage=self.name,
            kind=self.kind,
            recorded_cfg=stage_cfg,
            keep_data=True,
            metrics={
                "rft_completions": rft.completions,
                "rft_prompts": rft.prompts,
                "rft_replayed": rft.replayed,
            },
        )


@dataclass(frozen=True)
class ScoreStep(Step):
    """Pass rates of a GRPO stage's candidate prompts under the model the stage starts from
    (``score-grpo-<name>``, before the stage; its ``pass_rate:`` section)."""

    kind: ClassVar[str] = "score"
    stage: str = ""
    """The GRPO stage's step name, ``grpo-<name>``."""
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"score-{self.stage}")

    def section(self, cfg: PipelineConfig) -> Any:
        return keys.stage_section(cfg, self.stage).pass_rate

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        assert inputs.data is not None, "scoring runs after the data step"
        return keys.score_identity(
            cfg, self.stage, inputs.model.fingerprint, stage_train_fingerprint(inputs.data, self.stage)
        )

    def output_dir(self, store: Store, key: str) -> Path:
        return store.score_dir(self.stage, key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> ScoreResult:
        assert inputs.data is not None
        return steps.score_step(cfg, self.stage, inputs.model, inputs.data, output_dir)

    def output_is_valid(self, result: Any) -> bool:
        """The folder is intact and its pass-rate file reads back (bounded, every count checked)."""
        from posttrain.data.pass_rates import PassRates

        return isinstance(result, ScoreResult) and _reads_back(
            result.output_dir, result.output_fingerprint, lambda: PassRates.load(result.output_dir)
        )

    def made_from(self, result: Any, inputs: StepInputs) -> bool:
        return result.model_fingerprint == inputs.model.fingerprint and result.stage == self.stage

    def advance(self, inputs: StepInputs, result: ScoreResult) -> StepInputs:
        return StepInputs(inputs.model, inputs.data, result)

    @staticmethod
    def output_of(result: ScoreResult) -> str:
        return result.output_dir

    @staticmethod
    def metrics_of(result: ScoreResult) -> dict[str, Any]:
        return dict(result.summary)


TRAIN_KINDS: dict[str, type[TrainStep]] = {"sft": SFTStep, "dpo": DPOStep, "grpo": GRPOStep, "rft": RFTStep}
"""Training-stage kinds by the ``kind`` the config gives each enabled stage (`PipelineConfig.stages`)."""


@dataclass(frozen=True)
class EvalStep(Step):
    """Evaluate the current model; ``stage`` is what is evaluated (`baseline` or a training step)."""

    kind: ClassVar[str] = "eval"
    feeds_downstream: ClassVar[bool] = False
    stage: str = "baseline"
    final: bool = False
    """Whether it evaluates the run's final model: only then are ``final_only`` sets evaluated."""
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"eval-{self.stage}")

    def section(self, cfg: PipelineConfig) -> Any:
        return cfg.eval.for_model(final=self.final)

    def _config(self, cfg: PipelineConfig) -> PipelineConfig:
        """``cfg`` with the evaluation sets this step evaluates."""
        return cfg if self.final else cfg.model_copy(update={"eval": self.section(cfg)})

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        assert inputs.data is not None, "an evaluation runs after the data step"
        return keys.eval_identity(
            self._config(cfg), self.name, inputs.model.fingerprint, inputs.data.eval_fingerprint
        )

    def output_dir(self, store: Store, key: str) -> Path:
        return store.eval_dir(self.stage, key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> EvalResult:
        assert inputs.data is not None
        return steps.eval_step(self._config(cfg), self.stage, inputs.model, inputs.data, output_dir)

    def output_is_valid(self, result: Any) -> bool:
        """The report folder is intact (extra sets' reports live inside it, so its hash covers them)
        and every report in it reads back (bounded), as ``eval --diff`` and tracking will read it."""
        return isinstance(result, EvalResult) and _reads_back(
            result.report_dir,
            result.output_fingerprint,
            lambda: [EvalReport.load(folder) for _, folder, _ in result.reports()],
        )

    def made_from(self, result: Any, inputs: StepInputs) -> bool:
        return result.model_fingerprint == inputs.model.fingerprint and result.stage == self.stage

    @staticmethod
    def output_of(result: EvalResult) -> str:
        return result.report_dir

    @staticmethod
    def metrics_of(result: EvalResult) -> dict[str, Any]:
        return result.metrics()


def _same_place(a: str, b: str) -> bool:
    """Two model references name the same model: one folder (resolved), or the same hub id."""
    pa, pb = Path(a), Path(b)
    if pa.is_dir() or pb.is_dir():
        return pa.resolve() == pb.resolve()
    return a == b


def _intact(directory: str, fingerprint: str) -> bool:
    """An output folder still holds what was recorded (a record without a fingerprint never does)."""
    return bool(fingerprint) and Path(directory).is_dir() and fingerprint_tree(directory) == fingerprint


def _reads_back(directory: str, fingerprint: str, read: Callable[[], object]) -> bool:
    """:func:`_intact`, and ``read()`` (which reads the folder's files as later steps will, bounded)
    raises nothing: a file that no longer parses is recomputed, even under a record that vouches for it."""
    if not _intact(directory, fingerprint):
        return False
    try:
        read()
    except (PosttrainError, OSError) as exc:
        note_unreadable(exc)
        return False
    return True


Visitor = Callable[[Step, "str | None", StepInputs], Any]


@dataclass(frozen=True)
class Plan:
    """The ordered steps of one config; :meth:`walk` threads the model and data through them."""

    config: PipelineConfig
    steps: tuple[Step, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    @property
    def training_steps(self) -> list[TrainStep]:
        return [s for s in self.steps if isinstance(s, TrainStep)]

    def step(self, name: str) -> Step:
        for candidate in self.steps:
            if candidate.name == name:
                return candidate
        raise KeyError(name)

    def check_force(self, force: Sequence[str]) -> None:
        """``--force`` names data or training steps of this plan; anything else is a ConfigError."""
        valid = [s.name for s in self.steps if s.feeds_downstream]
        unknown = sorted(set(force) - set(valid))
        if unknown:
            raise ConfigError(
                f"--force {', '.join(unknown)}: not a step of {self.config.name}; "
                f"steps: {', '.join(sorted(valid))}"
            )

    def walk(self, base: ModelRef, visit: Visitor) -> StepInputs:
        """Visit each step in order with its cache key and inputs; returns the final inputs.

        ``visit(step, key, inputs)`` returns the step's result, or None when it cannot (a dry run
        of a step that would run). Steps that consume an unknown output get ``key=None``.
        """
        inputs = StepInputs(base)
        unknown = False
        for step in self.steps:
            key = None if unknown else step.key(self.config, inputs)
            result = visit(step, key, inputs)
            if not step.feeds_downstream:
                continue
            if result is None:
                unknown = True
            elif not unknown:
                inputs = step.advance(inputs, result)
        return inputs


def build_plan(cfg: PipelineConfig) -> Plan:
    """The steps of ``cfg`` in execution order: data, baseline eval, each stage (a GRPO stage with
    ``pass_rate:`` after its scoring step) and its eval."""
    plan: list[Step] = [DataStep()]
    stages = cfg.stages()
    if cfg.eval.baseline:
        plan.append(EvalStep("baseline", final=not stages))
    for i, (kind, name) in enumerate(stages):
        if kind in ("grpo", "rft") and keys.stage_section(cfg, name).pass_rate is not None:
            plan.append(ScoreStep(stage=name))
        plan.append(TRAIN_KINDS[kind](name=name))
        if cfg.eval.after_each_stage or i == len(stages) - 1:
            plan.append(EvalStep(name, final=i == len(stages) - 1))
    return Plan(cfg, tuple(plan))


def preview(cfg: PipelineConfig, force: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """``--dry-run``: (step, cached/run, why) for each step of the plan a run would execute.

    Reads the store and writes nothing (records; for an output without one, its result and content):
    no store is created, no server started.
    """
    store = Store.at(cfg.orchestration.store, create=False)
    records = StoreRecords(store)
    with remembered_digests(records.digests_path, save=False):
        return dry_run(build_plan(cfg), records, steps.base_model(cfg), force, store)
