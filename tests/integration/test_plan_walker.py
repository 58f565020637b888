"""The plan walker (flows/plan_walker.py) without Prefect: which steps run and which are served from
cache, what ``--force`` reruns, what each step leaves in MLflow, and how evaluations submitted
beside the walk are collected. Steps run in this process through a :class:`PlanRunner` that calls
each step directly, as the flow's runner does through its Prefect task (tests/system/test_pipeline.py
runs the flow itself)."""

from __future__ import annotations

import fcntl
import logging
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest

CONFIG = """\
name: walk
seed: 0
model: {name: tiny-random, precision: fp32}
data:
  source: synthetic
  synthetic: {num_examples: 24, min_ops: 1, max_ops: 2}
  eval_size: 4
  max_prompt_tokens: 1024
sft:
  limit: 8
  trainer: {max_steps: 1, per_device_train_batch_size: 4, learning_rate: 1.0e-3}
eval: {limit: 4, max_completion_length: 4, batch_size: 4}
tracking: {log_model: true}
"""

STEPS = ["data", "eval-baseline", "sft", "eval-sft"]


def _in_process():
    from posttrain.flows.plan_walker import PlanRunner

    class InProcess(PlanRunner):
        """Runs each step here; with ``concurrent_evals`` an evaluation is submitted as a finished
        (or failed, for a step named in ``failing``) future, collected later by the walk."""

        failing: set[str] = set()
        ran: list[str] = []

        def execute(self, step, call, run):
            InProcess.ran.append(step.name)
            return step.run(call["cfg"], call["inputs"], call["output_dir"], report_to=run.report_to)

        def submit(self, step, call):
            if not self.cfg.orchestration.concurrent_evals:
                return None
            InProcess.ran.append(step.name)
            future: Future = Future()
            if step.name in self.failing:
                future.set_exception(RuntimeError(f"{step.name} broke"))
            else:
                future.set_result(step.run(call["cfg"], call["inputs"], call["output_dir"]))
            return future

    InProcess.ran = []
    return InProcess


@dataclass
class Walk:
    tmp: Path
    build: object
    """conftest's ``smoke_config`` builder, given this module's config file."""
    cfg: object = None
    summary: object = None

    @property
    def client(self):
        import mlflow

        return mlflow.MlflowClient(self.cfg.tracking.tracking_uri)

    def children(self, run_id: str) -> dict:
        parent = self.client.get_run(run_id)
        runs = self.client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
        return {r.info.run_name: r for r in runs}

    def walk(self, force=(), runner=None, **overrides):
        from posttrain.flows.plan_walker import run_plan
        from posttrain.pipeline.plan import build_plan

        cfg = self.load(**overrides)
        return run_plan(build_plan(cfg), force, runner or _in_process())

    def load(self, **overrides):
        sets = [f"{key.replace('__', '.')}={value}" for key, value in overrides.items()]
        return self.build(self.tmp, *sets, config=self.tmp / "walk.yaml")

    def output(self, summary, step: str) -> Path:
        return Path(next(o.output for o in summary.outcomes if o.step == step))


@pytest.fixture(scope="module")
def first(tmp_path_factory, smoke_config) -> Walk:
    from posttrain.flows.plan_walker import run_plan
    from posttrain.pipeline.plan import build_plan

    tmp = tmp_path_factory.mktemp("walk")
    (tmp / "walk.yaml").write_text(CONFIG)
    walk = Walk(tmp, smoke_config)
    walk.cfg = walk.load()
    walk.summary = run_plan(build_plan(walk.cfg), (), _in_process())
    shutil.copytree(tmp / "store", tmp / "pristine", symlinks=True)
    return walk


@pytest.fixture
def walk(first) -> Walk:
    """The first walk, with its store put back afterwards for a test that changes it."""
    yield first
    store = first.tmp / "store"
    shutil.rmtree(store)
    shutil.copytree(first.tmp / "pristine", store, symlinks=True)


def statuses(summary) -> list[tuple[str, str]]:
    return [(o.step, o.status) for o in summary.outcomes]


