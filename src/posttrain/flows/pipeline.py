"""The `posttrain-pipeline` Prefect flow: prepare data → baseline eval → each training stage → eval.

Every step is a cached task keyed by what its output depends on (see `posttrain.steps`), so an
unchanged config reruns nothing, a changed stage reruns from that stage on, and `force` reruns a
stage and everything after it on purpose. A cache record whose output directory is gone or no
longer matches its fingerprint is recomputed, not trusted. MLflow gets one parent run per flow run
and one nested run per step; a step served from cache still appears, tagged `cached=true`.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from the
# real annotation objects, and a string "PipelineConfig" cannot be resolved when a deployment runs.
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from posttrain import steps
from posttrain.config import PipelineConfig
from posttrain.flows.plan import Planner
from posttrain.store import Store
from posttrain.tasks.stages import eval_task, prepare_task, train_task
from posttrain.tracking import Tracker, start_pipeline_run

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    step: str
    status: str
    """`ran` or `cached`."""
    reason: str
    key: str
    output: str
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineSummary:
    config: str
    run_id: str | None
    outcomes: list[StepOutcome] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Runner:
    """Runs one step as a cached task with the right refresh decision and its MLflow run."""

    def __init__(self, cfg: PipelineConfig, store: Store, tracker: Tracker, force: Sequence[str]):
        self.cfg, self.store, self.tracker = cfg, store, tracker
        self.planner = Planner(cfg, store, force)
        self.summary = PipelineSummary(cfg.name, tracker.run_id)

    def run(self, step: str, task: Any, key: str, output_dir: str, **kwargs: Any) -> Any:
        decision = self.planner.decide(step, key)
        options = {"result_storage": self.store.results_dir, "refresh_cache": decision.status != "cached"}
        if decision.status == "cached":
            state = task.with_options(**options)(**kwargs, output_dir=output_dir, key=key, return_state=True)
            result = state.result()
            run = self.tracker.record_cached_stage(step, cache_key=key)
            run.set_tags({"cache_key": key})
        else:
            with self.tracker.stage(step, params=_section(self.cfg, step), cache_key=key) as run:
                if step.startswith(("sft", "dpo", "grpo")):
                    kwargs["report_to"] = run.report_to
                state = task.with_options(**options)(
                    **kwargs, output_dir=output_dir, key=key, return_state=True
                )
                result = state.result()
                _log_result(run, result)
        metrics = _metrics_of(result)
        status = "cached" if decision.status == "cached" else "ran"
        self.summary.outcomes.append(
            StepOutcome(step, status, decision.reason, key, _output_of(result), metrics)
        )
        logger.info("%-22s %-6s %s", step, decision.status, decision.reason)
        return result


def _section(cfg: PipelineConfig, step: str) -> Any:
    if step == "data":
        return cfg.data
    if step.startswith("eval-"):
        return cfg.eval
    return steps.stage_section(cfg, step)


def _output_of(result: Any) -> str:
    return getattr(result, "output_dir", None) or getattr(result, "report_dir", None) or result.data_dir


def _metrics_of(result: Any) -> dict[str, Any]:
    if isinstance(result, steps.EvalResult):
        return dict(result.summary)
    if isinstance(result, steps.DataResult):
        return dict(result.stats)
    return dict(result.metrics)


def _log_result(run: Any, result: Any) -> None:
    """What each kind of step leaves in its nested MLflow run."""
    if isinstance(result, steps.DataResult):
        data = steps.load_data(result)
        run.log_metrics({k: v for k, v in result.stats.items() if isinstance(v, int | float)})
        run.log_dataset(data.train, name="train", context="training", digest=result.train_fingerprint)
        run.log_dataset(data.eval, name="heldout", context="evaluation", digest=result.eval_fingerprint)
        return
    if isinstance(result, steps.EvalResult):
        from posttrain.evaluation.report import EvalReport

        report = EvalReport.load(result.report_dir)
        run.log_eval(result.summary, [r.as_dict() for r in report.records])
        run.log_metrics({f"eval/{k}": v for k, v in result.timings.items() if isinstance(v, int | float)})
        return
    from posttrain.training.stage_io import read_stage_json

    info = read_stage_json(result.output_dir)
    run.log_stage_json(info)
    run.log_metrics({k: v for k, v in result.metrics.items() if isinstance(v, int | float)})
    run.log_alerts(list(result.alerts))
    if result.samples:
        run.log_completions(result.output_dir)
        run.plot_rewards()


@flow(name="posttrain-pipeline", log_prints=False)
def posttrain_pipeline(config: PipelineConfig, force: list[str] | None = None) -> dict[str, Any]:
    """Run (or reuse) every step of one pipeline config; returns the per-step summary."""
    cfg = config
    store = Store.at(cfg.orchestration.store)
    with store.lock(), start_pipeline_run(cfg) as tracker:
        store.clean_interrupted_writes()
        runner = _Runner(cfg, store, tracker, force or ())
        base = steps.base_model(cfg)
        key = steps.data_key(cfg, base.fingerprint)
        data = runner.run("data", prepare_task, key, str(store.data_dir(key)), cfg=cfg, model=base)

        def evaluate(stage: str, model: steps.ModelRef) -> None:
            key = steps.eval_key(cfg, stage, model, data)
            runner.run(
                f"eval-{stage}",
                eval_task,
                key,
                str(store.eval_dir(stage, key)),
                cfg=cfg,
                stage=stage,
                model=model,
                data=data,
            )

        model = base
        if cfg.eval.baseline:
            evaluate("baseline", model)
        stages = cfg.stage_names()
        for i, stage in enumerate(stages):
            key = steps.train_key(cfg, stage, model, data)
            result = runner.run(
                stage,
                train_task,
                key,
                str(store.stage_dir(stage, key)),
                cfg=cfg,
                stage=stage,
                model=model,
                data=data,
            )
            model = steps.ModelRef(result.output_dir, result.fingerprints["output"])
            if cfg.eval.after_each_stage or i == len(stages) - 1:
                evaluate(stage, model)
        tracker.plot_accuracy_by_stage()
        last_training = next((o for o in reversed(runner.summary.outcomes) if o.step in stages), None)
        if last_training is not None and last_training.status == "ran":
            # A cached final model was logged by the run that produced it (see cached_from_run_id).
            tracker.log_final_model(model.path, base_model_path=_adapter_base(model.path))
        create_markdown_artifact(
            key=f"{cfg.name.lower().replace('.', '-')}-summary",
            markdown=summary_markdown(runner.summary),
            description=f"posttrain {cfg.name}: evaluation per stage",
        )
    return runner.summary.as_dict()


def _adapter_base(path: str) -> str | None:
    from posttrain.training.stage_io import adapter_root, is_adapter_dir

    return adapter_root(path) if is_adapter_dir(path) else None


def summary_markdown(summary: PipelineSummary) -> str:
    """Eval metrics per stage, for the Prefect UI."""
    lines = [
        f"# {summary.config}",
        "",
        f"MLflow run: `{summary.run_id}`",
        "",
        "| step | status | accuracy (strict) | accuracy (flexible) | strict format |",
        "|---|---|---|---|---|",
    ]
    for o in summary.outcomes:
        if o.step.startswith("eval-"):
            m = o.metrics
            lines.append(
                f"| {o.step[5:]} | {o.status} | {m.get('accuracy_strict', 0):.1%} | "
                f"{m.get('accuracy_flexible', 0):.1%} | {m.get('strict_format_rate', 0):.1%} |"
            )
    return "\n".join(lines)
