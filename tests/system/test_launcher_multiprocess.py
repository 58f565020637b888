"""SFT, DPO and a GRPO stage trained by 2 processes on the CPU (`launch.launcher: accelerate` with
configs/accelerate/cpu.yaml: torchrun + gloo on 127.0.0.1, a free port), each against a 1-process run
with the same global batch (2 x 2 vs 1 x 4).

Each rank records a hash of every sequence its training forward passes see
(``POSTTRAIN_RECORD_INPUTS``, posttrain.training.distributed): the two ranks must see different
sequences, and for SFT and DPO (deterministic data) together exactly the 1-process run's.

Saving a sharded policy (FSDP2) is checked with torch's ``fully_shard`` on the CPU
(tests/system/fsdp2_save_worker.py): accelerate 1.x never turns FSDP on for a CPU run, so a stage cannot
train under FSDP2 here (posttrain.pipeline.launcher refuses such a config).
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.core.config import PipelineConfig
from posttrain.core.errors import StageError
from posttrain.core.processes import stop_process_group
from posttrain.models.artifacts import read_stage_json
from posttrain.models.loading import load_stage_model
from posttrain.pipeline.launcher import CPU_ACCELERATE_CONFIG
from posttrain.pipeline.plan import StepInputs, build_plan
from posttrain.pipeline.steps import ModelRef, base_model, load_data, prepare_step
from posttrain.training.distributed import RECORD_INPUTS_ENV

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
LOSS_TOLERANCE = 1e-5
"""Relative difference allowed between the 2-process and the 1-process loss at each step (fp32: the
two runs differ only in how gradients are summed: gloo's all-reduce of two halves vs one batch),
with two orders of magnitude of room over the differences that summing order makes."""
STEPS = 3


@pytest.fixture(autouse=True)
def loopback(monkeypatch, caplog):
    # Every line the ranks print is logged at INFO by the launcher; keeping them makes a failed
    # launch's report show the failing rank's own error, not only torchrun's summary of it.
    caplog.set_level(logging.INFO, logger="posttrain.pipeline.launcher")
    monkeypatch.chdir(REPO)  # configs/accelerate/cpu.yaml is read relative to the working directory
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the launcher picks a free port itself
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def config(tiny_model_dir, tmp_path, section: str, stage: dict, launcher: str) -> PipelineConfig:
    raw = {
        "name": "mp",
        "seed": 3,
        "model": {"name": str(tiny_model_dir), "precision": "fp32"},
        "data": {"source": "synthetic", "synthetic": {"num_examples": 40, "max_ops": 2}, "eval_size": 4},
        "orchestration": {"store": str(tmp_path / "store")},
        "launch": {"launcher": launcher, "accelerate_config": CPU_ACCELERATE_CONFIG},
    }
    if section == "grpo":
        raw["grpo"] = {"stages": [stage]}
    else:
        raw[section] = stage
    return PipelineConfig.model_validate(raw)


def train(cfg: PipelineConfig, step: str, out: Path, records: Path, monkeypatch):
    monkeypatch.setenv(RECORD_INPUTS_ENV, str(records))
    model = base_model(cfg)
    data = prepare_step(cfg, model, out.parent / f"data-{out.name}")
    return build_plan(cfg).step(step).run(cfg, StepInputs(model, data), str(out))


def seen(records: Path, rank: int) -> list[list[str]]:
    """Per training forward of one rank: the hashes of the sequences in it."""
    path = records / f"rank{rank}.jsonl"
    return [json.loads(line)["rows"] for line in path.read_text().splitlines()]


def losses(output_dir: str) -> list[float]:
    rows = [json.loads(line) for line in (Path(output_dir) / "log_history.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and "train_runtime" not in row]


def two_and_one(tiny_model_dir, tmp_path, monkeypatch, section, step, stage_for):
    """(2-process result, its records folder, 1-process result, its records folder)."""
    two = config(tiny_model_dir, tmp_path, section, stage_for(2), "accelerate")
    one = config(tiny_model_dir, tmp_path, section, stage_for(4), "inprocess")
    result2 = train(two, step, tmp_path / "two", tmp_path / "rec2", monkeypatch)
    result1 = train(one, step, tmp_path / "one", tmp_path / "rec1", monkeypatch)
    return result2, tmp_path / "rec2", result1, tmp_path / "rec1"


def assert_same_curve(result2, result1) -> list[float]:
    """Both ran STEPS optimizer steps; the loss curves agree within LOSS_TOLERANCE; returns the
    relative differences (printed by pytest -s for the record)."""
    assert result2.metrics["global_step"] == result1.metrics["global_step"] == STEPS
    curve2, curve1 = losses(result2.output_dir), losses(result1.output_dir)
    assert len(curve2) == len(curve1) == STEPS
    diffs = [abs(a - b) / max(abs(b), 1e-8) for a, b in zip(curve2, curve1, strict=True)]
    print(f"loss 2 processes {curve2}\nloss 1 process   {curve1}\nrelative diff    {diffs}")
    assert max(diffs) <= LOSS_TOLERANCE, (curve2, curve1)
    return diffs


def assert_loads(result) -> None:
    model, _ = load_stage_model(result.output_dir)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert read_stage_json(result.output_dir)["metrics"]["global_step"] == STEPS


def test_sft_on_two_processes_matches_one(tiny_model_dir, tmp_path, monkeypatch):
    def stage(batch):
        return {"trainer": {"max_steps": STEPS, "per_device_train_batch_size": batch, "logging_steps": 1}}

    result2, rec2, result1, rec1 = two_and_one(tiny_model_dir, tmp_path, monkeypatch, "sft", "sft", stage)
    rank0, rank1, single = seen(rec2, 0), seen(rec2, 1), seen(rec1, 0)
    assert len(rank0) == len(rank1) == len(single) == STEPS  # one training forward per step and rank
    assert all(len(rows) == 2 for rows in rank0 + rank1)
    # Different halves of every global batch, together the 1-process batch.
    for step in range(STEPS):
        assert not set(rank0[step]) & set(rank1[step])
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])
    assert_same_curve(result2, result1)
    assert_loads(result2)
    assert not (tmp_path / "two.ckpt").exists()  # rank 0 cleaned up as in process


def test_dpo_on_two_processes_matches_one(tiny_model_dir, tmp_path, monkeypatch):
    def stage(batch):
        return {
            "num_prompts": 12,
            "num_generations": 2,
            "max_completion_length": 8,
            "trainer": {"max_steps": STEPS, "per_device_train_batch_size": batch, "logging_steps": 1},
        }

    result2, rec2, result1, rec1 = two_and_one(tiny_model_dir, tmp_path, monkeypatch, "dpo", "dpo", stage)
    # Rank 0 sampled the pairs once; both ranks trained on the same pairs file as the 1-process run.
    pairs = [(Path(r.output_dir) / "dpo_pairs.jsonl").read_text() for r in (result2, result1)]
    assert pairs[0] == pairs[1]
    rank0, rank1, single = seen(rec2, 0), seen(rec2, 1), seen(rec1, 0)
    assert len(rank0) == len(rank1) == len(single) == STEPS
    for step in range(STEPS):
        assert not set(rank0[step]) & set(rank1[step])
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])
    assert_same_curve(result2, result1)
    assert_loads(result2)


def test_grpo_on_two_processes(tiny_model_dir, tmp_path, monkeypatch):
    """GRPO samples its completions on each rank with that rank's seed, so the two runs do not see
    the same completions and their losses are not comparable step by step; the check is that the
    ranks trained on different completions of the same prompts, for the configured steps."""

    def stage(batch):
        return {
            "name": "fmt",
            "rewards": [{"name": "xml_count"}],
            "trainer": {
                "max_steps": STEPS,
                "per_device_train_batch_size": batch,
                "num_generations": 4,
                "max_completion_length": 8,
                "logging_steps": 1,
            },
        }

    # 4 completions per rank: TRL's load-time check of the options assumes one process, where a
    # generation batch of 2 x 1 would not hold a group of 4.
    cfg = config(tiny_model_dir, tmp_path, "grpo", stage(4), "accelerate")
    result = train(cfg, "grpo-fmt", tmp_path / "two", tmp_path / "rec2", monkeypatch)
    rank0, rank1 = seen(tmp_path / "rec2", 0), seen(tmp_path / "rec2", 1)
    assert result.metrics["global_step"] == STEPS
    assert len(rank0) == len(rank1) >= STEPS
    for a, b in zip(rank0, rank1, strict=True):
        assert not set(a) & set(b)
    curve = losses(result.output_dir)
    assert len(curve) == STEPS and all(math.isfinite(x) for x in curve)
    assert_loads(result)


def test_grpo_on_two_processes_keeps_one_prompt_pool(tiny_model_dir, tmp_path, monkeypatch):
    """Resample, retiring and a pool refresh on 2 processes: the random model solves nothing, so
    every group is flat, resample rounds run, prompts retire and the refresh sends pool prompts
    away. Both ranks record the same pool decisions at every step (they decide on the whole
    batch), so they trained one pool."""
    from posttrain.core.results import ScoreResult
    from posttrain.data.pass_rates import PassRates

    stage = {
        "name": "pool",
        "rewards": [{"name": "correctness"}],
        "zero_signal": "resample",
        "zero_signal_max_rounds": 1,
        "zero_signal_retire_after": 1,
        "pass_rate": {"samples": 4, "refresh_every": 1, "refresh_size": 4},
        "trainer": {
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,  # 2 groups on each rank
            "num_generations": 2,
            "max_completion_length": 6,
            "logging_steps": 1,
        },
    }
    cfg = config(tiny_model_dir, tmp_path, "grpo", stage, "accelerate")
    data = prepare_step(cfg, base_model(cfg), tmp_path / "data")
    scores = tmp_path / "scores"
    ids = load_data(data).train["id"][:12]
    scores.mkdir()
    PassRates(4, {str(pid): 2 for pid in ids}).save(scores)
    scored = ScoreResult("grpo-pool", str(scores), {}, model_fingerprint="")
    monkeypatch.setenv(RECORD_INPUTS_ENV, str(tmp_path / "rec"))
    inputs = StepInputs(base_model(cfg), data, scored)
    result = build_plan(cfg).step("grpo-pool").run(cfg, inputs, str(tmp_path / "two"))
    assert result.metrics["global_step"] == STEPS

    def pools(rank):
        rows = [
            json.loads(line)
            for line in (tmp_path / "rec" / f"pool-rank{rank}.jsonl").read_text().splitlines()
        ]
        for row in rows:  # each rank times its own share of a refresh
            for record in row["refresh"]["history"]:
                del record["seconds"]
        return rows

    rank0 = pools(0)
    assert len(rank0) == STEPS and rank0 == pools(1)
    assert rank0[-1]["sampler"]["retired"] and rank0[-1]["refresh"]["history"]
    logged = [
        json.loads(line) for line in (Path(result.output_dir) / "log_history.jsonl").read_text().splitlines()
    ]
    assert any(row.get("zero_signal/rounds", 0) > 0 for row in logged)


def test_a_failing_child_is_a_stage_error_with_its_exit_code(tiny_model_dir, tmp_path, monkeypatch):
    cfg = config(tiny_model_dir, tmp_path, "sft", {"trainer": {"max_steps": 1}}, "accelerate")
    data = prepare_step(cfg, base_model(cfg), tmp_path / "data")
    missing = StepInputs(ModelRef(str(tmp_path / "no-model"), "fp"), data)  # every rank fails to load it
    with pytest.raises(StageError, match=r"^stage sft: accelerate launch exited with code [1-9]"):
        build_plan(cfg).step("sft").run(cfg, missing, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.ckpt").exists()


SAVE_WORKER = Path(__file__).with_name("fsdp2_save_worker.py")
SAVE_TIMEOUT_S = 90
"""The worker takes about 10 s on 2 cores; a save that does not gather on every rank hangs."""


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    names = ("model.safetensors", "adapter_model.safetensors")
    return load_file(next(folder / n for n in names if (folder / n).exists()))


def test_a_fsdp2_sharded_policy_is_saved_whole(tiny_model_dir, tmp_path):
    """2 processes shard the tiny model with FSDP2, take one step, and save it as a stage does: the
    files equal those of the same step on a whole copy (full fine-tune, LoRA merged, LoRA adapter)."""
    import torch

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_ACCELERATE_CONFIG]
    cmd += [
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        str(SAVE_WORKER),
        str(tiny_model_dir),
        str(tmp_path),
    ]
    proc = subprocess.Popen(  # noqa: S603 - our interpreter and worker, no shell
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=SAVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        pytest.fail(f"the sharded save did not finish in {SAVE_TIMEOUT_S} s (a rank waits on a collective)")
    assert proc.returncode == 0, log[-3000:]
    start = weights(tiny_model_dir)
    for folder in ("full", "merged", "adapter"):
        sharded, whole = weights(tmp_path / folder / "sharded"), weights(tmp_path / folder / "whole")
        assert sharded.keys() == whole.keys() and sharded, folder
        for key, value in sharded.items():
            assert value.shape == whole[key].shape, (folder, key)  # whole tensors, not one rank's half
            assert torch.allclose(value, whole[key], rtol=0, atol=1e-6), (folder, key)
        if folder != "adapter":
            assert {k: v.shape for k, v in sharded.items()} == {k: v.shape for k, v in start.items()}
            assert any(not torch.equal(v, start[k]) for k, v in sharded.items()), folder  # it trained
            model, _ = load_stage_model(str(tmp_path / folder / "sharded"))
            assert type(model).__name__ == "LlamaForCausalLM"
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "full/sharded" / name).read_text() == (tmp_path / "full/whole" / name).read_text()
    config = "adapter_config.json"
    assert (tmp_path / "adapter/sharded" / config).read_text() == (
        tmp_path / "adapter/whole" / config
    ).read_text()
