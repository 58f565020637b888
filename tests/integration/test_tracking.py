"""MLflow tracking against real SQLite stores (one per test), plus a real 1-step TRL trainer.

A new SQLite store costs seconds of migrations, so one migrated empty database is built per module
and copied for each test: every test still gets its own ``sqlite:///{tmp_path}/mlflow.db``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from posttrain.core.config import parse_config
from posttrain.tracking import (
    MAX_PARAM_LENGTH,
    Tracker,
    compare_runs,
    flatten_params,
    format_comparison,
    plot_comparison,
    resolve_tracking_uri,
    start_pipeline_run,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # runs the migrations
    return path


@pytest.fixture
def uri(tmp_path, template_db, monkeypatch) -> str:
    shutil.copy(template_db, tmp_path / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # anything written relative to the cwd stays in the test's folder
    return f"sqlite:///{tmp_path}/mlflow.db"


def make_cfg(uri: str | None, name: str = "track-test", **sections):
    raw = {"name": name, "model": {"name": "tiny-random"}, "tracking": {"tracking_uri": uri}, **sections}
    return parse_config(raw)


def client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def children(uri: str, tracker: Tracker) -> dict[str, object]:
    runs = client(uri).search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
    return {r.info.run_name: r for r in runs}


def artifact_paths(uri: str, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client(uri).list_artifacts(run_id, path)}


def download(uri: str, run_id: str, path: str, dst: Path) -> Path:
    return Path(client(uri).download_artifacts(run_id, path, str(dst)))


# --------------------------------------------------------------------------- pure helpers


def test_flatten_params_dotted_keys_json_values_and_mlflow_limit():
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    assert MAX_PARAM_LENGTH == MAX_PARAM_VAL_LENGTH == 6000
    flat = flatten_params(
        {
            "a": {"b": 1, "c": [1, 2], "d": None, "e": True},
            "stages": [{"name": "x", "rewards": [{"w": 0.5}]}],
            "empty": {},
            "long": "y" * 7000,
        }
    )
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]" and flat["a.d"] == "null" and flat["a.e"] == "true"
    assert flat["stages.0.name"] == "x" and flat["stages.0.rewards.0.w"] == "0.5"
    assert flat["empty"] == "{}"
    assert len(flat["long"]) == 6000 and flat["long"].endswith("[truncated]")


def test_resolve_tracking_uri_precedence(tmp_path, monkeypatch):
    from posttrain.core.config import TrackingConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(TrackingConfig()) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_tracking_uri(TrackingConfig()) == "http://127.0.0.1:5999"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="sqlite:////x/y.db")) == "sqlite:////x/y.db"


def test_importing_tracking_is_light():
    """`posttrain validate` imports the package; mlflow (~1.6 s) and matplotlib load only when used."""
    code = (
        "import sys, posttrain.tracking; print(sorted({'mlflow', 'matplotlib', 'pandas'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_disabled_tracker_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(None, tracking={"enabled": False})
    with start_pipeline_run(cfg) as tracker:
        assert tracker.report_to == "none" and tracker.run_id is None
        with tracker.stage("sft", params=cfg.model, cache_key="k") as stage:
            assert stage.report_to == "none"
            stage.log_metrics({"loss": 1.0})
            stage.log_eval({"accuracy": 0.5}, [{"q": "1"}])
            stage.log_alerts([{"kind": "no_signal", "step": 1, "message": "m"}])
            stage.log_stage_json({"a": 1})
            assert stage.plot_rewards([{"step": 1, "reward": 0.1}]) is False
            assert stage.log_completions(tmp_path) == 0
        assert tracker.record_cached_stage("dpo", cache_key="k").run_id is None
        assert tracker.find_producer("k") is None
        assert tracker.log_final_model(tmp_path) is None
        assert tracker.plot_accuracy_by_stage() is False
        assert tracker.log_stage_gains() is False
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no mlruns


# --------------------------------------------------------------------------- runs


def test_parent_and_nested_stage_runs(uri, tmp_path):
    import datasets

    cfg = make_cfg(uri, sft={"trainer": {"max_steps": 2}})
    with start_pipeline_run(cfg) as tracker:
        assert os.environ["MLFLOW_TRACKING_URI"] == uri and tracker.report_to == ["mlflow"]
        ds = datasets.Dataset.from_list([{"question": "1+1?", "answer": "2"}] * 3)
        with tracker.stage("data", cache_key="data-key") as stage:
            stage.log_dataset(ds, "train", "training", source="synthetic(seed=0)")
            stage.log_metrics({"train_examples": 3, "note": "text is skipped", "flag": True})
        with tracker.stage("sft", params=cfg.sft) as stage:
            import mlflow

            assert mlflow.active_run().info.run_id == stage.run_id
            stage.log_history([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "epoch": 1.0}])
            stage.log_stage_json({"stage": "sft", "output": Path("/x"), "metrics": {"loss": 1.5}})
        with pytest.raises(RuntimeError), tracker.stage("dpo"):
            raise RuntimeError("boom")
    assert "MLFLOW_TRACKING_URI" not in os.environ  # restored, nothing leaks into the next test

    c = client(uri)
    parent = c.get_run(tracker.run_id)
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["posttrain.config_name"] == "track-test" and tags["posttrain.role"] == "pipeline"
    assert len(tags["posttrain.config_hash"]) == 16
    assert {
        "posttrain.version.mlflow",
        "posttrain.version.transformers",
        "posttrain.version.posttrain",
    } <= set(tags)
    assert parent.data.params["model.name"] == "tiny-random"
    assert parent.data.params["sft.trainer.max_steps"] == "2"
    assert "config.yaml" in artifact_paths(uri, tracker.run_id)
    assert "tiny-random" in download(uri, tracker.run_id, "config.yaml", tmp_path / "dl").read_text()

    kids = children(uri, tracker)
    assert set(kids) == {"data", "sft", "dpo"}
    assert kids["dpo"].info.status == "FAILED" and kids["sft"].info.status == "FINISHED"
    assert kids["data"].data.tags["posttrain.cache_key"] == "data-key"
    assert kids["data"].data.metrics == {"train_examples": 3.0, "flag": 1.0}
    [inp] = kids["data"].inputs.dataset_inputs
    assert inp.dataset.name == "train" and inp.dataset.digest == ds._fingerprint
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"
    sft = kids["sft"]
    assert sft.data.params["stage.trainer.max_steps"] == "2"
    assert [(m.step, m.value) for m in c.get_metric_history(sft.info.run_id, "loss")] == [(1, 2.0), (2, 1.5)]
    stage_json = json.loads(download(uri, sft.info.run_id, "stage.json", tmp_path / "dl2").read_text())
    assert stage_json["output"] == "/x"


def test_stages_in_worker_threads_get_their_own_active_run(uri):
    """Prefect runs tasks in threads and MLflow's active run is thread-local: each stage must still be
    the active run of its own thread (where the trainer's callback logs) and a child of the parent."""
    import mlflow

    def task(name: str) -> str:
        with tracker.stage(name) as stage:
            mlflow.log_metric("fluent", 1.0)  # what transformers' MLflowCallback does
            return stage.run_id

    with start_pipeline_run(make_cfg(uri)) as tracker, ThreadPoolExecutor(2) as pool:
        run_ids = list(pool.map(task, ["sft", "eval-baseline"]))
    kids = children(uri, tracker)
    assert {k: r.info.run_id for k, r in kids.items()} == dict(
        zip(["sft", "eval-baseline"], run_ids, strict=True)
    )
    assert all(r.data.metrics == {"fluent": 1.0} and r.info.status == "FINISHED" for r in kids.values())
    assert len(client(uri).search_runs([tracker.experiment_id])) == 3


def test_param_relogging_with_another_value_is_kept_as_a_tag(uri):
    with start_pipeline_run(make_cfg(uri)) as tracker, tracker.stage("sft") as stage:
        stage.log_params({"lr": 1e-5})
        stage.log_params({"lr": 1e-5, "epochs": 1})  # same value again: fine
        stage.log_params({"lr": 2e-5})  # MLflow would reject this; posttrain keeps the first
    run = client(uri).get_run(stage.run_id)
    assert run.data.params == {"stage.lr": "1e-05", "stage.epochs": "1"}
    assert run.data.tags["param_conflict.stage.lr"] == "2e-05"


def test_eval_table_round_trip_and_parent_mirror(uri, tmp_path):
    records = [
        {"question": "2+2?", "gold": "4", "completion": "<answer>\n4\n</answer>", "correct": True},
        {"question": "3*3?", "gold": "9", "completion": "ten", "correct": False},
    ]
    with start_pipeline_run(make_cfg(uri)) as tracker, tracker.stage("eval-sft") as stage:
        stage.log_eval({"accuracy_strict": 0.5, "format_rate": 1.0}, records)
    table = client(uri).load_table(tracker.experiment_id, "eval_examples.json", run_ids=[stage.run_id])
    assert table["question"].tolist() == ["2+2?", "3*3?"] and table["correct"].tolist() == [True, False]
    assert table["gold"].tolist() == [4, 9]  # log_table's documented type change: "4" -> 4
    exact = download(uri, stage.run_id, "eval_examples.jsonl", tmp_path / "dl").read_text().splitlines()
    assert [json.loads(line) for line in exact] == records  # the JSONL copy is exact
    assert client(uri).get_run(stage.run_id).data.metrics == {
        "eval/accuracy_strict": 0.5,
        "eval/format_rate": 1.0,
    }
    parent = client(uri).get_run(tracker.run_id).data.metrics
    assert parent == {"eval-sft/accuracy_strict": 0.5, "eval-sft/format_rate": 1.0}


def test_alerts_completions_and_plots(uri, tmp_path):
    import pandas as pd

    out = tmp_path / "grpo-out" / "completions"
    out.mkdir(parents=True)
    for step in (1, 2):  # the layout TRL's GRPOTrainer writes with log_completions=True
        pd.DataFrame(
            {
                "step": [step] * 2,
                "prompt": [[{"role": "system", "content": "fmt"}, {"role": "user", "content": "1+1?"}]] * 2,
                "completion": [[{"role": "assistant", "content": f"<answer>{step}</answer>"}]] * 2,
                "strict_format": [0.0, 1.0],
                "advantage": [-0.5, 0.5],
            }
        ).to_parquet(out / f"completions_{step:05d}.parquet")
    alerts = [
        {"step": 1, "kind": "no_signal", "value": 1.0, "message": "all rewards equal", "remedy": "SFT first"},
        {"step": 4, "kind": "no_signal", "value": 1.0, "message": "still equal", "remedy": "SFT first"},
        {"step": 3, "kind": "kl_blowup", "value": 2.5, "message": "kl 2.5", "remedy": "raise beta"},
    ]
    history = [
        {
            "step": s,
            "reward": 0.1 * s,
            "rewards/strict_format/mean": 0.05 * s,
            "rewards/correctness/mean": 0.02 * s,
            "loss": 0.1,
            **({"eval/accuracy": 0.03 * s, "eval/format": 1.0} if s % 2 else {}),  # every 2 steps
        }
        for s in range(1, 6)
    ]
    with start_pipeline_run(make_cfg(uri)) as tracker:
        with tracker.stage("eval-baseline") as stage:
            stage.log_eval({"accuracy_strict": 0.0, "accuracy_flexible": 0.1})
        with tracker.stage("grpo-format") as stage:
            stage.log_history(history)  # what the trainer callback would have logged
            assert stage.log_completions(out.parent) == 4
            stage.log_alerts(alerts)
            assert stage.plot_rewards() is True  # read back from the run's metric history
            curves = stage._reward_history()  # what that plot drew: rewards and held-out accuracy
            assert sorted(curves) == [
                "eval/accuracy",
                "reward",
                "rewards/correctness/mean",
                "rewards/strict_format/mean",
            ]
            assert [step for step, _ in curves["eval/accuracy"]] == [1, 3, 5]
        with tracker.stage("eval-grpo-format") as ev:
            ev.log_eval({"accuracy_strict": 0.4, "accuracy_flexible": 0.5})
        assert tracker.plot_accuracy_by_stage() is True

    run = client(uri).get_run(stage.run_id)
    assert run.data.tags["alert.no_signal"] == "step 1: all rewards equal (+1 more)"
    assert run.data.tags["alert.kl_blowup"] == "step 3: kl 2.5" and run.data.tags["alerts.count"] == "3"
    assert client(uri).get_run(tracker.run_id).data.tags["alerts.grpo-format"] == "no_signal,kl_blowup"
    saved = json.loads(download(uri, stage.run_id, "alerts.json", tmp_path / "a").read_text())
    assert saved == {"alerts": alerts}
    assert artifact_paths(uri, stage.run_id, "completions") == {
        "completions/completions_00001.parquet",
        "completions/completions_00002.parquet",
    }
    table = json.loads(download(uri, stage.run_id, "completions.json", tmp_path / "c").read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert (
        rows[0]["completion"] == "<answer>1</answer>" and rows[0]["prompt"] == "[system] fmt\n\n[user] 1+1?"
    )
    assert (
        table["columns"][:2] == ["step", "question"] and rows[0]["question"] == "1+1?"
    )  # not behind the system prompt
    for run_id, name in ((stage.run_id, "reward_curves.png"), (tracker.run_id, "accuracy_by_stage.png")):
        png = download(uri, run_id, name, tmp_path / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_cached_stage_points_at_its_producer(uri):
    cfg = make_cfg(uri)
    with start_pipeline_run(cfg) as first:
        with first.stage("sft", params={"lr": 1e-5}, cache_key="sft-abc") as producer:
            producer.log_history([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}])
        with first.stage("eval-sft", kind="eval", params={"limit": 8}, cache_key="eval-abc") as ev:
            ev.log_eval({"accuracy_strict": 0.25})
        with first.stage("eval-base", params={"limit": 8}) as older:  # logged as an older posttrain did
            older.log_eval({"accuracy_strict": 0.0})
    with start_pipeline_run(cfg) as second:
        assert second.find_producer("sft-abc") == producer.run_id
        assert second.find_producer("missing") is None
        cached = second.record_cached_stage("sft", cache_key="sft-abc")
        cached_eval = second.record_cached_stage("eval-sft", kind="eval", producer_run_id=ev.run_id)
        cached_older = second.record_cached_stage("eval-base", kind="eval", producer_run_id=older.run_id)
    c = client(uri)
    run = c.get_run(cached.run_id)
    assert run.data.tags["cached"] == "true" and run.data.tags["cached_from_run_id"] == producer.run_id
    assert run.data.tags["mlflow.parentRunId"] == second.run_id and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in c.get_metric_history(cached.run_id, "loss")] == [(1, 2.0), (2, 1.0)]
    assert run.data.params == {"stage.lr": "1e-05"}
    assert "posttrain.cache_key" not in run.data.tags  # a cached copy never becomes a producer
    assert second.find_producer("sft-abc") == producer.run_id
    assert c.get_run(cached_eval.run_id).data.metrics == {"eval/accuracy_strict": 0.25}
    # An evaluation's config params are named after its section, and a cached copy keeps them.
    assert (
        c.get_run(ev.run_id).data.params == c.get_run(cached_eval.run_id).data.params == {"eval.limit": "8"}
    )
    # A producer an older posttrain logged named them stage.*: the copy names them as this one does.
    assert c.get_run(older.run_id).data.params == {"stage.limit": "8"}
    assert c.get_run(cached_older.run_id).data.params == {"eval.limit": "8"}
    assert c.get_run(second.run_id).data.metrics == {
        "eval-sft/accuracy_strict": 0.25,
        "eval-base/accuracy_strict": 0.0,
    }
    assert set(children(uri, second)) == {"sft", "eval-sft", "eval-base"}


def test_compare_runs_shows_only_the_differing_param_and_stage_metrics(uri, tmp_path, monkeypatch):
    trackers = []
    for lr, accuracy in ((1e-5, 0.2), (3e-5, 0.4)):
        cfg = make_cfg(uri, sft={"trainer": {"learning_rate": lr}})
        steps = ["eval-baseline", "grpo-format", "eval-grpo-format"]
        with start_pipeline_run(cfg, steps=steps) as tracker:
            with tracker.stage("eval-baseline") as s:
                s.log_eval({"accuracy_strict": 0.1, "accuracy_strict/gsm8k": 0.05})
            with tracker.stage("grpo-format", kind="grpo") as s:
                s.log_history([{"step": i, "reward": accuracy * i} for i in range(1, 4)])
            with tracker.stage("eval-grpo-format") as s:
                s.log_eval({"accuracy_strict": accuracy})
        trackers.append(tracker)
    ids = [t.run_id for t in trackers]

    comparison = compare_runs(experiment="track-test", last=2, tracking_uri=uri)
    assert [r.run_id for r in comparison.runs] == ids  # oldest first
    assert comparison.param_diffs == {"sft.trainer.learning_rate": ["1e-05", "3e-05"]}
    assert comparison.metric_names == [  # in the plan's order, a metric's slices beside it
        "eval-baseline/accuracy_strict",
        "eval-baseline/accuracy_strict/gsm8k",
        "eval-grpo-format/accuracy_strict",
    ]
    assert [r.stage_metrics["eval-grpo-format/accuracy_strict"] for r in comparison.runs] == [0.2, 0.4]
    assert comparison.runs[1].reward_curves["grpo-format"] == [(1, 0.4), (2, 0.8), (3, 1.2000000000000002)]
    assert comparison.runs[0].duration_s is not None and comparison.runs[0].start_time is not None
    assert comparison.table()[1]["sft.trainer.learning_rate"] == "3e-05"
    assert compare_runs(run_ids=ids[::-1], tracking_uri=uri).runs[0].run_id == ids[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the CLI's default: the environment
    assert [r.run_id for r in compare_runs(last=1).runs] == ids[1:]

    text = format_comparison(comparison)
    assert "sft.trainer.learning_rate" in text and "3e-05" in text
    row = next(line for line in text.splitlines() if line.startswith("eval-grpo-format strict"))
    assert row.split()[-2:] == ["20.0%", "40.0%"]
    assert "eval-baseline [gsm8k] strict" in text  # an extra set is a headline row of its own
    assert "model.name" not in text  # equal params are not shown
    png = plot_comparison(comparison, tmp_path / "cmp.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


# --------------------------------------------------------------------------- transformers / TRL


def test_trl_trainer_logs_into_the_stage_run(uri, tiny_model_dir, tmp_path, monkeypatch):
    """report_to=["mlflow"] inside a stage: the callback uses our run, starts no other, ends nothing.

    MLFLOW_NESTED_RUN=1 would make the callback open (and close) a grandchild run; the stage hides it.
    """
    import datasets
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    monkeypatch.setenv("MLFLOW_NESTED_RUN", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = datasets.Dataset.from_list([{"text": "Natalia sold 48 clips. <answer>72</answer>"}] * 4)
    with start_pipeline_run(make_cfg(uri)) as tracker:
        with tracker.stage("sft") as stage:
            args = SFTConfig(
                output_dir=str(tmp_path / "out"),
                max_steps=1,
                per_device_train_batch_size=2,
                logging_steps=1,
                save_strategy="no",
                report_to=stage.report_to,
                use_cpu=True,
                bf16=False,
                max_length=32,
                run_name="sft",
            )
            SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()
            assert mlflow.active_run().info.run_id == stage.run_id  # not ended by the callback
            assert os.environ.get("MLFLOW_NESTED_RUN") is None
        assert os.environ["MLFLOW_NESTED_RUN"] == "1"
        assert mlflow.active_run() is None
    c = client(uri)
    everything = c.search_runs([tracker.experiment_id])
    assert {r.info.run_id for r in everything} == {tracker.run_id, stage.run_id}  # no extra run
    run = c.get_run(stage.run_id)
    assert run.info.status == "FINISHED"
    assert "loss" in run.data.metrics and "train_runtime" in run.data.metrics
    assert run.data.params["learning_rate"] and run.data.params["max_steps"] == "1"


def test_log_final_model_full_and_peft_adapter(uri, tiny_model_dir, tmp_path):
    import mlflow
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter_dir)

    with start_pipeline_run(make_cfg(uri)) as tracker:
        full_uri = tracker.log_final_model(tiny_model_dir)
        with pytest.raises(ValueError, match="base_model_path"):
            tracker.log_final_model(adapter_dir)
        adapter_uri = tracker.log_final_model(adapter_dir, base_model_path=tiny_model_dir, name="adapter")
    assert client(uri).get_run(tracker.run_id).data.tags["posttrain.model_uri"] == adapter_uri
    for model_uri in (full_uri, adapter_uri):
        logged = client(uri).get_logged_model(model_uri.removeprefix("models:/"))
        assert logged.experiment_id == tracker.experiment_id and logged.source_run_id == tracker.run_id
        assert logged.status == "READY" and logged.params["model.name"] == "tiny-random"

    mlflow.set_tracking_uri(uri)
    try:
        for model_uri in (full_uri, adapter_uri):
            local = Path(
                mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / model_uri[9:]))
            )
            reqs = (local / "requirements.txt").read_text()
            assert "transformers==" in reqs and "torchvision" not in reqs
        assert (local / "peft").is_dir() and not list(local.rglob("model.safetensors"))  # base by reference
        pipe = mlflow.transformers.load_model(adapter_uri)
        assert type(pipe.model).__name__.startswith("Peft")
        full = mlflow.transformers.load_model(full_uri, return_type="components")["model"].state_dict()
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        assert full.keys() == reference.keys() and all(torch.equal(full[k], reference[k]) for k in reference)
    finally:
        mlflow.set_tracking_uri(None)


def test_log_final_model_respects_the_config_switch(uri, tiny_model_dir):
    with start_pipeline_run(make_cfg(uri, tracking={"tracking_uri": uri, "log_model": False})) as tracker:
        assert tracker.log_final_model(tiny_model_dir) is None


def test_async_flush_is_prompt_unless_the_user_chose_a_buffer(monkeypatch):
    from posttrain.tracking.mlflow_io import prompt_async_flush

    monkeypatch.delenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", raising=False)
    prompt_async_flush()
    assert os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] == "1"
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "5")
    prompt_async_flush()
    assert os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] == "5"


