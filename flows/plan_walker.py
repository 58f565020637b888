"""Walking a config's plan: each step served from cache or run, each with its MLflow run.

:class:`PlanRunner` holds everything a pipeline run does around its steps (the refresh decision,
the cache record, the nested MLflow run, the stage's LoggedModel, the shared store) and imports no
Prefect: the ``posttrain-pipeline`` flow (:mod:`posttrain.flows.pipeline_flow`) runs each step that must
run as a Prefect task through a subclass, and :func:`run_cached` serves a run whose every step is
cached without Prefect at all (no server to start: seconds instead of tens of seconds), logging to
MLflow exactly what the flow logs for the same run.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.cache.digests import remembered_digests
from posttrain.cache.keys import stage_section
from posttrain.cache.planner import Planner
from posttrain.cache.records import StoreRecords
from posttrain.cache.shared import SharedStore, open_shared
from posttrain.cache.store import StepLock, Store
from posttrain.core.atomic import discard_checkpoints
from posttrain.core.config import PipelineConfig
from posttrain.core.metric_names import qualify_metrics
from posttrain.core.results import DataResult, EvalResult, ScoreResult
from posttrain.data.pass_rates import PassRates
from posttrain.evaluation.diff import stage_delta_metrics
from posttrain.evaluation.report import EvalReport
from posttrain.models.artifacts import (
    adapter_root,
    is_adapter_dir,
    read_log_history,
    read_stage_json,
    read_train_data,
)
from posttrain.pipeline.plan import EvalStep, Plan, Step, StepInputs, TrainStep, build_plan, preview
from posttrain.pipeline.steps import base_model, load_data, stage_train_fingerprint
from posttrain.pipeline.validation import check_rewards
from posttrain.tracking import (
    MODEL_ID_TAG,
    StageRun,
    Tracker,
    close_abandoned_runs,
    flatten_params,
    start_pipeline_run,
)

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineSummary",
    "PlanRunner",
    "StepNotCached",
    "StepOutcome",
    "run_cached",
    "run_plan",
    "stage_deltas",
    "sweep_started",
    "warn_unfinished",
]


@dataclass(frozen=True)
class StepOutcome:
    step: str
    status: str
    """`ran` or `cached`."""
    reason: str
    key: str
    output: str
    metrics: dict[str, Any] = field(default_factory=dict)
    kind: str = ""
    """The plan step's kind: `data`, `sft`, `dpo`, `grpo`, `rft`, `score` or `eval`."""
    seconds: float | None = None
    """Wall time of a training or scoring step when it ran (its producer's, when served from cache)."""


