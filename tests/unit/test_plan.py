"""The typed plan without Prefect: step order from the config, --force names, and how walk threads
the model and data through the steps (and stops knowing keys after a step that would rerun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cache.planner import Decision, Planner
from posttrain.core.config import ConfigError
from posttrain.core.results import DataResult
from posttrain.pipeline import load_config
from posttrain.pipeline.plan import (
    DataStep,
    EvalStep,
    GRPOStep,
    SFTStep,
    StepInputs,
    build_plan,
)
from posttrain.pipeline.steps import ModelRef


@pytest.fixture(scope="module")
def plan_for(smoke_config_path):
    """``plan_for(*overrides)``: the plan of the smoke config with ``overrides``."""
    return lambda *overrides: build_plan(load_config(smoke_config_path, list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            (),
            ["data", "eval-baseline", "sft", "eval-sft", "dpo", "eval-dpo", "grpo-format", "eval-grpo-format"]
            + ["grpo-correctness", "eval-grpo-correctness"],
        ),  # everything
        (
            ("eval.after_each_stage=false", "eval.baseline=false"),
            ["data", "sft", "dpo", "grpo-format", "grpo-correctness", "eval-grpo-correctness"],
        ),  # only the final evaluation
        (
            ("sft.enabled=false", "dpo=null", "eval.baseline=false"),
            ["data", "grpo-format", "eval-grpo-format", "grpo-correctness", "eval-grpo-correctness"],
        ),  # GRPO only
    ],
)
def test_plan_follows_the_config(plan_for, overrides, names):
    assert plan_for(*overrides).names == names


def test_steps_are_typed(plan_for):
    plan = plan_for()
    assert isinstance(plan.step("data"), DataStep)
    assert isinstance(plan.step("sft"), SFTStep) and plan.step("sft").kind == "sft"
    grpo = plan.step("grpo-format")
    assert isinstance(grpo, GRPOStep) and grpo.kind == "grpo"
    assert grpo.section(plan.config).name == "format"
    assert isinstance(plan.step("eval-sft"), EvalStep) and plan.step("eval-sft").stage == "sft"
    assert [s.name for s in plan.training_steps] == ["sft", "dpo", "grpo-format", "grpo-correctness"]


def test_force_names_steps_of_the_plan(plan_for):
    plan = plan_for()
    plan.check_force(["data", "grpo-correctness"])
    with pytest.raises(ConfigError, match="--force a, b: not a step"):
        plan.check_force(["b", "a"])
    with pytest.raises(KeyError, match="grpo-bogus"):
        plan.step("grpo-bogus")
    with pytest.raises(ConfigError, match="--force grpo-bogus: not a step of smoke; steps: data, dpo, "):
        plan.check_force(["grpo-bogus"])
    with pytest.raises(ConfigError, match="eval-sft"):
        plan.check_force(["eval-sft"])  # evaluations are not forced: nothing downstream uses them


def _data(fp: str = "d") -> DataResult:
    return DataResult(data_dir="/data", train_fingerprint=f"train-{fp}", eval_fingerprint=f"eval-{fp}")


def test_walk_threads_model_and_data_through_the_steps(plan_for, monkeypatch):
    from posttrain.core.results import StageResult

    plan = plan_for("eval.after_each_stage=false", "eval.baseline=false")
    seen = []

    def visit(step, key, inputs: StepInputs):
        seen.append((step.name, inputs.model.path, inputs.data.data_dir if inputs.data else None, key))
        if isinstance(step, DataStep):
            return _data()
        if isinstance(step, EvalStep):
            return None  # an evaluation with no result does not hide anything downstream
        return StageResult(step.name, f"/out/{step.name}", {}, {"output": f"fp-{step.name}"})

    final = plan.walk(ModelRef("/base", "fp-base"), visit)
    assert [(name, model, data) for name, model, data, _ in seen] == [
        ("data", "/base", None),
        ("sft", "/base", "/data"),
        ("dpo", "/out/sft", "/data"),
        ("grpo-format", "/out/dpo", "/data"),
        ("grpo-correctness", "/out/grpo-format", "/data"),
        ("eval-grpo-correctness", "/out/grpo-correctness", "/data"),
    ]
    assert all(key for *_, key in seen)
    assert final.model == ModelRef("/out/grpo-correctness", "fp-grpo-correctness")


def test_keys_after_an_unknown_output_are_unknown(plan_for):
    plan = plan_for("eval.after_each_stage=false", "eval.baseline=false")
    keys = {}

    def visit(step, key, inputs):
        keys[step.name] = key
        return _data() if isinstance(step, DataStep) else None  # sft "would run": its output is unknown

    plan.walk(ModelRef("/base", "fp-base"), visit)
    assert keys["data"] and keys["sft"]
    assert all(
        keys[name] is None for name in ("dpo", "grpo-format", "grpo-correctness", "eval-grpo-correctness")
    )


def test_data_and_eval_keys_change_with_their_inputs(plan_for):
    plan = plan_for()
    data, evaluate = plan.step("data"), plan.step("eval-sft")
    base = _inputs()
    assert data.key(plan.config, base) != data.key(plan.config, _inputs("fp-other"))  # the tokenizer's model
    assert evaluate.key(plan.config, base) != evaluate.key(plan.config, _inputs("fp-other"))
    assert evaluate.key(plan.config, base) != plan.step("eval-dpo").key(plan.config, base)
    other_eval_split = StepInputs(base.model, DataResult("/data", "train-d", "eval-x"))
    other_train_split = StepInputs(base.model, DataResult("/data", "train-x", "eval-d"))
    assert evaluate.key(plan.config, base) != evaluate.key(plan.config, other_eval_split)
    assert evaluate.key(plan.config, base) == evaluate.key(plan.config, other_train_split)


def test_keys_change_with_the_inputs(plan_for):
    plan = plan_for()
    sft = plan.step("sft")
    base = StepInputs(ModelRef("/base", "fp-base"), _data())
    assert sft.key(plan.config, base) == sft.key(
        plan.config, StepInputs(ModelRef("/elsewhere", "fp-base"), _data())
    )
    assert sft.key(plan.config, base) != sft.key(
        plan.config, StepInputs(ModelRef("/base", "fp-other"), _data())
    )
    assert sft.key(plan.config, base) != sft.key(
        plan.config, StepInputs(ModelRef("/base", "fp-base"), _data("x"))
    )
    other = plan_for("sft.trainer.learning_rate=0.5")
    assert other.step("sft").key(other.config, base) != sft.key(plan.config, base)
    # When checkpoints are written changes nothing a stage produces: a killed stage's checkpoints
    # stay under its key.
    for when in ("save_steps=3", "save_total_limit=2", "save_strategy=epoch", "save_strategy='no'"):
        other = plan_for(f"sft.trainer.{when}")
        assert other.step("sft").key(other.config, base) == sft.key(plan.config, base), when


def damage(out: Path) -> None:
    (out / "report.json").write_text("{}")


def move_store(out: Path) -> None:
    from posttrain.core.atomic import RESULT_FILE

    result = json.loads((out / RESULT_FILE).read_text())
    (out / RESULT_FILE).write_text(json.dumps({**result, "report_dir": "/elsewhere/evals/x"}))


def garble(out: Path) -> None:
    from posttrain.core.atomic import RESULT_FILE

    (out / RESULT_FILE).write_text("not json")


def drop_result(out: Path) -> None:
    from posttrain.core.atomic import RESULT_FILE

    (out / RESULT_FILE).unlink()


ADOPTED = ("cached", "complete output adopted (its cache record was missing)")
NOT_ADOPTED = ("run", "output without a cache record failed verification: recomputing")


@pytest.mark.parametrize(
    ("change", "model_fp", "expected"),
    [
        (None, "m1", ADOPTED),  # a kill fell between the rename and the record: intact, adopted
        (damage, "m1", NOT_ADOPTED),  # content no longer what the result recorded
        (None, "m2", NOT_ADOPTED),  # the result of another model's evaluation
        (move_store, "m1", NOT_ADOPTED),  # a result that names another folder
        (garble, "m1", NOT_ADOPTED),  # not a result
        (drop_result, "m1", NOT_ADOPTED),  # an output without its result (from before results existed)
    ],
)
def test_an_output_without_its_record_is_adopted_only_if_it_verifies(
    plan_for, tmp_path, change, model_fp, expected
):
    from posttrain.cache.digests import fingerprint_tree
    from posttrain.cache.planner import Planner
    from posttrain.cache.records import StoreRecords
    from posttrain.cache.store import Store
    from posttrain.core.atomic import write_result
    from posttrain.core.results import EvalResult

    plan = plan_for(f"orchestration.store={tmp_path / 'store'}")
    store = Store.at(tmp_path / "store")
    step = plan.step("eval-sft")
    inputs = StepInputs(ModelRef("model", model_fp), DataResult("data", "t", "e"))
    key = step.key(plan.config, inputs)
    out = _report(step.output_dir(store, key))
    summary = {"accuracy_strict": 0.5}
    write_result(out, EvalResult("sft", str(out.resolve()), summary, {}, "m1", fingerprint_tree(out)))
    if change is not None:
        change(out)

    decision = Planner(plan, StoreRecords(store), store=store).decide(step, key, inputs)
    assert (decision.status, decision.reason) == expected
    assert decision.adopted == (expected == ADOPTED)
    if decision.adopted:
        assert decision.result.summary == summary and decision.result.report_dir == str(out.resolve())
    # Without the store (the planner before adoption existed) nothing is adopted.
    assert Planner(plan, StoreRecords(store)).decide(step, key, inputs).status == "run"


@pytest.mark.parametrize(
    ("name", "model_fp", "expected"),
    [
        ("sft", "fp-base", ADOPTED),
        ("sft", "fp-other", NOT_ADOPTED),  # trained from another model: its key prefix matched by chance
        ("data", "fp-other", ADOPTED),  # a data result does not record the model it was made for
    ],
)
def test_a_stage_or_data_output_without_its_record_is_adopted_only_if_made_from_these_inputs(
    plan_for, tmp_path, name, model_fp, expected
):
    from posttrain.cache.digests import fingerprint_tree
    from posttrain.cache.planner import dry_run
    from posttrain.cache.records import StoreRecords
    from posttrain.cache.store import Store
    from posttrain.core.atomic import write_result
    from posttrain.core.results import StageResult
    from posttrain.models.artifacts import fingerprint_dir

    plan = plan_for(f"orchestration.store={tmp_path / 'store'}")
    store = Store.at(tmp_path / "store")
    step = plan.step(name)
    made = StepInputs(ModelRef("/base", "fp-base"), _data())
    key = step.key(plan.config, made)
    out = _folder(step.output_dir(store, key), "config.json", "model.safetensors", "stage.json").resolve()
    if name == "data":
        result = DataResult(str(out), "train-d", "eval-d", {"n_train": 4}, fingerprint_tree(out))
    else:
        fingerprints = {"output": fingerprint_dir(out), "input_model": "fp-base"}
        result = StageResult(name, str(out), {"loss": 0.5}, fingerprints)
    write_result(out, result)

    asked = StepInputs(ModelRef("/base", model_fp), _data())
    decision = Planner(plan, StoreRecords(store), store=store).decide(step, key, asked)
    assert (decision.status, decision.reason) == expected
    if name == "data":  # the dry run shows the adoption too, and only when it is given the store
        assert dry_run(plan, StoreRecords(store), made.model, store=store)[0] == ("data", *ADOPTED)
        assert dry_run(plan, StoreRecords(store), made.model)[0][1] == "run"


GSM8K_SET = "{name: gsm8k, data: local, path: %s, limit: 2}"

# (extra sets, does the data step's key change too): every change of an extra set changes the
# evaluations' keys; the data step's key changes when the questions training must not overlap change
EXTRA_SET_CASES = [
    ("[{name: synth, data: synthetic, limit: 3}]", True),  # a generated set: decontamination input
    ("[{name: synth, data: synthetic, limit: 4}]", True),  # more of its questions
    ("[{name: synth, data: synthetic, limit: 3, max_ops: 2}]", True),  # other questions
    (
        "[{name: synth, data: synthetic, limit: 3, max_completion_length: 5}]",
        True,
    ),  # generation only (vs none)
    ("[{name: held, data: heldout, limit: 3}]", False),  # a slice of the held-out data: nothing new
    ("[{name: held2, data: heldout, limit: 3}]", False),  # renamed: its metrics and folder change
]


def test_extra_eval_sets_are_part_of_the_evaluation_keys(plan_for, tmp_path):
    inputs = StepInputs(ModelRef("/base", "fp-base"), _data())

    def keys(*overrides: str) -> tuple[str, str, str]:
        plan = plan_for(*overrides)
        return tuple(plan.step(s).key(plan.config, inputs) for s in ("data", "sft", "eval-sft"))

    none = keys()
    seen = {none[2]}
    for extra, data_changes in EXTRA_SET_CASES:
        data, sft, evaluation = keys(f"eval.extra_sets={extra}")
        assert evaluation not in seen, extra
        seen.add(evaluation)
        assert (data != none[0]) == data_changes, extra
        assert sft == none[1], extra  # training keys follow the data's content, not its key
    generated = [keys(f"eval.extra_sets={extra}") for extra, _ in EXTRA_SET_CASES[:4]]
    assert generated[3][0] == generated[0][0]  # the generation limit does not change the questions

    data_file = tmp_path / "gsm8k.jsonl"
    data_file.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    before = keys(f"eval.extra_sets=[{GSM8K_SET % data_file}]")
    data_file.write_text('{"question": "1+2?", "answer": "#### 3"}\n')  # same path, new content
    after = keys(f"eval.extra_sets=[{GSM8K_SET % data_file}]")
    assert after[0] != before[0] and after[2] != before[2] and after[1] == before[1]


def test_a_final_only_set_is_evaluated_and_keyed_at_the_final_evaluation_only(plan_for, monkeypatch):
    inputs = StepInputs(ModelRef("/base", "fp-base"), _data())
    final_set = "{name: test, data: synthetic, limit: 4, final_only: true}"
    every_set = "{name: dev, data: synthetic, limit: 4}"
    plan = plan_for(f"eval.extra_sets=[{every_set}, {final_set}]")
    finals = {s.name: s.final for s in plan.steps if isinstance(s, EvalStep)}
    assert finals == {
        "eval-baseline": False,
        "eval-sft": False,
        "eval-dpo": False,
        "eval-grpo-format": False,
        "eval-grpo-correctness": True,
    }
    sets = {name: [s.name for s in plan.step(name).section(plan.config).extra_sets] for name in finals}
    assert sets["eval-sft"] == ["dev"] and sets["eval-grpo-correctness"] == ["dev", "test"]
    assert plan_for("sft.enabled=false", "dpo=null", "grpo.stages=[]").steps[1].final  # nothing trains
    assert not plan_for("sft.enabled=false", "dpo=null").step("eval-baseline").final

    def key(step: str, test_limit: int) -> str:
        changed = plan_for(
            f"eval.extra_sets=[{every_set}, {final_set.replace('limit: 4', f'limit: {test_limit}')}]"
        )
        return changed.step(step).key(changed.config, inputs)

    assert key("eval-sft", 4) == key("eval-sft", 9)  # a stage's evaluation does not evaluate it
    assert key("eval-grpo-correctness", 4) != key("eval-grpo-correctness", 9)

    # The step evaluates the sets of its own section: the final-only one only at the end.
    from posttrain.pipeline import steps

    evaluated = {}
    monkeypatch.setattr(
        steps,
        "eval_step",
        lambda cfg, stage, *a, **k: evaluated.setdefault(stage, [n for n, _ in cfg.eval.all_sets()]),
    )
    for name in ("eval-sft", "eval-grpo-correctness"):
        plan.step(name).run(plan.config, inputs, "out")
    assert evaluated == {"sft": [None, "dev"], "grpo-correctness": [None, "dev", "test"]}


def test_each_extra_set_gets_its_own_questions_and_generation_limit(smoke_config_path):
    from posttrain.data.eval_sets import SYNTHETIC_EVAL_SEED
    from posttrain.pipeline.steps import _set_records

    cfg = load_config(
        smoke_config_path,
        [
            "eval.extra_sets=[{name: hard, data: synthetic, limit: 6, min_ops: 3, max_ops: 3, max_completion_length: 5},"
            " {name: mixed, data: synthetic, limit: 6}, {name: small, data: synthetic, limit: 4, numbers: small},"
            " {name: unseen, data: synthetic, limit: 5, themes: [farm]}]"
        ],
    )
    (primary_name, primary), (hard_name, hard), (_, mixed), (_, small), (_, unseen) = cfg.eval.all_sets()
    assert (primary_name, hard_name) == (None, "hard")
    assert primary.data == "heldout" and primary.extra_sets == [] and primary.max_completion_length == 16
    assert hard.max_completion_length == 5 and mixed.max_completion_length == 16  # the primary's unless given
    assert {r["ops"] for r in _set_records(cfg, hard)} == {3}
    assert len(_set_records(cfg, mixed)) == 6 and {r["ops"] for r in _set_records(cfg, mixed)} <= {1, 2, 3, 4}
    small_ids = [r["id"] for r in _set_records(cfg, small)]
    assert small_ids == [f"synthetic-small-s{SYNTHETIC_EVAL_SEED}-{i}" for i in range(4)]
    assert all("apple" in r["question"] for r in _set_records(cfg, unseen))  # only the farm's story


# --------------------------------------------------------------------------- steps, planner, dry run
# The flow's caching decisions without Prefect: records in memory, real output folders.


class FakeRecords:
    """Cache records in memory (the CacheRecords protocol); keys in ``corrupt`` fail to read."""

    def __init__(self, results=None, lineages=None, corrupt=()):
        self.results, self.lineages, self.corrupt = dict(results or {}), dict(lineages or {}), set(corrupt)
        self.reads: list[tuple[str, str | None]] = []

    def exists(self, key):
        return key in self.results or key in self.corrupt

    def read(self, key, kind=None):
        self.reads.append((key, kind))
        if key in self.corrupt:
            raise ValueError("not JSON")
        return self.results[key]

    def code_of_lineage(self, lineage):
        return self.lineages.get(lineage)


def _folder(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text(json.dumps({"file": f"{name} of {path.name}"}))
    return path


def data_output(root: Path) -> DataResult:
    from posttrain.cache.digests import fingerprint_tree

    folder = _folder(root / "data", "train.jsonl", "stats.json")
    return DataResult(str(folder), "train-d", "eval-d", {"n_train": 4}, fingerprint_tree(folder))


def stage_output(root: Path, name: str):
    from posttrain.core.results import StageResult
    from posttrain.models.artifacts import fingerprint_dir

    folder = _folder(root / name, "config.json", "model.safetensors", "stage.json")
    return StageResult(
        name, str(folder), {"loss": 0.5}, {"output": fingerprint_dir(folder), "input_model": "fp-base"}
    )


def eval_output(root: Path, stage: str):
    from posttrain.cache.digests import fingerprint_tree
    from posttrain.core.results import EvalResult

    folder = _report(root / f"eval-{stage}")
    return EvalResult(stage, str(folder), {"accuracy_strict": 0.5}, {}, "fp", fingerprint_tree(folder))


def _report(folder: Path) -> Path:
    """A real (empty) evaluation report: a cached evaluation's report must read back."""
    from posttrain.evaluation.report import EvalReport

    return EvalReport(model=folder.name, summary={"accuracy_strict": 0.5}, records=()).save(folder)


