"""In-training evaluation of GRPO stages (`eval_every`): schedule, scores, the held-out slice, a real stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, PipelineConfig, SyntheticConfig
from posttrain.generation.engine import Completion
from posttrain.training import eval_callback
from posttrain.training.eval_callback import EVAL_METRICS, HeldoutEval, heldout_slice

STRICT = "<reasoning>\n{}\n</reasoning>\n<answer>\n{}\n</answer>"


class FakeModel:
    """What the callback touches of a policy: its mode and generation config."""

    generation_config = None

    def __init__(self) -> None:
        self.training = True

    def eval(self):
        self.training = False
        return self

    def train(self, mode: bool = True):
        self.training = mode
        return self


def fake_trainer(tokenizer, model=None):
    return SimpleNamespace(
        processing_class=tokenizer,
        args=SimpleNamespace(chat_template_kwargs=None, max_completion_length=32),
        model=model or FakeModel(),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        rollout_func=None,
    )


def records(*answers):
    return [
        {"prompt": [{"role": "user", "content": f"question {i}?"}], "answer": a}
        for i, a in enumerate(answers)
    ]


@pytest.fixture
def logged(monkeypatch):
    """What the callback logs, by step (Trainer.log replaced; the state's step is read from the callback)."""
    rows: list[dict] = []
    monkeypatch.setattr(eval_callback.Trainer, "log", lambda trainer, logs: rows.append(dict(logs)))
    return rows


def answer_with(monkeypatch, tokenizer, texts, finished, seen=None):
    """Generation replaced: the i-th prompt is answered `texts[i]` (finished or cut off)."""

    def generate(model, prompts, **kwargs):
        if seen is not None:
            seen.append((model, [list(p) for p in prompts], kwargs))
        assert not model.training  # generated in eval mode
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return [Completion(tuple(i), f) for i, f in zip(ids, finished, strict=True)], SimpleNamespace(
            tokens_per_second=1.0
        )

    monkeypatch.setattr(eval_callback, "generate_continuous", generate)


def test_scores_each_answer_against_its_own_record(tiny_tokenizer, monkeypatch, logged):
    texts = [
        STRICT.format("6*7", "42"),  # right, strict format
        "so the answer is 7",  # right only by the last number
        STRICT.format("1+1", "3"),  # wrong
        STRICT.format("9", "9"),  # right but cut off at the token limit
    ]
    seen: list = []
    answer_with(monkeypatch, tiny_tokenizer, texts, [True, True, True, False], seen)
    trainer = fake_trainer(tiny_tokenizer)
    callback = HeldoutEval(trainer, records("42", "7", "2", "9"), every=5)
    callback.on_train_begin(None, SimpleNamespace(global_step=0, max_steps=10), None)
    assert logged == [dict(zip(EVAL_METRICS, (0.5, 0.75, 0.75, 0.25), strict=True))]
    model, prompt_ids, kwargs = seen[0]
    assert model is trainer.model and trainer.model.training  # train mode restored
    assert kwargs["max_new_tokens"] == 32 and kwargs["batch_size"] == 4 and kwargs.get("temperature", 0) == 0
    expected = tiny_tokenizer.apply_chat_template(
        records("42")[0]["prompt"], tokenize=False, add_generation_prompt=True
    )
    assert tiny_tokenizer.decode(prompt_ids[0]) == expected


def test_evaluates_at_the_start_every_n_steps_and_at_the_end(tiny_tokenizer, monkeypatch, logged):
    answer_with(monkeypatch, tiny_tokenizer, ["1"], [True])
    callback = HeldoutEval(fake_trainer(tiny_tokenizer), records("1"), every=3)
    state = SimpleNamespace(global_step=0, max_steps=7)
    callback.on_train_begin(None, state, None)
    for step in range(1, 8):
        state.global_step = step
        callback.on_step_end(None, state, None)
    assert [row["step"] for row in callback.history] == [0, 3, 6, 7]
    assert len(logged) == 4 and all(row["eval/accuracy_flexible"] == 1.0 for row in logged)


HELDOUT = [{"id": str(i), "ops": ops, "answer": str(i)} for i, ops in enumerate([1, 3, 2, 1, 4, 1])]


@pytest.mark.parametrize(
    "data_filter, limit, expected_ids",
    [
        ({}, 4, ["0", "1", "2", "3"]),  # no filter: the first N
        ({"max_ops": 1}, 2, ["0", "3"]),  # the stage's difficulty
        ({"min_ops": 2, "max_ops": 3}, 10, ["1", "2"]),  # fewer than the limit
        ({"min_ops": 7}, 3, ["0", "1", "2"]),  # none in range: the whole held-out slice
    ],
)
def test_heldout_slice_follows_the_stage_data_filter(data_filter, limit, expected_ids):
    from datasets import Dataset

    from posttrain.core.config import StageDataFilter

    rows = heldout_slice(Dataset.from_list(HELDOUT), StageDataFilter(**data_filter), limit)
    assert [r["id"] for r in rows] == expected_ids


@pytest.mark.parametrize("kind", [{}, {"pass_rate": {"samples": 2}, "rft": {}}], ids=["grpo", "rft"])
def test_a_stage_evaluates_itself_on_the_slice_in_its_operation_range(kind):
    """What the plan hands a GRPO or an rft: stage to evaluate itself on (an rft: stage's fine-tuning
    takes it as given): its slice's records in its data_filter range, however many its limit takes."""
    from datasets import Dataset

    from posttrain.core.config import GRPOStageConfig
    from posttrain.data.prepare import PreparedData
    from posttrain.pipeline.steps import in_training_records

    held = Dataset.from_list(HELDOUT)
    prepared = PreparedData(train=held, eval=held, stats={}, selection=held)
    stage = GRPOStageConfig(
        name="s",
        rewards=[{"name": "correctness"}],
        eval_every=1,
        data_filter={"max_ops": 1, "limit": 1},
        **kind,
    )
    assert list(in_training_records(prepared, stage, "grpo-s")["id"]) == ["0", "3", "5"]


def test_grpo_step_hands_the_held_out_split_to_stages_that_evaluate(tiny_tokenizer, tmp_path, monkeypatch):
    from posttrain.core.results import DataResult
    from posttrain.data.prepare import prepare_data
    from posttrain.pipeline.plan import GRPOStep
    from posttrain.pipeline.steps import ModelRef
    from posttrain.training import grpo

    data_cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=20), eval_size=5)
    prepare_data(data_cfg, tiny_tokenizer).save(tmp_path / "data")
    data = DataResult(str(tmp_path / "data"), "t", "e")
    calls = []
    monkeypatch.setattr(grpo, "run_grpo_stage", lambda *args, **kwargs: calls.append(kwargs))
    for every in (None, 2):
        stage = GRPOStageConfig(name="s", rewards=[{"name": "xml_count"}], eval_every=every)
        cfg = PipelineConfig(name="t", model={"name": "m"}, data=data_cfg, grpo={"stages": [stage]})
        GRPOStep(name="grpo-s").train(cfg, ModelRef("m", "fp"), data, tmp_path / "out", "none")
    assert calls[0]["heldout"] is None and len(calls[1]["heldout"]) == 5


