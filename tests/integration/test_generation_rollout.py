"""GRPO's CPU rollout: the shadow copy of the policy, when it is refreshed, and when TRL generates instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.generation.rollout import ShadowPolicy, ShadowRollout, shadow_rollout_blockers


@pytest.fixture
def lora_policy(tiny_model_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from posttrain.core.config import LoraConfig
    from posttrain.models.loading import build_peft_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = get_peft_model(model, build_peft_config(LoraConfig(r=4, alpha=8)))
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapter do something
            param.data.normal_(0, 0.5)
    return policy.eval()


def test_shadow_policy_matches_the_lora_policy(lora_policy):
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        expected = lora_policy(input_ids=ids).logits
        exact = ShadowPolicy(lora_policy, torch.float32)
        exact.sync(lora_policy)
        assert torch.allclose(exact.model(input_ids=ids).logits, expected, atol=1e-4)
        fast = ShadowPolicy(lora_policy, torch.bfloat16)
        fast.sync(lora_policy)
        assert fast.model.dtype == torch.bfloat16
        assert torch.allclose(fast.model(input_ids=ids).logits.float(), expected, atol=0.1)


def test_shadow_is_refreshed_once_per_optimizer_step(lora_policy):
    """Several generation rounds in one step reuse the copy; the next step sees the updated policy."""
    rollout = ShadowRollout(torch.float32)
    shadow = rollout.refresh(lora_policy, step=0)
    lora_b = next(p for n, p in lora_policy.named_parameters() if "lora_B" in n)
    probe = next(p for n, p in shadow.model.named_parameters() if n.endswith("q_proj.weight"))
    before = probe.clone()
    with torch.no_grad():
        lora_b.add_(1.0)  # an optimizer step
    assert rollout.refresh(lora_policy, step=0) is shadow and torch.equal(probe, before)
    rollout.refresh(lora_policy, step=1)
    assert not torch.equal(probe, before) and rollout.synced_step == 1


def grpo_args(tmp_path, **overrides):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **overrides)


@pytest.mark.parametrize(
    "overrides, columns, blockers",
    [
        ({}, ["prompt", "answer"], []),  # TRL's defaults: temperature-only sampling
        ({"temperature": 0.7}, [], []),  # any temperature
        ({"top_p": 0.9}, [], ["top_p=0.9"]),
        ({"top_k": 50}, [], ["top_k=50"]),
        ({"min_p": 0.1}, [], ["min_p=0.1"]),
        ({"repetition_penalty": 1.1}, [], ["repetition_penalty=1.1"]),
        ({"generation_kwargs": {"no_repeat_ngram_size": 3}}, [], ["generation_kwargs"]),
        ({"cache_implementation": "static"}, [], ["cache_implementation"]),
        ({"use_transformers_continuous_batching": True}, [], ["use_transformers_continuous_batching"]),
        ({}, ["prompt", "image"], ["image inputs"]),  # multimodal prompts need TRL's path
    ],
)
def test_settings_the_engine_does_not_reproduce_leave_generation_to_trl(
    tmp_path, overrides, columns, blockers
):
    assert shadow_rollout_blockers(grpo_args(tmp_path, **overrides), columns) == blockers


def test_tools_leave_generation_to_trl(tmp_path):
    assert shadow_rollout_blockers(grpo_args(tmp_path), tools=[len]) == ["tools"]


def test_plain_text_prompts_are_tokenized_as_trl_does(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer = SimpleNamespace(
        args=SimpleNamespace(temperature=1.0, max_completion_length=3, chat_template_kwargs=None),
        processing_class=tiny_tokenizer,
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        state=SimpleNamespace(global_step=0),
    )
    out = ShadowRollout(torch.float32)(["2+2=", "seven times six is"], trainer)
    assert out["prompt_ids"] == tiny_tokenizer(text=["2+2=", "seven times six is"])["input_ids"]
    assert all(1 <= len(ids) <= 3 for ids in out["completion_ids"])
