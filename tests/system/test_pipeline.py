"""The Prefect pipeline on the smoke config: caching across runs, --force, eval-only reruns, MLflow lineage."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def workdir(smoke_store) -> Path:
    """Where the session's smoke run wrote; its store is put back after the test (smoke_store)."""
    return smoke_store.workdir


@pytest.fixture
def first_run(smoke_store):
    """The summary of the session's smoke run (tests/conftest.py: smoke_run)."""
    return smoke_store.summary


def statuses(summary) -> dict[str, str]:
    return {o["step"]: o["status"] for o in summary["outcomes"]}


STEPS = [
    "data",
    "eval-baseline",
    "sft",
    "eval-sft",
    "dpo",
    "eval-dpo",
    "grpo-format",
    "eval-grpo-format",
    "grpo-correctness",
    "eval-grpo-correctness",
]


def test_first_run_executes_every_step(first_run):
    assert list(statuses(first_run)) == STEPS
    assert set(statuses(first_run).values()) == {"ran"}
    eval_final = first_run["outcomes"][-1]["metrics"]
    assert 0.0 <= eval_final["accuracy_strict"] <= 1.0


def test_unchanged_rerun_is_all_cached_and_runs_nothing(smoke_config, first_run, workdir, step_calls):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview as dry_run

    assert {status for _, status, _ in dry_run(smoke_config(workdir))} == {"cached"}
    summary = posttrain_pipeline(smoke_config(workdir))
    assert set(statuses(summary).values()) == {"cached"}
    assert step_calls == []
    assert [o["key"] for o in summary["outcomes"]] == [o["key"] for o in first_run["outcomes"]]


def test_force_reruns_the_stage_and_what_follows(smoke_config, first_run, workdir):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview as dry_run

    planned = {step: status for step, status, _ in dry_run(smoke_config(workdir), ["grpo-format"])}
    got = statuses(posttrain_pipeline(smoke_config(workdir), force=["grpo-format"]))
    expected = {s: ("run" if i >= STEPS.index("grpo-format") else "cached") for i, s in enumerate(STEPS)}
    assert planned == expected
    assert got == {s: ("ran" if v == "run" else "cached") for s, v in expected.items()}


def test_changing_eval_options_reruns_only_evaluation(smoke_config, first_run, workdir):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    got = statuses(posttrain_pipeline(smoke_config(workdir, "eval.max_completion_length=12")))
    assert {s for s, v in got.items() if v == "ran"} == {s for s in STEPS if s.startswith("eval-")}


def test_missing_output_is_recomputed(smoke_config, first_run, workdir):
    import shutil

    from posttrain.flows.pipeline_flow import posttrain_pipeline

    sft_dir = next(o["output"] for o in first_run["outcomes"] if o["step"] == "sft")
    shutil.rmtree(sft_dir)
    got = statuses(posttrain_pipeline(smoke_config(workdir)))
    assert got["sft"] == "ran" and got["data"] == "cached"


def test_mlflow_holds_parent_and_nested_stage_runs(first_run, workdir):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    parent = client.get_run(first_run["run_id"])
    assert parent.data.tags["posttrain.config_name"] == "smoke"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == set(STEPS)
    grpo = by_name["grpo-format"]
    assert any(k.startswith("rewards/") for k in grpo.data.metrics)
    # Each curve is the trainer's own points (steps 1..N); the stage's summary of last values lands
    # on the last step, not on a false point at step 0 that every chart would start from.
    for key in ("reward", "loss"):
        steps = [m.step for m in client.get_metric_history(grpo.info.run_id, key)]
        assert steps and min(steps) >= 1 and steps[-1] == max(steps), (key, steps)
    assert "eval/accuracy_strict" in by_name["eval-sft"].data.metrics
    eval_params = by_name["eval-sft"].data.params  # the eval section's, not a stage's: eval.limit
    assert "eval.limit" in eval_params and not any(k.startswith("stage.") for k in eval_params)
    artifacts = {a.path for a in client.list_artifacts(grpo.info.run_id)}
    assert "stage.json" in artifacts
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"config.yaml", "stage_gains.json"}


TRAINING = ["sft", "dpo", "grpo-format", "grpo-correctness"]


