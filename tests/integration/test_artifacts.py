"""What a stage writes and how it is read back, without training: stage.json, the log history, the
policy in each save mode, fingerprints of datasets and models, and tidying what a kill left behind.

Fast on purpose (no trainer): mutation testing runs these for every planted change in
models/artifacts.py and core/atomic.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from posttrain.core.atomic import tidy_interrupted
from posttrain.core.errors import StageError
from posttrain.core.results import StageResult
from posttrain.models import artifacts
from posttrain.models.artifacts import (
    fingerprint_dataset,
    fingerprint_dir,
    fingerprint_model,
    is_adapter_dir,
    is_complete_stage,
    read_stage_json,
    read_train_data,
    save_policy,
    write_log_history,
    write_stage_json,
    write_train_data,
)

STAGE_ARGS = {
    "stage": "grpo-format",
    "kind": "grpo",
    "config": {"name": "format", "hub_token": "hf_abcdefghijklmnopqrstuvwxyz0123"},
    "config_hash": "c0ffee",
    "model_config_hash": "m0de1",
    "input_model": "/models/base",
    "input_fingerprint": "in-fp",
    "data_fingerprint": "data-fp",
    "seed": 3,
    "precision": "bf16",
    "metrics": {"loss": 0.25, "reward": 1.5},
    "alerts": [{"kind": "no_signal", "step": 1}],
    "samples": ["completions/completions_00001.parquet"],
    "artifact": "adapter",
    "adapter": {"base": "/models/base", "base_fingerprint": "in-fp", "root": "/models/base"},
    "duration_s": 12.34567,
}


def test_stage_json_records_what_produced_the_policy(tmp_path):
    info = write_stage_json(tmp_path, **STAGE_ARGS, extra={"trainer_options": {"lr": 1e-5, "dir": tmp_path}})
    on_disk = read_stage_json(tmp_path)
    assert on_disk == info
    assert {k: on_disk[k] for k in ("schema", "stage", "kind", "config_hash", "model_config_hash")} == {
        "schema": 1,
        "stage": "grpo-format",
        "kind": "grpo",
        "config_hash": "c0ffee",
        "model_config_hash": "m0de1",
    }
    assert on_disk["input_model"] == {"path": "/models/base", "fingerprint": "in-fp"}
    assert (on_disk["data_fingerprint"], on_disk["seed"], on_disk["precision"]) == ("data-fp", 3, "bf16")
    assert on_disk["artifact"] == "adapter" and on_disk["adapter"] == STAGE_ARGS["adapter"]
    assert on_disk["metrics"] == {"loss": 0.25, "reward": 1.5}
    assert on_disk["alerts"] == [{"kind": "no_signal", "step": 1}]
    assert on_disk["samples"] == ["completions/completions_00001.parquet"]
    assert on_disk["duration_s"] == 12.346
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", on_disk["created"])
    assert set(on_disk["versions"]) >= {"posttrain", "torch", "transformers", "trl", "peft"}
    assert on_disk["trainer_options"] == {"lr": 1e-5, "dir": str(tmp_path)}  # made JSON
    assert on_disk["config"] == {"name": "format", "hub_token": "***"}  # secrets never reach the disk
    assert "hf_abcdefghij" not in (tmp_path / "stage.json").read_text()
    assert (tmp_path / "stage.json").read_text().startswith('{\n  "schema": 1,\n  "stage"')  # indented


def test_stage_json_without_adapter_or_extra(tmp_path):
    info = write_stage_json(tmp_path, **{**STAGE_ARGS, "adapter": None, "artifact": "merged"})
    assert info["adapter"] is None and "trainer_options" not in info


def test_reading_a_missing_or_corrupt_stage_json_says_which(tmp_path):
    with pytest.raises(StageError, match=r"is not a posttrain stage output \(no stage.json\)"):
        read_stage_json(tmp_path)
    (tmp_path / "stage.json").write_text("{half")
    with pytest.raises(StageError, match=r"stage.json: malformed JSON .* \(a damaged stage.json\)"):
        read_stage_json(tmp_path)


def test_log_history_is_one_json_object_per_logged_step(tmp_path):
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "path": tmp_path}]
    write_log_history(tmp_path, rows)
    lines = (tmp_path / "log_history.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 0.5},
        {"step": 2, "path": str(tmp_path)},
    ]
    write_log_history(tmp_path, [{"step": 3}])  # rewritten, not appended
    assert (tmp_path / "log_history.jsonl").read_text() == '{"step": 3}\n'


def test_kept_training_data_reads_back_row_for_row_and_a_damaged_file_as_none(tmp_path, caplog):
    """The rows an rft: stage kept are logged as its MLflow dataset; a damaged or foreign file in
    the store is noted and logged as nothing, never half-read."""
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "completion": [{"role": "assistant", "content": "2"}],
        },
        {
            "prompt": [{"role": "user", "content": "2+2?"}],
            "completion": [{"role": "assistant", "content": "4"}],
        },
    ]
    assert read_train_data(tmp_path) is None  # a stage that kept none
    before = fingerprint_dir(tmp_path)
    write_train_data(tmp_path, rows)
    assert read_train_data(tmp_path).to_list() == rows
    assert fingerprint_dir(tmp_path) == before  # a record of the run, not part of the policy
    mixed = '{"prompt": "1+1?", "completion": "2"}\n{"prompt": [{"role": "user"}], "completion": "4"}\n'
    for damaged in ('{"prompt": [\n', "[1, 2]\n", mixed):
        (tmp_path / artifacts.TRAIN_DATA_FILE).write_text(damaged)
        with caplog.at_level(logging.WARNING):
            assert read_train_data(tmp_path) is None
    assert "not logging the stage's training data" in caplog.text


def test_stage_result_as_dict():
    result = StageResult("sft", "/out", {"loss": 1.0}, {"output": "fp"}, artifact="full")
    assert result.as_dict() == {
        "stage": "sft",
        "output_dir": "/out",
        "metrics": {"loss": 1.0},
        "fingerprints": {"output": "fp"},
        "alerts": (),
        "duration_s": 0.0,
        "samples": (),
        "artifact": "full",
        "adapter_base": None,
    }


def test_complete_stage_needs_stage_json_and_a_policy(tmp_path):
    (tmp_path / "stage.json").write_text("{}")
    assert not is_complete_stage(tmp_path)  # stage.json alone: no policy
    (tmp_path / "adapter_config.json").write_text("{}")
    assert is_complete_stage(tmp_path) and is_complete_stage(str(tmp_path))
    assert is_adapter_dir(tmp_path) and not is_adapter_dir(tmp_path / "nope")


def test_hidden_files_are_not_part_of_the_policy(tmp_path):
    (tmp_path / "model.safetensors").write_text("w")
    before = fingerprint_dir(tmp_path)
    (tmp_path / ".lock").write_text("editor")
    (tmp_path / "training_args.bin").write_text("args")
    assert fingerprint_dir(tmp_path) == before
    (tmp_path / "x.safetensors").write_text("w")
    assert fingerprint_dir(tmp_path) != before


def test_fingerprint_dataset_prefers_the_libraries_own():
    import datasets

    ds = datasets.Dataset.from_dict({"q": ["a", "b"]})
    assert fingerprint_dataset(ds) == ds._fingerprint
    rows = [{"q": "a"}, {"q": "b"}]
    plain = fingerprint_dataset(rows)  # anything iterable without one: a hash of its rows
    assert plain == hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    assert fingerprint_dataset([{"q": "a"}, {"q": "c"}]) != plain
    assert fingerprint_dataset([{"a": 1, "b": 2}]) == fingerprint_dataset([{"b": 2, "a": 1}])  # key order
    assert fingerprint_dataset([{"path": Path("/x")}]) == fingerprint_dataset([{"path": "/x"}])  # str()


def test_fingerprint_model_of_a_folder_a_builtin_and_a_hub_id(tmp_path, tiny_model_dir, monkeypatch):
    assert fingerprint_model(str(tiny_model_dir)) == fingerprint_dir(tiny_model_dir)
    monkeypatch.setenv("HOME", str(tmp_path))
    home_model = tmp_path / "models" / "mine"
    home_model.mkdir(parents=True)
    (home_model / "config.json").write_text("{}")
    assert fingerprint_model("~/models/mine") == fingerprint_dir(home_model)  # ~ expanded
    asked = []

    def resolve(name, cache_dir=None):
        asked.append((name, cache_dir))
        return str(tiny_model_dir)

    monkeypatch.setattr(artifacts, "resolve_model_path", resolve)
    assert fingerprint_model("tiny-random", tmp_path) == fingerprint_dir(tiny_model_dir)
    assert asked == [("tiny-random", tmp_path)]  # built-ins are looked up in the configured cache
    monkeypatch.setattr(artifacts, "resolve_model_path", lambda name, cache_dir=None: name)
    hub = fingerprint_model("org/model")
    assert hub == hashlib.sha256(b"hub:org/model@main").hexdigest()[:16]
    assert (
        fingerprint_model("org/model", revision="v2") == hashlib.sha256(b"hub:org/model@v2").hexdigest()[:16]
    )


@pytest.fixture
def lora_model(tiny_model_dir):
    """The tiny model with a LoRA adapter whose update is not zero (as after training)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.fill_(0.1)
    return peft, AutoTokenizer.from_pretrained(tiny_model_dir)