def test_open_tracking_store_creates_the_database_and_logs_nothing(tmp_path):
    from posttrain.tracking import open_tracking_store

    db = tmp_path / "fresh.db"
    open_tracking_store(
        make_cfg(f"sqlite:///{db}", tracking={"enabled": False, "tracking_uri": f"sqlite:///{db}"})
    )
    assert not db.exists()
    open_tracking_store(make_cfg(f"sqlite:///{db}"))
    assert db.exists()
    assert [e.name for e in client(f"sqlite:///{db}").search_experiments()] == ["Default"]


# --------------------------------------------------------------------------- MLflow's own variables


def test_mlflow_experiment_name_and_an_outer_run_are_honoured(uri, monkeypatch):
    """$MLFLOW_EXPERIMENT_NAME picks the experiment; under $MLFLOW_RUN_ID (as `mlflow run` sets it)
    or a caller's active run, the pipeline run nests in it and leaves it running."""
    import mlflow

    from posttrain.core.errors import ConfigError

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    with start_pipeline_run(make_cfg(uri)) as tracker:
        pass
    assert client(uri).get_experiment(tracker.experiment_id).name == "from-env" == tracker.experiment_name
    cfg = make_cfg(uri, tracking={"tracking_uri": uri, "experiment": "explicit"})
    with start_pipeline_run(cfg) as explicit:
        pass
    assert client(uri).get_experiment(explicit.experiment_id).name == "explicit"  # the config wins
    # both open in the UI as model training, not GenAI (the tag decides MLflow 3's experiment view)
    for experiment_id in (tracker.experiment_id, explicit.experiment_id):
        assert (
            client(uri).get_experiment(experiment_id).tags["mlflow.experimentKind"]
            == "custom_model_development"
        )

    outer_experiment = client(uri).create_experiment("outer")
    outer = client(uri).create_run(outer_experiment, run_name="outer")
    monkeypatch.setenv("MLFLOW_RUN_ID", outer.info.run_id)
    with start_pipeline_run(make_cfg(uri)) as nested, nested.stage("sft") as stage:
        assert os.environ.get("MLFLOW_RUN_ID") is None  # hidden from the trainer's callback
    parent = client(uri).get_run(nested.run_id)
    assert parent.data.tags["mlflow.parentRunId"] == outer.info.run_id
    assert parent.info.experiment_id == outer_experiment and nested.experiment_name == "outer"
    assert client(uri).get_run(stage.run_id).data.tags["mlflow.parentRunId"] == nested.run_id
    assert client(uri).get_run(outer.info.run_id).info.status == "RUNNING"  # not ours to end

    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    with pytest.raises(ConfigError, match=r"^MLFLOW_RUN_ID=0{32}: no such run at sqlite"):
        start_pipeline_run(make_cfg(uri))

    monkeypatch.delenv("MLFLOW_RUN_ID")
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(experiment_id=outer_experiment) as active:
            with start_pipeline_run(make_cfg(uri)) as inner, inner.stage("sft") as stage:
                assert mlflow.active_run().info.run_id == stage.run_id
            assert mlflow.active_run().info.run_id == active.info.run_id
    finally:
        mlflow.set_tracking_uri(None)
    assert client(uri).get_run(inner.run_id).data.tags["mlflow.parentRunId"] == active.info.run_id