def output_for(root: Path, step):
    if isinstance(step, DataStep):
        return data_output(root)
    if isinstance(step, EvalStep):
        return eval_output(root, step.stage)
    return stage_output(root, step.name)


def _inputs(model_fp: str = "fp-base") -> StepInputs:
    return StepInputs(ModelRef("/base", model_fp), _data())


def _flip_a_byte(path: Path) -> None:
    text = path.read_text()
    path.write_text(text.replace("of", "0f", 1) if "of" in text else text + " ")


@pytest.mark.parametrize("make", [data_output, lambda root: eval_output(root, "sft")], ids=["data", "eval"])
def test_a_data_or_eval_output_stands_while_its_folder_is_unmodified(tmp_path, make):
    import dataclasses
    import shutil

    result = make(tmp_path)
    step = DataStep() if isinstance(result, DataResult) else EvalStep("sft")
    assert step.output_is_valid(result)
    assert not step.output_is_valid(dataclasses.replace(result, output_fingerprint=""))  # an old record
    assert not step.output_is_valid(stage_output(tmp_path, "sft"))  # another kind of result
    folder = Path(step.output_of(result))
    _flip_a_byte(next(folder.iterdir()))
    assert not step.output_is_valid(result)
    shutil.rmtree(folder)
    assert not step.output_is_valid(result)