@dataclass
class PipelineSummary:
    config: str
    run_id: str | None
    outcomes: list[StepOutcome] = field(default_factory=list)
    changes: dict[str, float] = field(default_factory=dict)
    """:func:`stage_deltas`: each evaluation's paired change from the one before and its cost."""
    experiment: str | None = None
    """The MLflow experiment ``run_id`` is in."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Submitted:
    """An evaluation running beside the walk (:meth:`PlanRunner.submit`), holding its key's lock
    until :meth:`PlanRunner._collect` records and logs it."""

    step: EvalStep
    key: str
    inputs: StepInputs
    reason: str
    evaluated: str | None
    future: Any
    lock: StepLock


class StepNotCached(RuntimeError):
    """A step of a run meant to be served from cache would have to run (see :func:`run_cached`)."""


class PlanRunner:
    """Visits each plan step: serves it from cache or runs it, with its MLflow run.

    This class runs nothing itself: :meth:`execute` raises :class:`StepNotCached`, which is what
    :func:`run_cached` wants. The Prefect flow's subclass runs a step as a Prefect task.
    """

    def __init__(
        self,
        plan: Plan,
        store: Store,
        tracker: Tracker,
        force: Sequence[str],
        shared: SharedStore | None = None,
    ):
        self.cfg, self.store, self.tracker, self.shared = plan.config, store, tracker, shared
        self.records = StoreRecords(store)
        self.planner = Planner(plan, self.records, force, store, shared)
        self.summary = PipelineSummary(plan.config.name, tracker.run_id, experiment=tracker.experiment_name)
        self.final_stage = plan.training_steps[-1].name if plan.training_steps else None
        self.models: dict[str, str] = {}
        """Training step name → its MLflow LoggedModel id (evaluations log against it)."""
        self.step_names = plan.names
        self._pending: list[_Submitted] = []
        self._failed: list[BaseException] = []

    def __call__(self, step: Step, key: str | None, inputs: StepInputs) -> Any:
        assert key is not None, "the flow always knows its inputs"
        self._collect(wait=False)
        # Decided and made under the key's lock: another point of a sweep may be making this step.
        lock = self.store.step_lock(key).acquire()
        try:
            result = self._visit(step, key, inputs, lock)
        except BaseException:
            lock.release()
            raise
        if not (self._pending and self._pending[-1].lock is lock):
            lock.release()
        return result

    def _visit(self, step: Step, key: str, inputs: StepInputs, lock: StepLock) -> Any:
        decision = self.planner.decide(step, key, inputs)
        cached = decision.status == "cached"
        evaluated = self.models.get(step.stage) if isinstance(step, EvalStep) else None
        output_dir = step.output_dir(self.store, key)
        # A finished stage needs no checkpoints; a forced one retrains from its input.
        forced = self.planner.forced_from is not None
        if isinstance(step, TrainStep) and (cached or forced) and discard_checkpoints(output_dir):
            logger.info("%s: deleted the checkpoints of an interrupted run", step.name)
        if cached:
            # The verified result from the store's JSON record: Prefect's result store (which
            # unpickles what a record names) is never read; see posttrain.cache.records.
            result = decision.result
            if decision.adopted:
                self._record(step, key, inputs, result)
            self._tracked(
                step.name,
                lambda: self._log_cached(step, key, result, decision.adopted, evaluated, inputs.data),
            )
        else:
            call = {"cfg": self.cfg, "step": step.name, "inputs": inputs, "key": key}
            call["output_dir"] = str(output_dir)
            if isinstance(step, EvalStep) and (future := self.submit(step, call)) is not None:
                # Nothing downstream needs an evaluation: the walk goes on with the key still locked.
                self._pending.append(_Submitted(step, key, inputs, decision.reason, evaluated, future, lock))
                return None
            with self._stage_run(step, key) as run:
                result = self.execute(step, call, run)
                self._ran(step, key, inputs, result, run, evaluated)
        self._conclude(step, key, decision.reason, result, ran=not cached)
        return result

    def _log_cached(
        self, step: Step, key: str, result: Any, adopted: bool, evaluated: str | None, data: DataResult | None
    ) -> None:
        """A cached step's nested run: the producer's metrics copied, or, when no finished run
        produced it (its run was killed, or its tracking server went away, before it logged its
        result), everything a run of the step logs, read from the store."""
        producer = self.tracker.find_producer(key)
        # Searched once, here: without a cache key the record does not search again.
        run = self.tracker.record_cached_stage(step.name, kind=step.kind, producer_run_id=producer)
        run.set_tags({"cache_key": key})
        if run.enabled and (adopted or producer is None):
            logger.info("%s: no finished MLflow run logged this output; logging it from the store", step.name)
            run.set_tags({"adopted": "true"} if adopted else {"logged_from_store": "true"})
            _log_result(run, result, model_id=evaluated, cfg=self.cfg, data=data)
            if isinstance(step, TrainStep):
                run.log_history(read_log_history(result.output_dir))
        if isinstance(step, TrainStep):
            self._stage_model(step, run, key, result, cached=True)

    def _tracked(self, during: str, log: Any) -> None:
        """``log()``: MLflow calls about step ``during``. If they fail because the tracking server
        went away, tracking is off for the rest of the run (:meth:`Tracker.went_away`) and the run
        goes on: the step's output and record are in the store already."""
        if not self.tracker.enabled:
            return
        try:
            log()
        except Exception as exc:
            if not self.tracker.went_away(during, exc):
                raise

    def submit(self, step: EvalStep, call: dict[str, Any]) -> Any:
        """Start evaluation ``step`` beside what follows it and return its future (with a blocking
        ``result()``), or None to run it now like any step (the default)."""
        return None

    def done(self, future: Any) -> bool:
        """Whether a future :meth:`submit` returned has finished."""
        return future.done()

    def _collect(self, *, wait: bool) -> None:
        """Record and log the submitted evaluations that finished (with ``wait``, all of them, in plan
        order) as if each had run in place, then release its key's lock. A failure is kept for
        :meth:`finish`: the walk goes on, and the other evaluations are still waited for."""
        for sub in [s for s in self._pending if wait or self.done(s.future)]:
            self._pending.remove(sub)
            try:
                with self._stage_run(sub.step, sub.key) as run:
                    result = sub.future.result()
                    self._ran(sub.step, sub.key, sub.inputs, result, run, sub.evaluated)
                self._conclude(sub.step, sub.key, sub.reason, result, ran=True)
            except Exception as exc:  # noqa: BLE001 - reported by finish()
                self._failed.append(exc)
                logger.error("%s failed: %s", sub.step.name, exc)
            finally:
                sub.lock.release()

    def finish(self, *, raise_errors: bool = True) -> None:
        """Wait for the submitted evaluations, so none is still writing into the store when the run
        ends; then raise the first failure (unless ``raise_errors`` is false: the walk failed
        already and that is the error to report)."""
        self._collect(wait=True)
        order = {name: i for i, name in enumerate(self.step_names)}
        self.summary.outcomes.sort(key=lambda o: order[o.step])
        if self._failed and raise_errors:
            raise self._failed[0]

    def _stage_run(self, step: Step, key: str) -> Any:
        return self.tracker.stage(step.name, kind=step.kind, params=step.section(self.cfg), cache_key=key)

    def _ran(
        self,
        step: Step,
        key: str,
        inputs: StepInputs,
        result: Any,
        run: StageRun,
        evaluated: str | None,
    ) -> None:
        """What follows a step that ran, inside its MLflow run: its cache record, its logged result,
        and for a training stage its history, LoggedModel and health alerts."""
        self._record(step, key, inputs, result)
        self._tracked(step.name, lambda: self._log_ran(step, key, result, run, evaluated, inputs.data))
        if isinstance(step, TrainStep):
            self.after_training(step, result, run)

    def _log_ran(
        self, step: Step, key: str, result: Any, run: StageRun, evaluated: str | None, data: DataResult | None
    ) -> None:
        _log_result(run, result, model_id=evaluated, cfg=self.cfg, data=data)
        if isinstance(step, TrainStep):
            if self.cfg.launch_of(step.section(self.cfg)).launcher == "accelerate":
                # Its processes report to no tracker: the history rank 0 kept, logged here.
                run.log_history(read_log_history(result.output_dir))
            self._stage_model(step, run, key, result, cached=False)

    def _conclude(self, step: Step, key: str, reason: str, result: Any, *, ran: bool) -> None:
        """The step's shared copy and its line in the summary."""
        cached = not ran
        output_dir = step.output_dir(self.store, key)
        if self.shared is not None:
            # A step that ran replaces the shared copy: it was missing, failed verification or forced.
            self.shared.push(step.kind, key, output_dir, result, replace=not cached)
        status = "cached" if cached else "ran"
        self.summary.outcomes.append(
            StepOutcome(
                step.name,
                status,
                reason,
                key,
                step.output_of(result),
                step.metrics_of(result),
                step.kind,
                _seconds(result),
            )
        )
        logger.info("%-22s %-6s %s", step.name, "cached" if cached else "run", reason)

    def execute(self, step: Step, call: dict[str, Any], run: StageRun) -> Any:
        """Run ``step`` (``call``: the step task's arguments) inside its MLflow ``run``; its result."""
        raise StepNotCached(f"{step.name} is not served from cache")

    def after_training(self, step: TrainStep, result: Any, run: StageRun) -> None:
        """Called after a training step ran and its result and model were logged."""

    def _record(self, step: Step, key: str, inputs: StepInputs, result: Any) -> None:
        identity = step.identity(self.cfg, inputs)
        self.records.write(
            key,
            step=step.name,
            kind=step.kind,
            result=result,
            lineage=identity.lineage,
            code=identity.code.files,
        )

    def _stage_model(self, step: TrainStep, run: StageRun, key: str, result: Any, *, cached: bool) -> None:
        """The stage output's LoggedModel: the producer's for a cached stage, else a new one (with
        the weights for the final stage when ``tracking.log_model``, a reference otherwise)."""
        model_id = self.tracker.find_stage_model(key) if cached else None
        linked = False  # to the stage's run, as log_model links the weights it logs
        if model_id is None:
            section = step.section(self.cfg)
            params = {  # the model settings this stage trained with (its own `lora:` included)
                **flatten_params(self.cfg.model_for(section), "model"),
                **flatten_params(section, "stage"),
            }
            where = {"kind": step.kind, "cache_key": key, "params": params}
            if step.name == self.final_stage and self.tracker.log_models:
                model = result.output_dir
                base = adapter_root(model) if is_adapter_dir(model) else None
                uri = self.tracker.log_final_model(model, base_model_path=base, stage=run, **where)
                model_id = uri.removeprefix("models:/") if uri else None
                linked = model_id is not None
            else:
                model_id = self.tracker.log_stage_model(run, output_dir=result.output_dir, **where)
        if model_id is not None:
            self.models[step.name] = model_id
            run.set_tags({MODEL_ID_TAG: model_id})
            self.tracker.link_stage_model(run, model_id, final=step.name == self.final_stage, linked=linked)


