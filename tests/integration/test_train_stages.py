"""Every training stage end to end on the tiny model: 2-3 steps each, a few seconds per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.config import (
    DataConfig,
    DPOStageConfig,
    GRPOStageConfig,
    ModelConfig,
    SFTStageConfig,
    SyntheticConfig,
)
from posttrain.core.errors import HardwareError, StageError
from posttrain.core.results import StageResult
from posttrain.models.artifacts import is_complete_stage, read_stage_json
from posttrain.models.loading import load_stage_model

LORA = {"r": 4, "alpha": 8}
GRPO_SHAPES = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 16}
STAGE_JSON_KEYS = {
    "schema",
    "stage",
    "kind",
    "config_hash",
    "model_config_hash",
    "config",
    "input_model",
    "data_fingerprint",
    "seed",
    "precision",
    "artifact",
    "adapter",
    "metrics",
    "alerts",
    "samples",
    "duration_s",
    "created",
    "versions",
    "trainer_options",
    "trainer_options_hash",
}


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=48, max_ops=3), eval_size=8)
    return prepare_data(cfg, tiny_tokenizer).train


def grpo_stage(name: str, data_filter: dict | None = None, **trainer) -> GRPOStageConfig:
    return GRPOStageConfig(
        name=name,
        rewards=[{"name": "xml_count"}, {"name": "correctness", "weight": 2.0}],
        sample_every=2,
        data_filter=data_filter or {},
        trainer={"max_steps": 3, **GRPO_SHAPES, **trainer},
    )


def assert_stage_output(result: StageResult, stage: str, artifact: str) -> dict:
    out = Path(result.output_dir)
    assert result.stage == stage and result.artifact == artifact and is_complete_stage(out)
    assert set(result.fingerprints) == {"input_model", "data", "config", "trainer_options", "output"}
    info = read_stage_json(out)
    assert set(info) >= STAGE_JSON_KEYS and info["stage"] == stage and info["artifact"] == artifact
    assert info["input_model"]["fingerprint"] == result.fingerprints["input_model"]
    assert info["versions"]["trl"] and info["metrics"]["global_step"] >= 1
    assert [p.name for p in out.parent.iterdir() if ".tmp-" in p.name] == []  # nothing half-written left
    return info


def generate_a_few_tokens(path: str | Path) -> None:
    model, tokenizer = load_stage_model(path)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_sft_merge_policy_writes_a_standalone_model(tiny_model_dir, data, tmp_path):
    from posttrain.training.sft import run_sft

    cfg = SFTStageConfig(limit=16, trainer={"max_steps": 2, "per_device_train_batch_size": 4})
    result = run_sft(
        cfg, ModelConfig(name=str(tiny_model_dir), lora=LORA), tiny_model_dir, data, tmp_path / "sft"
    )
    info = assert_stage_output(result, "sft", "merged")
    assert (Path(result.output_dir) / "model.safetensors").exists() and info["adapter"] is None
    assert result.metrics["train_examples"] == 16 and result.fingerprints["data"] == data._fingerprint
    assert len(json.loads((Path(result.output_dir) / "log_history.jsonl").read_text().splitlines()[0])) > 0
    generate_a_few_tokens(result.output_dir)


def test_sft_full_finetune_ignores_adapter_policy(tiny_model_dir, data, tmp_path):
    from posttrain.training.sft import run_sft

    model_cfg = ModelConfig(name=str(tiny_model_dir), lora=None, adapter_policy="adapter", precision="fp32")
    cfg = SFTStageConfig(limit=8, trainer={"max_steps": 1, "per_device_train_batch_size": 4})
    result = run_sft(cfg, model_cfg, tiny_model_dir, data, tmp_path / "sft")
    assert assert_stage_output(result, "sft", "full")["precision"] == "fp32"


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_dpo_samples_on_policy_pairs_and_trains(tiny_model_dir, data, tmp_path, lora):
    from posttrain.training.dpo import PAIRS_FILE, run_dpo

    cfg = DPOStageConfig(
        num_prompts=4,
        num_generations=3,
        max_completion_length=12,
        trainer={"max_steps": 2, "per_device_train_batch_size": 2, "max_length": 256},
    )
    result = run_dpo(
        cfg, ModelConfig(name=str(tiny_model_dir), lora=lora), tiny_model_dir, data, tmp_path / "dpo"
    )
    assert_stage_output(result, "dpo", "merged" if lora else "full")
    m = result.metrics
    assert m["pairs/n_prompts"] == 4 and m["pairs/n_pairs"] + m["pairs/dropped_ties"] == 4
    assert 0 <= m["sampling/correct_rate"] <= 1 and m["sampling/seconds"] > 0
    pairs = (Path(result.output_dir) / PAIRS_FILE).read_text().splitlines()
    assert len(pairs) == m["pairs/n_pairs"] and set(json.loads(pairs[0])) == {"prompt", "chosen", "rejected"}


def test_dpo_without_preferences_fails_clearly_and_writes_nothing(tiny_model_dir, data, tmp_path):
    from posttrain.training.dpo import run_dpo

    # A reward every sample earns equally and no reference solution to fall back on: all groups tie.
    cfg = DPOStageConfig(
        num_prompts=3,
        num_generations=2,
        max_completion_length=4,
        rewards=[{"name": "length", "params": {"min_tokens": 0, "max_tokens": 1000}}],
    )
    with pytest.raises(StageError, match="no preference pairs"):
        run_dpo(
            cfg,
            ModelConfig(name=str(tiny_model_dir), lora=LORA),
            tiny_model_dir,
            data.remove_columns("solution"),
            tmp_path / "dpo",
        )
    assert list(tmp_path.iterdir()) == []


def test_two_grpo_stages_chain_in_adapter_mode(tiny_model_dir, data, tmp_path, capfd):
    from posttrain.training.grpo import run_grpo_stage

    model_cfg = ModelConfig(name=str(tiny_model_dir), lora=LORA, adapter_policy="adapter")
    capfd.readouterr()
    first = run_grpo_stage(grpo_stage("format"), model_cfg, tiny_model_dir, data, tmp_path / "g1", seed=1)
    console = "".join(capfd.readouterr())
    # a progress bar, not a metrics line or a completion table per step (those go to MLflow)
    assert "'loss'" not in console and "{'" not in console and "\u2500\u2500\u2500" not in console
    info = assert_stage_output(first, "grpo-format", "adapter")
    assert info["adapter"]["base"] == str(Path(tiny_model_dir).resolve())
    assert first.samples == (
        "completions/completions_00001.parquet",
        "completions/completions_00002.parquet",
        "completions/completions_00003.parquet",
    )
    assert all((Path(first.output_dir) / s).exists() for s in first.samples)
    # The untrained tiny model never earns a reward: flagged on the very first step.
    assert first.alerts[0]["kind"] == "no_signal" and first.alerts[0]["step"] == 1
    assert "rewards/xml_count_reward/mean" in first.metrics and "reward" in first.metrics

    second_cfg = grpo_stage("correct", {"min_ops": 2, "limit": 8}, max_steps=2, beta=0.05)
    second = run_grpo_stage(second_cfg, model_cfg, first.output_dir, data, tmp_path / "g2")
    info = assert_stage_output(second, "grpo-correct", "adapter")
    assert info["adapter"]["base"] == first.output_dir and info["adapter"]["root"] == info["adapter"][
        "base"
    ].replace(first.output_dir, str(Path(tiny_model_dir).resolve()))
    assert second.fingerprints["input_model"] == first.fingerprints["output"]
    assert second.metrics["train_examples"] == 8 and "kl" in second.metrics
    generate_a_few_tokens(second.output_dir)


def test_grpo_with_peft_options_and_a_trl_reward(tiny_model_dir, data, tmp_path):
    """peft's own LoraConfig options reach the adapter; TRL's accuracy_reward trains by its name."""
    from posttrain.core.config import PipelineConfig
    from posttrain.training.grpo import run_grpo_stage

    lora = {"r": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]}
    model_cfg = PipelineConfig(name="t", model={"name": str(tiny_model_dir), "lora": lora}).model
    stage = GRPOStageConfig(
        name="trl",
        rewards=[{"name": "accuracy_reward"}, {"name": "xml_count", "weight": 0.5}],
        trainer={"max_steps": 1, **GRPO_SHAPES},
    )
    adapter_cfg = model_cfg.model_copy(update={"adapter_policy": "adapter"})
    result = run_grpo_stage(stage, adapter_cfg, tiny_model_dir, data, tmp_path / "g")
    assert_stage_output(result, "grpo-trl", "adapter")
    assert "rewards/accuracy_reward/mean" in result.metrics
    saved = json.loads((Path(result.output_dir) / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["use_rslora"] is True
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"]


def test_grpo_full_finetune_with_kl_and_stop_on_alert(tiny_model_dir, data, tmp_path):
    from posttrain.training.grpo import run_grpo_stage

    stage = GRPOStageConfig(
        name="stop",
        rewards=[{"name": "correctness"}],
        monitor={"on_alert": "stop"},
        trainer={"max_steps": 3, "beta": 0.1, **GRPO_SHAPES},
    )
    result = run_grpo_stage(
        stage, ModelConfig(name=str(tiny_model_dir), lora=None), tiny_model_dir, data, tmp_path / "g"
    )
    assert_stage_output(result, "grpo-stop", "full")
    assert result.metrics["global_step"] == 1 and result.alerts[0]["kind"] == "no_signal"
    generate_a_few_tokens(result.output_dir)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")
@pytest.mark.parametrize(
    "model_extra, trainer, match",
    [
        ({"quantization": "4bit", "lora": LORA}, {}, "4bit"),  # QLoRA needs bitsandbytes on CUDA
        ({"precision": "fp16"}, {}, "fp16 needs a CUDA GPU"),
        ({}, {"optim": "adamw_8bit"}, "adamw_8bit"),
        ({}, {"use_vllm": True}, "vLLM needs a CUDA GPU"),
    ],
)
def test_gpu_only_options_fail_clearly_on_cpu(tiny_model_dir, data, tmp_path, model_extra, trainer, match):
    from posttrain.training.grpo import run_grpo_stage

    stage = grpo_stage("gpu", **trainer)
    with pytest.raises(HardwareError, match=match):
        run_grpo_stage(
            stage, ModelConfig(name=str(tiny_model_dir), **model_extra), tiny_model_dir, data, tmp_path / "g"
        )
    assert list(tmp_path.iterdir()) == []


def test_a_crashing_stage_leaves_no_output(tiny_model_dir, data, tmp_path, monkeypatch):
    from posttrain.training import grpo

    def broken(*args, **kwargs):
        raise RuntimeError("reward server down")

    monkeypatch.setattr(grpo, "make_grpo_trainer", broken)
    with pytest.raises(RuntimeError, match="reward server down"):
        grpo.run_grpo_stage(
            grpo_stage("x"),
            ModelConfig(name=str(tiny_model_dir), lora=LORA),
            tiny_model_dir,
            data,
            tmp_path / "g",
        )
    assert list(tmp_path.iterdir()) == []
