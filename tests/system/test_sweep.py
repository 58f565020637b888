"""`posttrain sweep`: one pipeline run (one MLflow parent run) per point of a --set grid, cached stages
shared between points, and the comparison of the runs at the end."""

from __future__ import annotations

import pytest

from posttrain.cli import main

CUT = ("dpo=null", "grpo.stages=[]")
"""The smoke config cut to data → (baseline) → sft."""


def test_sweep_runs_each_point_reusing_shared_steps_and_compares_them(
    smoke_config_path, smoke_sets, tmp_path, step_calls, capsys
):
    db = tmp_path / "mlflow.db"
    argv = ["sweep", str(smoke_config_path), *smoke_sets(tmp_path, *CUT, "eval.baseline=false")]
    assert main([*argv, "--set", "sft.trainer.learning_rate=1e-3,1e-4"]) == 0
    out = capsys.readouterr().out
    # the data step is shared by both points; SFT and its evaluation ran once per point
    assert sorted(step_calls) == ["eval_step", "eval_step", "prepare_step", "sft_step", "sft_step"]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    parents = [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]
    assert sorted(r.data.params["sft.trainer.learning_rate"] for r in parents) == ["0.0001", "0.001"]
    # each point's run is named after what it sets, so the runs table tells them apart
    assert sorted(r.info.run_name for r in parents) == [
        "sft.trainer.learning_rate=1e-3 (smoke)",
        "sft.trainer.learning_rate=1e-4 (smoke)",
    ]
    for parent in parents:
        assert parent.info.run_id[:12] in out  # the comparison's "run id" row
    assert "sft.trainer.learning_rate" in out  # the comparison shows what differs between points


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "seed=1"], "two or more"),  # one point is not a sweep
        (["--set", "seed=1,"], "empty sweep value"),
        (["--seeds", "0"], "two or more"),  # one seed either
        (["--seeds", "0,x"], "--seeds 0,x: give integers"),
        (["--seeds", "0,1,0"], "repeated"),
        (["--seeds", "0,1", "--set", "seed=2,3"], "--seeds or --set seed"),  # two ways to say one thing
    ],
)
def test_sweep_without_two_points_is_refused_in_one_line(smoke_config_path, args, message, capsys):
    assert main(["sweep", str(smoke_config_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_seeds_share_data_and_baseline_and_compare_aggregates_three_seeds(
    smoke_config_path, smoke_sets, tmp_path, step_calls, capsys
):
    """`sweep --seeds 0,1,2` on the smoke config (cut to SFT): one run per seed in one seed group,
    the seed-independent steps made once, and the comparison's numbers across the three seeds."""
    import mlflow

    from posttrain.core.stats import t_interval

    db = tmp_path / "mlflow.db"
    assert (
        main(
            [
                "sweep",
                str(smoke_config_path),
                *smoke_sets(tmp_path, *CUT, "tracking.system_metrics=false"),
                "--seeds",
                "0,1,2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # data and the baseline evaluation do not depend on the seed: made once for the three seeds
    assert sorted(step_calls) == ["eval_step"] * 4 + ["prepare_step"] + ["sft_step"] * 3

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    parents = sorted(
        (r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"),
        key=lambda r: r.data.params["seed"],
    )
    assert [r.data.params["seed"] for r in parents] == ["0", "1", "2"]
    assert len({r.data.tags["posttrain.seed_group"] for r in parents}) == 1  # grouped in the UI too
    for parent in parents:  # every run logged its stage's paired change and the interval around it
        metrics = parent.data.metrics
        low, high = (
            metrics["eval-sft/delta_accuracy_strict_ci_low"],
            metrics["eval-sft/delta_accuracy_strict_ci_high"],
        )
        assert low <= metrics["eval-sft/delta_accuracy_strict"] <= high

    group = parents[0].data.tags["posttrain.seed_group"]
    assert f"across seeds: group {group} (seeds 0, 1, 2)" in out  # the sweep's own comparison
    assert (
        main(
            ["compare", "--tracking-uri", f"sqlite:///{db}", "--last", "3", "--plot", str(tmp_path / "c.png")]
        )
        == 0
    )
    across = capsys.readouterr().out.split("across seeds")[1].splitlines()
    for metric, label in (("accuracy_strict", "strict"), ("strict_format_rate", "format")):
        values = [r.data.metrics[f"eval-sft/{metric}"] for r in parents]
        expected = t_interval(values)
        row = next(x for x in across if x.startswith("eval-sft ") and x.split()[1] == label)
        assert row.split()[2] == f"{100 * expected.estimate:.1f}%"
        if len(set(values)) > 1:
            assert f"[{100 * expected.low:.1f}, {100 * expected.high:.1f}]" in row
        else:  # the tiny model often scores alike on every seed: no interval of zero width
            assert row.endswith("- (no spread)")
        changes = [r.data.metrics[f"eval-sft/delta_{metric}"] for r in parents]
        change_row = next(x for x in across if x.startswith("  change from baseline") and label in x.split())
        assert f"{100 * t_interval(changes).estimate:+.1f}" in change_row.split()


def test_parallel_points_run_in_processes_of_their_own_and_make_a_shared_step_once(
    smoke_config_path, smoke_sets, tmp_path, step_spy, capsys
):
    import os

    # Each point's SFT waits until both have started: one point at a time never gets past it.
    step_spy.hook("sft_step", wait_for=("sft_step", 2), timeout=120)
    db = tmp_path / "mlflow.db"
    argv = [
        "sweep",
        str(smoke_config_path),
        "--parallel",
        "2",
        *smoke_sets(tmp_path, *CUT, "tracking.system_metrics=false"),
    ]
    assert main([*argv, "--set", "sft.trainer.learning_rate=1e-3,1e-4"]) == 0
    # data and the baseline evaluation are the same step for both points: made once, under its lock
    assert sorted(step_spy) == ["eval_step"] * 3 + ["prepare_step"] + ["sft_step"] * 2
    sft_pids = {pid for label, pid, *_ in step_spy.spans() if label == "sft"}
    assert len(sft_pids) == 2 and os.getpid() not in sft_pids  # a worker process per point

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    parents = [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]
    assert sorted(r.data.params["sft.trainer.learning_rate"] for r in parents) == ["0.0001", "0.001"]
    # neither point's start closed the other's runs as abandoned
    assert {r.info.status for r in runs} == {"FINISHED"}
    for parent in parents:
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(r.info.run_name for r in children) == ["data", "eval-baseline", "eval-sft", "sft"]
    assert not list((tmp_path / "store").glob("*/*.tmp-*"))
    assert "sft.trainer.learning_rate" in capsys.readouterr().out


def test_parallel_below_one_is_refused_in_one_line(smoke_config_path, capsys):
    assert main(["sweep", str(smoke_config_path), "--set", "seed=0,1", "--parallel", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: sweep: --parallel 0: give 1 or more points at a time"], err
