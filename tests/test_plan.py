"""The typed plan without Prefect: step order from the config, --force names, and how walk threads
the model and data through the steps (and stops knowing keys after a step that would rerun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.core.config import ConfigError
from posttrain.pipeline import load_config
from posttrain.pipeline.plan import DataStep, EvalStep, GRPOStep, SFTStep, StepInputs, build_plan
from posttrain.pipeline.steps import DataResult, ModelRef

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


def plan_for(*overrides: str):
    return build_plan(load_config(SMOKE, list(overrides)))


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
def test_plan_follows_the_config(overrides, names):
    assert plan_for(*overrides).names == names


def test_steps_are_typed():
    plan = plan_for()
    assert isinstance(plan.step("data"), DataStep)
    assert isinstance(plan.step("sft"), SFTStep) and plan.step("sft").kind == "sft"
    grpo = plan.step("grpo-format")
    assert isinstance(grpo, GRPOStep) and grpo.kind == "grpo"
    assert grpo.section(plan.config).name == "format"
    assert isinstance(plan.step("eval-sft"), EvalStep) and plan.step("eval-sft").stage == "sft"
    assert [s.name for s in plan.training_steps] == ["sft", "dpo", "grpo-format", "grpo-correctness"]


def test_force_names_steps_of_the_plan():
    plan = plan_for()
    plan.check_force(["data", "grpo-correctness"])
    with pytest.raises(ConfigError, match="--force grpo-bogus: not a step of smoke; steps: data, dpo, "):
        plan.check_force(["grpo-bogus"])
    with pytest.raises(ConfigError, match="eval-sft"):
        plan.check_force(["eval-sft"])  # evaluations are not forced: nothing downstream uses them


def _data(fp: str = "d") -> DataResult:
    return DataResult(data_dir="/data", train_fingerprint=f"train-{fp}", eval_fingerprint=f"eval-{fp}")


def test_walk_threads_model_and_data_through_the_steps(monkeypatch):
    from posttrain.models.artifacts import StageResult

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


def test_keys_after_an_unknown_output_are_unknown():
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


def test_keys_change_with_the_inputs():
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
def test_an_output_without_its_record_is_adopted_only_if_it_verifies(tmp_path, change, model_fp, expected):
    from posttrain.core.atomic import write_result
    from posttrain.core.hashing import fingerprint_tree
    from posttrain.pipeline.plan import Planner
    from posttrain.pipeline.records import StoreRecords
    from posttrain.pipeline.steps import EvalResult
    from posttrain.pipeline.store import Store

    plan = plan_for(f"orchestration.store={tmp_path / 'store'}")
    store = Store.at(tmp_path / "store")
    step = plan.step("eval-sft")
    inputs = StepInputs(ModelRef("model", model_fp), DataResult("data", "t", "e"))
    key = step.key(plan.config, inputs)
    out = step.output_dir(store, key)
    out.mkdir(parents=True)
    (out / "report.json").write_text('{"accuracy": 0.5}')
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


GSM8K_SET = "{name: gsm8k, data: local, path: %s, limit: 2}"

# (extra sets, does the data step's key change too): every change of an extra set changes the
# evaluations' keys; the data step's key changes when the questions training must not overlap change
EXTRA_SET_CASES = [
    ("[{name: synth, data: synthetic, limit: 3}]", True),  # a generated set: decontamination input
    ("[{name: synth, data: synthetic, limit: 4}]", True),  # more of its questions
    ("[{name: synth, data: synthetic, limit: 3, max_ops: 2}]", True),  # other questions
    ("[{name: synth, data: synthetic, limit: 3, max_new_tokens: 5}]", True),  # generation only (vs none)
    ("[{name: held, data: heldout, limit: 3}]", False),  # a slice of the held-out data: nothing new
    ("[{name: held2, data: heldout, limit: 3}]", False),  # renamed: its metrics and folder change
]


def test_extra_eval_sets_are_part_of_the_evaluation_keys(tmp_path):
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


def test_each_extra_set_gets_its_own_questions_and_generation_limit():
    from posttrain.pipeline.steps import _set_records

    cfg = load_config(
        SMOKE,
        [
            "eval.extra_sets=[{name: hard, data: synthetic, limit: 6, min_ops: 3, max_ops: 3, max_new_tokens: 5},"
            " {name: mixed, data: synthetic, limit: 6}]"
        ],
    )
    (primary_name, primary), (hard_name, hard), (_, mixed) = cfg.eval.all_sets()
    assert (primary_name, hard_name) == (None, "hard")
    assert primary.data == "heldout" and primary.extra_sets == [] and primary.max_new_tokens == 16
    assert hard.max_new_tokens == 5 and mixed.max_new_tokens == 16  # the primary's unless given
    assert {r["ops"] for r in _set_records(cfg, hard)} == {3}
    assert len(_set_records(cfg, mixed)) == 6 and {r["ops"] for r in _set_records(cfg, mixed)} <= {1, 2, 3, 4}