def _log_result(
    run: Any, result: Any, *, cfg: PipelineConfig, model_id: str | None = None, data: DataResult | None = None
) -> None:
    """What each kind of step leaves in its nested MLflow run (evaluations: against ``model_id``; a
    training stage: with what it draws from as its input, ``data``'s train set or the stage's own
    prompts, before the stage's own selection, or the rows it kept of what it trained on)."""
    dataset_name = cfg.eval.data
    if isinstance(result, DataResult):
        prepared = load_data(result)
        run.log_metrics({k: v for k, v in result.stats.items() if isinstance(v, int | float)})
        run.log_dataset(prepared.train, name="train", context="training", digest=result.train_fingerprint)
        run.log_dataset(prepared.eval, name="heldout", context="evaluation", digest=result.eval_fingerprint)
        for stage, dataset in prepared.stage_train.items():
            digest = stage_train_fingerprint(result, stage)
            run.log_dataset(dataset, name=f"{stage} prompts", context="training", digest=digest)
        return
    if isinstance(result, EvalResult):
        for name, folder, metrics in result.reports():
            report = EvalReport.load(folder)
            info = report.config.get("dataset")
            run.log_eval(
                qualify_metrics(metrics, name),
                [r.as_dict() for r in report.records],
                model_id=model_id,
                dataset_name=name or dataset_name,
                table=f"{name}/eval_examples" if name else "eval_examples",
                data_info=info if isinstance(info, dict) else None,
            )
        run.log_metrics({f"eval/{k}": v for k, v in result.timings.items() if isinstance(v, int | float)})
        return
    if isinstance(result, ScoreResult):
        rates = PassRates.load(result.output_dir)
        questions = {r.id: r.question for r in EvalReport.load(result.output_dir).records}
        run.log_metrics({k: v for k, v in result.summary.items() if isinstance(v, int | float)})
        pass_rate = stage_section(cfg, result.stage).pass_rate  # today's band: it is not in the key
        run.log_pass_rates(rates, pass_rate, questions)
        return
    info = read_stage_json(result.output_dir)
    run.log_stage_json(info)
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, int | float)}
    # The summary holds each metric's last logged value (summarize_history): logged at the stage's
    # last step it ends the curves the trainer drew; without a step it would start them at step 0.
    run.log_metrics(metrics, step=int(metrics.get("step", 0)))
    run.log_alerts(list(result.alerts))
    if info.get("kind") == "rft":  # rows no data step holds: the exact set it fine-tuned on, or none
        kept = read_train_data(result.output_dir)
        if kept is not None:
            run.log_dataset(
                kept,
                name=f"{result.stage} training data",
                context="training",
                digest=str(info.get("data_fingerprint") or "") or None,
            )
    elif data is not None:
        prepared = load_data(data)
        run.log_dataset(
            prepared.train_for(result.stage),
            name=f"{result.stage} prompts" if result.stage in prepared.stage_train else "train",
            context="training",
            digest=stage_train_fingerprint(data, result.stage),
        )
    if result.samples:
        run.log_completions(result.output_dir)
        run.plot_rewards()