def test_each_stage_is_a_logged_model_with_its_evaluation_linked(first_run, workdir):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    parent = client.get_run(first_run["run_id"])
    models = client.search_logged_models(
        [parent.info.experiment_id],
        filter_string=f"tags.`posttrain.pipeline_run_id` = '{parent.info.run_id}'",
    )
    by_stage = {m.name: m for m in models}
    assert sorted(by_stage) == sorted(TRAINING)  # one per training stage, none for data or evals
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    runs = {r.info.run_name: r for r in children}
    # The run pages' "Logged models": each stage's run lists its model, the pipeline run the final one.
    assert [o.model_id for o in parent.outputs.model_outputs] == [by_stage[TRAINING[-1]].model_id]
    train = [
        d.dataset
        for d in client.get_run(runs["data"].info.run_id).inputs.dataset_inputs
        if d.dataset.name == "train"
    ]
    for stage, model in by_stage.items():
        stage_run = client.get_run(runs[stage].info.run_id)
        assert [o.model_id for o in stage_run.outputs.model_outputs] == [model.model_id], stage
        # The stage's run names the train set it drew from, with the data step's digest.
        assert [(d.dataset.name, d.dataset.digest) for d in stage_run.inputs.dataset_inputs] == [
            (train[0].name, train[0].digest)
        ], stage
        assert [t.value for d in stage_run.inputs.dataset_inputs for t in d.tags] == ["training"], stage
        assert str(model.status) == "READY" and model.source_run_id == runs[stage].info.run_id
        assert model.tags["posttrain.model_content"] == "reference"  # smoke: tracking.log_model false
        assert model.tags["posttrain.output_dir"] == next(
            o["output"] for o in first_run["outcomes"] if o["step"] == stage
        )
        assert model.params["stage.trainer.max_steps"] == "2" and model.params["model.name"] == "tiny-random"
        eval_run = runs[f"eval-{stage}"]
        # later tests rerun evaluations of the same (cached) stage outputs: they link to this model too
        [linked] = [
            m for m in model.metrics if m.run_id == eval_run.info.run_id and m.key == "eval/accuracy_strict"
        ]
        assert (
            linked.value == eval_run.data.metrics["eval/accuracy_strict"] and linked.dataset_name == "heldout"
        )
        assert [a.path for a in client.list_logged_model_artifacts(model.model_id)] == ["stage.json"]
    # the evaluation set is the same dataset for every stage, so the model view compares like with like
    assert len({x.dataset_digest for m in models for x in m.metrics}) == 1
    system = [k for k in runs["grpo-format"].data.metrics if k.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system and "system/system_memory_usage_megabytes" in system


def test_prefect_flow_runs_are_named_after_their_config_and_their_mlflow_runs_after_them(first_run, workdir):
    """The UI's runs list shows `smoke-brave-spider`, not `brave-spider` for every config; the MLflow
    pipeline run has the same name and the flow run's id, so either UI finds the other's run."""
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["posttrain-pipeline"])))
    assert runs
    for run in runs:
        name = run.parameters["config"]["name"]
        assert re.fullmatch(rf"{re.escape(name)}-[a-z]+-[a-z]+", run.name), (name, run.name)
    parent = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").get_run(first_run["run_id"])
    [flow_run] = [r for r in runs if str(r.id) == parent.data.tags["posttrain.prefect_flow_run_id"]]
    assert parent.info.run_name == flow_run.name


def test_the_prefect_summary_shows_each_evaluation_and_what_each_stage_bought():
    from posttrain.flows.pipeline_flow import summary_markdown
    from posttrain.flows.plan_walker import PipelineSummary, StepOutcome

    def outcome(step, kind, metrics=None):
        return StepOutcome(step, "ran", "", "k", "/out", metrics or {}, kind)

    summary = PipelineSummary(
        "smoke",
        "abc",
        [
            outcome("eval-baseline", "eval", {"accuracy_strict": 0.25}),
            outcome("sft", "sft"),
            outcome("eval-sft", "eval", {"accuracy_strict": 0.5}),
        ],
        {
            "eval-sft/stage_minutes": 2.0,
            "eval-sft/delta_accuracy_strict": 0.25,
            "eval-sft/delta_accuracy_strict_ci_low": 0.1,
            "eval-sft/delta_accuracy_strict_ci_high": 0.4,
        },
    )
    lines = summary_markdown(summary).splitlines()
    assert "| sft | ran | 50.0% | 0.0% | 0.0% | - |" in lines
    assert lines[-3:] == [
        "| stage | minutes | change (points) | points per minute |",
        "|---|---|---|---|",
        "| sft | 2.0 | +25.0 [+10.0, +40.0] | +12.50 |",
    ]
    # an extra evaluation set's change gets a column of its own: a stage trained for problems the
    # primary set does not hold shows what it bought there
    summary.changes |= {
        "eval-sft/delta_accuracy_strict/unseen": 0.3,
        "eval-sft/delta_accuracy_strict_ci_low/unseen": 0.2,
        "eval-sft/delta_accuracy_strict_ci_high/unseen": 0.4,
    }
    assert summary_markdown(summary).splitlines()[-3:] == [
        "| stage | minutes | change (points) | points per minute | unseen change |",
        "|---|---|---|---|---|",
        "| sft | 2.0 | +25.0 [+10.0, +40.0] | +12.50 | +30.0 [+20.0, +40.0] |",
    ]


