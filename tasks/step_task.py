"""One thin Prefect task that runs any step of the plan (``posttrain.pipeline.plan``).

Caching is posttrain's, not Prefect's: the flow decides from the store's JSON cache records
(:mod:`posttrain.cache.records`) whether a step runs, calls this task only for steps that run,
and writes the record of the result itself. Prefect persists nothing (its result records may be
pickles, and a record names its own serializer, so reading one from a shared store could run
code). The task receives the config and the step's name, not live objects, and rebuilds the plan
itself, so a worker process runs exactly what the flow planned.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from posttrain.core.config import PipelineConfig
from posttrain.pipeline.plan import Step, StepInputs, build_plan

__all__ = ["GPU_TAG", "step_task", "task_for"]

GPU_TAG = "gpu"
"""The tag of every step that holds the accelerator (training and evaluation, not data): Prefect's
tag concurrency limit ``gpu`` bounds how many run at once (``orchestration.gpu_slots``)."""


@task(name="posttrain-step", task_run_name="{step}", cache_policy=NO_CACHE, persist_result=False, retries=0)
def step_task(
    cfg: PipelineConfig, step: str, inputs: StepInputs, output_dir: str, key: str, report_to: Any = "none"
) -> Any:
    """Run plan step ``step`` of ``cfg`` on ``inputs`` into ``output_dir``."""
    return build_plan(cfg).step(step).run(cfg, inputs, output_dir, report_to=report_to)


def task_for(step: Step) -> Any:
    """:func:`step_task` for plan step ``step``, with the ``gpu`` tag unless it is the data step."""
    return step_task if step.kind == "data" else step_task.with_options(tags={GPU_TAG})
