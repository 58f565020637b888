"""Training that must change the model, on the tiny model in a few optimizer steps.

test_train_stages.py checks the plumbing (what a stage writes); these check the effect. Every stage,
in every way of saving its policy (LoRA merged, LoRA adapter, full fine-tuning), leaves weights that
differ from its input and that fit its own objective better: a lower SFT loss on its examples, a
wider DPO margin on its pairs. GRPO learns only from reward differences inside a group, which the
untrained tiny model never earns on the format rewards; here it trains on a length reward whose
score varies with every random completion, so the update from a non-zero advantage runs. The YAML
reward weights decide both what GRPO sums and which completion DPO prefers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.core.config import DPOStageConfig, GRPOStageConfig, ModelConfig, SFTStageConfig
from posttrain.models.loading import load_stage_model

LORA = {"r": 4, "alpha": 8}
MODES = {
    "merge": {"lora": LORA},
    "adapter": {"lora": LORA, "adapter_policy": "adapter"},
    "full": {"lora": None},
}
# One prompt of 8 completions per step: 8 random completions all of one length would be a fluke.
GRPO_SHAPES = {"per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 16}
# Whitespace-separated words of a 16-token random completion vary (about 2 to 12): below
# `min_tokens` the length reward ramps linearly, so the completions of one prompt score differently.
EARNABLE = {"name": "length", "weight": 2.0, "params": {"min_tokens": 40, "max_tokens": 80}}


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    from posttrain.core.config import DataConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=32, max_ops=2), eval_size=4)
    return prepare_data(cfg, tiny_tokenizer).train


def model_cfg(tiny_model_dir, mode: str) -> ModelConfig:
    return ModelConfig(name=str(tiny_model_dir), precision="fp32", **MODES[mode])


def weights(path) -> dict[str, torch.Tensor]:
    """The policy a later stage would load (adapter chains merged), tensor by tensor."""
    model, _ = load_stage_model(path, "fp32")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    assert before.keys() == after.keys()
    return [name for name in before if not torch.equal(before[name], after[name])]


def assert_moved(before, result, mode: str) -> None:
    changed = moved(before, weights(result.output_dir))
    if mode == "full":
        assert "model.embed_tokens.weight" in changed and len(changed) > 10, changed
    else:  # LoRA on all linear layers: every projection moves, the embeddings and norms do not
        assert changed and all(n.endswith("_proj.weight") for n in changed), changed
        assert any(".self_attn." in n for n in changed) and any(".mlp." in n for n in changed), changed


def encode(tokenizer, prompt: list[dict], completion: str) -> tuple[list[int], int]:
    """Token ids of prompt + assistant completion, and where the completion starts."""
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"]
    turn = [*prompt, {"role": "assistant", "content": completion}]
    ids = tokenizer.apply_chat_template(turn, return_dict=True)["input_ids"]
    assert ids[: len(head)] == head
    return ids, len(head)


def completion_logprob(model, tokenizer, prompt: list[dict], completion: str) -> float:
    """Sum of the log-probabilities of the completion's tokens after the prompt."""
    ids, start = encode(tokenizer, prompt, completion)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(ids[1:])
    return logprobs[torch.arange(len(targets)), targets][start - 1 :].sum().item()