@pytest.mark.parametrize(
    ("parameters", "name"),
    [
        ({"config": "configs/smoke.yaml"}, "smoke"),  # run_config: a deployment's path
        ({"config": {"name": "raw", "seed": 1}}, "raw"),  # a deployment's raw parameters
        ({"configs": [{"name": "swept"}, {"name": "swept"}]}, "swept"),  # a sweep's points
        ({"config": {"seed": 1}}, None),  # no name: Prefect's slug alone
    ],
)
def test_a_flow_run_name_comes_from_whatever_form_its_config_arrives_in(parameters, name):
    from prefect import flow
    from prefect.context import FlowRunContext

    from posttrain.flows.prefect_ui import config_run_name

    @flow(flow_run_name=config_run_name)
    def started(config: Any = None, configs: Any = None) -> str:
        return FlowRunContext.get().flow_run.name

    got = started(**parameters)
    assert re.fullmatch((rf"{name}-" if name else "") + "[a-z]+-[a-z]+", got), got


def test_compare_promote_moves_the_champion_alias(first_run, workdir, capsys):
    import mlflow

    from posttrain.cli import main

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    args = ["compare", "--experiment", "smoke", "--last", "1", "--tracking-uri", uri]
    args += ["--plot", str(workdir / "promote.png"), "--promote", "--metric", "strict_format_rate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    client = mlflow.MlflowClient(uri)
    champion = client.get_model_version_by_alias("smoke", "champion")
    model = client.get_logged_model(champion.source.removeprefix("models:/"))
    scores = {
        m.name: {x.key: x.value for x in m.metrics}["eval/strict_format_rate"]
        for m in client.search_logged_models([model.experiment_id])
        if m.tags.get("posttrain.pipeline_run_id") == model.tags["posttrain.pipeline_run_id"]
    }
    assert scores[model.name] == max(scores.values())
    assert f"champion: smoke v{champion.version} = {model.name}" in out and "no champion before" in out
    assert main(args) == 0  # again: nothing moves, and it says so
    assert "champion unchanged: smoke v1" in capsys.readouterr().out
    assert main([*args[:-1], "no_such_metric"]) == 2
    assert (
        "--promote: no stage model of these runs has the metric 'eval/no_such_metric'"
        in capsys.readouterr().err
    )


def test_cli_dry_run_compare_and_serve_without_server(
    smoke_config_path, first_run, workdir, capsys, monkeypatch
):
    from posttrain.cli import main

    sets = [
        "--set",
        f"orchestration.store={workdir / 'store'}",
        "--set",
        f"model.cache_dir={workdir / 'models'}",
        "--set",
        f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
    ]
    assert main(["run", str(smoke_config_path), *sets, "--dry-run", "--force", "dpo"]) == 0
    out = capsys.readouterr().out
    assert "sft                    cached" in out and "dpo                    run     forced" in out

    png = workdir / "compare.png"
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    assert (
        main(["compare", "--experiment", "smoke", "--last", "2", "--tracking-uri", uri, "--plot", str(png)])
        == 0
    )
    out = capsys.readouterr().out
    assert "eval-grpo-correctness" in out or "grpo-correctness" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["serve", str(smoke_config_path), "--cron", "0 3 * * *", *sets]) == 2
    assert "prefect server start" in capsys.readouterr().err

    assert main(["run", str(smoke_config_path), *sets, "--force", "nope"]) == 2
    assert "not a step of smoke" in capsys.readouterr().err


