"""The `posttrain-pipeline` Prefect flow: prepare data → baseline eval → each training stage → eval.

Every step is a cached task keyed by what its output depends on (see `posttrain.pipeline.steps`), so an
unchanged config reruns nothing, a changed stage reruns from that stage on, and `force` reruns a
stage and everything after it on purpose. A cache record whose output directory is gone or no
longer matches its fingerprint is recomputed, not trusted. MLflow gets one parent run per flow run
and one nested run per step; a step served from cache still appears, tagged `cached=true`.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from the
# real annotation objects, and a string "PipelineConfig" cannot be resolved when a deployment runs.
import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from posttrain.core.atomic import discard_checkpoints
from posttrain.core.config import PipelineConfig
from posttrain.core.hashing import remembered_digests
from posttrain.core.metric_names import qualify_metrics, slices_of
from posttrain.core.redact import redact, redact_override
from posttrain.evaluation.report import EvalReport
from posttrain.flows.prefect_compat import redact_stored_parameters, store_parameters_redacted
from posttrain.flows.prefect_ui import emit_health_alerts, posttrain_logs_to_prefect
from posttrain.models.artifacts import adapter_root, is_adapter_dir, read_log_history, read_stage_json
from posttrain.pipeline import load_config
from posttrain.pipeline.plan import EvalStep, Plan, Planner, Step, StepInputs, TrainStep, build_plan, dry_run
from posttrain.pipeline.records import StoreRecords
from posttrain.pipeline.shared import SharedStore, open_shared
from posttrain.pipeline.steps import DataResult, EvalResult, base_model, load_data
from posttrain.pipeline.store import Store
from posttrain.pipeline.validation import check_rewards
from posttrain.tasks.steps import step_task
from posttrain.tracking import MODEL_ID_TAG, StageRun, Tracker, flatten_params, start_pipeline_run

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineSummary",
    "StepOutcome",
    "artifact_key",
    "posttrain_pipeline",
    "preview",
    "redact_run_parameters",
    "run_config",
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
    """The plan step's kind: `data`, `sft`, `dpo`, `grpo` or `eval`."""


@dataclass
class PipelineSummary:
    config: str
    run_id: str | None
    outcomes: list[StepOutcome] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Runner:
    """Runs one plan step as a cached task with the right refresh decision and its MLflow run."""

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
        self.summary = PipelineSummary(plan.config.name, tracker.run_id)
        self.final_stage = plan.training_steps[-1].name if plan.training_steps else None
        self.models: dict[str, str] = {}
        """Training step name → its MLflow LoggedModel id (evaluations log against it)."""

    def __call__(self, step: Step, key: str | None, inputs: StepInputs) -> Any:
        assert key is not None, "the flow always knows its inputs"
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
            # unpickles what a record names) is never read; see posttrain.pipeline.records.
            result = decision.result
            if decision.adopted:
                self._record(step, key, inputs, result)
            run = self.tracker.record_cached_stage(step.name, kind=step.kind, cache_key=key)
            run.set_tags({"cache_key": key})
            if decision.adopted:  # the run that produced it was killed before logging its result
                run.set_tags({"adopted": "true"})
                _log_result(run, result, model_id=evaluated, dataset_name=self.cfg.eval.data)
            if isinstance(step, TrainStep):
                self._stage_model(step, run, key, result, cached=True)
        else:
            call = {"cfg": self.cfg, "step": step.name, "inputs": inputs, "key": key}
            call["output_dir"] = str(output_dir)
            with self.tracker.stage(
                step.name, kind=step.kind, params=step.section(self.cfg), cache_key=key
            ) as run:
                state = step_task(**call, report_to=run.report_to, return_state=True)
                result = state.result()
                self._record(step, key, inputs, result)
                _log_result(run, result, model_id=evaluated, dataset_name=self.cfg.eval.data)
                if isinstance(step, TrainStep):
                    if self.cfg.launch_of(step.section(self.cfg)).launcher == "accelerate":
                        # Its processes report to no tracker: the history rank 0 kept, logged here.
                        run.log_history(read_log_history(result.output_dir))
                    self._stage_model(step, run, key, result, cached=False)
                    emit_health_alerts(
                        self.cfg.name,
                        step.name,
                        list(result.alerts),
                        mlflow_run_id=run.run_id,
                        task_run_id=state.state_details.task_run_id,
                    )
        if self.shared is not None:
            # A step that ran replaces the shared copy: it was missing, failed verification or forced.
            self.shared.push(step.kind, key, output_dir, result, replace=not cached)
        status = "cached" if cached else "ran"
        self.summary.outcomes.append(
            StepOutcome(
                step.name,
                status,
                decision.reason,
                key,
                step.output_of(result),
                step.metrics_of(result),
                step.kind,
            )
        )
        logger.info("%-22s %-6s %s", step.name, decision.status, decision.reason)
        return result

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
        if model_id is None:
            params = {
                **flatten_params(self.cfg.model, "model"),
                **flatten_params(step.section(self.cfg), "stage"),
            }
            where = {"kind": step.kind, "cache_key": key, "params": params}
            if step.name == self.final_stage and self.tracker.log_models:
                model = result.output_dir
                base = adapter_root(model) if is_adapter_dir(model) else None
                uri = self.tracker.log_final_model(model, base_model_path=base, stage=run, **where)
                model_id = uri.removeprefix("models:/") if uri else None
            else:
                model_id = self.tracker.log_stage_model(run, output_dir=result.output_dir, **where)
        if model_id is not None:
            self.models[step.name] = model_id
            run.set_tags({MODEL_ID_TAG: model_id})