def _q_proj(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    weights = load_file(path / "model.safetensors")
    return weights[next(k for k in sorted(weights) if k.endswith("layers.0.self_attn.q_proj.weight"))]


def test_merge_policy_saves_the_trained_update_folded_in(lora_model, tiny_model_dir, tmp_path):
    model, tokenizer = lora_model
    assert save_policy(model, tokenizer, tmp_path, adapter_policy="merge") == "merged"
    assert not is_adapter_dir(tmp_path) and (tmp_path / "tokenizer_config.json").exists()
    assert not torch.equal(_q_proj(tmp_path), _q_proj(tiny_model_dir))  # not the untrained base


def test_adapter_policy_saves_only_the_adapter(lora_model, tmp_path):
    model, tokenizer = lora_model
    assert save_policy(model, tokenizer, tmp_path, adapter_policy="adapter") == "adapter"
    assert is_adapter_dir(tmp_path) and not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "tokenizer_config.json").exists()


def test_full_finetuning_saves_the_whole_model_whatever_the_policy(tiny_model_dir, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with caplog.at_level(logging.WARNING):
        assert save_policy(model, tokenizer, tmp_path / "a", adapter_policy="adapter") == "full"
    assert caplog.messages == [
        "adapter_policy: adapter needs LoRA (model.lora); full fine-tuning saves the whole model"
    ]
    caplog.clear()
    assert save_policy(model, tokenizer, tmp_path / "m", adapter_policy="merge") == "full"
    assert caplog.text == ""
    for out in ("a", "m"):
        assert torch.equal(_q_proj(tmp_path / out), _q_proj(tiny_model_dir))
        assert (tmp_path / out / "tokenizer_config.json").exists()


def test_an_adapter_chain_that_loops_is_an_error(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for adapter, parent in ((a, b), (b, a)):
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text("{}")
        (adapter / "stage.json").write_text(json.dumps({"adapter": {"base": str(parent)}}))
    with pytest.raises(StageError, match=f"adapter chain loops at {a}"):
        artifacts.adapter_root(a)


def test_tidying_deletes_unfinished_outputs_and_restores_interrupted_swaps(tmp_path, caplog):
    (tmp_path / "sft-1.tmp-aa").mkdir()  # killed while writing
    (tmp_path / "dpo-2").mkdir()
    (tmp_path / "dpo-2.old-bb").mkdir()  # killed after the swap: the new one is in place
    (tmp_path / "grpo-3.old-cc").mkdir()  # killed between the renames: the only copy
    (tmp_path / "grpo-3.old-cc" / "stage.json").write_text("{}")
    (tmp_path / "eval-4").mkdir()  # a finished output: untouched
    with caplog.at_level(logging.WARNING):
        touched = tidy_interrupted(tmp_path)
    assert [p.name for p in touched] == ["dpo-2.old-bb", "grpo-3.old-cc", "sft-1.tmp-aa"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dpo-2", "eval-4", "grpo-3"]
    assert (tmp_path / "grpo-3" / "stage.json").exists()
    assert caplog.messages == [f"restored {tmp_path / 'grpo-3'} from an interrupted replacement"]
    assert tidy_interrupted(tmp_path / "missing") == []


def test_tidying_never_follows_a_link(tmp_path):
    """A link named like a leftover is not posttrain's (it writes none): deleting or renaming
    through it would reach outside the store, so it is left as it is."""
    target = tmp_path / "elsewhere"
    (target / "keep").mkdir(parents=True)
    (tmp_path / "sft-1.tmp-aa").symlink_to(target)
    (tmp_path / "dpo-2.old-bb").symlink_to(target)
    assert tidy_interrupted(tmp_path) == []
    assert (target / "keep").is_dir() and (tmp_path / "sft-1.tmp-aa").is_symlink()
    assert tidy_interrupted(tmp_path / "sft-1.tmp-aa") == []  # nor a linked folder itself