def test_dry_run_and_the_flow_run_the_same_plan(smoke_config, first_run, workdir, monkeypatch):
    import dataclasses

    import posttrain.flows.pipeline_flow as pipeline_flow
    import posttrain.pipeline.plan as plan_module
    from posttrain.pipeline.plan import build_plan

    def without_dpo_eval(cfg):
        plan = build_plan(cfg)
        return dataclasses.replace(plan, steps=tuple(s for s in plan.steps if s.name != "eval-dpo"))

    # The one plan both read: the dry run's preview and the flow each build it by this name.
    monkeypatch.setattr(pipeline_flow, "build_plan", without_dpo_eval)
    monkeypatch.setattr(plan_module, "build_plan", without_dpo_eval)
    planned = [step for step, _, _ in plan_module.preview(smoke_config(workdir))]
    ran = list(statuses(pipeline_flow.posttrain_pipeline(smoke_config(workdir))))
    expected = [s for s in STEPS if s != "eval-dpo"]
    assert planned == expected
    assert ran == expected


def output_of(summary, step: str) -> str:
    return next(o["output"] for o in summary["outcomes"] if o["step"] == step)


def rerun_of_the_last_stage(cfg, step_calls: list[str]):
    """Run ``cfg``, the smoke config with an override that touches only its last GRPO stage: every
    step before it must be served from the cache and that stage must train again."""
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    summary = posttrain_pipeline(cfg)
    got = statuses(summary)
    before = STEPS[: STEPS.index("grpo-correctness")]
    assert {s: got[s] for s in before} == dict.fromkeys(before, "cached")
    assert got["grpo-correctness"] == "ran" and step_calls[0] == "grpo_step"
    return summary


def test_one_reward_weight_reruns_exactly_that_stage_and_what_follows(
    smoke_config, first_run, workdir, step_calls
):
    from posttrain.models.artifacts import fingerprint_dir

    summary = rerun_of_the_last_stage(
        smoke_config(workdir, "grpo.stages.1.rewards.1.weight=0.25"), step_calls
    )
    got = statuses(summary)
    # The evaluation reruns exactly when the retrained policy differs (its key is the weights' hash).
    outputs = [output_of(run, "grpo-correctness") for run in (first_run, summary)]
    changed = fingerprint_dir(outputs[0]) != fingerprint_dir(outputs[1])
    assert got["eval-grpo-correctness"] == ("ran" if changed else "cached")
    assert step_calls == (["grpo_step", "eval_step"] if changed else ["grpo_step"])


def test_a_stages_own_lora_null_fully_fine_tunes_that_stage_only(
    smoke_config, first_run, workdir, step_calls
):
    """The smoke config trains LoRA adapters (model.lora); `lora: null` in one stage trains that stage's
    full model, reruns it and what follows, and leaves the stages before it cached."""
    import mlflow

    from posttrain.models.artifacts import read_stage_json

    summary = rerun_of_the_last_stage(smoke_config(workdir, "grpo.stages.1.lora=null"), step_calls)
    infos = [
        read_stage_json(output_of(run, step))
        for run, step in ((first_run, "grpo-correctness"), (summary, "grpo-correctness"), (summary, "dpo"))
    ]
    assert [info["artifact"] for info in infos] == ["merged", "full", "merged"]
    assert infos[0]["model_config_hash"] != infos[1]["model_config_hash"]
    # Its LoggedModel's params say what trained it: no adapter, where the earlier stages had one.
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    parent = client.get_run(summary["run_id"])
    models = client.search_logged_models(
        [parent.info.experiment_id],
        filter_string=f"tags.`posttrain.pipeline_run_id` = '{parent.info.run_id}'",
    )
    [model] = [m for m in models if m.name == "grpo-correctness"]  # the cached stages keep theirs
    assert (
        model.params["model.lora"] == model.params["stage.lora"] == "null"
        and "model.lora.r" not in model.params
    )


def test_a_flipped_byte_in_a_stages_weights_reruns_it(
    smoke_config, first_run, workdir, step_calls, monkeypatch
):
    """Even when the digest of the weights is remembered and the flip keeps their size and mtime."""
    import json
    import os

    from posttrain.cache import digests
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    monkeypatch.setattr(digests, "SETTLE_NS", 0)
    posttrain_pipeline(smoke_config(workdir))  # checks every output, remembering the digests
    sft_dir = Path(next(o["output"] for o in first_run["outcomes"] if o["step"] == "sft"))
    weights = next(sft_dir.glob("*.safetensors"))
    memo = json.loads((workdir / "store" / "results" / "digests" / "files.json").read_text())
    assert str(weights.resolve()) in memo["files"]
    before = weights.stat()
    with weights.open("r+b") as fh:  # in place: the same inode and size
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)[0]
        fh.seek(-1, os.SEEK_END)
        fh.write(
            bytes([last ^ 0xFF])
        )  # a byte of the last tensor: the file stays loadable, the model does not
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    step_calls.clear()
    got = statuses(posttrain_pipeline(smoke_config(workdir)))
    assert got["sft"] == "ran" and "sft_step" in step_calls
    assert got["data"] == "cached" and got["eval-baseline"] == "cached"