def _log_result(run: Any, result: Any, *, model_id: str | None = None, dataset_name: str = "eval") -> None:
    """What each kind of step leaves in its nested MLflow run (evaluations: against ``model_id``)."""
    if isinstance(result, DataResult):
        data = load_data(result)
        run.log_metrics({k: v for k, v in result.stats.items() if isinstance(v, int | float)})
        run.log_dataset(data.train, name="train", context="training", digest=result.train_fingerprint)
        run.log_dataset(data.eval, name="heldout", context="evaluation", digest=result.eval_fingerprint)
        return
    if isinstance(result, EvalResult):
        for name, folder, metrics in result.reports():
            records = [r.as_dict() for r in EvalReport.load(folder).records]
            run.log_eval(
                qualify_metrics(metrics, name),
                records,
                model_id=model_id,
                dataset_name=name or dataset_name,
                table=f"{name}/eval_examples" if name else "eval_examples",
            )
        run.log_metrics({f"eval/{k}": v for k, v in result.timings.items() if isinstance(v, int | float)})
        return
    info = read_stage_json(result.output_dir)
    run.log_stage_json(info)
    run.log_metrics({k: v for k, v in result.metrics.items() if isinstance(v, int | float)})
    run.log_alerts(list(result.alerts))
    if result.samples:
        run.log_completions(result.output_dir)
        run.plot_rewards()


@flow(name="posttrain-pipeline", log_prints=False)
def posttrain_pipeline(config: PipelineConfig, force: list[str] | None = None) -> dict[str, Any]:
    """Run (or reuse) every step of one pipeline config's plan; returns the per-step summary."""
    cfg = config
    check_rewards(cfg, cfg.name)  # parameters may come from anyone who can trigger a deployment
    plan = build_plan(cfg)
    store = Store.at(cfg.orchestration.store)
    store.check_writable()
    # Reentrant: `posttrain run` takes the lock before Prefect's server starts, then runs this flow.
    with (
        posttrain_logs_to_prefect(),
        store.lock(reentrant=True),
        start_pipeline_run(cfg, steps=plan.names, store=str(store.root)) as tracker,
    ):
        store.clean_interrupted_writes()
        runner = _Runner(plan, store, tracker, force or (), open_shared(cfg.orchestration.shared_store))
        with remembered_digests(runner.records.digests_path):
            plan.walk(base_model(cfg), runner)
        if leftovers := store.unfinished_checkpoints():  # every stage of this plan finished
            logger.warning(
                "%d checkpoint folder(s) of unfinished stages of other configs or code: %s "
                "(a rerun of that config resumes from them; delete them otherwise)",
                len(leftovers),
                ", ".join(p.name for p in leftovers),
            )
        tracker.plot_accuracy_by_stage()
        create_markdown_artifact(
            key=artifact_key(cfg.name),
            markdown=summary_markdown(runner.summary),
            description=f"posttrain {cfg.name}: evaluation per stage",
        )
    return runner.summary.as_dict()


