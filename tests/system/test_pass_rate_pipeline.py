"""A GRPO stage with ``pass_rate:`` through the whole pipeline: the scoring step runs as a Prefect
task before its stage, its rates are kept in the store and logged to MLflow, the stage trains on
the prompts in the band only, and a rerun serves the scoring from cache (a new learning rate too).

The model is scripted (tests/integration/test_pass_rate.py): whatever the question it answers 7
with probability 3/4 and 8 otherwise, so questions whose gold is 9 are never solved and must
never reach the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_models import answers_seven_mostly

pytestmark = pytest.mark.system

GOLDS = (7, 8, 9)


@pytest.fixture(scope="module")
def scripted_model_dir(tiny_tokenizer, tmp_path_factory) -> Path:
    model = answers_seven_mostly(tiny_tokenizer, "\n", 0.75)  # the generation prompt ends in a newline
    folder = tmp_path_factory.mktemp("scripted-model")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    rows = [{"question": f"question {i}?", "answer": f"#### {GOLDS[i % 3]}"} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def scored_config(smoke_config, workdir, model_dir, data, *overrides):
    return smoke_config(
        workdir,
        f"model.name={model_dir}",
        "data.source=local",
        f"data.path={data}",
        "data.eval_size=6",
        "sft.enabled=false",
        "dpo=null",
        "eval.baseline=false",
        "grpo.stages=[{name: correctness, rewards: [{name: correctness}], pass_rate: {samples: 8, candidates: 18}}]",
        "grpo.defaults.trainer.max_completion_length=8",
        "grpo.defaults.trainer.temperature=1.0",
        *overrides,
    )


def test_the_stage_trains_only_on_prompts_its_scoring_step_kept(
    smoke_config, scripted_model_dir, questions, tmp_path
):
    from posttrain.data.pass_rates import PassRates
    from posttrain.data.prepare import PreparedData
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.flows.plan_walker import run_cached
    from posttrain.pipeline.plan import build_plan, preview

    cfg = scored_config(smoke_config, tmp_path, scripted_model_dir, questions)
    assert [name for name, *_ in preview(cfg)][:3] == ["data", "score-grpo-correctness", "grpo-correctness"]
    summary = posttrain_pipeline(cfg)
    outcomes = {o["step"]: o for o in summary["outcomes"]}
    score = outcomes["score-grpo-correctness"]
    assert score["status"] == "ran" and score["kind"] == "score"
    assert Path(score["output"]).parent == tmp_path / "store" / "scores"
    rates = PassRates.load(score["output"])
    assert rates.samples == 8 and len(rates.correct) == 18

    prepared = PreparedData.load(outcomes["data"]["output"])
    gold = {str(r["id"]): r["answer"].split("####")[-1].strip() for r in prepared.train}
    assert {gold[pid] for pid, n in rates.correct.items() if n == 0} >= {"9"}  # never solved
    assert all(n == 0 for pid, n in rates.correct.items() if gold[pid] == "9")
    kept = {pid for pid, n in rates.correct.items() if 0 < n < 8}
    assert kept and all(gold[pid] in ("7", "8") for pid in kept)
    stage = outcomes["grpo-correctness"]
    assert stage["status"] == "ran" and stage["metrics"]["train_examples"] == len(kept)

    # a rerun serves everything from cache, without Prefect; a new learning rate retrains only
    again = run_cached(cfg)
    assert again is not None and {o["status"] for o in again["outcomes"]} == {"cached"}
    lr = scored_config(
        smoke_config, tmp_path, scripted_model_dir, questions, "grpo.stages.0.trainer.learning_rate=0.002"
    )
    plan = {name: (status, why) for name, status, why in preview(lr)}
    assert plan["score-grpo-correctness"][0] == "cached" and plan["grpo-correctness"][0] == "run"
    assert (
        build_plan(lr).step("score-grpo-correctness").key(lr, _inputs(build_plan(lr), summary))
        == score["key"]
    )

    import mlflow

    from posttrain.tracking.mlflow_io import experiment_name

    client = mlflow.MlflowClient(cfg.tracking.tracking_uri)
    runs = client.search_runs(
        [client.get_experiment_by_name(experiment_name(cfg)).experiment_id],
        filter_string="tags.mlflow.runName = 'score-grpo-correctness'",
    )
    run = next(r for r in runs if r.data.tags.get("cached") != "true")  # the producer, not the rerun
    assert run.data.metrics["kept"] == len(kept) and run.data.metrics["prompts"] == 18
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"pass_rates.png", "pass_rates.json"} <= artifacts


def _inputs(plan, summary):
    """The scoring step's inputs as the first run had them (the base model, its prepared data)."""
    from posttrain.cache.records import read_output_result
    from posttrain.pipeline.plan import StepInputs
    from posttrain.pipeline.steps import base_model

    data_out = next(o["output"] for o in summary["outcomes"] if o["step"] == "data")
    return StepInputs(base_model(plan.config), read_output_result("data", data_out))


