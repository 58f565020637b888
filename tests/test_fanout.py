"""Fan-out in the Prefect flow: evaluations beside training (``orchestration.concurrent_evals``) and
Prefect's ``gpu`` tag concurrency limit (``orchestration.gpu_slots``) over every step task."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from posttrain.pipeline import load_config

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
WAIT_S = 60.0
"""How long an evaluation waits for the next stage's training to start (only a broken fan-out waits it out)."""


def small(tmp: Path, *overrides: str):
    """The smoke config cut to data → eval-baseline → sft → eval-sft, in its own store."""
    return load_config(
        SMOKE,
        [
            f"orchestration.store={tmp / 'store'}",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            f"model.cache_dir={tmp / 'models'}",
            "dpo.enabled=false",
            "grpo.stages=[]",
            "tracking.system_metrics=false",
            *overrides,
        ],
    )


@pytest.fixture
def spans(monkeypatch):
    """(step function, stage, start, end) of each training and evaluation call, and the event set
    when SFT starts; ``hold_baseline(fn)`` runs ``fn`` inside the baseline evaluation."""
    import posttrain.pipeline.steps as steps

    record: dict = {"spans": [], "sft_started": threading.Event(), "hold": None}

    def spy_sft(*args, _real=steps.sft_step, **kwargs):
        record["sft_started"].set()
        start = time.monotonic()
        try:
            return _real(*args, **kwargs)
        finally:
            record["spans"].append(("sft", start, time.monotonic()))

    def spy_eval(cfg, stage, *args, _real=steps.eval_step, **kwargs):
        start = time.monotonic()
        try:
            if stage == "baseline" and record["hold"] is not None:
                record["hold"]()
            return _real(cfg, stage, *args, **kwargs)
        finally:
            record["spans"].append((f"eval-{stage}", start, time.monotonic()))

    monkeypatch.setattr(steps, "sft_step", spy_sft)
    monkeypatch.setattr(steps, "eval_step", spy_eval)
    return record


def test_an_evaluation_runs_beside_the_next_training_stage(tmp_path, spans):
    from mlflow import MlflowClient

    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview

    seen: dict = {}
    # The baseline evaluation finishes only once SFT has started: in place, SFT would wait for it.
    spans["hold"] = lambda: seen.setdefault("sft_started", spans["sft_started"].wait(WAIT_S))
    cfg = small(tmp_path, "orchestration.concurrent_evals=true")
    summary = posttrain_pipeline(cfg)

    assert seen == {"sft_started": True}
    outcomes = summary["outcomes"]
    assert [(o["step"], o["status"]) for o in outcomes] == [
        ("data", "ran"),
        ("eval-baseline", "ran"),
        ("sft", "ran"),
        ("eval-sft", "ran"),
    ]
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


@pytest.fixture
def gpu_limit():
    """Prefect's ``tag:gpu`` limit, removed afterwards (it would queue other tests' steps)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield client
        client.delete_concurrency_limit_by_tag("gpu")


def test_gpu_slots_let_one_step_hold_the_gpu_at_a_time(tmp_path, spans, gpu_limit):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    # Unlimited, SFT would start during this pause (the test above proves it does).
    spans["hold"] = lambda: time.sleep(3)
    cfg = small(tmp_path, "orchestration.concurrent_evals=true", "orchestration.gpu_slots=1")
    summary = posttrain_pipeline(cfg)

    assert gpu_limit.read_global_concurrency_limit_by_name("tag:gpu").limit == 1
    assert {o["status"] for o in summary["outcomes"]} == {"ran"}
    ordered = sorted(spans["spans"], key=lambda s: s[1])
    assert [name for name, *_ in ordered][0] in {"eval-baseline", "sft"}
    assert len(ordered) == 3
    for (a, _, a_end), (b, b_start, _) in zip(ordered, ordered[1:], strict=False):
        assert a_end <= b_start, f"{a} and {b} held the gpu at once"


def test_a_failed_evaluation_fails_the_run_after_the_rest_is_done(tmp_path, spans):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview

    def fail():
        spans["sft_started"].wait(WAIT_S)
        raise RuntimeError("evaluation broke")

    spans["hold"] = fail
    cfg = small(tmp_path, "orchestration.concurrent_evals=true")
    with pytest.raises(Exception, match="evaluation broke"):
        posttrain_pipeline(cfg)
    # SFT and its evaluation finished and were recorded; only the failed evaluation reruns.
    assert {step: status for step, status, _ in preview(cfg)} == {
        "data": "cached",
        "eval-baseline": "run",
        "sft": "cached",
        "eval-sft": "cached",
    }
