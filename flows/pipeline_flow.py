"""The `posttrain-pipeline` Prefect flow: prepare data → baseline eval → each training stage → eval.

Every step is a cached task keyed by what its output depends on (see `posttrain.cache.keys`), so an
unchanged config reruns nothing, a changed stage reruns from that stage on, and `force` reruns a
stage and everything after it on purpose. A cache record whose output directory is gone or no
longer matches its fingerprint is recomputed, not trusted. MLflow gets one parent run per flow run
and one nested run per step; a step served from cache still appears, tagged `cached=true`.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from the
# real annotation objects, and a string "PipelineConfig" cannot be resolved when a deployment runs.
import logging
import re
from dataclasses import asdict
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from posttrain.core.config import PipelineConfig
from posttrain.core.metric_names import slices_of
from posttrain.core.redact import redact, redact_override
from posttrain.evaluation.diff import STAGE_VALUE_TITLE, stage_value_columns, stage_value_rows
from posttrain.evaluation.report import rate_text
from posttrain.flows.plan_walker import PipelineSummary, PlanRunner, StepOutcome, run_plan
from posttrain.flows.prefect_compat import redact_stored_parameters, store_parameters_redacted
from posttrain.flows.prefect_ui import config_run_name, emit_health_alerts, posttrain_logs_to_prefect
from posttrain.flows.workers import worker_processes, workers_use_this_api
from posttrain.pipeline import load_config
from posttrain.pipeline.plan import EvalStep, Step, TrainStep, build_plan
from posttrain.pipeline.validation import check_rewards
from posttrain.tasks.step_task import GPU_TAG, task_for
from posttrain.tracking import PREFECT_FLOW_RUN_TAG, StageRun

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineSummary",
    "StepOutcome",
    "artifact_key",
    "posttrain_pipeline",
    "redact_run_parameters",
    "run_config",
    "set_gpu_slots",
]


class _PrefectRunner(PlanRunner):
    """Runs each step that must run as a Prefect task, and emits its health alerts as events."""

    _task_run_id: Any = None

    def execute(self, step: Step, call: dict[str, Any], run: StageRun) -> Any:
        state = task_for(step)(**call, report_to=run.report_to, return_state=True)
        self._task_run_id = state.state_details.task_run_id
        return state.result()

    def submit(self, step: EvalStep, call: dict[str, Any]) -> Any:
        """With ``orchestration.concurrent_evals``, the evaluation runs in a worker process of the
        flow's task runner (:mod:`posttrain.flows.workers`)."""
        if not self.cfg.orchestration.concurrent_evals:
            return None
        return task_for(step).submit(**call)

    def done(self, future: Any) -> bool:
        return future.wrapped_future.done()

    def after_training(self, step: TrainStep, result: Any, run: StageRun) -> None:
        emit_health_alerts(
            self.cfg.name,
            step.name,
            list(result.alerts),
            mlflow_run_id=run.run_id,
            task_run_id=self._task_run_id,
        )


@flow(
    name="posttrain-pipeline",
    flow_run_name=config_run_name,
    task_runner=worker_processes(),
    log_prints=False,
)
def posttrain_pipeline(
    config: PipelineConfig,
    force: list[str] | None = None,
    sweep_point: bool = False,
    run_name: str | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every step of one pipeline config's plan; returns the per-step summary.

    ``sweep_point``: one point of a ``posttrain-sweep`` flow, which holds the store's lock, tidied
    the store and closed its abandoned MLflow runs once for all its points. ``run_name``: the MLflow
    pipeline run's name (default: this flow run's, ``smoke-brave-spider``, so either UI finds the
    other's run; the MLflow run is also tagged with the flow run's id)."""
    from prefect.runtime import flow_run

    cfg = config
    check_rewards(cfg, cfg.name)  # parameters may come from anyone who can trigger a deployment
    plan = build_plan(cfg)
    if cfg.orchestration.gpu_slots is not None:
        set_gpu_slots(cfg.orchestration.gpu_slots)
    with posttrain_logs_to_prefect(), workers_use_this_api():
        summary = run_plan(
            plan,
            force or (),
            _PrefectRunner,
            sweep_point=sweep_point,
            run_name=run_name or flow_run.name,
            run_tags={PREFECT_FLOW_RUN_TAG: str(flow_run.id)},
        )
        create_markdown_artifact(
            key=artifact_key(cfg.name),
            markdown=summary_markdown(summary),
            description=f"posttrain {cfg.name}: evaluation per stage",
        )
    return summary.as_dict()


@flow(name="posttrain-run-config", flow_run_name=config_run_name, log_prints=False)
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


def set_gpu_slots(slots: int) -> None:
    """Set the Prefect server's tag concurrency limit ``gpu`` to ``slots``: created or updated
    (Prefect's endpoint is an upsert; ``prefect concurrency-limit create gpu N`` makes the same call).

    A process that ran a ``gpu`` task while no limit existed skips the server's check for that tag
    for the next 5 s (Prefect's memory of absent limits), so the flow sets the limit before any step.

    The server's upsert reads, then inserts: two runs that start together can both find no limit,
    and the second insert fails with 409 Conflict. By then the limit exists, so one more call
    updates it.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        try:
            client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 409:
                raise
            client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)


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


def summary_markdown(summary: PipelineSummary) -> str:
    """Eval metrics per stage, for the Prefect UI: the primary set, strict accuracy per number of
    operations, and each extra set's strict accuracy; then what each stage bought, as the terminal
    shows it (its minutes, its paired change with the interval, points per minute)."""
    evals = [o for o in summary.outcomes if o.kind == "eval"]
    extra = list(dict.fromkeys(s for o in evals for s in slices_of(o.metrics) if s is not None))
    lines = [
        f"# {summary.config}",
        "",
        f"MLflow run: `{summary.run_id}`",
        "",
        "| step | status | accuracy (strict) [95% CI] | accuracy (flexible) | strict format | strict by ops |"
        + "".join(f" {name} (strict) |" for name in extra),
        "|---|---|---|---|---|---|" + "---|" * len(extra),
    ]
    for o in evals:
        m, slices = o.metrics, slices_of(o.metrics)
        by_ops = ", ".join(f"{n}: {v:.0%}" for n, v in slices.get(None, {}).items() if n is not None)
        lines.append(
            f"| {o.step.removeprefix('eval-')} | {o.status} | {rate_text(m, 'accuracy_strict')} | "
            f"{m.get('accuracy_flexible', 0):.1%} | {m.get('strict_format_rate', 0):.1%} | {by_ops or '-'} |"
            + "".join(f" {slices.get(name, {}).get(None, 0):.1%} |" for name in extra)
        )
    if rows := stage_value_rows([asdict(o) for o in summary.outcomes], summary.changes):
        columns = stage_value_columns(summary.changes)
        lines += ["", f"**{STAGE_VALUE_TITLE}**", "", "| " + " | ".join(columns) + " |"]
        lines += ["|---" * len(columns) + "|", *("| " + " | ".join(row) + " |" for row in rows)]
    return "\n".join(lines)