def run_plan(
    plan: Plan,
    force: Sequence[str] = (),
    runner: type[PlanRunner] = PlanRunner,
    *,
    sweep_point: bool = False,
    run_name: str | None = None,
    run_tags: Mapping[str, str] | None = None,
) -> PipelineSummary:
    """Walk ``plan`` in its store under the store's lock and one MLflow pipeline run, visiting each
    step with ``runner``; then the accuracy-by-stage plot. Returns the per-step summary. The MLflow
    pipeline run is named ``run_name`` (default: the config's name) and also gets ``run_tags``.

    A ``sweep_point`` leaves the store's lock, its tidying and the closing of its abandoned MLflow
    runs to the sweep, which does them once for all its points (:func:`sweep_started`): a point
    that tidied would delete a sibling's output while it is written."""
    cfg = plan.config
    store = Store.at(cfg.orchestration.store)
    store.check_writable()
    with contextlib.ExitStack() as stack:
        if not sweep_point:
            # Reentrant: `posttrain run` takes the lock before Prefect's server starts, then runs the flow.
            stack.enter_context(store.lock(reentrant=True))
        run = start_pipeline_run(
            cfg,
            run_name=run_name,
            run_tags=run_tags,
            steps=plan.names,
            store=str(store.root),
            close_abandoned=not sweep_point,
        )
        tracker = stack.enter_context(run)
        if not sweep_point:
            store.clean_interrupted_writes()
        visit = runner(plan, store, tracker, force, open_shared(cfg.orchestration.shared_store))
        with remembered_digests(visit.records.digests_path):
            try:
                plan.walk(base_model(cfg), visit)
            except BaseException:
                visit.finish(raise_errors=False)
                raise
            visit.finish()
        if not sweep_point:  # every stage of this plan finished
            warn_unfinished(store)
        visit.summary.changes = stage_deltas(visit.summary)
        visit._tracked("the run's summary", lambda: tracker.log_metrics(visit.summary.changes))
        visit._tracked("the run's summary", tracker.plot_accuracy_by_stage)
        visit._tracked("the run's summary", tracker.log_stage_gains)
        tracker.finish()
        if tracker.lost is not None:
            raise tracker.lost_error(str(store.root))
    return visit.summary