@pytest.mark.parametrize("mode", list(MODES))
def test_sft_moves_the_weights_and_lowers_the_loss_on_its_examples(tiny_model_dir, data, tmp_path, mode):
    from posttrain.training.sft import run_sft, sft_dataset

    cfg = SFTStageConfig(
        limit=8,
        trainer={"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 3e-3},
    )
    result = run_sft(cfg, model_cfg(tiny_model_dir, mode), tiny_model_dir, data, tmp_path / "sft")
    assert result.artifact == {"merge": "merged", "adapter": "adapter", "full": "full"}[mode]
    assert_moved(weights(tiny_model_dir), result, mode)

    rows = list(sft_dataset(data, 8))

    def loss(path) -> float:
        model, tokenizer = load_stage_model(path, "fp32")
        total = [
            completion_logprob(model, tokenizer, r["prompt"], r["completion"][0]["content"]) for r in rows
        ]
        return -sum(total) / len(total)

    before, after = loss(tiny_model_dir), loss(result.output_dir)
    assert after < before - 1.0, (before, after)
    losses = [row["loss"] for row in result_log(result) if "loss" in row]
    assert len(losses) == 4 and losses[-1] < losses[0]


def result_log(result) -> list[dict]:
    return [
        json.loads(line) for line in (Path(result.output_dir) / "log_history.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize("mode", list(MODES))
def test_dpo_moves_the_weights_and_widens_the_margin_of_its_pairs(tiny_model_dir, data, tmp_path, mode):
    from posttrain.training.dpo import PAIRS_FILE, run_dpo

    cfg = DPOStageConfig(
        num_prompts=4,
        num_generations=3,
        max_completion_length=12,
        trainer={"max_steps": 3, "per_device_train_batch_size": 2, "max_length": 256, "learning_rate": 3e-3},
    )
    result = run_dpo(cfg, model_cfg(tiny_model_dir, mode), tiny_model_dir, data, tmp_path / "dpo")
    assert_moved(weights(tiny_model_dir), result, mode)

    pairs = [json.loads(line) for line in (Path(result.output_dir) / PAIRS_FILE).read_text().splitlines()]
    assert pairs

    def margin(path) -> float:
        model, tokenizer = load_stage_model(path, "fp32")
        return sum(
            completion_logprob(model, tokenizer, p["prompt"], p["chosen"][0]["content"])
            - completion_logprob(model, tokenizer, p["prompt"], p["rejected"][0]["content"])
            for p in pairs
        ) / len(pairs)

    before, after = margin(tiny_model_dir), margin(result.output_dir)
    assert after > before + 1.0, (before, after)


def grpo_stage(rewards: list[dict], **trainer) -> GRPOStageConfig:
    return GRPOStageConfig(
        name="earn",
        rewards=rewards,
        trainer={"max_steps": 2, "learning_rate": 1e-2, **GRPO_SHAPES, **trainer},
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_grpo_on_a_reward_the_tiny_model_earns_moves_the_weights(tiny_model_dir, data, tmp_path, mode):
    from posttrain.training.grpo import run_grpo_stage

    stage = grpo_stage([EARNABLE, {"name": "xml_count", "weight": 0.5}])
    result = run_grpo_stage(stage, model_cfg(tiny_model_dir, mode), tiny_model_dir, data, tmp_path / "g")
    rows = [row for row in result_log(result) if "reward" in row]
    assert len(rows) == 2
    assert any(row["frac_reward_zero_std"] < 1.0 and row["reward_std"] > 0 for row in rows)  # advantages
    for row in rows:
        # The logged reward is the weighted sum of the rewards: the YAML weights reached TRL.
        weighted = 2.0 * row["rewards/length_reward/mean"] + 0.5 * row["rewards/xml_count_reward/mean"]
        assert row["reward"] == pytest.approx(weighted, abs=1e-5)
    assert not [a for a in result.alerts if a["kind"] == "no_signal"]
    assert_moved(weights(tiny_model_dir), result, mode)


def test_grpo_without_reward_differences_leaves_the_weights_as_they_were(tiny_model_dir, data, tmp_path):
    """The contrast: every completion scores 0 on xml_count, advantages are 0, nothing may move."""
    from posttrain.training.grpo import run_grpo_stage

    stage = grpo_stage([{"name": "xml_count"}], max_steps=1)
    result = run_grpo_stage(stage, model_cfg(tiny_model_dir, "full"), tiny_model_dir, data, tmp_path / "g")
    assert result.alerts[0]["kind"] == "no_signal"
    assert moved(weights(tiny_model_dir), weights(result.output_dir)) == []


def test_yaml_reward_weights_reach_grpo_config(smoke_config_path, tiny_model_dir, data, tmp_path):
    from posttrain.pipeline import load_config
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext

    smoke = smoke_config_path
    cfg = load_config(smoke, ["grpo.stages.1.rewards.0.weight=3.0", "grpo.stages.1.rewards.1.weight=0.25"])
    ctx = StageContext("grpo-correctness", tmp_path, "fp32", 0, "none")
    trainer, _ = make_grpo_trainer(cfg.grpo.stages[1], cfg.model, str(tiny_model_dir), data, ctx)
    assert trainer.args.reward_weights == [3.0, 0.25]
    assert trainer.reward_weights.tolist() == [3.0, 0.25]
    assert [f.__name__ for f in trainer.reward_funcs] == ["correctness_reward", "strict_format_reward"]


FORMATTED = "<reasoning>\n6 * 7\n</reasoning>\n<answer>\n42\n</answer>"  # strict format, 6 words
RAMBLING = " ".join(["then"] * 30)  # no format, 30 words


@pytest.mark.parametrize(
    "format_weight, length_weight, chosen",
    [
        # 1.0 + 0.1 * 0.2 beats 0.1 * 1.0; then 0.1 + 0.2 loses to 1.0
        pytest.param(1.0, 0.1, FORMATTED, id="format-heavy-picks-formatted"),
        pytest.param(0.1, 1.0, RAMBLING, id="length-heavy-picks-rambling"),
    ],
)
def test_yaml_reward_weights_decide_the_dpo_pair(format_weight, length_weight, chosen):
    from posttrain.data.builders import build_dpo_dataset
    from posttrain.generation.sampling import Samples
    from posttrain.training.dpo import score_samples
    from posttrain.training.stage_run import build_reward_funcs

    section = yaml.safe_load(
        f"""
        rewards:
          - {{name: strict_format, weight: {format_weight}}}
          - {{name: length, weight: {length_weight}, params: {{min_tokens: 30, max_tokens: 60}}}}
        """
    )
    cfg = DPOStageConfig(**section)
    funcs, weights_ = build_reward_funcs(cfg.rewards)
    prompt = [{"role": "user", "content": "6 times 7?"}]
    rows = [{"prompt": prompt, "answer": "42"}]
    samples = Samples(texts=[[FORMATTED, RAMBLING]], token_ids=[[[1] * 6, [1] * 30]], seconds=1.0)
    scores, _ = score_samples(rows, samples, funcs, weights_)
    pairs, _ = build_dpo_dataset([prompt], samples.texts, scores)
    assert pairs[0]["chosen"][0]["content"] == chosen
    assert pairs[0]["rejected"][0]["content"] != chosen
