"""Each library's private hooks, checked against the installed version, so lifting a pin fails loudly.

For every compatibility module: its version range equals pyproject's pin, the installed version is
inside it, and every private name the module touches still exists with the shape it relies on.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from posttrain.generation import torch_compat, transformers_compat
from posttrain.models import datasets_compat, peft_compat
from posttrain.training import trl_compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def pinned(package: str) -> SpecifierSet:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for dependency in dependencies:
        requirement = Requirement(dependency)
        if requirement.name == package:
            return requirement.specifier
    raise AssertionError(f"{package} is not a dependency in pyproject.toml")


@pytest.mark.parametrize(
    "package, checked",
    [
        ("trl", trl_compat.TRL_VERSIONS),
        ("transformers", transformers_compat.TRANSFORMERS_VERSIONS),
        ("peft", peft_compat.PEFT_VERSIONS),
        ("datasets", datasets_compat.DATASETS_VERSIONS),
        ("torch", torch_compat.TORCH_VERSIONS),
    ],
)
def test_compat_module_matches_the_pin_and_the_installed_version(package, checked):
    assert SpecifierSet(checked) == pinned(package), (
        f"pyproject pins {package} {pinned(package)} but its compat module was checked for {checked}: "
        "re-check the hooks the module lists, then update its version range"
    )
    assert version(package) in SpecifierSet(checked), f"{package} {version(package)} is outside {checked}"


# --------------------------------------------------------------------------- TRL


def test_trl_token_counter_carried_over_on_resume_exists():
    """``carry_token_count`` sets the attribute SFT and DPO count ``num_tokens`` in."""
    from trl import DPOTrainer, SFTTrainer

    for trainer in (SFTTrainer, DPOTrainer):
        assert "self._total_train_tokens = 0" in inspect.getsource(trainer.__init__), trainer.__name__
        assert "self._total_train_tokens +=" in inspect.getsource(trainer), trainer.__name__


def test_trl_private_names_exist():
    import trl.trainer.utils as trl_utils
    from trl import GRPOTrainer

    # TRL's own function, also when an earlier test already installed posttrain's CPU adjustment.
    use_triton = getattr(trl_utils._use_triton, "_posttrain_compact_on_cpu", trl_utils._use_triton)
    assert list(inspect.signature(use_triton).parameters) == ["device"]
    assert callable(trl_utils.add_fused_lm_head)
    assert "rollout_func" in inspect.signature(GRPOTrainer).parameters


def test_rollout_func_runs_inside_a_real_grpo_trainer(tiny_model_dir, tiny_tokenizer, tmp_path):
    """TRL calls the shadow rollout, accepts its output, and sees the same prompts and stop ids it would use."""
    from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data
    from posttrain.generation.engine import encode_prompts, stop_token_ids
    from posttrain.generation.rollout import ShadowRollout
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext

    data = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=12), eval_size=4),
        tiny_tokenizer,
    ).train
    stage = GRPOStageConfig(
        name="compat",
        rewards=[{"name": "xml_count"}],
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 8,
        },
    )
    ctx = StageContext(stage="grpo-compat", work_dir=tmp_path, seed=0, report_to="none", precision="bf16")
    trainer, _ = make_grpo_trainer(
        stage,
        ModelConfig(name=str(tiny_model_dir), lora={"r": 4, "alpha": 8}),
        str(tiny_model_dir),
        data,
        ctx,
    )
    assert isinstance(trainer.rollout_func, ShadowRollout)
    calls = []
    rollout = trainer.rollout_func

    def recorded(prompts, trainer_):
        out = rollout(prompts, trainer_)
        calls.append((prompts, out))
        return out

    trainer.rollout_func = recorded
    trainer.train()
    prompts, out = calls[0]
    assert (
        trainer._tokenize_prompts(prompts)[0] == out["prompt_ids"] == encode_prompts(tiny_tokenizer, prompts)
    )
    assert set(trainer.eos_token_ids) == stop_token_ids(trainer.model, tiny_tokenizer)
    lengths = [len(ids) for ids in out["completion_ids"]]
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert rollout.synced_step == 0 and rollout.shadow.model.dtype == torch.bfloat16


def test_dynamic_sampling_hooks_exist_with_the_signatures_it_overrides():
    from trl import GRPOTrainer

    def params(name):
        return list(inspect.signature(getattr(GRPOTrainer, name)).parameters)

    assert params("_generate_and_score_completions") == ["self", "inputs"]
    assert params("_calculate_rewards") == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "self._calculate_rewards(" in source and "self.multi_objective_aggregation" in source
    assert 'self._metrics[mode]["frac_reward_zero_std"]' in source  # the lists GRPOTrainer.log averages


def test_dynamic_sampling_runs_inside_a_real_grpo_trainer(tiny_model_dir, tiny_tokenizer, tmp_path):
    """TRL's batch (with reference and old log-probabilities) has only keys the merge knows, rounds are
    merged, and the counts reach the logged row."""
    from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext
    from posttrain.training.zero_signal import LEFT_PADDED, METRICS, PER_ROW, RECOUNTED, RIGHT_PADDED

    data = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=12), eval_size=4),
        tiny_tokenizer,
    ).train
    stage = GRPOStageConfig(
        name="compat",
        rewards=[{"name": "correctness"}],  # the random tiny model never answers right: every group is flat
        zero_signal="resample",
        zero_signal_max_rounds=1,
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 4,
            "steps_per_generation": 2,  # old log-probabilities are computed
            "beta": 0.1,  # reference log-probabilities too
            "num_generations": 4,
            "max_completion_length": 6,
        },
    )
    ctx = StageContext(stage="grpo-compat", work_dir=tmp_path, seed=0, report_to="none", precision="fp32")
    model_cfg = ModelConfig(name=str(tiny_model_dir), lora={"r": 4, "alpha": 8})
    trainer, _ = make_grpo_trainer(stage, model_cfg, str(tiny_model_dir), data, ctx)
    rounds = []
    generate = trainer._posttrain_generate

    def recorded(inputs):
        batch, rewards = generate(inputs)
        rounds.append((set(batch), rewards.shape))
        return batch, rewards

    trainer._posttrain_generate = recorded
    trainer.train()
    known = set(LEFT_PADDED) | set(RIGHT_PADDED) | set(PER_ROW) | {RECOUNTED}
    assert len(rounds) == 2 and all(keys <= known for keys, _ in rounds)
    assert {"old_per_token_logps", "ref_per_token_logps"} <= rounds[0][0]
    assert rounds[0][1] == (8, 1)  # every process's rows, one column per reward
    row = next(r for r in trainer.state.log_history if "zero_signal/rounds" in r)
    always = set(METRICS) - {"zero_signal/completions_per_useful_group"}  # only once a group has signal
    assert always <= set(row) and row["zero_signal/rounds"] == 1.0 and "reward" in row


def test_compact_fused_head_patch_is_reversible():
    import trl.trainer.utils as trl_utils

    trl_compat.compact_fused_head_on_cpu(False)  # earlier tests may have built trainers, which switch it on
    original = trl_utils._use_triton
    assert original(torch.device("cpu")) is False  # TRL projects every position on a CPU
    try:
        assert trl_compat.compact_fused_head_on_cpu(True)
        assert trl_utils._use_triton(torch.device("cpu")) is True
    finally:
        trl_compat.compact_fused_head_on_cpu(False)
    assert trl_utils._use_triton is original


def test_completion_tables_leave_the_console_and_come_back(capsys):
    """TRL prints its rich table through the module's own name; with the switch on it prints nothing."""
    import trl.trainer.grpo_trainer as grpo_module

    trl_compat.no_completion_tables(False)
    original = grpo_module.print_prompt_completions_sample
    table = (["prompt"], ["completion"], {"reward": [1.0]}, [0.5], 1)
    try:
        assert trl_compat.no_completion_tables(True)
        grpo_module.print_prompt_completions_sample(*table)
        assert capsys.readouterr().out == ""
    finally:
        trl_compat.no_completion_tables(False)
    assert grpo_module.print_prompt_completions_sample is original
    original(*table)
    assert "completion" in capsys.readouterr().out  # TRL's own printer, for contrast


