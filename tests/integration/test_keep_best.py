"""`keep: best`: a stage's output is the checkpoint that scored best on the selection slice, never the
evaluation set; early stopping; the slice itself. Tiny model, a few steps per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SFTStageConfig, SyntheticConfig
from posttrain.models.artifacts import read_stage_json
from posttrain.training import eval_callback
from posttrain.training.eval_callback import HeldoutEval

SYNTHETIC = SyntheticConfig(num_examples=48, max_ops=2)


@pytest.fixture(scope="module")
def prepared(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    return prepare_data(DataConfig(synthetic=SYNTHETIC, eval_size=8, selection_size=6), tiny_tokenizer)


@pytest.fixture
def scripted(monkeypatch):
    """The in-training accuracy made to follow a script by step, and the policy's weights at each
    evaluation: what the stage's output can then be compared with."""
    return scripted_again(monkeypatch, {})


def scripted_again(monkeypatch, script: dict[int, float]):
    weights: dict[int, dict[str, torch.Tensor]] = {}
    real_model = HeldoutEval._generation_model
    real_score = eval_callback.score_answers
    current = {}

    def generation_model(self, step):
        from peft import PeftModel, get_peft_model_state_dict

        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        state = get_peft_model_state_dict(policy) if isinstance(policy, PeftModel) else policy.state_dict()
        weights[step] = {k: v.detach().clone() for k, v in state.items()}
        current["step"] = step
        return real_model(self, step)

    def score(texts, golds, finished):
        metrics = real_score(texts, golds, finished)
        return {**metrics, "eval/accuracy": script[current["step"]]}

    monkeypatch.setattr(HeldoutEval, "_generation_model", generation_model)
    monkeypatch.setattr(eval_callback, "score_answers", score)
    return script, weights


class Killed(BaseException):
    """Stands in for SIGKILL."""


def kill_after_checkpoint(monkeypatch, step: int) -> None:
    """Die right after the checkpoint of ``step`` is written (the evaluation callback's ``on_save``)."""

    def die(self, args, state, control, **kwargs):
        if state.global_step == step:
            raise Killed

    monkeypatch.setattr(HeldoutEval, "on_save", die, raising=False)


def sft(tiny_model_dir, prepared, out: Path, **selection):
    from posttrain.training.sft import run_sft

    cfg = SFTStageConfig(
        trainer={
            "max_steps": selection.pop("max_steps", 4),
            "per_device_train_batch_size": 4,
            "learning_rate": 5e-3,
        },
        eval_every=1,
        eval_limit=4,
        **selection,
    )
    model_cfg = ModelConfig(name=str(tiny_model_dir), lora=None, precision="fp32")
    return run_sft(
        cfg,
        model_cfg,
        tiny_model_dir,
        prepared.train,
        out,
        selection=prepared.selection,
        eval_max_new_tokens=8,
    )


def saved_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def same(saved: dict[str, torch.Tensor], snapshot: dict[str, torch.Tensor]) -> bool:
    shared = [k for k in saved if k in snapshot]
    assert len(shared) > 5
    return all(torch.equal(saved[k], snapshot[k]) for k in shared)


def test_keep_best_outputs_the_peak_checkpoint_and_records_its_step(
    tiny_model_dir, prepared, tmp_path, scripted
):
    script, weights = scripted
    script.update({0: 0.1, 1: 0.3, 2: 0.6, 3: 0.4, 4: 0.2})  # peaks early, then falls
    result = sft(tiny_model_dir, prepared, tmp_path / "best", keep="best")
    out = Path(result.output_dir)
    assert not same(weights[2], weights[4])  # training moved the weights after the peak
    assert same(saved_weights(out), weights[2]) and not same(saved_weights(out), weights[4])
    chosen = read_stage_json(out)["selection"]
    assert (chosen["best_step"], chosen["best_score"], chosen["last_step"]) == (2, 0.6, 4)
    assert chosen["scores"] == [[0, 0.1], [1, 0.3], [2, 0.6], [3, 0.4], [4, 0.2]]
    assert chosen["select_metric"] == "accuracy" and chosen["questions"] == 4 and not chosen["stopped_early"]
    assert (result.metrics["selected_step"], result.metrics["selected_score"]) == (2, 0.6)  # MLflow metrics
    assert chosen["beat_input"] is True


@pytest.mark.parametrize(
    "script", [{0: 0.5, 1: 0.5, 2: 0.5}, {0: 0.5, 1: 0.25, 2: 0.25}], ids=["flat", "worse"]
)
def test_a_selection_that_never_beats_the_input_says_so(
    tiny_model_dir, prepared, tmp_path, scripted, script, caplog
):
    scripted[0].update(script)
    with caplog.at_level("WARNING", logger="posttrain.training.selection"):
        result = sft(tiny_model_dir, prepared, tmp_path / "flat", keep="best", max_steps=2)
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert (chosen["best_step"], chosen["beat_input"]) == (1, False)  # the first of equals
    assert "no checkpoint scored above the stage's input on the 4 selection questions" in caplog.text


