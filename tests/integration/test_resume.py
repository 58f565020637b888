"""Resuming a stage from its checkpoint, in-process on the tiny model: a stage that dies after step k
and is run again ends exactly where an uninterrupted run ends (same steps, same losses, same weights),
and the checkpoint bookkeeping around it (tests/system/test_faults.py kills real processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from posttrain.core.atomic import CHECKPOINTS_SUFFIX, checkpoints_dir
from posttrain.core.config import (
    DataConfig,
    DPOStageConfig,
    GRPOStageConfig,
    ModelConfig,
    SFTStageConfig,
    SyntheticConfig,
)
from posttrain.training.stage_run import last_checkpoint, prepare_work_dir

LORA = {"r": 4, "alpha": 8}
EVERY_STEP = {"max_steps": 3, "save_steps": 1, "learning_rate": 1e-3}


class Killed(BaseException):
    """Stands in for SIGKILL: raised right after a checkpoint is complete."""


def killed_after(step: int, run, out: Path, monkeypatch) -> None:
    """``run(out)`` killed right after the checkpoint of ``step`` is complete."""
    from transformers import Trainer

    save = Trainer._save_checkpoint

    def save_then_die(self, model, trial):
        save(self, model, trial)
        if self.state.global_step == step:
            raise Killed

    monkeypatch.setattr(Trainer, "_save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        run(out)
    monkeypatch.setattr(Trainer, "_save_checkpoint", save)


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=32, max_ops=3), eval_size=4)
    return prepare_data(cfg, tiny_tokenizer).train


def stage_runner(kind: str, tiny_model_dir: Path, data):
    """``run(output_dir)`` for a 3-step stage of ``kind`` that checkpoints every step."""
    model = ModelConfig(name=str(tiny_model_dir), lora=LORA, precision="fp32")
    if kind == "sft":
        from posttrain.training.sft import run_sft

        cfg = SFTStageConfig(limit=12, trainer={**EVERY_STEP, "per_device_train_batch_size": 2})
        return lambda out: run_sft(cfg, model, tiny_model_dir, data, out)
    if kind == "dpo":
        from posttrain.training.dpo import run_dpo

        trainer = {**EVERY_STEP, "per_device_train_batch_size": 1, "max_length": 256}
        cfg = DPOStageConfig(num_prompts=4, num_generations=2, max_completion_length=8, trainer=trainer)
        return lambda out: run_dpo(cfg, model, tiny_model_dir, data, out)
    from posttrain.training.grpo import run_grpo_stage

    cfg = GRPOStageConfig(
        name="r",
        rewards=[{"name": "test_resume:distinct_characters"}],
        trainer={
            **EVERY_STEP,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 12,
        },
    )
    return lambda out: run_grpo_stage(cfg, model, tiny_model_dir, data, out)


def distinct_characters(completions, **kwargs):
    """A reward that tells random completions apart (the built-in ones score them all alike), so
    GRPO's advantages and gradients are not zero."""
    return [len(set(c[0]["content"])) / 10 for c in completions]


# Timings differ between runs; the final row's train_loss averages only the steps of the last
# train() call (transformers' choice when resuming).
NOT_COMPARED = {"step_time", "train_runtime", "train_loss", "pass_rate/refresh_seconds"}