def test_a_stage_output_stands_while_complete_and_unmodified(plan_for, tmp_path):
    step = plan_for().step("sft")
    result = stage_output(tmp_path, "sft")
    assert step.output_is_valid(result)
    assert not step.output_is_valid(data_output(tmp_path))
    _flip_a_byte(Path(result.output_dir) / "model.safetensors")
    assert not step.output_is_valid(result)
    fresh = stage_output(tmp_path / "again", "sft")
    (Path(fresh.output_dir) / "config.json").unlink()  # no loadable policy: unfinished
    assert not step.output_is_valid(fresh)


def test_each_step_writes_into_its_store_folder_and_reports_its_result(plan_for, tmp_path):
    from posttrain.cache.store import Store

    store, key, plan = Store.at(tmp_path / "store"), "0123456789abcdef01234567", plan_for()
    assert plan.step("data").output_dir(store, key) == store.root / "data" / "0123456789ab"
    assert (
        plan.step("grpo-format").output_dir(store, key) == store.root / "stages" / "grpo-format-0123456789ab"
    )
    assert plan.step("eval-dpo").output_dir(store, key) == store.root / "evals" / "dpo-0123456789ab"
    data, stage, report = data_output(tmp_path), stage_output(tmp_path, "sft"), eval_output(tmp_path, "sft")
    assert (DataStep.output_of(data), DataStep.metrics_of(data)) == (data.data_dir, {"n_train": 4})
    assert (SFTStep.output_of(stage), SFTStep.metrics_of(stage)) == (stage.output_dir, {"loss": 0.5})
    assert (EvalStep.output_of(report), EvalStep.metrics_of(report)) == (report.report_dir, report.summary)
    after_data = DataStep().advance(StepInputs(ModelRef("/base", "fp")), data)
    assert after_data == StepInputs(ModelRef("/base", "fp"), data)
    assert plan.step("sft").advance(after_data, stage) == StepInputs(
        ModelRef(stage.output_dir, stage.fingerprints["output"]), data
    )
    assert EvalStep("sft").advance(after_data, report) == after_data
    assert [plan.step(n).section(plan.config) for n in ("data", "sft", "eval-sft")] == [
        plan.config.data,
        plan.config.sft,
        plan.config.eval,
    ]