# --------------------------------------------------------------------------- transformers


def test_dynamic_layer_contract_holds(tiny_model_dir):
    from transformers import AutoConfig, DynamicCache
    from transformers.cache_utils import DynamicLayer

    for method in transformers_compat.DYNAMIC_LAYER_CONTRACT["methods"]:
        assert callable(getattr(DynamicLayer, method, None)), f"DynamicLayer.{method} is gone"
    assert list(inspect.signature(DynamicLayer.update).parameters)[:3] == [
        "self",
        "key_states",
        "value_states",
    ]
    layer = DynamicLayer()
    layer.lazy_initialization(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    for attribute in transformers_compat.DYNAMIC_LAYER_CONTRACT["attributes"]:
        assert hasattr(layer, attribute), f"DynamicLayer no longer sets {attribute}"
    cache = DynamicCache(config=AutoConfig.from_pretrained(tiny_model_dir))
    assert cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers)


def test_load_best_checkpoint_reaches_the_trainers_own_loader():
    """Item 4: the end-of-training loader of ``load_best_model_at_end`` still exists and takes
    nothing but the trainer (tests/integration/test_keep_best.py runs it)."""
    import inspect

    from transformers import Trainer

    assert list(inspect.signature(Trainer._load_best_model).parameters) == ["self"]


