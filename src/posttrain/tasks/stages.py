"""Thin Prefect tasks around the plain step functions in `posttrain.steps`.

Each task is cached under the explicit key its caller computed (`posttrain.steps.*_key`): the key
names everything the output depends on, so results are reused across flow runs, unlike Prefect's
default policy (which includes the run id), and a changed file behind an unchanged path is seen,
unlike the INPUTS policy. Result storage is set per run by the flow (the store's `results/`).
"""

from __future__ import annotations

from typing import Any

from prefect import task

from posttrain import steps
from posttrain.config import PipelineConfig


def _explicit_key(context: Any, parameters: dict[str, Any]) -> str:
    return parameters["key"]


_CACHED = {"cache_key_fn": _explicit_key, "persist_result": True, "retries": 0}


@task(name="prepare-data", **_CACHED)
def prepare_task(cfg: PipelineConfig, model: steps.ModelRef, output_dir: str, key: str) -> steps.DataResult:
    return steps.prepare_step(cfg, model, output_dir)


@task(name="train", task_run_name="train-{stage}", **_CACHED)
def train_task(
    cfg: PipelineConfig,
    stage: str,
    model: steps.ModelRef,
    data: steps.DataResult,
    output_dir: str,
    key: str,
    report_to: Any = "none",
):
    return steps.train_step(cfg, stage, model, data, output_dir, report_to=report_to)


@task(name="evaluate", task_run_name="eval-{stage}", **_CACHED)
def eval_task(
    cfg: PipelineConfig, stage: str, model: steps.ModelRef, data: steps.DataResult, output_dir: str, key: str
) -> steps.EvalResult:
    return steps.eval_step(cfg, stage, model, data, output_dir)