def test_a_first_walk_runs_every_step_in_plan_order(first):
    from posttrain.cache.records import StoreRecords
    from posttrain.cache.store import Store

    summary = first.summary
    assert statuses(summary) == [(s, "ran") for s in STEPS]
    assert [o.kind for o in summary.outcomes] == ["data", "eval", "sft", "eval"]
    assert summary.config == "walk" and summary.run_id
    records = StoreRecords(Store.at(first.tmp / "store"))
    for outcome in summary.outcomes:
        assert records.exists(outcome.key) and Path(outcome.output).is_dir(), outcome.step
    assert "accuracy_strict" in summary.outcomes[-1].metrics
    assert summary.as_dict()["outcomes"][2]["step"] == "sft"


def test_each_step_has_its_mlflow_run_and_the_stage_its_logged_model(first):
    runs = first.children(first.summary.run_id)
    assert set(runs) == set(STEPS)
    sft = runs["sft"]
    assert sft.data.tags["posttrain.cache_key"] == first.summary.outcomes[2].key
    model_id = sft.data.tags["posttrain.model_id"]
    model = first.client.get_logged_model(model_id)
    # the last training stage with tracking.log_model: its weights, not a reference
    assert model.name == "sft" and model.tags["posttrain.model_content"] == "weights"
    assert model.params["model.name"] == "tiny-random" and model.params["stage.trainer.max_steps"] == "1"
    # the evaluation of the stage is logged against the stage's model; the baseline against none
    linked = {m.run_id for m in model.metrics}
    assert runs["eval-sft"].info.run_id in linked and runs["eval-baseline"].info.run_id not in linked
    # the stage's summary lands on its last step; the data step logs its counts and both datasets
    assert {m.step for m in first.client.get_metric_history(sft.info.run_id, "train_loss")} == {1}
    assert runs["data"].data.metrics and {d.dataset.name for d in runs["data"].inputs.dataset_inputs} >= {
        "train",
        "heldout",
    }
    parent = first.client.get_run(first.summary.run_id)
    assert "eval-sft/delta_accuracy_strict" in parent.data.metrics  # the paired change per stage
    # The weights MLflow logged are listed once as the stage run's output, and as the pipeline run's.
    outputs = first.client.get_run(sft.info.run_id).outputs.model_outputs
    assert [o.model_id for o in outputs] == [o.model_id for o in parent.outputs.model_outputs] == [model_id]


def test_an_unchanged_walk_is_served_from_cache_and_points_at_the_producers(walk):
    from posttrain.flows.plan_walker import run_cached

    again = run_cached(walk.cfg)
    assert again is not None and [(o["step"], o["status"]) for o in again["outcomes"]] == [
        (s, "cached") for s in STEPS
    ]
    assert [o["key"] for o in again["outcomes"]] == [o.key for o in walk.summary.outcomes]
    before, cached = walk.children(walk.summary.run_id), walk.children(again["run_id"])
    assert cached["sft"].data.tags["cached"] == "true"
    # the cached stage's run names the model its producer logged; no new model is made
    assert cached["sft"].data.tags["posttrain.model_id"] == before["sft"].data.tags["posttrain.model_id"]
    models = walk.client.search_logged_models([cached["sft"].info.experiment_id])
    assert [m.name for m in models] == ["sft"]


def test_force_reruns_the_named_step_and_what_follows(walk):
    from posttrain.flows.plan_walker import run_cached

    assert run_cached(walk.cfg, ["sft"]) is None  # a step would run: nothing done without Prefect
    checkpoints = Path(walk.output(walk.summary, "sft").as_posix() + ".ckpt")
    checkpoints.mkdir()  # left by an interrupted run: a forced stage retrains from its input
    forced = walk.walk(["sft"])
    assert statuses(forced) == [
        ("data", "cached"),
        ("eval-baseline", "cached"),
        ("sft", "ran"),
        ("eval-sft", "ran"),
    ]
    assert forced.outcomes[2].reason.startswith("forced") and not checkpoints.exists()
    runs = walk.children(forced.run_id)
    assert "cached" not in runs["sft"].data.tags
    assert (
        runs["sft"].data.tags["posttrain.model_id"]
        != walk.children(walk.summary.run_id)["sft"].data.tags["posttrain.model_id"]
    )