def _seconds(result: Any) -> float | None:
    """What a step cost in wall time, for the steps that buy a change (training and scoring)."""
    if isinstance(result, ScoreResult):
        value = result.summary.get("duration_s")
        return float(value) if isinstance(value, int | float) else None
    duration = getattr(result, "duration_s", None)
    return float(duration) if isinstance(duration, int | float) and duration > 0 else None


def stage_deltas(summary: PipelineSummary) -> dict[str, float]:
    """Each evaluation's paired change from the evaluation before it in the plan, on the same
    questions, as parent-run metrics: ``eval-sft/delta_accuracy_strict`` with its interval, the
    questions fixed and broken, McNemar's p (:func:`posttrain.evaluation.diff.stage_delta_metrics`),
    and ``eval-sft/stage_minutes``: the wall time of the training and scoring steps between the two
    evaluations, what the change cost (left out, named, when a step between has no recorded time).
    ``posttrain compare`` reads them back; a pair whose reports cannot be read is skipped, named."""
    evals = [o for o in summary.outcomes if o.kind == "eval"]
    order = {o.step: i for i, o in enumerate(summary.outcomes)}
    out: dict[str, float] = {}
    for before, after in itertools.pairwise(evals):
        between = summary.outcomes[order[before.step] + 1 : order[after.step]]
        unknown = [o.step for o in between if o.seconds is None]
        if unknown:
            # Summing the steps that have a time would understate the cost and overstate the
            # points per minute; no minutes is the honest figure.
            logger.warning(
                "%s: no stage minutes: no wall time recorded for %s", after.step, ", ".join(unknown)
            )
        elif between:
            out[f"{after.step}/stage_minutes"] = round(sum(o.seconds or 0.0 for o in between) / 60, 3)
        try:
            deltas = stage_delta_metrics(before.output, after.output)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("no paired change from %s to %s: %s", before.step, after.step, exc)
            continue
        out.update({f"{after.step}/{name}": value for name, value in deltas.items()})
    return out


def warn_unfinished(store: Store) -> None:
    """Warn of checkpoint folders left in ``store`` by stages no run of it finished."""
    if leftovers := store.unfinished_checkpoints():
        logger.warning(
            "%d checkpoint folder(s) of unfinished stages of other configs or code: %s "
            "(a rerun of that config resumes from them; delete them otherwise)",
            len(leftovers),
            ", ".join(p.name for p in leftovers),
        )


def sweep_started(cfg: PipelineConfig, store: Store) -> None:
    """What a run does once per store, done once for all the points of a sweep before they start
    (each runs with ``sweep_point``): tidy what a killed run left, close its MLflow runs."""
    store.clean_interrupted_writes()
    close_abandoned_runs(cfg, str(store.root))


def run_cached(cfg: PipelineConfig, force: Sequence[str] = ()) -> dict[str, Any] | None:
    """The pipeline run of ``cfg`` without Prefect, when its dry run serves every step from cache;
    None, having done nothing, when any step would run.

    Call it holding the store's lock, so that the dry run's decisions still hold when the plan is
    walked: each step is decided again then, by the same checks as in the flow (key, record, output
    verified), and a step that would run after all raises :class:`StepNotCached`. MLflow gets what
    the flow's run logs; Prefect gets nothing (no flow run, no summary artifact).
    """
    check_rewards(cfg, cfg.name)
    if any(status != "cached" for _, status, _ in preview(cfg, force)):
        return None
    return run_plan(build_plan(cfg), force).as_dict()
