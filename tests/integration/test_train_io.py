"""Stage outputs on disk: fingerprints, atomic replacement, sample pruning, adapter loading, the CPU LM head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.atomic import staging_dir
from posttrain.core.errors import StageError
from posttrain.models import artifacts
from posttrain.models.artifacts import fingerprint_dir
from posttrain.training.grpo import prune_samples
from posttrain.training.stage_run import precision_flags, summarize_history


def write(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_fingerprint_tracks_the_policy_not_the_run_records(tmp_path):
    write(tmp_path / "model.safetensors", "weights")
    write(tmp_path / "tokenizer.json", "{}")
    before = fingerprint_dir(tmp_path)
    assert len(before) == 16 and before == fingerprint_dir(tmp_path)
    write(tmp_path / "stage.json", json.dumps({"metrics": {}}))
    write(tmp_path / "log_history.jsonl", "{}")
    write(tmp_path / "completions" / "completions_00001.parquet", "samples")
    write(tmp_path / "checkpoint-5" / "model.safetensors", "old")
    assert fingerprint_dir(tmp_path) == before  # run records do not change what a later stage loads
    write(tmp_path / "model.safetensors", "weightz")
    assert fingerprint_dir(tmp_path) != before


def test_adapter_fingerprint_includes_its_base(tmp_path):
    for base in ("aaaa", "bbbb"):
        d = tmp_path / base
        write(d / "adapter_model.safetensors", "same adapter")
        write(d / "stage.json", json.dumps({"adapter": {"base": "/x", "base_fingerprint": base}}))
    assert fingerprint_dir(tmp_path / "aaaa") != fingerprint_dir(tmp_path / "bbbb")


def test_fingerprint_of_missing_dir_is_an_error(tmp_path):
    with pytest.raises(StageError, match="not a directory"):
        fingerprint_dir(tmp_path / "nope")


def test_staging_dir_replaces_the_old_output_only_on_success(tmp_path):
    out = tmp_path / "stage"
    with staging_dir(out) as work:
        assert work.parent == tmp_path and work.name.startswith("stage.tmp-")
        write(work / "stage.json", "1")
    assert (out / "stage.json").read_text() == "1"
    with pytest.raises(RuntimeError), staging_dir(out) as work:
        write(work / "stage.json", "2")
        raise RuntimeError("training crashed")
    assert (out / "stage.json").read_text() == "1"  # the previous complete output survives
    with staging_dir(out) as work:
        write(work / "stage.json", "3")
    assert (out / "stage.json").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage"]  # no temporary or old dirs left


def test_is_complete_stage(tmp_path):
    assert not artifacts.is_complete_stage(tmp_path)
    write(tmp_path / "config.json", "{}")
    assert not artifacts.is_complete_stage(tmp_path)  # weights without stage.json: unfinished
    write(tmp_path / "stage.json", "{}")
    assert artifacts.is_complete_stage(tmp_path)


def test_adapter_chain_root_and_errors(tmp_path):
    base, a1, a2 = tmp_path / "base", tmp_path / "a1", tmp_path / "a2"
    write(base / "config.json", "{}")
    for adapter, parent in ((a1, base), (a2, a1)):
        write(adapter / "adapter_config.json", "{}")
        write(adapter / "stage.json", json.dumps({"adapter": {"base": str(parent)}}))
    assert artifacts.adapter_root(a2) == str(base)
    write(a1 / "stage.json", json.dumps({"adapter": None}))
    with pytest.raises(StageError, match="without a recorded base"):
        artifacts.adapter_root(a2)


@pytest.mark.parametrize(
    "steps, every, kept",
    [
        ([1, 2, 3, 4, 5, 6, 7], 3, [1, 3, 6, 7]),  # first, every 3rd, last
        ([1, 2], 5, [1, 2]),  # short run: first and last
        ([], 5, []),  # nothing logged
    ],
)
def test_prune_samples(tmp_path, steps, every, kept):
    for step in steps:
        write(tmp_path / "completions" / f"completions_{step:05d}.parquet")
    listed = prune_samples(tmp_path, every)
    assert listed == [f"completions/completions_{s:05d}.parquet" for s in kept]
    assert sorted(p.name for p in (tmp_path / "completions").glob("*")) == [p.split("/")[1] for p in listed]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU flags")
@pytest.mark.parametrize(
    "precision, flags",
    [
        ("bf16", {"use_cpu": True, "bf16": True, "fp16": False}),  # autocast, fp32 master weights
        ("fp32", {"use_cpu": True, "bf16": False, "fp16": False}),
    ],
)
def test_precision_flags_on_cpu(precision, flags):
    assert precision_flags(precision) == flags


def test_summarize_history_keeps_last_values_and_first_reward():
    history = [
        {"loss": 1.0, "reward": 0.1},
        {"loss": 0.5, "reward": 0.4, "kl": float("nan")},
        {"train_loss": 0.7},
    ]
    assert summarize_history(history) == {"loss": 0.5, "reward": 0.4, "train_loss": 0.7, "reward_first": 0.1}


def test_modeling_loader_understands_adapter_stage_dirs(tiny_model_dir, tmp_path):
    from peft import get_peft_model

    from posttrain.core.config import LoraConfig
    from posttrain.models.loading import build_peft_config, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(tiny_model_dir), "fp32", for_training=True)
    policy = get_peft_model(model, build_peft_config(LoraConfig(r=4, alpha=8)))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.fill_(0.01)
    policy.eval()  # no LoRA dropout in the reference logits
    adapter = tmp_path / "adapter"
    assert artifacts.save_policy(policy, tokenizer, adapter, adapter_policy="adapter") == "adapter"
    (adapter / "stage.json").write_text(json.dumps({"adapter": {"base": str(tiny_model_dir)}}))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        loaded, _ = load_model_and_tokenizer(str(adapter), "fp32")
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5)


def test_compact_fused_head_on_cpu_gives_the_same_logprobs_and_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from posttrain.training.trl_compat import compact_fused_head_on_cpu

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, 300, (2, 10))
    labels = ids.clone()
    labels[:, :6] = -100  # prompt positions carry no label
    results = []
    try:
        for enabled in (False, True):
            assert compact_fused_head_on_cpu(enabled) is enabled
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            (out.log_probs.sum() + out.entropy.sum()).backward()
            results.append((out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()))
    finally:
        compact_fused_head_on_cpu(False)
    for full, compact in zip(*results, strict=True):
        assert torch.allclose(full, compact, atol=1e-5)


def _execute_sft(model_dir: Path, output_dir: Path, train_fn, *, dataset=None, options=None):
    """``execute_stage`` of an SFT stage of ``model_dir`` with ``train_fn`` as its training."""
    from posttrain.core.config import ModelConfig, SFTStageConfig
    from posttrain.training.stage_run import execute_stage

    return execute_stage(
        stage="sft",
        kind="sft",
        stage_cfg=SFTStageConfig(),
        model_cfg=ModelConfig(name=str(model_dir), precision="fp32"),
        model_path=model_dir,
        train_dataset=dataset,
        output_dir=output_dir,
        seed=0,
        report_to="none",
        options=options or {},
        train_fn=train_fn,
    )


def test_a_stage_that_fails_before_its_first_checkpoint_leaves_nothing_behind(tiny_model_dir, tmp_path):
    import datasets

    def broken(ctx):
        raise RuntimeError("broke")

    with pytest.raises(RuntimeError, match="broke"):
        _execute_sft(
            tiny_model_dir, tmp_path / "sft", broken, dataset=datasets.Dataset.from_dict({"prompt": ["q"]})
        )
    assert not (tmp_path / "sft").exists() and not (tmp_path / "sft.ckpt").exists()


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"optim": "adamw_8bit"}, "adamw_8bit .* needs a CUDA GPU"),
        ({"use_vllm": True}, "vLLM needs a CUDA GPU"),
    ],
    ids=["8-bit-optimizer", "vllm"],
)
def test_a_stage_run_as_its_own_process_checks_its_trainer_options_against_the_hardware_first(
    tiny_model_dir, tmp_path, monkeypatch, options, fragment
):
    """The launcher runs a stage without the pipeline's validation: the stage itself refuses GPU-only
    trainer options on a CPU before it reads its data or writes anything."""
    from posttrain.core.errors import HardwareError
    from posttrain.models import hardware

    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    with pytest.raises(HardwareError, match=fragment):  # the data (None) is not read before the check
        _execute_sft(tiny_model_dir, tmp_path / "sft", lambda ctx: pytest.fail("trained"), options=options)
    assert list(tmp_path.iterdir()) == []