def test_a_run_tidies_what_a_killed_run_left_in_the_store(smoke_config, first_run, workdir):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    stages = workdir / "store" / "stages"
    dpo_dir = Path(next(o["output"] for o in first_run["outcomes"] if o["step"] == "dpo"))
    unfinished = stages / "grpo-format-0123456789ab.tmp-dead"
    unfinished.mkdir()
    (unfinished / "model.safetensors").write_bytes(b"half written")
    aside = dpo_dir.with_name(dpo_dir.name + ".old-beef")
    dpo_dir.rename(aside)  # killed between the two renames: the complete output sits aside

    got = statuses(posttrain_pipeline(smoke_config(workdir)))
    assert not unfinished.exists() and not aside.exists()
    assert dpo_dir.is_dir()
    assert got["dpo"] == "cached"  # put back, verified, and served


def test_cached_stage_runs_point_at_the_run_that_produced_them(smoke_config, first_run, workdir):
    import mlflow

    from posttrain.flows.pipeline_flow import posttrain_pipeline

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    rerun = posttrain_pipeline(smoke_config(workdir))
    assert set(statuses(rerun).values()) == {"cached"}

    def children(run_id):
        runs = client.search_runs(
            [client.get_run(run_id).info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'"
        )
        return {r.info.run_name: r for r in runs}

    produced, cached = children(first_run["run_id"]), children(rerun["run_id"])
    assert set(cached) == set(STEPS)
    for run in cached.values():
        assert run.data.tags["cached"] == "true"
        producer = client.get_run(run.data.tags["cached_from_run_id"])
        assert producer.data.tags["posttrain.cache_key"] == run.data.tags["cache_key"]
        assert "cached" not in producer.data.tags  # the run that computed it, not another cached copy
    for name in ("data", "eval-baseline"):  # never recomputed since the first run
        assert cached[name].data.tags["cached_from_run_id"] == produced[name].info.run_id
    # A cached copy's run has its producer's inputs: datasets, and for an evaluation the model.
    for name, run in cached.items():
        copy = client.get_run(run.info.run_id).inputs
        producer = client.get_run(run.data.tags["cached_from_run_id"]).inputs
        assert sorted((d.dataset.name, d.dataset.digest) for d in copy.dataset_inputs) == sorted(
            (d.dataset.name, d.dataset.digest) for d in producer.dataset_inputs
        ), name
        assert copy.dataset_inputs, name  # every step's run names its data
        assert [m.model_id for m in copy.model_inputs] == [m.model_id for m in producer.model_inputs], name
    # A cached stage's run lists the model its producer made, and so does the cached pipeline run.
    for name in TRAINING:
        model_id = client.get_run(cached[name].info.run_id).data.tags["posttrain.model_id"]
        producer = client.get_run(cached[name].data.tags["cached_from_run_id"])
        assert model_id == producer.data.tags["posttrain.model_id"], name
        assert [o.model_id for o in client.get_run(cached[name].info.run_id).outputs.model_outputs] == [
            model_id
        ]
    final = client.get_run(cached[TRAINING[-1]].info.run_id).data.tags["posttrain.model_id"]
    assert [o.model_id for o in client.get_run(rerun["run_id"]).outputs.model_outputs] == [final]


def test_health_alerts_become_prefect_events_naming_the_stage():
    from posttrain.flows.prefect_ui import health_alert_events

    alerts = [{"step": 1, "kind": "no_signal", "value": 1.0, "message": "all equal", "remedy": "SFT first"}]
    [event] = health_alert_events("smoke", "grpo-format", alerts, mlflow_run_id="abc", task_run_id="t-1")
    assert event["event"] == "posttrain.health.no_signal"
    assert event["resource"]["prefect.resource.id"] == "posttrain.stage.smoke.grpo-format"
    assert event["resource"]["posttrain.alert"] == "no_signal" and event["payload"] == alerts[0]
    assert {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]} == {
        "task-run": "prefect.task-run.t-1",
        "mlflow-run": "mlflow.run.abc",
    }