def test_a_cached_stage_drops_the_checkpoints_of_an_interrupted_run(walk, caplog):
    checkpoints = Path(walk.output(walk.summary, "sft").as_posix() + ".ckpt")
    (checkpoints / "checkpoint-1").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="posttrain.flows.plan_walker"):
        again = walk.walk()
    assert {s for _, s in statuses(again)} == {"cached"} and not checkpoints.exists()
    assert "sft: deleted the checkpoints of an interrupted run" in caplog.messages


def test_an_output_whose_record_is_missing_is_adopted_and_recorded(walk):
    from posttrain.cache.records import StoreRecords
    from posttrain.cache.store import Store

    records = StoreRecords(Store.at(walk.tmp / "store"))
    key = walk.summary.outcomes[2].key
    records.path(key).unlink()  # a kill between the output's rename and its record
    runner = _in_process()
    again = walk.walk(runner=runner)
    assert statuses(again)[2] == ("sft", "cached") and "adopted" in again.outcomes[2].reason
    assert runner.ran == [] and records.exists(key)
    sft = walk.children(again.run_id)["sft"]
    assert sft.data.tags["adopted"] == "true" and "train_loss" in sft.data.metrics


def test_evaluations_beside_the_walk_are_collected_in_plan_order(walk):
    runner = _in_process()
    again = walk.walk((), runner, orchestration__concurrent_evals="true", eval__max_completion_length=5)
    assert runner.ran == ["eval-baseline", "eval-sft"]
    assert statuses(again) == [
        ("data", "cached"),
        ("eval-baseline", "ran"),
        ("sft", "cached"),
        ("eval-sft", "ran"),
    ]
    runs = walk.children(again.run_id)
    assert "eval/accuracy_strict" in runs["eval-baseline"].data.metrics


def test_a_failed_evaluation_beside_the_walk_fails_it_after_the_rest(walk):
    runner = _in_process()
    runner.failing = {"eval-baseline"}
    with pytest.raises(RuntimeError, match="eval-baseline broke"):
        walk.walk((), runner, orchestration__concurrent_evals="true", eval__max_completion_length=5)
    assert runner.ran == ["eval-baseline", "eval-sft"]  # the walk went on, and waited for the rest
    from posttrain.cache.store import Store

    # its key's lock was released: taking it without waiting succeeds
    path = Store.at(walk.tmp / "store").step_lock(walk.summary.outcomes[1].key).path
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_pair_of_evaluations_without_readable_reports_has_no_delta(tmp_path, caplog):
    from posttrain.flows.plan_walker import PipelineSummary, StepOutcome, stage_deltas

    summary = PipelineSummary("walk", None)
    for step in ("eval-baseline", "eval-sft"):
        summary.outcomes.append(StepOutcome(step, "ran", "", "k", str(tmp_path / step), kind="eval"))
    summary.outcomes.insert(1, StepOutcome("sft", "ran", "", "k", str(tmp_path), kind="sft", seconds=60.0))
    with caplog.at_level(logging.WARNING, logger="posttrain.flows.plan_walker"):
        assert stage_deltas(summary) == {"eval-sft/stage_minutes": 1.0}
    assert caplog.messages[0].startswith("no paired change from eval-baseline to eval-sft: ")


def test_each_change_carries_the_minutes_of_the_steps_that_bought_it(tmp_path):
    """A GRPO stage's cost includes its scoring step; evaluations and data cost nothing here."""
    from posttrain.evaluation import EvalRecord, EvalReport, score_completion
    from posttrain.flows.plan_walker import PipelineSummary, StepOutcome, stage_deltas

    def report(folder, answer):
        record = EvalRecord.from_samples(
            "q1", "q?", "4", [score_completion(f"<answer>{answer}</answer>", "4")]
        )
        EvalReport(model="m", summary={}, records=(record,)).save(folder)
        return str(folder)

    summary = PipelineSummary("walk", None)
    summary.outcomes += [
        StepOutcome("data", "ran", "", "k", "/d", kind="data", seconds=None),
        StepOutcome("eval-baseline", "ran", "", "k", report(tmp_path / "a", 3), kind="eval", seconds=None),
        StepOutcome("score-grpo-x", "ran", "", "k", "/s", kind="score", seconds=60.0),
        StepOutcome("grpo-x", "cached", "", "k", "/g", kind="grpo", seconds=240.0),
        StepOutcome("eval-grpo-x", "ran", "", "k", report(tmp_path / "b", 4), kind="eval", seconds=None),
    ]
    changes = stage_deltas(summary)
    assert changes["eval-grpo-x/stage_minutes"] == 5.0 and changes["eval-grpo-x/delta_accuracy_strict"] == 1.0
    assert "eval-baseline/stage_minutes" not in changes


