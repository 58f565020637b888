"""`posttrain sweep`: one pipeline run (one MLflow parent run) per point of a --set grid, cached stages
shared between points, and the comparison of the runs at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml")


def test_sweep_runs_each_point_reusing_shared_steps_and_compares_them(tmp_path, step_calls, capsys):
    db = tmp_path / "mlflow.db"
    fixed = [
        f"orchestration.store={tmp_path / 'store'}",
        f"tracking.tracking_uri=sqlite:///{db}",
        f"model.cache_dir={tmp_path / 'models'}",
        "dpo=null",
        "grpo.stages=[]",
        "eval.baseline=false",
    ]
    argv = ["sweep", SMOKE, *(a for s in fixed for a in ("--set", s))]
    assert main([*argv, "--set", "sft.trainer.learning_rate=1e-3,1e-4"]) == 0
    out = capsys.readouterr().out
    # the data step is shared by both points; SFT and its evaluation ran once per point
    assert sorted(step_calls) == ["eval_step", "eval_step", "prepare_step", "sft_step", "sft_step"]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    parents = [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]
    assert sorted(r.data.params["sft.trainer.learning_rate"] for r in parents) == ["0.0001", "0.001"]
    for parent in parents:
        assert parent.info.run_id[:12] in out  # the comparison's "run id" row
    assert "sft.trainer.learning_rate" in out  # the comparison shows what differs between points


@pytest.mark.parametrize("sets", [["seed=1"], ["seed=1,"]])
def test_sweep_without_two_values_is_refused_in_one_line(sets, capsys):
    assert main(["sweep", SMOKE, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "sweep" in err[0], err