def test_keep_last_outputs_the_last_step(tiny_model_dir, prepared, tmp_path, scripted):
    script, weights = scripted
    script.update({0: 0.1, 1: 0.3, 2: 0.6, 3: 0.4, 4: 0.2})
    result = sft(tiny_model_dir, prepared, tmp_path / "last")  # still evaluates, keeps the last
    assert same(saved_weights(Path(result.output_dir)), weights[4])
    assert (
        "selection" not in read_stage_json(Path(result.output_dir)) and "selected_step" not in result.metrics
    )


def test_patience_stops_after_evaluations_without_a_new_best(tiny_model_dir, prepared, tmp_path, scripted):
    script, weights = scripted
    script.update({0: 0.0, 1: 0.5, 2: 0.5, 3: 0.4, 4: 0.9, 5: 0.9, 6: 0.9})  # a tie is no improvement
    result = sft(tiny_model_dir, prepared, tmp_path / "stop", keep="best", patience=2, max_steps=6)
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert (chosen["best_step"], chosen["last_step"], chosen["stopped_early"]) == (1, 3, True)
    assert sorted(weights) == [0, 1, 2, 3]  # steps 4-6 never ran
    assert same(saved_weights(Path(result.output_dir)), weights[1])


def test_a_resumed_stage_still_outputs_the_best_checkpoint_from_before_the_kill(
    tiny_model_dir, prepared, tmp_path, scripted, monkeypatch
):
    """Killed right after step 3's checkpoint, the stage resumes from it and still outputs step 2's
    weights: the best checkpoint survives the working folder's tidying and the trainer state remembers it."""
    script, weights = scripted
    script.update({0: 0.1, 1: 0.3, 2: 0.6, 3: 0.4, 4: 0.2})

    kill_after_checkpoint(monkeypatch, 3)
    with pytest.raises(Killed):
        sft(tiny_model_dir, prepared, tmp_path / "resume", keep="best")
    work = tmp_path / "resume.ckpt"
    assert sorted(p.name for p in work.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    monkeypatch.undo()  # the scripted accuracy too: set it up again, keeping the weights seen so far
    step_2 = weights[2]
    script, weights = scripted_again(monkeypatch, script)
    result = sft(tiny_model_dir, prepared, tmp_path / "resume", keep="best")
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert result.metrics["resumed_from_step"] == 3 and chosen["best_step"] == 2
    assert [s for s, _ in chosen["scores"]] == [0, 1, 2, 3, 3, 4]  # the resumed run re-evaluates its start
    assert same(saved_weights(Path(result.output_dir)), step_2)
    assert not (tmp_path / "resume.ckpt").exists()  # finished: the checkpoints are gone


def test_prepare_work_dir_keeps_the_best_checkpoint_beside_the_newest(tmp_path):
    from posttrain.training.stage_run import prepare_work_dir

    for step, best in ((2, None), (4, 2), (6, 2)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        state = {
            "global_step": step,
            "best_model_checkpoint": str(tmp_path / f"checkpoint-{best}") if best else None,
        }
        (folder / "trainer_state.json").write_text(json.dumps(state))
    assert prepare_work_dir(tmp_path) == (str(tmp_path / "checkpoint-6"), 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6"]


def by_length(completions, **kwargs):
    """A reward the random tiny model earns unevenly, so every step has a gradient."""
    return [len(c[0]["content"]) % 3 / 2 for c in completions]


def test_a_grpo_stage_keeps_its_best_checkpoint(tiny_model_dir, prepared, tmp_path, scripted, monkeypatch):
    from posttrain.training import grpo

    monkeypatch.setattr(grpo, "build_reward_funcs", lambda specs: ([by_length], [1.0]))
    script, weights = scripted
    script.update({0: 0.0, 1: 0.7, 2: 0.2, 3: 0.1})
    stage = GRPOStageConfig(
        name="g",
        rewards=[{"name": "xml_count"}],
        trainer={
            "max_steps": 3,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 8,
            "learning_rate": 1e-2,
        },
        eval_every=1,
        eval_limit=4,
        keep="best",
        select_metric="accuracy",
    )
    model_cfg = ModelConfig(name=str(tiny_model_dir), lora={"r": 4, "alpha": 8}, adapter_policy="adapter")
    result = grpo.run_grpo_stage(
        stage, model_cfg, tiny_model_dir, prepared.train, tmp_path / "g", heldout=prepared.selection
    )
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert (chosen["best_step"], chosen["best_score"], chosen["last_step"]) == (1, 0.7, 3)
    assert result.metrics["selected_step"] == 1
    from safetensors.torch import load_file

    adapter = load_file(str(Path(result.output_dir) / "adapter_model.safetensors"))
    assert not same(weights[1], weights[3])  # training moved the adapter after step 1
    assert same(adapter, weights[1]) and not same(adapter, weights[3])


# --------------------------------------------------------------------------- the selection slice


def test_the_selection_slice_never_overlaps_the_evaluation_set(tiny_tokenizer, tmp_path):
    """Asserted on ids: the selection slice is cut from the training records after the held-out split,
    and decontaminated against an external evaluation set made of the same questions."""
    from posttrain.data.prepare import prepare_data
    from posttrain.data.synthetic import generate_problems

    cfg = DataConfig(synthetic=SyntheticConfig(num_examples=60, max_ops=2), eval_size=10, selection_size=12)
    # by construction, not only by the decontamination that also guards it
    for decontamination in (8, None):
        prepared = prepare_data(
            cfg.model_copy(update={"decontamination_ngram": decontamination}), tiny_tokenizer
        )
        slices = (prepared.selection, prepared.eval, prepared.train)
        selection, heldout, train = ({r["id"] for r in ds} for ds in slices)
        assert len(selection) == 12 and len(heldout) == 10
        assert not selection & heldout and not selection & train and not heldout & train
        assert prepared.stats["selection"] == 12 and prepared.stats["selection_fingerprint"]

    # an external evaluation set drawn from the same generator: its questions are the training
    # records' own, so decontamination must take every shared one out of the selection slice
    external = generate_problems(60, max_ops=2, seed=0)[:30]
    with_external = prepare_data(cfg, tiny_tokenizer, eval_questions=[r["question"] for r in external])
    chosen = {r["id"] for r in with_external.selection}
    assert not chosen & {r["id"] for r in external}
    assert with_external.stats["selection_decontaminated"] > 0


def test_the_selection_slice_is_saved_loaded_and_optional(tiny_tokenizer, tmp_path):
    from posttrain.data.prepare import PreparedData, prepare_data

    prepared = prepare_data(DataConfig(synthetic=SYNTHETIC, eval_size=8, selection_size=6), tiny_tokenizer)
    prepared.save(tmp_path / "with")
    loaded = PreparedData.load(tmp_path / "with")
    assert loaded.selection["id"] == prepared.selection["id"]
    assert loaded.selection._fingerprint == prepared.stats["selection_fingerprint"]
    plain = prepare_data(DataConfig(synthetic=SYNTHETIC, eval_size=8), tiny_tokenizer)
    plain.save(tmp_path / "without")
    assert plain.selection is None and PreparedData.load(tmp_path / "without").selection is None
    assert "selection" not in plain.stats
    # the slice comes out of the training records, and only out of them
    assert len(prepared.train) == len(plain.train) - 6 and prepared.eval["id"] == plain.eval["id"]


def test_check_disjoint_refuses_a_shared_id():
    from posttrain.core.errors import DataError
    from posttrain.data.prepare import check_disjoint

    with pytest.raises(DataError, match="shares 1 id"):
        check_disjoint([{"id": "q1"}, {"id": "q2"}], heldout=[{"id": "q2"}])


def test_a_resumed_stage_keeps_counting_towards_its_patience(
    tiny_model_dir, prepared, tmp_path, scripted, monkeypatch
):
    """Patience 2: step 2 ties the best (one evaluation without a new best), step 3 is lower (two):
    the stage stops at step 3 with step 1's weights. Killed after step 2's checkpoint, it resumes
    with that count of one, and stops at step 3 as well, rather than training on to step 4's peak."""
    script, _ = scripted
    script.update({0: 0.0, 1: 0.5, 2: 0.5, 3: 0.4, 4: 0.9, 5: 0.9, 6: 0.9})

    kill_after_checkpoint(monkeypatch, 2)
    with pytest.raises(Killed):
        sft(tiny_model_dir, prepared, tmp_path / "resume", keep="best", patience=2, max_steps=6)
    monkeypatch.undo()
    scripted_again(monkeypatch, script)
    result = sft(tiny_model_dir, prepared, tmp_path / "resume", keep="best", patience=2, max_steps=6)
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert result.metrics["resumed_from_step"] == 2
    assert (chosen["best_step"], chosen["last_step"], chosen["stopped_early"]) == (1, 3, True)


def test_an_early_stopped_stage_killed_while_writing_its_output_outputs_the_same_best(
    tiny_model_dir, prepared, tmp_path, scripted, monkeypatch
):
    """Stopped early at step 3 (patience 2) and killed while writing: the rerun trains nothing more
    and outputs step 1's weights, as the uninterrupted run does."""
    from posttrain.training import stage_run

    script, weights = scripted
    script.update({0: 0.0, 1: 0.5, 2: 0.5, 3: 0.4, 4: 0.9, 5: 0.9, 6: 0.9})

    def die(*args, **kwargs):
        raise Killed

    save = stage_run.save_policy
    monkeypatch.setattr(stage_run, "save_policy", die)
    with pytest.raises(Killed):
        sft(tiny_model_dir, prepared, tmp_path / "stop", keep="best", patience=2, max_steps=6)
    step_1 = weights[1]
    monkeypatch.setattr(stage_run, "save_policy", save)
    result = sft(tiny_model_dir, prepared, tmp_path / "stop", keep="best", patience=2, max_steps=6)
    chosen = read_stage_json(Path(result.output_dir))["selection"]
    assert (chosen["best_step"], chosen["last_step"], chosen["stopped_early"]) == (1, 3, True)
    assert 4 not in weights  # step 4 never ran
    assert same(saved_weights(Path(result.output_dir)), step_1)