def test_a_change_whose_cost_is_partly_unknown_gets_no_minutes_and_says_why(tmp_path, caplog):
    """Summing only the timed steps would understate the cost and overstate points per minute."""
    from posttrain.evaluation import EvalRecord, EvalReport, score_completion
    from posttrain.flows.plan_walker import PipelineSummary, StepOutcome, stage_deltas

    for name in ("a", "b"):
        record = EvalRecord.from_samples("q1", "q?", "4", [score_completion("<answer>4</answer>", "4")])
        EvalReport(model="m", summary={}, records=(record,)).save(tmp_path / name)
    summary = PipelineSummary("walk", None)
    summary.outcomes += [
        StepOutcome("eval-baseline", "ran", "", "k", str(tmp_path / "a"), kind="eval"),
        StepOutcome("score-grpo-x", "cached", "", "k", "/s", kind="score", seconds=None),
        StepOutcome("grpo-x", "ran", "", "k", "/g", kind="grpo", seconds=240.0),
        StepOutcome("eval-grpo-x", "ran", "", "k", str(tmp_path / "b"), kind="eval"),
    ]
    with caplog.at_level(logging.WARNING, logger="posttrain.flows.plan_walker"):
        changes = stage_deltas(summary)
    assert "eval-grpo-x/stage_minutes" not in changes and changes["eval-grpo-x/delta_accuracy_strict"] == 0.0
    assert caplog.messages == ["eval-grpo-x: no stage minutes: no wall time recorded for score-grpo-x"]


def test_checkpoints_of_unfinished_stages_are_named_after_a_walk(walk, caplog):
    from posttrain.cache.store import Store
    from posttrain.flows.plan_walker import warn_unfinished

    store = Store.at(walk.tmp / "store")
    (walk.tmp / "store" / "stages" / "grpo-0123456789ab.ckpt").mkdir()
    with caplog.at_level(logging.WARNING, logger="posttrain.flows.plan_walker"):
        warn_unfinished(store)
    assert caplog.messages == [
        "1 checkpoint folder(s) of unfinished stages of other configs or code: grpo-0123456789ab.ckpt "
        "(a rerun of that config resumes from them; delete them otherwise)"
    ]


def test_a_sweep_tidies_the_store_and_closes_abandoned_runs_once_before_its_points(walk):
    from posttrain.cache.store import Store
    from posttrain.flows.plan_walker import sweep_started

    store = Store.at(walk.tmp / "store")
    half_written = walk.tmp / "store" / "stages" / "sft-0123456789ab.tmp-1"
    half_written.mkdir()
    client = walk.client
    experiment = client.get_run(walk.summary.run_id).info.experiment_id
    abandoned = client.create_run(experiment, tags={"posttrain.store": str(store.root)}).info.run_id
    sweep_started(walk.cfg, store)
    assert not half_written.exists()
    assert client.get_run(abandoned).info.status == "KILLED"


