"""The pipeline as one typed plan of steps, built once from the config.

:func:`build_plan` turns a config into an ordered tuple of :class:`Step` objects: prepare the data,
evaluate the base model, then each training stage followed by its evaluation. Everything that
needs the pipeline's shape reads this one object: the Prefect flow runs it (``flows/pipeline_flow.py``),
``--dry-run`` prints it (:func:`dry_run`), tracking names its nested runs after ``Step.name`` and
tags them with ``Step.kind``, and ``--force`` checks its step names. Adding a kind of training stage
is one :class:`TrainStep` entry in :data:`TRAIN_KINDS` plus its stage function.

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
from typing import Any, ClassVar, Protocol

from posttrain.core.config import PipelineConfig
from posttrain.core.errors import ConfigError, PosttrainError
from posttrain.core.hashing import fingerprint_tree, remembered_digests
from posttrain.core.results import DataResult, EvalResult, StageResult
from posttrain.core.untrusted import note_unreadable
from posttrain.evaluation.report import EvalReport
from posttrain.models.artifacts import fingerprint_dir, is_complete_stage, read_stage_json
from posttrain.pipeline import keys, steps
from posttrain.pipeline.launcher import launch_stage
from posttrain.pipeline.records import RecordError, StoreRecords, path_outside, read_output_result
from posttrain.pipeline.shared import SharedStore
from posttrain.pipeline.steps import ModelRef
from posttrain.pipeline.store import Store

logger = logging.getLogger(__name__)

__all__ = [
    "TRAIN_KINDS",
    "preview",
    "CacheRecords",
    "DataStep",
    "Decision",
    "EvalStep",
    "Plan",
    "Planner",
    "Step",
    "StepInputs",
    "TrainStep",
    "build_plan",
    "dry_run",
]


@dataclass(frozen=True)
class StepInputs:
    """What a step consumes: the current model and, after the data step, the prepared data."""

    model: ModelRef
    data: DataResult | None = None


class Step:
    """One step of the plan: its identity, cache key, output location, how to run and verify it."""

    kind: ClassVar[str]
    """`data`, `sft`, `dpo`, `grpo` or `eval`: tags the MLflow run, names the Prefect task."""
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
    """A training stage: ``sft``, ``dpo`` or ``grpo-<name>`` (see :data:`TRAIN_KINDS`)."""

    kind: ClassVar[str] = "train"
    name: str = ""

    def section(self, cfg: PipelineConfig) -> Any:
        return keys.stage_section(cfg, self.name)

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        assert inputs.data is not None, "a training step runs after the data step"
        data = inputs.data
        selection = str(data.stats.get("selection_fingerprint", ""))
        return keys.train_identity(
            cfg, self.name, inputs.model.fingerprint, data.train_fingerprint, selection
        )

    def output_dir(self, store: Store, key: str) -> Path:
        return store.stage_dir(self.name, key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> StageResult:
        """Train in this process, or under ``accelerate launch`` (``launch.launcher``), whose
        processes run :meth:`train` themselves (posttrain.pipeline.stage_main)."""
        assert inputs.data is not None
        if cfg.launch_of(self.section(cfg)).launcher == "accelerate":
            return launch_stage(cfg, self.name, self.kind, self.section(cfg), inputs, str(output_dir))
        return self.train(cfg, inputs.model, inputs.data, output_dir, report_to)

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
        return steps.sft_step(cfg, model, data, output_dir, report_to)


@dataclass(frozen=True)
class DPOStep(TrainStep):
    kind: ClassVar[str] = "dpo"
    name: str = "dpo"

    def train(self, cfg, model, data, output_dir, report_to):
        return steps.dpo_step(cfg, model, data, output_dir, report_to)


@dataclass(frozen=True)
class GRPOStep(TrainStep):
    kind: ClassVar[str] = "grpo"

    def train(self, cfg, model, data, output_dir, report_to):
        return steps.grpo_step(cfg, self.section(cfg), model, data, output_dir, report_to)


TRAIN_KINDS: dict[str, type[TrainStep]] = {"sft": SFTStep, "dpo": DPOStep, "grpo": GRPOStep}
"""Training-stage kinds by the ``kind`` the config gives each enabled stage (`PipelineConfig.stages`)."""


@dataclass(frozen=True)
class EvalStep(Step):
    """Evaluate the current model; ``stage`` is what is evaluated (`baseline` or a training step)."""

    kind: ClassVar[str] = "eval"
    feeds_downstream: ClassVar[bool] = False
    stage: str = "baseline"
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"eval-{self.stage}")

    def section(self, cfg: PipelineConfig) -> Any:
        return cfg.eval

    def identity(self, cfg: PipelineConfig, inputs: StepInputs) -> keys.StepIdentity:
        assert inputs.data is not None, "an evaluation runs after the data step"
        return keys.eval_identity(cfg, self.name, inputs.model.fingerprint, inputs.data.eval_fingerprint)

    def output_dir(self, store: Store, key: str) -> Path:
        return store.eval_dir(self.stage, key)

    def run(self, cfg, inputs, output_dir, report_to="none") -> EvalResult:
        assert inputs.data is not None
        return steps.eval_step(cfg, self.stage, inputs.model, inputs.data, output_dir)

    def output_is_valid(self, result: Any) -> bool:
        """The report folder is intact (extra sets' reports live inside it, so its hash covers them)
        and every report in it reads back (bounded), as ``eval --diff`` and tracking will read it."""
        if not isinstance(result, EvalResult) or not _intact(result.report_dir, result.output_fingerprint):
            return False
        try:
            for _, folder, _ in result.reports():
                EvalReport.load(folder)
        except (PosttrainError, OSError) as exc:
            note_unreadable(exc)
            return False
        return True

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
    """The steps of ``cfg`` in execution order: data, baseline eval, each stage and its eval."""
    plan: list[Step] = [DataStep()]
    if cfg.eval.baseline:
        plan.append(EvalStep("baseline"))
    stages = cfg.stages()
    for i, (kind, name) in enumerate(stages):
        plan.append(TRAIN_KINDS[kind](name=name))
        if cfg.eval.after_each_stage or i == len(stages) - 1:
            plan.append(EvalStep(name))
    return Plan(cfg, tuple(plan))


# --------------------------------------------------------------------------- cache decisions


class CacheRecords(Protocol):
    """Where cached step results are kept (JSON records in the store: :mod:`posttrain.pipeline.records`)."""

    def exists(self, key: str) -> bool: ...

    def read(self, key: str, kind: str | None = None) -> Any: ...

    def code_of_lineage(self, lineage: str) -> dict[str, str] | None:
        """The code fingerprint files of the latest record of this lineage (None: no such record)."""
        ...


@dataclass(frozen=True)
class Decision:
    status: str
    """`cached` or `run`."""
    reason: str
    result: Any = field(default=None, compare=False, repr=False)
    """The verified cached result when `cached`."""
    adopted: bool = False
    """`cached` from a complete output whose cache record is missing: the caller writes the record."""


class Planner:
    """Which steps run and which are served from cache, and why: used by the flow and by ``--dry-run``.

    A step is cached when the records hold a result under its key and the output that result points
    to is still there, unmodified. With the ``store``, a step whose record is missing but whose
    output is there (a kill fell between the output's rename and its record) is *adopted*: the
    result the output carries is checked like a cached one (content fingerprint, inputs, path) and
    used instead of recomputing; an output that fails the check is recomputed and replaced.
    ``--force STEP`` reruns that step and everything after it: a forced retrain may produce
    identical weights, and the user asked for the rest too.
    """

    def __init__(
        self,
        plan: Plan,
        records: CacheRecords,
        force: Sequence[str] = (),
        store: Store | None = None,
        shared: SharedStore | None = None,
    ):
        plan.check_force(force)
        self.plan, self.records, self.force, self.store = plan, records, set(force), store
        self.shared = shared
        """With a shared store, an output missing here is pulled from it, then adopted (verified)."""
        self.forced_from: str | None = None

    def cached_result(self, step: Step, key: str) -> Any | None:
        """The cached result under ``key`` if its output is intact, else None."""
        return self._lookup(step, key)[0]

    def _lookup(self, step: Step, key: str, inputs: StepInputs | None = None) -> tuple[Any | None, str]:
        """(result, "") for a usable cache entry, else (None, why not)."""
        if not self.records.exists(key):
            return None, self._unrecorded_output(step, key) or self._why_missing(step, inputs)
        try:
            result = self.records.read(key, step.kind)
        except Exception as exc:  # an unreadable record is a cache miss, never a crash
            note_unreadable(f"cache record {key} is unreadable ({exc})")
            return None, "cache record unreadable"
        if (outside := self._outside(step, key, result)) is not None:
            note_unreadable(f"cache record {key}: names {outside}, outside the store {self._root}")
            return None, "cache record points outside the store"
        if not self._verified(step, result, inputs):
            return None, "cached output missing or modified"
        return result, ""

    @property
    def _root(self) -> Path | None:
        return self.store.root if self.store is not None else None

    def _outside(self, step: Step, key: str, result: Any) -> str | None:
        """A path of ``result`` that is not where this store keeps ``key``'s output (None: all are).
        Records and ``.result.json`` files are store contents: they may name any folder on the
        machine, and a cached output is served only from inside the store."""
        if self.store is None:
            return None
        expected = str(step.output_dir(self.store, key).resolve())
        if step.output_of(result) != expected:
            return step.output_of(result)
        return path_outside(result, self.store.root)

    def _verified(self, step: Step, result: Any, inputs: StepInputs | None) -> bool:
        """The output is intact and made from ``inputs``; damaged store contents (a malformed
        ``stage.json`` or report) are a miss, logged once, never a crash."""
        try:
            if inputs is not None and not step.made_from(result, inputs):
                return False
            return step.output_is_valid(result)
        except (
            PosttrainError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RecursionError,
        ) as exc:
            note_unreadable(f"{step.output_of(result)}: {exc}")
            return False

    def adoptable(self, step: Step, key: str, inputs: StepInputs) -> Any | None:
        """The verified result of ``step``'s output under ``key`` when it has no cache record, else None."""
        if self.store is None or self.records.exists(key):
            return None
        out = step.output_dir(self.store, key)
        try:
            result = read_output_result(step.kind, out)
        except RecordError as exc:
            if out.exists():
                note_unreadable(exc)
            return None
        if (outside := self._outside(step, key, result)) is not None:
            note_unreadable(f"{out}: its result names {outside}, outside the store {self._root}")
            return None
        return result if self._verified(step, result, inputs) else None

    def _pull(self, step: Step, key: str) -> bool:
        """Download ``key``'s output from the shared store when this store has neither record nor output."""
        if self.shared is None or self.store is None or self.records.exists(key):
            return False
        output_dir = step.output_dir(self.store, key)
        return not output_dir.exists() and self.shared.pull(step.kind, key, output_dir)

    def _unrecorded_output(self, step: Step, key: str) -> str:
        """Why an output without a record is not adopted ("" when there is no such output)."""
        if self.store is None or not step.output_dir(self.store, key).exists():
            return ""
        return "output without a cache record failed verification: recomputing"

    def _why_missing(self, step: Step, inputs: StepInputs | None) -> str:
        """No record under the key: say so, or that only the code changed since the last one."""
        missing = "no cache entry for these inputs/config"
        lookup = getattr(self.records, "code_of_lineage", None)
        if inputs is None or lookup is None:
            return missing
        identity = step.identity(self.plan.config, inputs)
        before = lookup(identity.lineage)
        if before is None:
            return missing
        changed = identity.code.changed(before)
        if not changed:
            return missing
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        return f"code changed: {', '.join(changed[:3])}{more}"

    def decide(self, step: Step, key: str, inputs: StepInputs | None = None) -> Decision:
        if step.name in self.force and self.forced_from is None:
            self.forced_from = step.name
        if self.forced_from is not None:
            why = "forced" if step.name == self.forced_from else f"after forced {self.forced_from}"
            return Decision("run", why)
        if not self.plan.config.orchestration.cache:
            return Decision("run", "caching disabled (orchestration.cache: false)")
        pulled = inputs is not None and self._pull(step, key)
        if inputs is not None and (adopted := self.adoptable(step, key, inputs)) is not None:
            why = (
                "pulled from the shared store"
                if pulled
                else "complete output adopted (its cache record was missing)"
            )
            return Decision("cached", why, adopted, True)
        result, why = self._lookup(step, key, inputs)
        if result is None:
            return Decision("run", why)
        return Decision("cached", f"cache hit {key[:12]}", result)


def dry_run(
    plan: Plan, records: CacheRecords, base: ModelRef, force: Sequence[str] = (), store: Store | None = None
) -> list[tuple[str, str, str]]:
    """(step, status, reason) for every step of ``plan``, without running anything.

    Keys downstream of a step that would run depend on that step's new output, so those steps are
    reported as `run` with the upstream step named. With ``store``, outputs whose record is missing
    are shown as they would be adopted (nothing is written).
    """
    planner = Planner(plan, records, force, store)
    rows: list[tuple[str, str, str]] = []
    upstream: list[str] = []

    def visit(step: Step, key: str | None, inputs: StepInputs) -> Any:
        if key is None:
            rows.append((step.name, "run", f"after {upstream[0]} reruns"))
            return None
        decision = planner.decide(step, key, inputs)
        rows.append((step.name, decision.status, decision.reason))
        result = decision.result
        if result is None and step.feeds_downstream and not upstream:
            upstream.append(step.name)
        return result

    plan.walk(base, visit)
    return rows


def preview(cfg: PipelineConfig, force: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """``--dry-run``: (step, cached/run, why) for each step of the plan a run would execute.

    Reads the store and writes nothing (records; for an output without one, its result and content):
    no store is created, no server started.
    """
    store = Store.at(cfg.orchestration.store, create=False)
    records = StoreRecords(store)
    with remembered_digests(records.digests_path, save=False):
        return dry_run(build_plan(cfg), records, steps.base_model(cfg), force, store)