def test_stage_models_link_evaluations_and_reuse_by_cache_key(uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    out = tmp_path / "sft-out"
    out.mkdir()
    (out / "stage.json").write_text('{"stage": "sft"}')
    records = [{"id": "a", "question": "1+1?", "gold": "2"}, {"id": "b", "question": "2+2?", "gold": "4"}]
    with start_pipeline_run(make_cfg(uri)) as tracker:
        with tracker.stage("sft", kind="sft", cache_key="sft-key") as sft:
            import time

            time.sleep(0.8)  # long enough for one system-metrics sample
        model_id = tracker.log_stage_model(
            sft, kind="sft", output_dir=out, cache_key="sft-key", params={"p": "1"}
        )
        with tracker.stage("eval-sft", kind="eval") as ev:
            ev.log_eval({"accuracy_strict": 0.5}, records, model_id=model_id, dataset_name="heldout")
    assert tracker.find_stage_model("sft-key") == model_id and tracker.find_stage_model("other") is None
    model = client(uri).get_logged_model(model_id)
    assert model.source_run_id == sft.run_id and model.model_type == "sft" and model.params == {"p": "1"}
    [metric] = model.metrics
    assert (metric.key, metric.value, metric.run_id) == ("eval/accuracy_strict", 0.5, ev.run_id)
    assert metric.dataset_name == "heldout" and metric.dataset_digest
    run = client(uri).get_run(ev.run_id)
    assert run.data.metrics["eval/accuracy_strict"] == 0.5
    assert [i.dataset.name for i in run.inputs.dataset_inputs] == ["heldout"]
    assert client(uri).get_run(tracker.run_id).data.metrics == {"eval-sft/accuracy_strict": 0.5}
    assert any(k.startswith("system/cpu") for k in client(uri).get_run(sft.run_id).data.metrics)
    found = client(uri).search_logged_models(
        [tracker.experiment_id], filter_string="tags.`posttrain.stage` = 'sft'"
    )
    assert [m.model_id for m in found] == [model_id]


def test_an_evaluation_names_its_dataset_split_and_size(uri, tmp_path):
    """A GSM8K number says which split it is on: params and the evaluated dataset's source."""
    import json as _json

    from posttrain.data.eval_sets import eval_set_info

    test_file = tmp_path / "test.jsonl"
    test_file.write_text('{"question": "1+1?", "answer": "#### 2"}\n' * 5)
    sets = {
        "gsm8k-test": eval_set_info("local", 2, path=str(test_file)),
        "hub-test": eval_set_info("hub", 2),
        "heldout": eval_set_info("heldout", 2, trained_on="train.jsonl"),
    }
    records = [{"id": "a", "question": "1+1?", "gold": "2"}, {"id": "b", "question": "2+2?", "gold": "4"}]
    with start_pipeline_run(make_cfg(uri)) as tracker:
        with tracker.stage("sft", kind="sft", cache_key="k") as sft:
            pass
        model_id = tracker.log_stage_model(sft, kind="sft", output_dir=tmp_path, cache_key="k")
        with tracker.stage("eval-sft", kind="eval") as ev:
            for name, info in sets.items():
                ev.log_eval(
                    {"accuracy_strict": 0.5}, records, model_id=model_id, dataset_name=name, data_info=info
                )
    run = client(uri).get_run(ev.run_id)
    params = run.data.params
    assert params["dataset.gsm8k-test.split"] == "test" and params["dataset.gsm8k-test.split_size"] == "5"
    assert (
        params["dataset.gsm8k-test.num_questions"] == "2" and params["dataset.gsm8k-test.source"] == "local"
    )
    assert params["dataset.gsm8k-test.label"] == f"{test_file} test split, 2 of 5 questions"
    assert (params["dataset.hub-test.dataset"], params["dataset.hub-test.split"]) == ("openai/gsm8k", "test")
    assert params["dataset.heldout.split"] == "dev"
    sources = {
        i.dataset.name: (i.dataset.source_type, _json.loads(i.dataset.source))
        for i in run.inputs.dataset_inputs
    }
    assert sources["gsm8k-test"][0] == "local" and sources["gsm8k-test"][1]["uri"] == str(test_file)
    assert sources["hub-test"][0] == "hugging_face"
    assert (sources["hub-test"][1]["path"], sources["hub-test"][1]["split"]) == ("openai/gsm8k", "test")
    assert sources["heldout"][0] == "code"


def test_a_lost_race_to_create_a_dataset_row_is_retried_once_and_nothing_else_is():
    from mlflow.exceptions import MlflowException

    from posttrain.tracking.mlflow_io import retry_dataset_race

    calls = []

    def lost_once():
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id")
        return "linked"

    assert retry_dataset_race(lost_once) == "linked" and len(calls) == 2

    def other_error():
        calls.append(2)
        raise MlflowException("RESOURCE_DOES_NOT_EXIST: run 'x' not found")

    with pytest.raises(MlflowException, match="not found"):
        retry_dataset_race(other_error)
    assert calls.count(2) == 1


def test_compare_shows_the_headline_by_default_and_aggregates_seeds(uri):
    """Three runs of one config with seeds 0, 1, 2: each run's accuracies with their intervals and
    paired changes, counters behind --all, and the mean and t interval over the seeds."""
    from posttrain.core.stats import t_interval, wilson_interval

    sft = {0: 0.20, 1: 0.25, 2: 0.32}
    for seed, accuracy in sft.items():
        with start_pipeline_run(make_cfg(uri, name="seeds", seed=seed)) as tracker:
            for stage, value in (("eval-baseline", 0.10), ("eval-sft", accuracy)):
                low, high = wilson_interval(100 * value, 100)
                with tracker.stage(stage) as s:
                    s.log_eval(
                        {
                            "accuracy_strict": value,
                            "accuracy_strict_ci_low": low,
                            "accuracy_strict_ci_high": high,
                            "decode_steps": 12.0,
                        }
                    )
            tracker.log_metrics(  # what a run logs for a stage's change on the same questions
                {
                    "eval-sft/delta_accuracy_strict": accuracy - 0.10,
                    "eval-sft/delta_accuracy_strict_ci_low": accuracy - 0.10 - 0.08,
                    "eval-sft/delta_accuracy_strict_ci_high": accuracy - 0.10 + 0.08,
                }
            )
    comparison = compare_runs(experiment="seeds", last=5, tracking_uri=uri)
    assert [r.seed for r in comparison.runs] == [0, 1, 2]
    assert len({r.seed_group for r in comparison.runs}) == 1 and comparison.runs[0].seed_group

    text = format_comparison(comparison)
    lines = text.splitlines()
    assert "eval-sft strict         20.0% [13.3, 28.9]" in text
    change = lines[lines.index(next(x for x in lines if x.startswith("eval-sft strict"))) + 1]
    assert change.startswith("  change from baseline") and "+10.0 [+2.0, +18.0] *" in change
    assert "decode_steps" not in text and "more metrics per run" in text  # a counter: behind --all
    assert "eval-sft/decode_steps" in format_comparison(comparison, show_all=True)

    across = text[text.index("across seeds") :].splitlines()
    assert "seeds 0, 1, 2" in across[0]
    mean = t_interval(list(sft.values()))
    row = next(x for x in across if x.startswith("eval-sft "))
    assert f"{100 * mean.estimate:.1f}%" in row and f"[{100 * mean.low:.1f}, {100 * mean.high:.1f}]" in row
    gains = t_interval([v - 0.10 for v in sft.values()])
    row = next(x for x in across if x.startswith("  change from baseline"))
    assert f"[{100 * gains.low:+.1f}, {100 * gains.high:+.1f}]" in row
    assert row.endswith("*") == gains.excludes(0)


def test_logging_a_local_model_drops_only_mlflows_hub_lookup_notices(caplog):
    from posttrain.tracking.parent_run import _without_local_model_notices

    mlflow_logger = logging.getLogger("mlflow.transformers")
    with caplog.at_level(logging.WARNING), _without_local_model_notices():
        mlflow_logger.warning("The model card could not be retrieved from the hub due to Repo id ...")
        mlflow_logger.warning("Unable to find license information for this model. Please verify ...")
        mlflow_logger.warning("something else went wrong")
    mlflow_logger.warning("The model card could not be retrieved (outside: kept)")
    assert [r.getMessage() for r in caplog.records] == [
        "something else went wrong",
        "The model card could not be retrieved (outside: kept)",
    ]


def test_a_scoring_step_logs_its_histogram_table_and_kept_share(uri, tmp_path):
    from posttrain.core.config import PassRateConfig
    from posttrain.data.pass_rates import PassRates

    with start_pipeline_run(make_cfg(uri)) as tracker, tracker.stage("score-grpo-x", kind="score") as stage:
        questions = {"a": "1+1?", "b": "2*3?", "c": "9-4?"}
        rates = PassRates(4, {"a": 0, "b": 1, "c": 2, "d": 4})
        stage.log_pass_rates(rates, PassRateConfig(samples=4), questions)
    run = client(uri).get_run(stage.run_id)
    assert run.data.metrics["kept"] == 2 and run.data.metrics["kept_share"] == 0.5
    png = download(uri, stage.run_id, "pass_rates.png", tmp_path / "p").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    table = json.loads(download(uri, stage.run_id, "pass_rates.json", tmp_path / "t").read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [(r["id"], r["correct"], r["pass_rate"], r["kept"]) for r in rows] == [
        ("a", 0, 0.0, False),
        ("b", 1, 0.25, True),
        ("c", 2, 0.5, True),
        ("d", 4, 1.0, False),
    ]
    assert rows[1]["question"] == "2*3?" and rows[3]["question"] == ""


# --------------------------------------------------------------------------- a server that went away


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_tracker_whose_server_is_gone_turns_itself_off_and_says_how_to_log_later(monkeypatch, caplog):
    """An MLflow call fails and the server's /health does not answer: the tracker goes off for the
    rest of the run (the next stage runs untracked, no call waits on the server again) and its
    closing error is one line naming the server, without its password, and the store."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://bob:PLANTED_SECRET@127.0.0.1:{closed_port()}"
    tracker = Tracker(True, uri, "1", "parent-run-id")
    with (
        caplog.at_level(logging.WARNING, logger="posttrain.tracking.parent_run"),
        tracker.stage("sft", kind="sft") as run,  # creating its run fails: the server is gone
    ):
        assert not run.enabled and run.report_to == "none"
    assert not tracker.enabled and "during sft" in tracker.lost and "unreachable" in tracker.lost
    said = [r.getMessage().split(" went away")[0] for r in caplog.records]
    assert said == ["MLflow tracking at " + uri.replace("PLANTED_SECRET", "***")]  # said once
    tracker.log_metrics({"x": 1.0})  # a no-op now, at once
    with tracker.stage("dpo") as later:
        assert not later.enabled
    tracker.finish()
    line = str(tracker.lost_error("/runs/store"))
    assert "\n" not in line and "PLANTED_SECRET" not in line and "PLANTED_SECRET" not in caplog.text
    assert f"127.0.0.1:{uri.rsplit(':', 1)[1]}" in line and "/runs/store" in line
    assert "run the same command again" in line


def test_background_threads_failing_at_once_say_the_outage_once(monkeypatch, caplog):
    """MLflow's background threads (the callback's async logging workers, the system-metrics
    monitor) report a lost server through the outage watch, and can do so at the same moment:
    the outage is said once, and every caller learns that tracking is gone."""
    import posttrain.tracking.parent_run as parent_run

    def slow_health_check(uri: str) -> str:
        time.sleep(0.05)  # /health times out: long enough for the other threads to arrive
        return f"MLflow tracking server unreachable: {uri}/health"

    monkeypatch.setattr(parent_run, "uri_problem", slow_health_check)
    tracker = Tracker(True, f"http://127.0.0.1:{closed_port()}", "1", "parent-run-id")
    start, answers = threading.Barrier(4), []

    def background_failure() -> None:
        start.wait()
        answers.append(tracker.went_away("sft", RuntimeError("log-batch failed")))

    with caplog.at_level(logging.WARNING, logger="posttrain.tracking.parent_run"):
        threads = [threading.Thread(target=background_failure) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert answers == [True] * 4 and not tracker.enabled and "during sft" in tracker.lost
    assert sum("went away during sft" in r.getMessage() for r in caplog.records) == 1


def test_a_failure_while_the_server_answers_is_not_a_server_gone(uri):
    """A refused call on a reachable store is a bug or a bad value: the caller re-raises it, and
    tracking stays on."""
    with start_pipeline_run(make_cfg(uri)) as tracker:
        assert not tracker.went_away("sft", RuntimeError("INVALID_PARAMETER_VALUE"))
        assert tracker.enabled and tracker.lost is None


@pytest.mark.parametrize(
    ("case", "argv", "expected"),
    [
        ("no database yet", ["compare"], "the default tracking store sqlite:///{tmp}/mlflow.db: no MLflow database at"),
        ("a folder", ["compare", "--tracking-uri", "sqlite:///{tmp}/folder"], "{tmp}/folder is not a file"),
        ("not SQLite", ["compare", "--tracking-uri", "sqlite:///{tmp}/notes.db"], "notes.db is not an SQLite database"),
        ("unknown scheme", ["compare", "--tracking-uri", "bogus://x"], "bogus is not a tracking store MLflow knows"),
        ("unknown run", ["compare", "--tracking-uri", "{uri}", "0" * 32], f"no MLflow run '{'0' * 32}' at sqlite:///"),
        ("not a run id", ["compare", "--tracking-uri", "{uri}", "x' OR 1=1"], "is not an MLflow run id"),
        ("unknown experiment", ["compare", "--tracking-uri", "{uri}", "--experiment", "nope"], "no MLflow experiment named 'nope'"),
        ("a step's run", ["compare", "--tracking-uri", "{uri}", "{child}"], "is not a pipeline run (a step's run; its pipeline run is {parent})"),
        ("promote option alone", ["compare", "--metric", "format"], "--metric applies to --promote only"),
        ("plot under a file", ["compare", "--tracking-uri", "{uri}", "--plot", "notes.db/x.png"], "notes.db is a file, not a folder"),
    ],
)  # fmt: skip
def test_compare_refuses_what_it_cannot_read_in_one_line_and_writes_nothing(
    case, argv, expected, uri, tmp_path, monkeypatch, capsys
):
    """MLflow answers these with a traceback (an unknown run or experiment), minutes of retries (a
    folder, a file that is not SQLite) or a new empty database where none was: compare checks first."""
    from posttrain.cli import main

    with (
        start_pipeline_run(make_cfg(uri), steps=["sft"]) as tracker,
        tracker.stage("sft", kind="sft") as stage,
    ):
        child = stage.run_id
    work = tmp_path / "work"
    work.mkdir()
    (work / "folder").mkdir()
    (work / "notes.db").write_text("not a database\n")
    monkeypatch.chdir(work)
    before = sorted(p.name for p in work.iterdir())
    fill = {"tmp": str(work), "uri": uri, "child": child, "parent": tracker.run_id}
    capsys.readouterr()
    assert main([a.format(**fill) for a in argv]) == 2, case
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert expected.format(**fill) in err
    assert sorted(p.name for p in work.iterdir()) == before  # no mlflow.db, no compare.png


def test_a_sqlite_store_mlflow_can_open_passes_the_check(tmp_path, template_db, monkeypatch):
    """The check refuses a folder or a file that is not a database, and nothing SQLite opens: an
    empty file (SQLite makes it a database), a database with options in the URI's query."""
    from posttrain.tracking.mlflow_io import resolve_tracking_uri, uri_problem

    (tmp_path / "empty.db").write_bytes(b"")
    shutil.copy(template_db, tmp_path / "real.db")
    for name in ("empty.db", "real.db", "real.db?timeout=30", "new.db"):
        assert uri_problem(f"sqlite:///{tmp_path}/{name}") is None, name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///real.db?timeout=30")
    assert resolve_tracking_uri(parse_config({"name": "x", "model": {"name": "tiny-random"}}).tracking) == (
        f"sqlite:///{tmp_path}/real.db?timeout=30"
    )


def test_the_server_check_trusts_tls_as_mlflow_is_told_to(monkeypatch):
    """A self-signed server MLflow reaches with MLFLOW_TRACKING_INSECURE_TLS must not be refused by
    a check that verifies certificates MLflow does not."""
    import ssl

    from posttrain.tracking.mlflow_io import _mlflow_tls_context

    for name in (
        "MLFLOW_TRACKING_INSECURE_TLS",
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    ):
        monkeypatch.delenv(name, raising=False)
    assert _mlflow_tls_context() is None  # urllib's default: verified
    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    context = _mlflow_tls_context()
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname


def test_compare_reads_a_run_id_given_in_upper_case(uri, capsys):
    from posttrain.cli import main

    with start_pipeline_run(make_cfg(uri), steps=["sft"]) as tracker:
        pass
    assert main(["compare", "--tracking-uri", uri, tracker.run_id.upper()]) == 0
    assert "plot: compare.png" in capsys.readouterr().out


def test_the_parent_run_holds_what_each_stage_bought_as_a_table(uri, tmp_path):
    """The UI lists a run's few hundred metrics unsorted; stage_gains.json puts each evaluation's
    accuracy, its change from the one before it with the paired interval, and the minutes in order."""
    with start_pipeline_run(make_cfg(uri), steps=["eval-baseline", "sft", "eval-sft"]) as tracker:
        tracker.log_metrics(
            {
                "eval-sft/accuracy_strict": 0.16,  # logged first: the table follows the plan, not MLflow
                "eval-sft/delta_accuracy_strict": 0.16,
                "eval-sft/delta_accuracy_strict_ci_low": 0.112,
                "eval-sft/delta_accuracy_strict_ci_high": 0.217,
                "eval-sft/stage_minutes": 1.5,
                "eval-baseline/accuracy_strict": 0.0,
            }
        )
        assert tracker.log_stage_gains() is True
    table = json.loads(download(uri, tracker.run_id, "stage_gains.json", tmp_path / "g").read_text())
    rows = [tuple(row) for row in table["data"]]
    assert table["columns"] == ["what", "value"]
    assert rows == [
        ("eval-baseline strict", "0.0%"),
        ("eval-sft strict", "16.0%"),
        ("change from baseline", "+16.0 [+11.2, +21.7] *"),
        ("bought with", "1.5 min, +10.67 points/min"),
    ]