class RecordingRun:
    """A stage's MLflow run that records what it is asked to log."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

    def called(self, name: str) -> list[tuple[tuple, dict]]:
        return [(args, kwargs) for called, args, kwargs in self.calls if called == name]


@pytest.mark.parametrize(("metrics", "step"), [({"train_loss": 0.5}, 0), ({"train_loss": 0.5, "step": 7}, 7)])
def test_a_stages_summary_is_logged_at_its_last_step_or_at_zero(tmp_path, metrics, step):
    from posttrain.core.results import StageResult
    from posttrain.flows.plan_walker import _log_result

    (tmp_path / "stage.json").write_text("{}")
    run = RecordingRun()
    result = StageResult(stage="sft", output_dir=str(tmp_path), metrics=metrics, fingerprints={})
    _log_result(run, result, cfg=_smoke_cfg())
    assert run.called("log_metrics") == [((metrics,), {"step": step})]


@pytest.mark.parametrize("kept", ["rows", "damaged", "none"])
def test_an_rft_stage_logs_the_rows_it_kept_as_its_dataset_and_nothing_else(tmp_path, kept):
    """Its training mix exists nowhere else; when the record is damaged or gone, no other set (its
    prompts, the run's train split) stands in for it."""
    from posttrain.core.results import DataResult, StageResult
    from posttrain.flows.plan_walker import _log_result
    from posttrain.models.artifacts import TRAIN_DATA_FILE, write_train_data

    (tmp_path / "stage.json").write_text('{"kind": "rft", "data_fingerprint": "mix-fingerprint"}')
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "completion": [{"role": "assistant", "content": "2"}],
        }
    ]
    if kept == "rows":
        write_train_data(tmp_path, rows)
    elif kept == "damaged":
        (tmp_path / TRAIN_DATA_FILE).write_text('{"prompt": "1+1?"}\n{"prompt": [1]}\n')
    run = RecordingRun()
    result = StageResult(stage="rft-new", output_dir=str(tmp_path), metrics={}, fingerprints={})
    data = DataResult(data_dir=str(tmp_path / "no-data"), train_fingerprint="t", eval_fingerprint="e")
    _log_result(run, result, cfg=_smoke_cfg(), data=data)
    logged = [
        (args[0].to_list(), kwargs["name"], kwargs["digest"]) for args, kwargs in run.called("log_dataset")
    ]
    assert logged == ([(rows, "rft-new training data", "mix-fingerprint")] if kept == "rows" else [])


def test_each_evaluation_set_gets_its_own_examples_table(tmp_path):
    from posttrain.core.results import EvalResult
    from posttrain.evaluation import EvalRecord, EvalReport, score_completion
    from posttrain.flows.plan_walker import _log_result

    record = EvalRecord.from_samples("q1", "q?", "42", [score_completion("<answer>42</answer>", "42")])
    for folder in (tmp_path, tmp_path / "gsm8k"):
        EvalReport(model="m", summary={}, records=(record,)).save(folder)
    result = EvalResult(
        stage="sft",
        report_dir=str(tmp_path),
        summary={"accuracy_strict": 1.0},
        timings={"seconds": 2.0},
        model_fingerprint="f",
        sets={"gsm8k": {"accuracy_strict": 1.0}},
    )
    run = RecordingRun()
    _log_result(run, result, model_id="model-1", cfg=_smoke_cfg())
    logged = [
        (kwargs["dataset_name"], kwargs["table"], kwargs["model_id"]) for _, kwargs in run.called("log_eval")
    ]
    assert logged == [("heldout", "eval_examples", "model-1"), ("gsm8k", "gsm8k/eval_examples", "model-1")]
    assert run.called("log_metrics") == [(({"eval/seconds": 2.0},), {})]


def _smoke_cfg(*overrides: str):
    from posttrain.pipeline import load_config

    return load_config(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml", list(overrides))


def test_a_scoring_step_logs_its_pass_rates_under_the_stages_band(tmp_path):
    """The rates, the histogram and the table; the kept share under the band the config has now
    (a band is not part of the scoring's key, so a cached scoring is shown as today's stage uses it)."""
    from posttrain.core.results import ScoreResult
    from posttrain.data.pass_rates import PassRates
    from posttrain.evaluation import EvalRecord, EvalReport, score_completion
    from posttrain.flows.plan_walker import _log_result

    records = tuple(
        EvalRecord.from_samples(pid, f"question {pid}", "1", [score_completion("<answer>1</answer>", "1")])
        for pid in "abc"
    )
    EvalReport(model="m", summary={}, records=records).save(tmp_path)
    PassRates(4, {"a": 0, "b": 1, "c": 2}).save(tmp_path)
    result = ScoreResult("grpo-correctness", str(tmp_path), {"prompts": 3, "mean_pass_rate": 0.25}, "fp")
    run = RecordingRun()
    _log_result(run, result, cfg=_smoke_cfg("grpo.stages.1.pass_rate={samples: 4, band: [0.3, 1.0]}"))
    assert run.called("log_metrics") == [(({"prompts": 3, "mean_pass_rate": 0.25},), {})]
    [(args, _)] = run.called("log_pass_rates")
    rates, pass_rate, questions = args
    assert (rates.correct, rates.samples, pass_rate.band) == ({"a": 0, "b": 1, "c": 2}, 4, (0.3, 1.0))
    assert questions == {"a": "question a", "b": "question b", "c": "question c"}
