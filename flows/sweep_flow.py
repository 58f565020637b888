"""The ``posttrain-sweep`` flow: one config's pipeline once per point of a ``--set`` grid, up to
``parallel`` points at a time.

Each point is a ``posttrain-pipeline`` subflow run (its own MLflow parent run) inside a task of this
flow, so Prefect's thread-pool task runner runs ``parallel`` of them side by side, and the ``gpu`` tag
limit (``orchestration.gpu_slots``) still bounds how many of their steps hold the device at once. The
points share one store: a step two points need is made once (the second waits on that step's lock in
the store, then finds it cached), and what a run does once per store (tidying a killed run's
leftovers, closing its MLflow runs) is done here, once, before the points start.
"""

# No `from __future__ import annotations`: Prefect builds the flow's parameter model from the real
# annotation objects (see posttrain.flows.pipeline_flow).
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from posttrain.cache.store import Store
from posttrain.core.config import PipelineConfig
from posttrain.flows.pipeline_flow import posttrain_pipeline
from posttrain.flows.plan_walker import side_by_side
from posttrain.pipeline.steps import import_step_libraries
from posttrain.tracking import side_by_side_runs

__all__ = ["posttrain_sweep", "run_sweep"]


@task(name="posttrain-sweep-point", task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False)
def sweep_point(config: PipelineConfig, label: str) -> str | None:
    """One point's pipeline run; its MLflow parent run id (None with tracking off)."""
    return posttrain_pipeline(config)["run_id"]


@flow(name="posttrain-sweep", log_prints=False)
def posttrain_sweep(configs: list[PipelineConfig], labels: list[str]) -> list[str | None]:
    """Run every point (``configs[i]``, named ``labels[i]``) in one store; their MLflow run ids, in order."""
    store = Store.at(configs[0].orchestration.store)
    import_step_libraries()  # before the points' threads race to import them
    with (
        store.lock(reentrant=True),
        side_by_side(store),
        side_by_side_runs(configs[0], str(store.root)),
    ):
        futures = [sweep_point.submit(cfg, label) for cfg, label in zip(configs, labels, strict=True)]
        return [f.result() for f in futures]


def run_sweep(configs: list[PipelineConfig], labels: list[str], parallel: int = 1) -> list[str | None]:
    """:func:`posttrain_sweep` with at most ``parallel`` points running at once."""
    runner = ThreadPoolTaskRunner(max_workers=parallel)
    return posttrain_sweep.with_options(task_runner=runner)(configs, labels)