@flow(name="posttrain-run-config", log_prints=False)
def run_config(
    config: str, overrides: list[str] | None = None, force: list[str] | None = None
) -> dict[str, Any]:
    """Run the pipeline for a config file (path relative to the working directory) with ``--set``
    style overrides: the entrypoint deployments use (``prefect.yaml``), since a path and a few
    overrides make better deployment parameters than a whole config.

    Secrets in the overrides (``...api_key=...``, a URI's password) never stay in Prefect's stored
    flow-run parameters: a direct call stores them redacted, and a deployment run's parameters
    (stored by whoever triggered it) are overwritten redacted as the run starts."""
    redact_stored_parameters(redact_run_parameters)
    cfg = load_config(config, overrides or ())
    return posttrain_pipeline(cfg, force=force)


def redact_run_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_config`'s parameters as Prefect may keep them (secrets replaced)."""
    cleaned = redact(parameters)
    if isinstance(parameters.get("overrides"), list):
        cleaned["overrides"] = [redact_override(str(o)) for o in parameters["overrides"]]
    return cleaned


store_parameters_redacted(run_config, redact_run_parameters)


def artifact_key(name: str) -> str:
    """A Prefect artifact key for a config name: Prefect takes only lowercase letters, digits and dashes.

    >>> artifact_key("My_Run.v2")
    'my-run-v2-summary'
    """
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") + "-summary"


def preview(cfg: PipelineConfig, force: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """``--dry-run``: (step, cached/run, why) for each step of the plan the flow would run (the same
    as :func:`posttrain.pipeline.plan.preview`, which the CLI uses without importing Prefect)."""
    store = Store.at(cfg.orchestration.store, create=False)
    records = StoreRecords(store)
    with remembered_digests(records.digests_path, save=False):
        return dry_run(build_plan(cfg), records, base_model(cfg), force, store)


def summary_markdown(summary: PipelineSummary) -> str:
    """Eval metrics per stage, for the Prefect UI: the primary set, strict accuracy per number of
    operations, and each extra set's strict accuracy."""
    evals = [o for o in summary.outcomes if o.kind == "eval"]
    extra = list(dict.fromkeys(s for o in evals for s in slices_of(o.metrics) if s is not None))
    lines = [
        f"# {summary.config}",
        "",
        f"MLflow run: `{summary.run_id}`",
        "",
        "| step | status | accuracy (strict) | accuracy (flexible) | strict format | strict by ops |"
        + "".join(f" {name} (strict) |" for name in extra),
        "|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for o in evals:
        m, slices = o.metrics, slices_of(o.metrics)
        by_ops = ", ".join(f"{n}: {v:.0%}" for n, v in slices.get(None, {}).items() if n is not None)
        lines.append(
            f"| {o.step.removeprefix('eval-')} | {o.status} | {m.get('accuracy_strict', 0):.1%} | "
            f"{m.get('accuracy_flexible', 0):.1%} | {m.get('strict_format_rate', 0):.1%} | {by_ops or '-'} |"
            + "".join(f" {slices.get(name, {}).get(None, 0):.1%} |" for name in extra)
        )
    return "\n".join(lines)
