"""The real built-in model through one GRPO step (opt in: ``pytest -m slow``; ~1-2 minutes on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig


@pytest.mark.slow
def test_smollm2_one_grpo_step_then_generates(tmp_path):
    from posttrain.data.prepare import prepare_data
    from posttrain.models.loading import load_stage_model, load_tokenizer
    from posttrain.models.resolve import resolve_model_path
    from posttrain.training.grpo import run_grpo_stage

    base = resolve_model_path("smollm2-135m-instruct")
    data = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=24), eval_size=4),
        load_tokenizer(base),
    ).train
    stage = GRPOStageConfig(
        name="format",
        rewards=[{"name": "xml_count"}, {"name": "soft_format"}],
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 32,
        },
    )
    model_cfg = ModelConfig(
        name="smollm2-135m-instruct", lora={"r": 8, "alpha": 16}, adapter_policy="adapter"
    )
    result = run_grpo_stage(stage, model_cfg, "smollm2-135m-instruct", data, tmp_path / "grpo")
    assert result.artifact == "adapter" and result.adapter_base == base
    assert result.metrics["global_step"] == 1 and "reward" in result.metrics

    model, tokenizer = load_stage_model(result.output_dir)
    prompt = tokenizer.apply_chat_template(
        data[0]["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