def test_each_step_runs_its_own_step_function(plan_for, monkeypatch):
    import posttrain.pipeline.plan as plan_module
    import posttrain.pipeline.steps as steps

    calls = []
    for name in ("prepare_step", "eval_step"):
        monkeypatch.setattr(
            steps, name, lambda *args, _name=name, **kw: calls.append((_name, args, kw)) or _name
        )
    for name, kind in (("sft_step", "SFTStep"), ("dpo_step", "DPOStep"), ("grpo_step", "GRPOStep")):

        def train(self, *args, _name=name, **kw):
            calls.append((_name, (self.name, *args), kw))
            return _name

        monkeypatch.setattr(getattr(plan_module, kind), "train", train)
    plan, inputs = plan_for(), _inputs()
    cfg = plan.config
    assert [plan.step(n).run(cfg, inputs, "/out", report_to="mlflow") for n in plan.names[:7]] == [
        "prepare_step",
        "eval_step",
        "sft_step",
        "eval_step",
        "dpo_step",
        "eval_step",
        "grpo_step",
    ]
    model, data = inputs.model, inputs.data
    assert calls[0] == ("prepare_step", (cfg, model, "/out"), {})
    assert calls[1] == ("eval_step", (cfg, "baseline", model, data, "/out"), {})
    assert calls[2] == ("sft_step", ("sft", cfg, model, data, "/out", "mlflow"), {})
    assert calls[4] == ("dpo_step", ("dpo", cfg, model, data, "/out", "mlflow"), {})
    assert calls[5][1][1] == "dpo"  # eval-dpo evaluates the dpo stage
    assert calls[6] == ("grpo_step", ("grpo-format", cfg, model, data, "/out", "mlflow"), {})
    plan.step("sft").run(cfg, inputs, "/out")  # untracked unless told otherwise
    assert calls[-1] == ("sft_step", ("sft", cfg, model, data, "/out", "none"), {})


