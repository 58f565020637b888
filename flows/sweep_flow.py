"""The ``posttrain-sweep`` flow: one config's pipeline once per point of a ``--set`` grid, up to
``parallel`` points at a time.

Each point is a ``posttrain-pipeline`` subflow run (its own MLflow parent run) inside a task of this
flow; with ``parallel`` above 1 the tasks run in that many worker processes
(:mod:`posttrain.flows.workers`), and the ``gpu`` tag limit (``orchestration.gpu_slots``) still bounds
how many of their steps hold the device at once. The points share one store, whose lock this flow
holds for all of them: a step two points need is made once (the second waits on that step's lock
in the store, then finds it cached), and what a run does once per store (tidying a killed run's
leftovers, closing its MLflow runs) is done here, once, before the points start.
"""

# No `from __future__ import annotations`: Prefect builds the flow's parameter model from the real
# annotation objects (see posttrain.flows.pipeline_flow).
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from posttrain.cache.store import Store
from posttrain.core.config import PipelineConfig
from posttrain.flows.pipeline_flow import posttrain_pipeline
from posttrain.flows.plan_walker import sweep_started, warn_unfinished
from posttrain.flows.prefect_ui import config_run_name
from posttrain.flows.workers import worker_processes, workers_use_this_api

__all__ = ["posttrain_sweep", "run_sweep"]


@task(name="posttrain-sweep-point", task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False)
def sweep_point(config: PipelineConfig, label: str) -> str | None:
    """One point's pipeline run, its MLflow run named after the point (``seed=1 (smoke)``: every
    point's config has the same name, and tables cut names short); its MLflow parent run id (None
    with tracking off)."""
    return posttrain_pipeline(config, sweep_point=True, run_name=f"{label} ({config.name})")["run_id"]


@flow(name="posttrain-sweep", flow_run_name=config_run_name, log_prints=False)
def posttrain_sweep(configs: list[PipelineConfig], labels: list[str], parallel: int = 1) -> list[str | None]:
    """Run every point (``configs[i]``, named ``labels[i]``) in one store, ``parallel`` at a time in
    worker processes (1: one after the other, in this process); their MLflow run ids, in order."""
    store = Store.at(configs[0].orchestration.store)
    points = list(zip(configs, labels, strict=True))
    with store.lock(reentrant=True):
        sweep_started(configs[0], store)
        if parallel == 1:
            run_ids = [sweep_point(cfg, label) for cfg, label in points]
        else:
            with workers_use_this_api():
                futures = [sweep_point.submit(cfg, label) for cfg, label in points]
                run_ids = [f.result() for f in futures]
        warn_unfinished(store)
    return run_ids


def run_sweep(configs: list[PipelineConfig], labels: list[str], parallel: int = 1) -> list[str | None]:
    """:func:`posttrain_sweep` with at most ``parallel`` points running at once."""
    return posttrain_sweep.with_options(task_runner=worker_processes(parallel))(configs, labels, parallel)
