"""What a config may make TRL, peft, transformers and vLLM do (core/library_policy.py): managed keys
always refused, code-loading keys refused without the opt-in from outside the config, server flags
parsed as `trl vllm-serve` parses them (abbreviations refused) and matched against an allow list."""

from __future__ import annotations

import argparse

import pytest

from posttrain.core.library_policy import (
    CUSTOM_CODE_ENV,
    OWNED_SERVER_FLAGS,
    VLLM_SERVE_FLAGS,
    check_attn_implementation,
    check_lora_options,
    check_server_args,
    check_trainer_options,
)


@pytest.fixture
def no_opt_in(monkeypatch):
    monkeypatch.delenv(CUSTOM_CODE_ENV, raising=False)


@pytest.fixture
def opt_in(monkeypatch):
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--mod", "other/model"], "abbreviations are refused .* --model"),  # swaps the served model
        (["--hos", "0.0.0.0"], "abbreviations are refused .* --host"),  # binds every interface
        (["--po=9"], "abbreviations are refused .* --port"),
        (["--trust-rem"], "abbreviations are refused .* --trust_remote_code"),
        (["--gpu-memory", "0.5"], "abbreviations are refused .* --gpu_memory_utilization"),
        (["--model", "x"], "--model is set by posttrain"),
        (["--revision=main"], "--revision is set by posttrain"),
        (["--trust_remote_code"], "--trust_remote_code is not among the server flags"),
        (["--speculative-config", "{}"], "is not among the server flags"),
        (["--max-num-seqs", "8"], "is not among the server flags"),  # forwarded to vllm serve unchecked
        (["other/model"], "is not a --flag"),
        (["-tp", "2"], "is not a --flag"),
        (["--"], "is not a --flag"),
        (["--gpu_memory_utilization"], "needs a value"),
        (["--gpu_memory_utilization", "--enforce_eager"], "needs a value"),
        (["--dtype", "int3"], "is not one of auto"),
        (["--enforce_eager", "maybe"], "is not a boolean"),
        (["--tensor_parallel_size", "0"], "is not a whole number"),
    ],
)
def test_server_flags_off_the_allow_list_or_abbreviated_are_refused(args, pattern, no_opt_in):
    with pytest.raises(ValueError, match=pattern):
        check_server_args(args)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--gpu_memory_utilization", "0.8", "--max-model-len", "4096"],
        ["--enforce_eager", "--enable-prefix-caching", "false", "--dtype=bfloat16"],
        ["--log_level", "warning", "--vllm_model_impl", "transformers", "--kv_cache_dtype", "fp8"],
    ],
)
def test_allowed_server_flags_pass_unchanged(args, no_opt_in):
    assert check_server_args(args) == args


def test_with_the_opt_in_other_flags_pass_but_owned_ones_and_abbreviations_never(opt_in):
    args = ["--max-num-seqs", "8", "--trust-remote-code", "--speculative_config", '{"n": 1}']
    assert check_server_args(args) == args
    for bad in (["--model", "x"], ["--mod", "x"], ["--host=0.0.0.0"], ["--hos=0.0.0.0"]):
        with pytest.raises(ValueError):
            check_server_args(bad)


def test_the_abbreviation_rule_matches_argparse():
    """Every flag the check refuses as an abbreviation is one argparse (as TRL builds it, dashes and
    underscores, abbreviations on) would expand; the check's list of TRL's options is complete."""
    import dataclasses

    from trl.scripts.vllm_serve import ScriptArguments

    fields = {f.name for f in dataclasses.fields(ScriptArguments)}
    assert fields == set(VLLM_SERVE_FLAGS) | set(OWNED_SERVER_FLAGS) | {
        "trust_remote_code",
        "distributed_executor_backend",
        "speculative_config",
    }
    parser = argparse.ArgumentParser(allow_abbrev=True, add_help=False)
    for name in fields:
        parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}")
    ns, rest = parser.parse_known_args(["--mod", "other/model", "--hos", "0.0.0.0"])
    assert (ns.model, ns.host, rest) == ("other/model", "0.0.0.0", [])  # what the check guards against


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"output_dir": "/tmp/x"}, "'output_dir' is managed by posttrain"),
        ({"log_completions_hub_repo": "me/x"}, "posttrain never publishes"),
        ({"trust_remote_code": True}, "'trust_remote_code' would let"),
        ({"trust_remote_code": "True"}, "'trust_remote_code' would let"),
        ({"model_init_kwargs": {"trust_remote_code": 1}}, "'model_init_kwargs.trust_remote_code'"),
        ({"model_init_kwargs": {"code_revision": "abc"}}, "'model_init_kwargs.code_revision'"),
        ({"model_init_kwargs": {"kernel_config": {}}}, "'model_init_kwargs.kernel_config'"),
        ({"model_init_kwargs": {"subfolder": "x"}}, "not among the loading options"),
        ({"model_init_kwargs": {"attn_implementation": "org/kernel"}}, "kernel repository"),
        ({"generation_kwargs": {"custom_generate": "org/loop"}}, "'generation_kwargs.custom_generate'"),
        ({"transformers_continuous_batching_config": {"x": [{"trust_remote_code": True}]}}, "x.0.trust"),
    ],
)
def test_trainer_options_that_load_code_need_the_opt_in(options, pattern, no_opt_in):
    with pytest.raises(ValueError, match=pattern):
        check_trainer_options(options)


def test_the_opt_in_allows_code_but_never_managed_keys(opt_in):
    check_trainer_options({"trust_remote_code": True, "model_init_kwargs": {"trust_remote_code": True}})
    check_attn_implementation("kernels-community/flash-attn")
    check_lora_options({"megatron_core": "megatron.core", "megatron_config": {}})
    with pytest.raises(ValueError, match="managed"):
        check_trainer_options({"push_to_hub": True})
    with pytest.raises(ValueError, match="managed"):
        check_lora_options({"task_type": "SEQ_CLS"})


@pytest.mark.parametrize(
    ("options", "ok"),
    [
        (
            {"trust_remote_code": False, "model_init_kwargs": {"dtype": "bfloat16", "use_kernels": False}},
            True,
        ),
        ({"generation_kwargs": {"top_p": 0.9}}, True),
        ({"model_init_kwargs": {"attn_implementation": "sdpa", "device_map": "auto"}}, True),
    ],
)
def test_harmless_settings_pass(options, ok, no_opt_in):
    check_trainer_options(options)


@pytest.mark.parametrize(
    "name", ["eager", "sdpa", "flex_attention", "paged|eager", "flash_attention_2", None]
)
def test_attention_implementations_transformers_runs_from_its_own_code(name, no_opt_in):
    check_attn_implementation(name)


def test_flash_attention_is_refused_where_transformers_would_fetch_a_hub_kernel(no_opt_in, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "kernels" else real(name, *a)
    )
    with pytest.raises(ValueError, match="flash_attn is not installed"):
        check_attn_implementation("flash_attention_2")