def test_planner_serves_a_verified_record_and_says_why_anything_else_runs(plan_for, tmp_path, caplog):
    plan = plan_for()
    sft = plan.step("sft")
    key = sft.key(plan.config, _inputs())
    result = stage_output(tmp_path, "sft")
    records = FakeRecords({key: result, "gone": stage_output(tmp_path / "gone", "sft")}, corrupt={"bad"})
    planner = Planner(plan, records)

    assert planner.decide(sft, key, _inputs()) == Decision("cached", f"cache hit {key[:12]}")
    assert planner.decide(sft, key).result is result
    assert records.reads[0] == (key, "sft")  # read as the step's kind
    assert planner.cached_result(sft, key) is result
    (Path(records.results["gone"].output_dir) / "config.json").unlink()
    assert planner.decide(sft, "gone") == Decision("run", "cached output missing or modified")
    assert planner.cached_result(sft, "gone") is None
    assert planner.decide(sft, "nothing") == Decision("run", "no cache entry for these inputs/config")
    with caplog.at_level("WARNING"):
        assert planner.decide(sft, "bad") == Decision("run", "cache record unreadable")
    assert caplog.messages == ["cache record bad is unreadable (not JSON); recomputing"]


def test_planner_with_caching_off_runs_everything(plan_for, tmp_path):
    plan = plan_for("orchestration.cache=false")
    key = plan.step("data").key(plan.config, _inputs())
    decision = Planner(plan, FakeRecords({key: data_output(tmp_path)})).decide(plan.step("data"), key)
    assert decision == Decision("run", "caching disabled (orchestration.cache: false)")


def test_force_reruns_the_named_step_and_everything_after_it(plan_for, tmp_path):
    plan = plan_for()
    records = FakeRecords({name: output_for(tmp_path / name, plan.step(name)) for name in plan.names})
    with pytest.raises(ConfigError, match="--force nope: not a step"):
        Planner(plan, records, ["nope"])
    planner = Planner(plan, records, ["dpo"])
    got = {name: planner.decide(plan.step(name), name) for name in plan.names}
    after = plan.names[plan.names.index("dpo") + 1 :]
    assert {n: d.reason for n, d in got.items() if d.status == "run"} == {
        "dpo": "forced",
        **dict.fromkeys(after, "after forced dpo"),
    }
    assert {d.status for n, d in got.items() if n not in after and n != "dpo"} == {"cached"}
    assert planner.forced_from == "dpo"
    both = Planner(plan, records, ["sft", "grpo-format"])  # the first forced step in plan order wins
    assert [both.decide(plan.step(n), n).reason for n in ("sft", "grpo-format")] == [
        "forced",
        "after forced sft",
    ]


def _why_missing(plan_for, changed: int, records_cls=None, with_inputs=True) -> tuple[str, list[str]]:
    plan = plan_for()
    step = plan.step("grpo-format")
    identity = step.identity(plan.config, _inputs())
    files = sorted(identity.code.files)
    before = {**identity.code.files, **{name: "old" for name in files[:changed]}}
    records = (records_cls or FakeRecords)(lineages={identity.lineage: before})
    return Planner(plan, records)._why_missing(step, _inputs() if with_inputs else None), files


def test_a_missing_key_says_which_code_changed_since_its_lineage_last_ran(plan_for):
    missing = "no cache entry for these inputs/config"
    why, files = _why_missing(plan_for, 1)
    assert why == f"code changed: {files[0]}"
    assert _why_missing(plan_for, 3)[0] == f"code changed: {', '.join(files[:3])}"
    assert _why_missing(plan_for, 4)[0] == f"code changed: {', '.join(files[:3])} (+1 more)"
    assert _why_missing(plan_for, 5)[0] == f"code changed: {', '.join(files[:3])} (+2 more)"
    assert _why_missing(plan_for, 0)[0] == missing  # same code: the config or inputs changed
    assert _why_missing(plan_for, 1, with_inputs=False)[0] == missing
    assert Planner(plan_for(), FakeRecords())._why_missing(plan_for().step("sft"), _inputs()) == missing

    class NoLineages(FakeRecords):  # records that cannot look up lineages
        code_of_lineage = None

    assert _why_missing(plan_for, 1, records_cls=NoLineages)[0] == missing

    class OldRecords:  # an older records class: no lineage lookup at all
        def __init__(self, lineages):
            pass

    assert _why_missing(plan_for, 1, records_cls=OldRecords)[0] == missing