def test_no_init_weights_is_a_context_manager():
    with transformers_compat.no_init_weights():
        pass


def _decode_once(model, packed: bool):
    """Prefill 3 equal-length rows, then decode one token with an all-ones mask (no padding)."""
    from transformers import DynamicCache

    ids = torch.tensor([[5, 9, 3, 7], [2, 8, 8, 1], [4, 4, 6, 2]])
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
    step = dict(input_ids=ids[:, :1], attention_mask=torch.ones(3, 5, dtype=torch.long), cache=cache)
    step["position_ids"] = torch.full((3, 1), 4)
    if not packed:
        return model(**step).logits
    with transformers_compat.packed_decode_attention(model):
        assert model.config._attn_implementation == transformers_compat.DECODE_ATTENTION
        return model(**step).logits


def test_packed_decode_attention_matches_sdpa_and_skips_its_gqa_path(tiny_model_dir, monkeypatch):
    """One unmasked query token: the packed path gives sdpa's logits without SDPA's slow ``enable_gqa``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny model is GQA
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        expected = _decode_once(model, packed=False)
        layers = model.config.num_hidden_layers
        assert calls[-layers:] == [True] * layers, (
            "transformers no longer takes the enable_gqa path: drop the hook"
        )
        calls.clear()
        got = _decode_once(model, packed=True)
    assert calls[-layers:] == [False] * layers
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored after the block


# --------------------------------------------------------------------------- torch


def test_packed_linear_weights_give_linear_outputs_from_current_weights(tiny_model_dir):
    """bf16 prepacked linears: same logits as ``F.linear``, packed afresh on each entry, undone on exit."""
    if not torch_compat.bf16_prepack_supported():
        pytest.skip("this CPU has no native bf16 in oneDNN: the engine leaves linears unpacked here")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.tensor([[5, 9, 3, 7, 1], [2, 8, 8, 1, 6]])
    with torch.inference_mode():
        for _ in range(2):  # the second round runs on changed weights (as after a training step)
            expected = model(input_ids=ids).logits
            with torch_compat.packed_linear_weights(model) as count:
                assert count == len(linears) and all("forward" in vars(m) for m in linears)
                got = model(input_ids=ids).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-2)
            assert not any("forward" in vars(m) for m in linears)  # plain nn.Linear again
            model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)


def test_packed_linear_weights_leave_fp32_and_subclassed_linears_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert torch_compat.packable_linears(model) == []

    class Adapted(torch.nn.Linear):  # stands for bitsandbytes' Linear4bit and other subclasses
        pass

    holder = torch.nn.Sequential(Adapted(4, 4).to(torch.bfloat16))
    assert torch_compat.packable_linears(holder) == []


# --------------------------------------------------------------------------- peft


def test_lora_layer_contract_holds(tiny_model_dir):
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from posttrain.core.config import LoraConfig
    from posttrain.models.loading import build_peft_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain_keys = set(model.state_dict())
    policy = get_peft_model(model, build_peft_config(LoraConfig(r=4, alpha=8)))
    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert layers
    for layer in layers:
        for name in peft_compat.LORA_LAYER_CONTRACT:
            assert hasattr(layer, name), f"peft LoraLayer lost {name}"
        assert layer.merged is False and "default" in layer.lora_A
        assert layer.get_delta_weight("default").shape == layer.get_base_layer().weight.shape
    keys = set(policy.get_base_model().state_dict())
    assert any(".base_layer." in k for k in keys) and any("lora_A" in k for k in keys)
    assert set(peft_compat.effective_state_dict(policy)) == plain_keys


# --------------------------------------------------------------------------- datasets


def test_dataset_fingerprint_tracks_transforms():
    from datasets import Dataset

    ds = Dataset.from_list([{"x": 1}, {"x": 2}])
    fingerprint = datasets_compat.dataset_fingerprint(ds)
    assert isinstance(fingerprint, str) and fingerprint == ds._fingerprint
    mapped = ds.map(lambda row: {"x": row["x"] + 1})
    assert datasets_compat.dataset_fingerprint(mapped) not in (None, fingerprint)
    datasets_compat.set_dataset_fingerprint(mapped, "recorded")
    assert datasets_compat.dataset_fingerprint(mapped) == "recorded"
    assert datasets_compat.dataset_fingerprint([{"x": 1}]) is None  # plain rows: no library fingerprint