# --------------------------------------------------------------------------- a real stage, tiny model


@pytest.fixture(scope="module")
def prepared(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=40, max_ops=2), eval_size=12)
    return prepare_data(cfg, tiny_tokenizer)


def by_length(completions, **kwargs):
    """A reward the random tiny model earns unevenly, so every step has a gradient."""
    return [len(c[0]["content"]) % 3 / 2 for c in completions]


def train(tiny_model_dir, prepared, tmp_path, monkeypatch, **options):
    from posttrain.training import grpo
    from posttrain.training.stage_run import StageContext

    monkeypatch.setattr(grpo, "build_reward_funcs", lambda specs: ([by_length], [1.0]))
    stage = GRPOStageConfig(
        name="ev",
        rewards=[{"name": "xml_count"}, {"name": "correctness"}],
        trainer={
            "max_steps": 3,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 8,
        },
        **options,
    )
    ctx = StageContext(stage="grpo-ev", work_dir=tmp_path, seed=0, report_to="none", precision="bf16")
    model_cfg = ModelConfig(name=str(tiny_model_dir), lora={"r": 4, "alpha": 8})
    trainer, monitor = grpo.make_grpo_trainer(
        stage, model_cfg, str(tiny_model_dir), prepared.train, ctx, heldout=prepared.eval
    )
    trainer.train()
    return trainer


def test_a_stage_logs_accuracy_by_step_and_trains_exactly_as_without(
    tiny_model_dir, prepared, tmp_path, monkeypatch
):
    with_eval = train(tiny_model_dir, prepared, tmp_path / "a", monkeypatch, eval_every=2, eval_limit=6)
    rows = [r for r in with_eval.state.log_history if "eval/accuracy" in r]
    assert [r["step"] for r in rows] == [0, 2, 3]
    assert all(set(EVAL_METRICS) <= set(r) and 0 <= r["eval/accuracy"] <= 1 for r in rows)
    without = train(tiny_model_dir, prepared, tmp_path / "b", monkeypatch)
    assert not [r for r in without.state.log_history if "eval/accuracy" in r]

    def training_rows(trainer):
        return [
            (r["step"], r["reward"], r.get("grad_norm")) for r in trainer.state.log_history if "reward" in r
        ]

    assert training_rows(with_eval) == training_rows(without)
    assert any(norm for _, _, norm in training_rows(without))  # there was something to learn
    for (name, a), b in zip(with_eval.model.named_parameters(), without.model.parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a, b), name