def test_decide_passes_the_inputs_on_to_say_why_a_key_is_missing(plan_for):
    plan = plan_for()
    step = plan.step("grpo-format")
    identity = step.identity(plan.config, _inputs())
    name = sorted(identity.code.files)[0]
    records = FakeRecords(lineages={identity.lineage: {**identity.code.files, name: "old"}})
    assert Planner(plan, records).decide(step, identity.key, _inputs()).reason == f"code changed: {name}"


def test_dry_run_reports_cached_steps_and_what_an_upstream_rerun_hides(plan_for, tmp_path):
    from posttrain.cache.planner import dry_run

    plan = plan_for("eval.after_each_stage=false")
    base = ModelRef("/base", "fp-base")
    keys = {}

    def produce(step, key, inputs):
        keys[step.name] = key
        return output_for(tmp_path / step.name, step)

    plan.walk(base, produce)
    kept = [n for n in plan.names if n not in ("sft", "eval-baseline")]  # their records are missing
    records = FakeRecords({keys[n]: output_for(tmp_path / "records" / n, plan.step(n)) for n in kept})
    rows = dry_run(plan, records, base)
    assert rows == [
        ("data", "cached", f"cache hit {keys['data'][:12]}"),
        ("eval-baseline", "run", "no cache entry for these inputs/config"),  # an eval hides nothing
        ("sft", "run", "no cache entry for these inputs/config"),
        ("dpo", "run", "after sft reruns"),
        ("grpo-format", "run", "after sft reruns"),
        ("grpo-correctness", "run", "after sft reruns"),
        ("eval-grpo-correctness", "run", "after sft reruns"),
    ]
    forced = dry_run(plan, records, base, ["data"])
    assert forced[0] == ("data", "run", "forced") and forced[2] == ("sft", "run", "after data reruns")
    # A missing key whose lineage ran under other code: the dry run says which file changed.
    identity = plan.step("sft").identity(
        plan.config, StepInputs(base, output_for(tmp_path / "d2", DataStep()))
    )
    changed = sorted(identity.code.files)[0]
    records.lineages[identity.lineage] = {**identity.code.files, changed: "old"}
    assert dry_run(plan, records, base)[2] == ("sft", "run", f"code changed: {changed}")


def test_preview_reads_the_store_without_creating_it(smoke_config_path, tiny_model_dir, tmp_path):
    from posttrain.pipeline.plan import preview

    store = tmp_path / "store"
    cfg = load_config(smoke_config_path, [f"model.name={tiny_model_dir}", f"orchestration.store={store}"])
    rows = preview(cfg)
    assert [name for name, _, _ in rows] == build_plan(cfg).names
    assert rows[0] == ("data", "run", "no cache entry for these inputs/config")
    assert {why for _, _, why in rows[1:]} == {"after data reruns"}
    assert preview(cfg, ["data"])[0] == ("data", "run", "forced")
    assert not store.exists()


# --------------------------------------------------------------------------- pass-rate scoring

SCORED = "grpo.stages.1.pass_rate={samples: 4}"


def test_a_stage_with_its_own_source_is_keyed_by_and_trains_on_its_own_split(plan_for, monkeypatch):
    import dataclasses

    import posttrain.pipeline.plan as plan_module
    import posttrain.training.grpo as grpo
    from posttrain.core.results import ScoreResult

    own_source = "grpo.stages.1.data={source: synthetic}"
    plan = plan_for(own_source, SCORED)
    own = dataclasses.replace(_data(), stats={"grpo-correctness.train_fingerprint": "own-1"})
    other_own = dataclasses.replace(own, stats={"grpo-correctness.train_fingerprint": "own-2"})
    other_run = dataclasses.replace(own, train_fingerprint="train-other")
    scores = ScoreResult("grpo-correctness", "/scores", {}, "fp-base", "scores-fp")
    stage, scoring, fmt = (
        plan.step(n) for n in ("grpo-correctness", "score-grpo-correctness", "grpo-format")
    )

    def key(step, data):
        return step.identity(plan.config, StepInputs(_inputs().model, data, scores)).key

    assert key(scoring, own) != key(scoring, other_own)  # its scoring reads the stage's split
    assert key(scoring, own) == key(scoring, other_run)
    assert key(stage, own) != key(stage, other_own)
    assert key(stage, own) != key(stage, other_run)  # it evaluates itself on the run's slices
    assert key(fmt, own) == key(fmt, other_own) != key(fmt, other_run)  # a stage without one: train

    drawn = []
    monkeypatch.setattr(grpo, "run_grpo_stage", lambda *a, **kw: drawn.append(a[3]) or "ran")
    prepared = type(
        "P", (), {"train": "train", "eval": [], "train_for": lambda self, stage: f"{stage}'s own"}
    )
    monkeypatch.setattr(plan_module, "load_data", lambda data: prepared())
    unscored = plan_for(own_source)
    unscored.step("grpo-correctness").run(unscored.config, _inputs(), "/out")
    assert drawn == ["grpo-correctness's own"]  # PreparedData.train_for's own test says what it holds