def test_dry_run_says_which_code_changed(smoke_config, first_run, workdir, monkeypatch):
    from posttrain.cache import keys
    from posttrain.cache.code import CodeFingerprint
    from posttrain.pipeline.plan import preview as dry_run

    real = keys.code_fingerprint

    def reward_fixed(kind, rewards=()):  # as if rewards/format.py had been edited since the last run
        fp = real(kind, rewards)
        return (
            CodeFingerprint({**fp.files, "posttrain/rewards/format.py": "edited"}) if kind == "grpo" else fp
        )

    monkeypatch.setattr(keys, "code_fingerprint", reward_fixed)
    rows = {step: (status, why) for step, status, why in dry_run(smoke_config(workdir))}
    before = STEPS[: STEPS.index("grpo-format")]
    assert {s: rows[s][0] for s in before} == dict.fromkeys(before, "cached")
    assert rows["grpo-format"] == ("run", "code changed: posttrain/rewards/format.py")
    assert rows["grpo-correctness"] == ("run", "after grpo-format reruns")


@pytest.mark.parametrize(("step", "file"), [("eval-baseline", "examples.jsonl"), ("data", "stats.json")])
def test_a_modified_data_or_eval_output_is_recomputed(
    smoke_config, first_run, workdir, step_calls, step, file
):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import preview as dry_run

    output = Path(
        next(o["output"] for o in posttrain_pipeline(smoke_config(workdir))["outcomes"] if o["step"] == step)
    )
    step_calls.clear()
    target = output / file
    target.write_text(
        target.read_text().replace("1", "7", 1)
    )  # still well-formed, no longer what was written
    assert (
        dict((s, why) for s, _, why in dry_run(smoke_config(workdir)))[step]
        == "cached output missing or modified"
    )
    got = statuses(posttrain_pipeline(smoke_config(workdir)))
    assert got[step] == "ran"
    assert step_calls[0] == ("prepare_step" if step == "data" else "eval_step")


def test_a_cached_cli_rerun_skips_prefect_and_logs_what_the_flow_logs(
    smoke_config, smoke_config_path, first_run, workdir, step_calls, monkeypatch, capsys, caplog
):
    """`posttrain run` serves an all-cached plan without the Prefect flow (no server to boot), with
    the same MLflow runs as the flow's rerun; a modified output still goes through the flow and runs."""
    import mlflow

    import posttrain.flows.pipeline_flow as pipeline_flow
    from posttrain.cli import main

    sets = [
        *("--set", f"orchestration.store={workdir / 'store'}"),
        *("--set", f"model.cache_dir={workdir / 'models'}"),
        *("--set", f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}"),
    ]
    flow_calls = []

    def flow_spy(*args, **kwargs):
        flow_calls.append(args)
        return real_flow(*args, **kwargs)

    real_flow = pipeline_flow.posttrain_pipeline
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(pipeline_flow, "posttrain_pipeline", flow_spy)
    by_flow = real_flow(smoke_config(workdir))  # the flow's own all-cached rerun, to compare with
    assert main(["run", str(smoke_config_path), *sets]) == 0
    out = capsys.readouterr().out
    assert flow_calls == [] and step_calls == []
    table = out.split("\n\n")[0].splitlines()[2:]  # the step table (the eval table follows)
    rows = [line.split() for line in table]
    assert [r[0] for r in rows] == STEPS and {r[1] for r in rows} == {"cached"}

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_run(first_run["run_id"]).info.experiment_id
    cli_run = client.search_runs(
        [experiment], "tags.`posttrain.role` = 'pipeline'", order_by=["attributes.start_time DESC"]
    )[0]
    flow_run = client.get_run(by_flow["run_id"])
    assert cli_run.info.run_id != flow_run.info.run_id and cli_run.info.status == "FINISHED"
    where = f"MLflow run {cli_run.info.run_id} in experiment '{client.get_experiment(experiment).name}'"
    assert out.rstrip().endswith(where), out[-300:]
    assert cli_run.data.params == flow_run.data.params
    assert cli_run.data.metrics == flow_run.data.metrics  # each evaluation mirrored on the parent

    def children(run_id):
        runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'")
        ignored = {"mlflow.parentRunId", "mlflow.runName", "mlflow.user", "mlflow.source.name"}
        return {
            r.info.run_name: (
                {k: v for k, v in r.data.tags.items() if k not in ignored},
                r.data.metrics,
                r.data.params,
                r.info.status,
            )
            for r in runs
        }

    assert children(cli_run.info.run_id) == children(flow_run.info.run_id)
    artifacts = {a.path for a in client.list_artifacts(cli_run.info.run_id)}
    assert artifacts == {a.path for a in client.list_artifacts(flow_run.info.run_id)}

    # A modified evaluation output (same size): the dry run sees it, so the flow runs that step.
    report = Path(next(o["output"] for o in first_run["outcomes"] if o["step"] == "eval-sft"))
    target = report / "examples.jsonl"
    target.write_text(target.read_text().replace("1", "7", 1))
    with caplog.at_level("WARNING"):
        assert main(["run", str(smoke_config_path), *sets]) == 0
    assert len(flow_calls) == 1 and step_calls == ["eval_step"]
    assert "running the pipeline flow" not in caplog.text  # decided before anything was logged


