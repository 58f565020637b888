"""Fan-out in the Prefect flow: evaluations beside training in worker processes
(``orchestration.concurrent_evals``) and Prefect's ``gpu`` tag concurrency limit
(``orchestration.gpu_slots``) over every step task, wherever it runs."""

from __future__ import annotations

import os
import time

import pytest

WAIT_S = 180
"""How long an evaluation waits for the next stage's training to start (only a broken fan-out waits
it out: a worker process imports torch and transformers first)."""


SMALL = ("dpo.enabled=false", "grpo.stages=[]", "tracking.system_metrics=false")
"""The smoke config cut to data → eval-baseline → sft → eval-sft."""


def test_an_evaluation_runs_beside_the_next_training_stage(smoke_config, tmp_path, step_spy):
    from mlflow import MlflowClient

    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview

    # The baseline evaluation finishes only once SFT has started: in place, SFT would wait for it.
    step_spy.hook("eval_step:baseline", wait_for=("sft_step", 1), timeout=WAIT_S)
    cfg = smoke_config(tmp_path, *SMALL, "orchestration.concurrent_evals=true")
    summary = posttrain_pipeline(cfg)

    outcomes = summary["outcomes"]
    assert [(o["step"], o["status"]) for o in outcomes] == [
        ("data", "ran"),
        ("eval-baseline", "ran"),
        ("sft", "ran"),
        ("eval-sft", "ran"),
    ]
    # Evaluations ran in worker processes, training in the flow's.
    pids = {label: pid for label, pid, *_ in step_spy.spans()}
    assert pids["sft"] == os.getpid() and os.getpid() not in (pids["eval-baseline"], pids["eval-sft"])
    assert all(
        0.0 <= o["metrics"]["accuracy_strict"] <= 1.0 for o in outcomes if o["step"].startswith("eval")
    )
    # Each evaluation's record was written: the next run serves every step from the cache.
    assert {status for _, status, _ in preview(cfg)} == {"cached"}
    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    runs = client.search_runs(
        [client.get_run(summary["run_id"]).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{summary['run_id']}'",
    )
    evals = {r.info.run_name: r for r in runs if r.info.run_name.startswith("eval-")}
    assert set(evals) == {"eval-baseline", "eval-sft"}
    assert all(
        r.info.status == "FINISHED" and "eval/accuracy_strict" in r.data.metrics for r in evals.values()
    )


PREFECT_NO_LIMIT_MEMORY_S = 5.0
"""A process that ran a task whose tags had no concurrency limit skips the server's check for those
tags this long (``prefect.concurrency.services``); this test's process ran such tasks before."""


@pytest.fixture
def gpu_limit():
    """Prefect's ``tag:gpu`` limit, removed afterwards (it would queue other tests' steps)."""
    from prefect.client.orchestration import get_client

    time.sleep(PREFECT_NO_LIMIT_MEMORY_S)
    with get_client(sync_client=True) as client:
        yield client
        client.delete_concurrency_limit_by_tag("gpu")


def test_gpu_slots_let_one_step_hold_the_gpu_at_a_time(smoke_config, tmp_path, step_spy, gpu_limit):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    # Unlimited, SFT would start during this pause (the test above proves it does).
    step_spy.hook("eval_step:baseline", sleep=3)
    cfg = smoke_config(tmp_path, *SMALL, "orchestration.concurrent_evals=true", "orchestration.gpu_slots=1")
    summary = posttrain_pipeline(cfg)

    assert gpu_limit.read_global_concurrency_limit_by_name("tag:gpu").limit == 1
    assert {o["status"] for o in summary["outcomes"]} == {"ran"}
    ordered = [s for s in step_spy.spans() if s[0] != "prepare"]
    assert [name for name, *_ in ordered][0] in {"eval-baseline", "sft"}
    assert len(ordered) == 3
    for (a, _, _, a_end), (b, _, b_start, _) in zip(ordered, ordered[1:], strict=False):
        assert a_end <= b_start, f"{a} and {b} held the gpu at once"


def test_a_failed_evaluation_fails_the_run_after_the_rest_is_done(smoke_config, tmp_path, step_spy):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview

    step_spy.hook("eval_step:baseline", wait_for=("sft_step", 1), timeout=WAIT_S, fail="evaluation broke")
    cfg = smoke_config(tmp_path, *SMALL, "orchestration.concurrent_evals=true")
    with pytest.raises(Exception, match="evaluation broke"):
        posttrain_pipeline(cfg)
    # SFT and its evaluation finished and were recorded; only the failed evaluation reruns.
    assert {step: status for step, status, _ in preview(cfg)} == {
        "data": "cached",
        "eval-baseline": "run",
        "sft": "cached",
        "eval-sft": "cached",
    }