def test_a_stage_with_its_own_selection_slice_is_keyed_by_and_evaluates_on_that_slice(plan_for, monkeypatch):
    """keep: best without the run's selection slice: the stage chooses its checkpoint by the slice
    cut from its own source, so that slice's content keys it and is what its evaluations read."""
    import dataclasses

    import posttrain.pipeline.plan as plan_module
    import posttrain.training.grpo as grpo

    own_slice = (
        "grpo.stages.1.data={source: synthetic, selection_size: 8}",
        "grpo.stages.1.eval_every=2",
        "grpo.stages.1.keep=best",
    )
    plan = plan_for(*own_slice)
    assert plan.config.data.selection_size == 0  # allowed: the stage has a slice of its own
    stats = {"grpo-correctness.train_fingerprint": "own", "selection_fingerprint": "run-slice"}
    one = dataclasses.replace(_data(), stats={**stats, "grpo-correctness.selection_fingerprint": "slice-1"})
    two = dataclasses.replace(_data(), stats={**stats, "grpo-correctness.selection_fingerprint": "slice-2"})
    run_slice = dataclasses.replace(one, stats={**one.stats, "selection_fingerprint": "run-slice-2"})
    stage = plan.step("grpo-correctness")

    def key(data):
        return stage.identity(plan.config, StepInputs(_inputs().model, data)).key

    assert key(one) != key(two)  # its own slice's content keys it
    assert key(one) == key(run_slice)  # the run's slice is not what it chooses by

    evaluated = []
    monkeypatch.setattr(grpo, "run_grpo_stage", lambda *a, **kw: evaluated.append(kw["heldout"]) or "ran")
    prepared = type(
        "P",
        (),
        {
            "train": "train",
            "eval": "heldout",
            "selection": None,
            "selection_for": lambda self, stage: {"grpo-correctness": "its own slice"}.get(
                stage, "the run's"
            ),
            "train_for": lambda self, stage: f"{stage}'s own",
        },
    )
    monkeypatch.setattr(plan_module, "load_data", lambda data: prepared())
    stage.run(plan.config, _inputs(), "/out")
    assert evaluated == ["its own slice"]


def score_output(root: Path, stage: str = "grpo-correctness", correct=None):
    from posttrain.cache.digests import fingerprint_tree
    from posttrain.core.results import ScoreResult
    from posttrain.data.pass_rates import PassRates

    folder = root / f"score-{stage}"
    folder.mkdir(parents=True)
    PassRates(4, correct or {"a": 2, "b": 4}).save(folder)
    return ScoreResult(stage, str(folder), {"prompts": 2}, "fp-base", fingerprint_tree(folder))


def test_a_stage_with_pass_rate_is_scored_right_before_it(plan_for):
    from posttrain.pipeline.plan import ScoreStep

    plan = plan_for(SCORED)
    names = plan.names
    assert names.index("score-grpo-correctness") == names.index("grpo-correctness") - 1
    assert "score-grpo-format" not in names  # only the stage that asks for it
    step = plan.step("score-grpo-correctness")
    assert isinstance(step, ScoreStep) and step.kind == "score" and step.feeds_downstream
    assert step.section(plan.config) == plan.config.grpo.stages[1].pass_rate


def test_the_score_key_follows_k_the_model_and_sampling_not_the_learning_rate_or_band(plan_for):
    plan = plan_for(SCORED)
    key = plan.step("score-grpo-correctness").key(plan.config, _inputs())

    def key_with(*overrides, inputs=None):
        other = plan_for(SCORED, *overrides)
        return other.step("score-grpo-correctness").key(other.config, inputs or _inputs())

    assert key_with("grpo.stages.1.pass_rate.samples=8") != key  # k
    assert key_with(inputs=_inputs("fp-other")) != key  # the model the stage starts from
    assert key_with(inputs=StepInputs(ModelRef("/base", "fp-base"), _data("x"))) != key  # the data
    assert key_with("grpo.stages.1.pass_rate.candidates=16") != key
    assert key_with("grpo.defaults.trainer.temperature=0.7") != key
    assert key_with("grpo.defaults.trainer.max_completion_length=24") != key
    assert key_with("seed=1") != key
    assert key_with("grpo.stages.1.trainer.chat_template_kwargs={enable_thinking: false}") != key
    # what only chooses among the rates, or only trains, leaves the scoring alone
    assert key_with("grpo.stages.1.pass_rate.band=[0.2, 0.8]") == key
    assert key_with("grpo.stages.1.pass_rate.weighting=variance") == key
    assert key_with("grpo.defaults.trainer.learning_rate=0.5") == key
    assert key_with("grpo.stages.1.trainer.beta=0.1") == key


RFT = (
    "grpo.stages.1.rft={replay: 1.0, trainer: {max_steps: 2}}",
    "grpo.stages.1.rewards=[{name: correctness}]",
)


def test_an_rft_stage_is_scored_right_before_it_and_fine_tunes_as_its_own_kind(plan_for):
    from posttrain.pipeline.plan import RFTStep, ScoreStep

    plan = plan_for(SCORED, *RFT)
    names = plan.names
    assert names[names.index("rft-correctness") - 1 :][:2] == ["score-rft-correctness", "rft-correctness"]
    assert "grpo-correctness" not in names and "eval-rft-correctness" in names
    step = plan.step("rft-correctness")
    assert isinstance(step, RFTStep) and step.kind == "rft"
    assert isinstance(plan.step("score-rft-correctness"), ScoreStep)
    assert plan.config.stages()[-1] == ("rft", "rft-correctness")