# --------------------------------------------------------------------------- extra evaluation sets

GSM8K_ROWS = [
    ("Ann has 3 apples and buys 4 more. How many apples does she have?", "3+4 = <<3+4=7>>7\n#### 7"),
    (
        "Bo reads 5 pages a day for 6 days, then 2 more pages. How many pages?",
        "5*6 = <<5*6=30>>30\n30+2 = <<30+2=32>>32\n#### 32",
    ),
    ("A box holds 12 eggs. How many eggs are in 2 boxes?", "12*2 = <<12*2=24>>24\n#### 24"),
    ("Never evaluated: the set's limit is 3.", "#### 1"),
]


def with_extra_sets(workdir: Path) -> list[str]:
    import json

    path = workdir / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS))
    sets = f"[{{name: gsm8k, data: local, path: {path}, limit: 3}}, {{name: synth, data: synthetic, limit: 4, max_ops: 2}}]"
    return [f"eval.extra_sets={sets}"]


@pytest.fixture(scope="module")
def extra_run(smoke_run, smoke_config):
    """The session's smoke run again with two extra evaluation sets. The tests below read what it
    left in turn (the last one damages a report), so the store is put back after all of them."""
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    workdir = smoke_run.workdir
    yield posttrain_pipeline(smoke_config(workdir, *with_extra_sets(workdir)))
    smoke_run.restore()


def test_extra_eval_sets_rerun_only_the_evaluations_and_report_each_set(extra_run):
    import json

    got = statuses(extra_run)
    assert {s for s, v in got.items() if v == "ran"} == {"data"} | {s for s in STEPS if s.startswith("eval-")}
    for outcome in (o for o in extra_run["outcomes"] if o["kind"] == "eval"):
        out, metrics = Path(outcome["output"]), outcome["metrics"]
        heads = {
            name: json.loads((out / name / "report.json").read_text()) for name in ("", "gsm8k", "synth")
        }
        assert heads[""]["config"]["data"] == "heldout" and heads[""]["config"]["extra_sets"] == []
        assert heads["gsm8k"]["config"]["dataset"] == {
            "source": "local",
            "dataset": str(out.parents[2] / "gsm8k.jsonl"),
            "split": "gsm8k",
            "num_questions": 3,
            "split_size": 4,
            "label": f"{out.parents[2] / 'gsm8k.jsonl'} gsm8k split, 3 of 4 questions",
        }
        assert heads[""]["config"]["dataset"]["label"] == (
            "dev slice held out of posttrain synthetic problems (never trained on), 8 questions"
        )
        assert heads["synth"]["config"]["dataset"]["split"] == "1-2 operations"
        assert (
            heads["gsm8k"]["summary"]["num_examples"] == 3 and heads["synth"]["summary"]["num_examples"] == 4
        )
        assert set(heads["gsm8k"]["by_ops"]) == {"1", "2"} and set(heads["synth"]["by_ops"]) <= {"1", "2"}
        for name, head in heads.items():
            suffix = f"/{name}" if name else ""
            assert metrics[f"accuracy_strict{suffix}"] == head["summary"]["accuracy_strict"]
            assert metrics[f"strict_format_rate{suffix}"] == head["summary"]["strict_format_rate"]
            for ops, values in head["by_ops"].items():
                assert metrics[f"accuracy_strict{suffix}/ops_{ops}"] == values["accuracy_strict"]
        assert metrics["accuracy_strict/gsm8k/ops_2"] == heads["gsm8k"]["by_ops"]["2"]["accuracy_strict"]