def history(result) -> list[dict]:
    """The stage's log history without timings (every loss, reward, grad norm, learning rate, ...)."""
    lines = (Path(result.output_dir) / "log_history.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [{k: v for k, v in row.items() if k not in NOT_COMPARED and "per_second" not in k} for row in rows]


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_a_stage_killed_after_a_checkpoint_resumes_to_the_same_end(
    kind, tiny_model_dir, data, tmp_path, monkeypatch
):

    from posttrain.rewards.registry import CUSTOM_CODE_ENV

    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")  # this module's reward
    run = stage_runner(kind, tiny_model_dir, data)
    uninterrupted = run(tmp_path / "whole")

    killed_after(1, run, tmp_path / "resumed", monkeypatch)
    work = checkpoints_dir(tmp_path / "resumed")
    assert last_checkpoint(work) == (work / "checkpoint-1", 1) and not (tmp_path / "resumed").exists()
    if kind == "dpo":  # the pairs the first run sampled are reused: no sampling on resume
        monkeypatch.setattr(
            "posttrain.training.dpo.sample_completions", lambda *a, **k: pytest.fail("resampled")
        )

    started = time.perf_counter()
    resumed = run(tmp_path / "resumed")
    this_run = time.perf_counter() - started
    assert any(row.get("grad_norm") for row in history(uninterrupted))  # it did learn something
    # its minutes include those spent up to the checkpoint before the kill
    assert resumed.duration_s > this_run
    assert resumed.metrics["resumed_from_step"] == 1 and "resumed_from_step" not in uninterrupted.metrics
    assert resumed.metrics["global_step"] == uninterrupted.metrics["global_step"] == 3
    # The same batches in the same order from the same optimizer state: equal logs, equal weights.
    assert history(resumed) == history(uninterrupted)
    assert resumed.fingerprints["output"] == uninterrupted.fingerprints["output"]
    assert not work.exists()  # checkpoints go once the output is in place
    if kind == "grpo":  # sampling resumed from the saved RNG state: the same completions were drawn
        import pandas as pd

        assert resumed.samples == uninterrupted.samples
        for name in resumed.samples:
            a, b = (pd.read_parquet(Path(r.output_dir) / name) for r in (resumed, uninterrupted))
            assert a["completion"].tolist() == b["completion"].tolist()


def write_checkpoint(folder: Path, step: int, state: str | None = None) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "optimizer.pt").write_bytes(b"x")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_only_a_complete_checkpoint_is_resumed_from(tmp_path):
    work = tmp_path / f"sft-abc{CHECKPOINTS_SUFFIX}"
    assert last_checkpoint(work) is None
    two = write_checkpoint(work, 2, json.dumps({"global_step": 2}))
    write_checkpoint(work, 3, '{"global_step": 3, "log_hi')  # killed while writing its state
    write_checkpoint(work, 4)  # killed before its state
    write_checkpoint(work, 5, json.dumps({"global_step": 4}))  # not this checkpoint's state
    assert last_checkpoint(work) == (two, 2)
    (work / "completions").mkdir()
    assert prepare_work_dir(work) == (str(two), 2)
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint-2", "completions"]


def test_a_checkpoint_without_the_files_its_trainer_writes_after_the_state_is_not_complete(tmp_path):
    """TRL's GRPO with use_adaptive_entropy writes entropy_ctrl_state.json after the trainer state: a
    kill in between leaves a checkpoint whose resume would restart the coefficient."""
    from posttrain.training.stage_run import late_checkpoint_files

    work = tmp_path / "grpo.ckpt"
    required = late_checkpoint_files({"use_adaptive_entropy": True})
    assert required == ("entropy_ctrl_state.json",) and late_checkpoint_files({}) == ()
    one = write_checkpoint(work, 1, json.dumps({"global_step": 1}))
    (one / "entropy_ctrl_state.json").write_text('{"entropy_coef": 0.01, "last_world_entropy": 1.0}')
    write_checkpoint(work, 2, json.dumps({"global_step": 2}))  # killed before the file
    three = write_checkpoint(work, 3, json.dumps({"global_step": 3}))
    (three / "entropy_ctrl_state.json").write_text('{"entropy_coef": 0.0')  # killed while writing it
    assert last_checkpoint(work, required) == (one, 1)
    assert last_checkpoint(work) == (three, 3)  # without the option the state file is enough


def test_a_working_folder_without_a_checkpoint_starts_empty(tmp_path):
    work = tmp_path / "sft.ckpt"
    write_checkpoint(work, 1)
    (work / "completions").mkdir()
    assert prepare_work_dir(work) == (None, 0)
    assert list(work.iterdir()) == []