def test_the_rft_stage_key_follows_its_scores_its_sft_options_and_the_records_it_replays(plan_for, tmp_path):
    import dataclasses

    from posttrain.cache.keys import code_kind

    plan = plan_for(SCORED, *RFT)
    one = score_output(tmp_path / "one", stage="rft-correctness")
    other = score_output(tmp_path / "two", stage="rft-correctness", correct={"a": 1, "b": 4})

    def key(cfg_plan, scores=one, data=None, step="rft-correctness"):
        inputs = StepInputs(_inputs().model, data or _data(), scores)
        return cfg_plan.step(step).key(cfg_plan.config, inputs)

    stage = key(plan)
    assert key(plan, scores=other) != stage
    assert key(plan_for(SCORED, *RFT, "grpo.stages.1.rft.replay=0.5")) != stage
    assert key(plan_for(SCORED, *RFT, "grpo.stages.1.rft.trainer.learning_rate=0.001")) != stage
    # the records it replays: the run's train split, read whether or not the stage has its own data
    replayed = dataclasses.replace(_data(), train_fingerprint="train-other")
    assert key(plan, data=replayed) != stage
    own = plan_for(SCORED, *RFT, "grpo.stages.1.data={source: synthetic}")
    own_data = dataclasses.replace(_data(), stats={"rft-correctness.train_fingerprint": "own-1"})
    assert key(own, data=own_data) != key(own, data=dataclasses.replace(own_data, train_fingerprint="t2"))
    assert code_kind(plan.step("rft-correctness").section(plan.config)) == "rft"
    # what only GRPO (or checkpointing) reads leaves it alone: grpo.defaults may set it for every stage
    for unused in (
        "grpo.stages.1.rft.trainer.save_steps=7",
        "grpo.stages.1.trainer.beta=0.1",
        "grpo.stages.1.trainer.learning_rate=0.3",
        "grpo.stages.1.sample_every=3",
    ):
        assert key(plan_for(SCORED, *RFT, unused)) == stage, unused
    assert key(plan_for(SCORED, *RFT, "grpo.stages.1.trainer.max_completion_length=24")) != stage
    # its scoring measures what a GRPO stage's would: the fine-tuning's settings leave it alone
    scoring = key(plan, step="score-rft-correctness")
    assert (
        key(plan_for(SCORED, *RFT, "grpo.stages.1.rft.replay=0.5"), step="score-rft-correctness") == scoring
    )
    assert (
        key(plan_for(SCORED, *RFT, "grpo.stages.1.pass_rate.samples=8"), step="score-rft-correctness")
        != scoring
    )


def test_the_stage_key_follows_its_pass_rates(plan_for, tmp_path):
    plan = plan_for(SCORED)
    stage = plan.step("grpo-correctness")
    one = score_output(tmp_path / "one")
    other = score_output(tmp_path / "two", correct={"a": 1, "b": 4})
    with_one = StepInputs(_inputs().model, _data(), one)
    assert stage.key(plan.config, with_one) != stage.key(
        plan.config, StepInputs(_inputs().model, _data(), other)
    )
    banded = plan_for(SCORED, "grpo.stages.1.pass_rate.band=[0.2, 0.8]")
    assert banded.step("grpo-correctness").key(banded.config, with_one) != stage.key(plan.config, with_one)
    # a stage without pass_rate keeps the key it always had
    plain = plan_for()
    assert plain.step("grpo-correctness").key(plain.config, _inputs()) == plain.step("grpo-correctness").key(
        plain.config, StepInputs(_inputs().model, _data(), one)
    )


def test_walk_hands_the_scores_to_their_stage_only(plan_for, tmp_path):
    from posttrain.core.results import StageResult
    from posttrain.pipeline.plan import ScoreStep

    plan = plan_for(SCORED, "eval.after_each_stage=false", "eval.baseline=false")
    scores = score_output(tmp_path)
    seen = {}

    def visit(step, key, inputs):
        seen[step.name] = inputs.scores
        if isinstance(step, DataStep):
            return _data()
        if isinstance(step, ScoreStep):
            return scores
        if isinstance(step, EvalStep):
            return None
        return StageResult(step.name, f"/out/{step.name}", {}, {"output": f"fp-{step.name}"})

    plan.walk(ModelRef("/base", "fp-base"), visit)
    assert seen["grpo-correctness"] == scores
    assert seen["score-grpo-correctness"] is None and seen["grpo-format"] is None
    assert seen["eval-grpo-correctness"] is None  # the stage's output is the next input, not the scores


@pytest.mark.parametrize(
    "damage_it",
    [
        lambda folder: (folder / "pass_rates.json").write_text("{"),
        lambda folder: (folder / "pass_rates.json").unlink(),
        lambda folder: (folder / "pass_rates.json").write_text(
            '{"posttrain_pass_rates": 1, "samples": 4, "correct": {"a": 9}}'
        ),
    ],
    ids=["truncated", "missing", "count above k"],
)
def test_a_damaged_pass_rate_file_is_recomputed(plan_for, tmp_path, damage_it):
    import dataclasses

    from posttrain.cache.digests import fingerprint_tree

    step = plan_for(SCORED).step("score-grpo-correctness")
    result = score_output(tmp_path)
    assert step.output_is_valid(result)
    damage_it(Path(result.output_dir))
    assert not step.output_is_valid(result)
    # even with a record that vouches for the damaged folder, the file must read back
    forged = dataclasses.replace(result, output_fingerprint=fingerprint_tree(result.output_dir))
    assert not step.output_is_valid(forged)


def test_the_stage_trains_on_the_pass_rates_its_scoring_step_wrote(plan_for, monkeypatch, tmp_path):
    import posttrain.pipeline.plan as plan_module
    import posttrain.training.grpo as grpo

    calls = []
    monkeypatch.setattr(grpo, "run_grpo_stage", lambda *a, **kw: calls.append(kw["pass_rates"]) or "ran")
    prepared = type("P", (), {"train": [], "eval": [], "train_for": lambda self, stage: []})
    monkeypatch.setattr(plan_module, "load_data", lambda data: prepared())
    plan = plan_for(SCORED)
    scores = score_output(tmp_path, correct={"a": 3, "b": 0})
    inputs = StepInputs(_inputs().model, _data(), scores)
    assert plan.step("grpo-correctness").run(plan.config, inputs, "/out") == "ran"
    assert calls[0].correct == {"a": 3, "b": 0}
    plan.step("grpo-format").run(plan.config, _inputs(), "/out")
    assert calls[1] is None