def test_a_stage_with_its_own_source_scores_and_trains_on_that_source_alone(
    smoke_config, scripted_model_dir, questions, tmp_path
):
    """The run's records feed SFT and the held-out slice; the stage's own file (answers only, golds 7
    and 8 the scripted model sometimes gives) is what its scoring step and its trainer see, less
    the one question it shares with the held-out slice and the three it evaluates itself on."""
    from posttrain.core.config import DataConfig
    from posttrain.data.pass_rates import PassRates
    from posttrain.data.prepare import PreparedData, prepare_data
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    own = tmp_path / "answers.jsonl"
    rows = [{"question": f"own question {i}?", "answer": f"#### {7 + i % 2}"} for i in range(12)]
    run_data = DataConfig(source="local", path=str(questions), eval_size=6)  # as scored_config has it
    held = prepare_data(run_data).eval[0]
    rows.append({"question": held["question"], "answer": "#### 7"})
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = scored_config(
        smoke_config,
        tmp_path,
        scripted_model_dir,
        questions,
        f"grpo.stages.0.data={{source: local, path: {own}, selection_size: 3}}",
        "grpo.stages.0.eval_every=1",
    )
    summary = posttrain_pipeline(cfg)
    outcomes = {o["step"]: o for o in summary["outcomes"]}
    prepared = PreparedData.load(outcomes["data"]["output"])
    stage_rows = prepared.train_for("grpo-correctness")
    chosen = list(prepared.stage_selection["grpo-correctness"]["question"])
    assert len(chosen) == 3 and not set(chosen) & set(stage_rows["question"])
    # the held-out one removed, from the prompts or from the slice
    assert sorted([*stage_rows["question"], *chosen]) == sorted(r["question"] for r in rows[:12])
    data_metrics = outcomes["data"]["metrics"]
    assert (
        data_metrics["grpo-correctness.decontaminated"]
        + data_metrics["grpo-correctness.selection_decontaminated"]
        == 1
    )
    rates = PassRates.load(outcomes["score-grpo-correctness"]["output"])
    assert set(rates.correct) == set(stage_rows["id"])  # scored: the stage's own prompts
    kept = [pid for pid, n in rates.correct.items() if 0 < n < 8]
    assert kept and outcomes["grpo-correctness"]["metrics"]["train_examples"] == len(kept)
    history = [
        json.loads(line)
        for line in (Path(outcomes["grpo-correctness"]["output"]) / "log_history.jsonl")
        .read_text()
        .splitlines()
    ]
    assert any("eval/accuracy" in row for row in history)  # it evaluated itself, on its slice

    import mlflow

    client = mlflow.MlflowClient(cfg.tracking.tracking_uri)
    children = client.search_runs(
        [client.get_run(summary["run_id"]).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{summary['run_id']}'",
    )
    inputs = {
        r.info.run_name: [(d.dataset.name, d.dataset.digest) for d in r.inputs.dataset_inputs]
        for r in children
    }
    fingerprint = prepared.stats["grpo-correctness.train_fingerprint"][:36]
    assert inputs["grpo-correctness"] == [("grpo-correctness prompts", fingerprint)]
    assert ("grpo-correctness prompts", fingerprint) in inputs["data"]


@pytest.fixture(scope="module")
def stopping_model_dir(tiny_tokenizer, tmp_path_factory) -> Path:
    model = answers_seven_mostly(tiny_tokenizer, "\n", 0.75, stop_on_eight=True)
    folder = tmp_path_factory.mktemp("stopping-model")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_an_rft_stage_fine_tunes_on_the_correct_completions_of_its_scoring_and_replays_worked_solutions(
    smoke_config, stopping_model_dir, questions, tmp_path
):
    """The scripted model answers 7 whatever the question, or gives no answer: the stage keeps each
    scored prompt's distinct completions whose answer is its gold and that stopped (none of a gold-8
    or gold-9 prompt, none cut off at the length limit), and mixes in as many of the run's worked
    solutions."""
    from posttrain.evaluation.report import EvalReport
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    worked = tmp_path / "worked.jsonl"  # the questions, with a worked solution to replay
    rows = [json.loads(line) for line in questions.read_text().splitlines()]
    worked.write_text("".join(json.dumps({**r, "answer": f"It is 3+4.\n{r['answer']}"}) + "\n" for r in rows))
    cfg = scored_config(
        smoke_config,
        tmp_path,
        stopping_model_dir,
        worked,
        "grpo.stages.0.rft={replay: 0.5, trainer: {max_steps: 1, per_device_train_batch_size: 2}}",
        "grpo.defaults.trainer.max_completion_length=16",  # room to stop after up to three sevens
    )
    summary = posttrain_pipeline(cfg)
    outcomes = {o["step"]: o for o in summary["outcomes"]}
    assert [o["step"] for o in summary["outcomes"]][1:3] == ["score-rft-correctness", "rft-correctness"]
    report = EvalReport.load(outcomes["score-rft-correctness"]["output"])
    right = {
        r.id: {s.completion for s in r.samples if s.correct_strict and s.strict == r.gold and not s.truncated}
        for r in report.records
    }
    assert all(not right[r.id] for r in report.records if r.gold != "7")
    cut_off = [s for r in report.records for s in r.samples if s.correct_strict and s.truncated]
    assert cut_off  # right answers that ran to the limit: the stage must leave them out
    expected = sum(len(texts) for texts in right.values())
    stage = outcomes["rft-correctness"]
    assert stage["status"] == "ran" and stage["kind"] == "rft"
    metrics = stage["metrics"]
    assert expected > 0 and metrics["rft_completions"] == expected
    assert metrics["rft_prompts"] == sum(1 for texts in right.values() if texts)
    assert metrics["rft_replayed"] == round(0.5 * expected)
    assert metrics["train_examples"] == expected + round(0.5 * expected)
    stage_json = json.loads((Path(stage["output"]) / "stage.json").read_text())
    assert stage_json["stage"] == "rft-correctness" and stage_json["kind"] == "rft"
    assert stage_json["config"]["rft"]["replay"] == 0.5 and stage_json["config"]["pass_rate"]["samples"] == 8
    kept = [
        json.loads(line) for line in (Path(stage["output"]) / "train_data.jsonl").read_text().splitlines()
    ]
    assert len(kept) == metrics["train_examples"]  # the mix, beside the model it made
    texts = [row["completion"][-1]["content"] for row in kept]
    assert sorted(t for t in texts if "It is 3+4." not in t) == sorted(t for ts in right.values() for t in ts)

    import mlflow

    client = mlflow.MlflowClient(cfg.tracking.tracking_uri)
    [run] = client.search_runs(
        [client.get_run(summary["run_id"]).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{summary['run_id']}' and attributes.run_name = 'rft-correctness'",
    )
    assert [(d.dataset.name, d.dataset.digest) for d in run.inputs.dataset_inputs] == [
        ("rft-correctness training data", stage_json["data_fingerprint"][:36])
    ]