def pool_stage_runner(tiny_model_dir: Path, data):
    """``run(output_dir)`` for a 4-step GRPO stage whose pass-rate pool (16 prompts at 2 of 4) is
    refreshed every step: the random model solves nothing, so each refresh retires the pool prompts
    it scores, and later batches train fresh prompts in their place."""
    from posttrain.core.config import PassRateConfig
    from posttrain.data.pass_rates import PassRates
    from posttrain.training.grpo import run_grpo_stage

    rates = PassRates(4, {str(pid): 2 for pid in data["id"][:16]})
    cfg = GRPOStageConfig(
        name="pool",
        rewards=[{"name": "test_resume:distinct_characters"}],
        pass_rate=PassRateConfig(samples=4, refresh_every=1, refresh_size=8),
        zero_signal="drop",
        zero_signal_retire_after=2,
        trainer={
            **EVERY_STEP,
            "max_steps": 4,
            "per_device_train_batch_size": 4,
            "num_generations": 2,
            "max_completion_length": 12,
        },
    )
    model = ModelConfig(name=str(tiny_model_dir), lora=LORA, precision="fp32")
    return lambda out: run_grpo_stage(cfg, model, tiny_model_dir, data, out, pass_rates=rates)


def test_a_stage_that_retires_prompts_resumes_with_them_retired(tiny_model_dir, data, tmp_path, monkeypatch):
    """Killed after step 2, a stage whose refreshes retired prompts (and drew fresh ones in their
    place) resumes with the same pool, the same retired prompts and the same place in the fresh
    order: every later batch, loss and weight is the uninterrupted run's."""

    from posttrain.rewards.registry import CUSTOM_CODE_ENV
    from posttrain.training.trl_compat import _dynamic_sampling_trainer

    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    trainer_class = _dynamic_sampling_trainer()
    generate = trainer_class._posttrain_generate
    batches: list[tuple[int, list[str]]] = []

    def spy(self, inputs):
        batches.append((self.state.global_step, [str(row["id"]) for row in inputs]))
        return generate(self, inputs)

    monkeypatch.setattr(trainer_class, "_posttrain_generate", spy)
    run = pool_stage_runner(tiny_model_dir, data)
    uninterrupted = run(tmp_path / "whole")
    whole_batches, batches[:] = list(batches), []

    killed_after(2, run, tmp_path / "resumed", monkeypatch)
    batches[:] = []
    resumed = run(tmp_path / "resumed")

    assert resumed.metrics["resumed_from_step"] == 2
    replaced = [row for row in history(uninterrupted) if row.get("zero_signal/groups_replaced")]
    assert [row["step"] for row in replaced if row["step"] > 2], "retired prompts were swapped after step 2"
    assert batches == [b for b in whole_batches if b[0] >= 2]  # steps 3 and 4 drew the same prompts
    assert history(resumed) == history(uninterrupted)
    assert resumed.fingerprints["output"] == uninterrupted.fingerprints["output"]


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_a_stage_killed_while_writing_its_output_is_not_trained_again(
    kind, tiny_model_dir, data, tmp_path, monkeypatch
):
    """The last checkpoint is complete and the kill comes while the output is written: the rerun
    trains no step (the trainer alone would train a fourth) and writes the uninterrupted output."""
    from posttrain.rewards.registry import CUSTOM_CODE_ENV
    from posttrain.training import stage_run

    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    run = stage_runner(kind, tiny_model_dir, data)
    uninterrupted = run(tmp_path / "whole")
    save = stage_run.save_policy

    def die(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(stage_run, "save_policy", die)
    with pytest.raises(Killed):
        run(tmp_path / "resumed")
    monkeypatch.setattr(stage_run, "save_policy", save)
    resumed = run(tmp_path / "resumed")
    assert resumed.metrics["resumed_from_step"] == 3 and resumed.metrics["global_step"] == 3
    steps = [row for row in history(resumed) if "loss" in row]
    assert steps == [row for row in history(uninterrupted) if "loss" in row]
    assert resumed.fingerprints["output"] == uninterrupted.fingerprints["output"]