def test_extra_eval_sets_in_mlflow_compare_and_the_run_summary(extra_run, smoke_run, capsys):
    import json

    import mlflow

    from posttrain.cli import eval_sets_legend, eval_table, main

    workdir = smoke_run.workdir
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    parent = client.get_run(extra_run["run_id"])
    runs = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    evaluation = run = next(r for r in runs if r.info.run_name == "eval-sft")
    metrics = evaluation.data.metrics
    assert {"eval/accuracy_strict", "eval/accuracy_strict/gsm8k", "eval/accuracy_strict/synth"} <= set(
        metrics
    )
    assert "eval/accuracy_strict/gsm8k/ops_2" in metrics and "eval/seconds/gsm8k" in metrics
    assert parent.data.metrics["eval-sft/accuracy_strict/gsm8k"] == metrics["eval/accuracy_strict/gsm8k"]
    artifacts = {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    assert {"eval_examples.json", "gsm8k", "synth"} <= artifacts
    # MLflow's table format ({"columns": [...], "data": [[...], ...]}); load_table reads the global URI
    table = json.loads(
        Path(
            client.download_artifacts(evaluation.info.run_id, "gsm8k/eval_examples.json", str(workdir))
        ).read_text()
    )
    assert table["columns"][:4] == ["id", "question", "gold", "ops"] and [r[3] for r in table["data"]] == [
        1,
        2,
        1,
    ]
    # Other tests in this module retrain sft under the same key (a flipped byte, a missing output),
    # each logging another model with that key: the evaluation links to one of them.
    models = client.search_logged_models(
        [parent.info.experiment_id],
        filter_string=f"tags.`posttrain.cache_key` = '{next(o['key'] for o in extra_run['outcomes'] if o['step'] == 'sft')}'",
    )
    linked = {
        (m.key, m.dataset_name)
        for model in models
        for m in model.metrics or ()
        if m.run_id == evaluation.info.run_id
    }
    assert {("eval/accuracy_strict", "heldout"), ("eval/accuracy_strict/gsm8k", "gsm8k")} <= linked

    args = ["compare", extra_run["run_id"], "--tracking-uri", uri, "--plot", str(workdir / "sets.png")]
    assert main(args) == 0
    headline = capsys.readouterr().out
    assert "eval-sft [gsm8k] strict" in headline and "eval-sft [synth] strict" in headline
    assert "eval-sft/accuracy_strict/synth/ops_1" not in headline  # per difficulty: behind --all
    assert main([*args, "--all"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("eval-")]
    sft_rows = [r for r in rows if r.startswith("eval-sft/")]
    assert "eval-sft/accuracy_strict/synth/ops_1" in sft_rows
    # stage order, not alphabetical: every row of eval-sft comes before any row of eval-dpo
    assert rows.index(sft_rows[-1]) < min(i for i, r in enumerate(rows) if r.startswith("eval-dpo/"))

    workdir_file = workdir / "gsm8k.jsonl"
    assert eval_sets_legend(extra_run["outcomes"], "heldout").splitlines() == [
        "evaluation sets:",
        "  heldout  dev slice held out of posttrain synthetic problems (never trained on), 8 questions",
        f"  gsm8k    {workdir_file} gsm8k split, 3 of 4 questions",
        "  synth    synthetic problems of 1-2 operations, 4 questions",
    ]
    assert run.data.params["dataset.gsm8k.split_size"] == "4"
    text = eval_table(extra_run["outcomes"], "heldout", width=200)
    assert text.splitlines()[1].split()[:4] == ["stage", "heldout", "ops", "1"]
    assert "gsm8k ops 2" in text and [line.split()[0] for line in text.splitlines()[3:]] == [
        "baseline",
        "sft",
        "dpo",
        "grpo-format",
        "grpo-correctness",
    ]


def test_a_modified_extra_set_report_reruns_the_evaluation(
    smoke_config, extra_run, smoke_run, step_calls, capsys
):
    from posttrain.cli import main
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    workdir = smoke_run.workdir

    config = smoke_config(workdir, *with_extra_sets(workdir))
    assert set(statuses(posttrain_pipeline(config)).values()) == {"cached"} and step_calls == []
    baseline, sft = (
        Path(next(o["output"] for o in extra_run["outcomes"] if o["step"] == s))
        for s in ("eval-baseline", "eval-sft")
    )

    assert main(["eval", "--diff", str(baseline), str(sft)]) == 0
    out = capsys.readouterr().out
    assert "evaluation set gsm8k:" in out and "evaluation set synth:" in out
    assert "by number of operations (strict):" in out.split("evaluation set gsm8k:")[1]

    target = baseline / "gsm8k" / "examples.jsonl"
    target.write_text(
        target.read_text().replace('"ops": 1', '"ops": 7', 1)
    )  # well-formed, not what was written
    got = statuses(posttrain_pipeline(config))
    assert got["eval-baseline"] == "ran" and step_calls == ["eval_step"]
