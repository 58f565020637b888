"""One thin Prefect task that runs any step of the plan (``posttrain.pipeline.plan``).

Each run is cached under the explicit key the plan computed for the step: the key names everything
the output depends on, so results are reused across flow runs, unlike Prefect's default policy
(which includes the run id), and a changed file behind an unchanged path is seen, unlike the
INPUTS policy. Result storage is set per run by the flow (the store's ``results/``). The task
receives the config and the step's name, not live objects, and rebuilds the plan itself, so a
worker process runs exactly what the flow planned.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from posttrain.core.config import PipelineConfig
from posttrain.pipeline.plan import StepInputs, build_plan

__all__ = ["step_task"]


def _explicit_key(context: Any, parameters: dict[str, Any]) -> str:
    return parameters["key"]


@task(
    name="posttrain-step", task_run_name="{step}", cache_key_fn=_explicit_key, persist_result=True, retries=0
)
def step_task(
    cfg: PipelineConfig, step: str, inputs: StepInputs, output_dir: str, key: str, report_to: Any = "none"
) -> Any:
    """Run plan step ``step`` of ``cfg`` on ``inputs`` into ``output_dir``."""
    return build_plan(cfg).step(step).run(cfg, inputs, output_dir, report_to=report_to)
