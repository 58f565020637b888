"""What a config may make TRL, peft, transformers and vLLM do: the one place that decides.

A config passes options through to other libraries (a stage's ``trainer:`` to TRL's config class,
``model.lora`` to ``peft.LoraConfig``, ``model.attn_implementation`` to transformers,
``vllm_server.extra_args`` to ``vllm serve``, in ``trl vllm-serve``'s words). Some of those options make the library load or
run code: a model repository's own modules (``trust_remote_code``), an attention kernel downloaded
from the hub (an ``org/repo`` attention implementation, ``use_kernels``), a module by name
(peft's ``megatron_core``), a generation loop from the hub (``custom_generate``), or a server flag
that vLLM turns into any of these. A config must never switch those on by itself: they are refused
unless custom code is allowed from *outside* the config, by ``--allow-custom-code`` or
``POSTTRAIN_ALLOW_CUSTOM_CODE=1`` (the same opt-in as custom ``module:function`` rewards), because a
config can come from anyone (a shared recipe, a Prefect deployment's parameters).

Three kinds of key are decided here:

* **managed**: posttrain sets them itself (``output_dir``, ``bf16``, ``push_to_hub``, peft's
  ``task_type``...); accepting them from YAML would silently fight the pipeline. Always refused, as
  is a trainer option holding a credential: transformers logs every trainer option to MLflow.
* **code**: keys that load or run code; refused without the opt-in.
* **server flags**: ``vllm_server.extra_args`` are parsed by the rules ``trl vllm-serve``'s argument
  parser applies, except that an abbreviation (``--mod`` for ``--model``) is refused, and each flag
  must be on :data:`VLLM_SERVE_FLAGS`, an allow list; with the opt-in, other flags (forwarded to
  ``vllm serve``) pass too. ``--model``, ``--host``, ``--port`` and ``--revision`` are posttrain's,
  opt-in or not.

The checks are cheap (no library import), so they run on every load, outside the remembered TRL and
peft checks (:mod:`posttrain.core.checked`): the opt-in is not part of what a remembered pass means.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.core.errors import ConfigError
from posttrain.core.redact import redact

__all__ = [
    "CUSTOM_CODE_ENV",
    "CustomCodeRefused",
    "MANAGED_LORA_KEYS",
    "MANAGED_TRAINER_KEYS",
    "OWNED_SERVER_FLAGS",
    "VLLM_SERVE_FLAGS",
    "allow_custom_code",
    "check_attn_implementation",
    "check_lora_options",
    "check_server_args",
    "check_trainer_options",
    "custom_code_allowed",
    "import_named",
    "is_custom",
    "opt_in_hint",
]

CUSTOM_CODE_ENV = "POSTTRAIN_ALLOW_CUSTOM_CODE"


def custom_code_allowed() -> bool:
    """Whether the config may make code run: ``$POSTTRAIN_ALLOW_CUSTOM_CODE`` (``--allow-custom-code``).

    The opt-in lives outside the config on purpose: a config (or a deployment's parameters) must
    never be able to grant itself the right to run code.
    """
    return os.environ.get(CUSTOM_CODE_ENV, "").strip().lower() in {"1", "true", "yes"}


def allow_custom_code() -> None:
    """Opt in for this process and the processes it starts (what ``--allow-custom-code`` does)."""
    os.environ[CUSTOM_CODE_ENV] = "1"


def opt_in_hint() -> str:
    return f"allow it with --allow-custom-code (or {CUSTOM_CODE_ENV}=1) if you trust this config"


# --------------------------------------------------------------------------- code a config names


class CustomCodeRefused(ConfigError):
    """A config names code (``module:function``) and the opt-in is absent."""


def is_custom(name: str) -> bool:
    """Whether ``name`` names code, ``package.module:attribute`` (a custom reward, tool or environment).

    >>> is_custom("pkg.tools:search"), is_custom("calculator")
    (True, False)
    """
    return isinstance(name, str) and ":" in name


def import_named(name: str, what: str) -> Any:
    """The attribute ``name`` (``package.module:attr.path``) names, imported only with the opt-in.

    ``what`` says what the config uses it for (``custom reward``, ``custom tool``), for the messages.
    """
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{what} {name!r} must look like 'package.module:function'")
    if not custom_code_allowed():
        raise CustomCodeRefused(
            f"{what} {name!r} would import and run code named by the config; {opt_in_hint()}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {name!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {name!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- TRL (trainer:)

MANAGED_TRAINER_KEYS = {
    "output_dir": "posttrain chooses each stage's output directory inside the store",
    "bf16": "set model.precision (auto|fp32|bf16|fp16) instead",
    "fp16": "set model.precision (auto|fp32|bf16|fp16) instead",
    "use_cpu": "posttrain picks the device from the hardware",
    "seed": "the run's seed is the top-level `seed`, which seeds TRL (see its entry in the config reference)",
    "data_seed": "the run's seed is the top-level `seed`, which seeds TRL's data order too; the split's "
    "seed is data.seed",
    "report_to": "tracking is configured in the `tracking:` section",
    "reward_weights": "give each reward a `weight` in the stage's `rewards:` list",
    "resume_from_checkpoint": "posttrain resumes a killed stage from its last checkpoint by itself: "
    "rerun `posttrain run` (finished stages are reused; --force STEP retrains one from scratch)",
    "save_only_model": "checkpoints keep the optimizer, scheduler and RNG states so a killed stage "
    "resumes exactly; set save_strategy: 'no' to write no checkpoints",
    "push_to_hub": "posttrain never publishes: upload a stage directory from the store or the MLflow model",
    "hub_token": "credentials never go in a config: set HF_TOKEN in the environment",
    "log_completions_hub_repo": "posttrain never publishes: completions are kept in the stage output "
    "and logged to MLflow",
}
"""``trainer:`` keys posttrain sets itself (refused always)."""

_CODE_TRAINER_KEYS = {
    "trust_remote_code": "would let transformers and vLLM run the model repository's own code",
}
"""``trainer:`` keys that make a library run code when set to a true value."""

# Keys, at any depth inside a trainer option's mapping (model_init_kwargs, generation_kwargs, ...),
# that make transformers or vLLM load code: true values only, except where any value does.
_NESTED_CODE_KEYS = {
    "trust_remote_code": "would let transformers and vLLM run the model repository's own code",
    "use_kernels": "would download and run kernels from the Hugging Face Hub",
    "kernel_config": "would download and run kernels from the Hugging Face Hub",
    "custom_generate": "would download and run a generation loop from the Hugging Face Hub",
    "code_revision": "names a revision of the model repository's own code",
}
_ANY_VALUE = {"kernel_config", "custom_generate", "code_revision"}

MODEL_INIT_KWARGS = frozenset(
    {
        "dtype",
        "torch_dtype",
        "attn_implementation",
        "device_map",
        "low_cpu_mem_usage",
        "use_cache",
        "max_memory",
    }
)
"""``trainer.model_init_kwargs`` keys (``from_pretrained`` options TRL uses for a reference model) a
config may set without the opt-in: how to load the weights, nothing that chooses code."""


def check_trainer_options(options: Mapping[str, Any]) -> None:
    """Refuse managed keys always, and keys that load code without the opt-in (ValueError naming the key).

    >>> check_trainer_options({"learning_rate": 1e-5, "model_init_kwargs": {"dtype": "bfloat16"}})
    >>> check_trainer_options({"output_dir": "/tmp"})
    Traceback (most recent call last):
    ValueError: 'output_dir' is managed by posttrain: posttrain chooses each stage's output directory inside the store
    """
    for key in options:
        if key in MANAGED_TRAINER_KEYS:
            raise ValueError(f"'{key}' is managed by posttrain: {MANAGED_TRAINER_KEYS[key]}")
    for key, value in options.items():
        if redact({key: value}) != {key: value}:
            raise ValueError(
                f"option '{key}' holds a credential (a secret-looking key, a URI password or a token): "
                "transformers logs every trainer option to MLflow as it is; pass credentials through "
                "the environment (HF_TOKEN, ...)"
            )
    if custom_code_allowed():
        return
    for key, value in options.items():
        if key in _CODE_TRAINER_KEYS and not _falsy(value):
            raise ValueError(f"option '{key}' {_CODE_TRAINER_KEYS[key]}; {opt_in_hint()}")
        if key == "model_init_kwargs" and isinstance(value, Mapping):
            for inner in value:
                if inner not in MODEL_INIT_KWARGS and inner not in _NESTED_CODE_KEYS:
                    raise ValueError(
                        f"option 'model_init_kwargs.{inner}' is not among the loading options a config "
                        f"may pass ({', '.join(sorted(MODEL_INIT_KWARGS))}); {opt_in_hint()}"
                    )
            if "attn_implementation" in value:
                check_attn_implementation(
                    value["attn_implementation"], "model_init_kwargs.attn_implementation"
                )
        _refuse_nested_code(value, key)


def _falsy(value: Any) -> bool:
    """False the way a library reading the option would take it (unsure means true: refused)."""
    if isinstance(value, str):
        return value.strip().lower() in {"false", "no", "off", "0", "n", "f", ""}
    return value is None or value is False or value == 0


def _refuse_nested_code(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            path = f"{where}.{key}"
            if key in _NESTED_CODE_KEYS and (key in _ANY_VALUE or not _falsy(item)):
                raise ValueError(f"option '{path}' {_NESTED_CODE_KEYS[key]}; {opt_in_hint()}")
            _refuse_nested_code(item, path)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _refuse_nested_code(item, f"{where}.{index}")


# --------------------------------------------------------------------------- transformers

_ATTENTION = ("eager", "sdpa", "flex_attention", "paged|eager", "paged|sdpa")
_FLASH = re.compile(r"^(paged\|)?flash_attention_[234]$")
# transformers' own test for a hub kernel repository (integrations/hub_kernels.py, is_kernel).
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")


def check_attn_implementation(name: Any, key: str = "attn_implementation") -> None:
    """An attention implementation transformers runs from its own code, or ValueError.

    A name of the form ``org/repo`` (transformers' hub-kernel pattern) downloads and runs that
    repository's kernel; ``flash_attention_N`` does the same when the ``flash_attn`` package is
    missing and the ``kernels`` package is installed (transformers falls back to a hub kernel).
    Both need the opt-in.

    >>> check_attn_implementation("sdpa")
    >>> check_attn_implementation("kernels-community/flash-attn")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: attn_implementation 'kernels-community/flash-attn' names a kernel repository ...
    """
    if name is None or custom_code_allowed():
        return
    if not isinstance(name, str):
        raise ValueError(f"{key} must be a string, got {name!r}")
    if name in _ATTENTION:
        return
    if _FLASH.match(name):
        import importlib.util

        if importlib.util.find_spec("kernels") is not None and importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                f"{key} {name!r}: flash_attn is not installed, so transformers would download and run a "
                f"flash-attention kernel from the Hugging Face Hub instead; install flash_attn, or {opt_in_hint()}"
            )
        return
    if _HUB_KERNEL.match(name):
        raise ValueError(
            f"{key} {name!r} names a kernel repository on the Hugging Face Hub (transformers would "
            f"download and run its code); {opt_in_hint()}"
        )
    choices = ", ".join([*_ATTENTION, "flash_attention_2", "flash_attention_3", "flash_attention_4"])
    raise ValueError(f"{key} {name!r} is not one of transformers' attention implementations ({choices})")


# --------------------------------------------------------------------------- peft (model.lora)

MANAGED_LORA_KEYS = {
    "task_type": "posttrain trains causal LMs (CAUSAL_LM)",
    "peft_type": "model.lora is a LoRA adapter",
    "base_model_name_or_path": "posttrain records each stage's base model itself",
    "revision": "set model.revision",
    "inference_mode": "posttrain trains the adapter",
    "auto_mapping": "set by peft",
    "peft_version": "set by peft",
}
"""``model.lora`` keys posttrain (or peft) sets itself (refused always)."""

_CODE_LORA_KEYS = {
    "megatron_core": "names a module peft imports",
    "megatron_config": "makes peft import the module named by megatron_core",
}


def check_lora_options(options: Mapping[str, Any]) -> None:
    """Refuse managed ``model.lora`` keys always, and keys that import code without the opt-in.

    >>> check_lora_options({"megatron_core": "os"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: option 'megatron_core' names a module peft imports; allow it with --allow-custom-code ...
    """
    for key in options:
        if key in MANAGED_LORA_KEYS:
            raise ValueError(f"'{key}' is managed by posttrain: {MANAGED_LORA_KEYS[key]}")
    if custom_code_allowed():
        return
    for key, value in options.items():
        if key in _CODE_LORA_KEYS and value is not None:
            raise ValueError(f"option '{key}' {_CODE_LORA_KEYS[key]}; {opt_in_hint()}")


# --------------------------------------------------------------------------- vLLM (trl vllm-serve)

OWNED_SERVER_FLAGS = {
    "model": "the stage's model",
    "host": "vllm_server.host",
    "port": "vllm_server.port",
    "revision": "model.revision",
}
"""``trl vllm-serve`` options posttrain sets itself (refused, opt-in or not)."""

_BOOL_WORDS = {"yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"}


def _positive_int(text: str) -> bool:
    return text.isdigit() and 0 < int(text) <= 1 << 20


def _fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def _one_of(*choices: str) -> tuple[Any, str]:
    return (lambda text: text in choices), "one of " + ", ".join(choices)


VLLM_SERVE_FLAGS: dict[str, tuple[Any, str] | None] = {
    "tensor_parallel_size": (_positive_int, "a whole number >= 1"),
    "data_parallel_size": (_positive_int, "a whole number >= 1"),
    "gpu_memory_utilization": (_fraction, "a fraction in (0, 1]"),
    "dtype": _one_of("auto", "half", "float16", "bfloat16", "float", "float32"),
    "max_model_len": (_positive_int, "a whole number >= 1"),
    "enable_prefix_caching": None,
    "enforce_eager": None,
    "kv_cache_dtype": _one_of("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    "log_level": _one_of("critical", "error", "warning", "info", "debug", "trace"),
    "vllm_model_impl": _one_of("vllm", "transformers"),
}
"""``trl vllm-serve`` options a config may pass without the opt-in, and how each value is checked
(None: a boolean flag, alone or with yes/no/true/false/1/0). Everything else ``trl vllm-serve``
accepts (``--trust_remote_code``, ``--speculative_config``, ``--config``, which sets environment
variables, or any ``vllm serve`` flag it forwards) needs the opt-in."""
# Every long option `trl vllm-serve` itself declares (TRL 1.16, trl/scripts/vllm_serve.py):
# abbreviations are checked against these, as argparse would expand them.
_TRL_SERVE_OPTIONS = (
    *VLLM_SERVE_FLAGS,
    *OWNED_SERVER_FLAGS,
    "trust_remote_code",
    "distributed_executor_backend",
    "speculative_config",
    "config",
    "help",
)
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def check_server_args(args: Sequence[str]) -> list[str]:
    """``vllm_server.extra_args`` checked flag by flag; returns them unchanged, or raises ValueError.

    Parsed as ``trl vllm-serve``'s parser reads them (``--flag value``, ``--flag=value``, dashes or
    underscores), but a flag must be spelled in full: argparse would expand ``--mod`` to ``--model``.

    >>> check_server_args(["--gpu_memory_utilization", "0.8", "--enforce-eager"])
    ['--gpu_memory_utilization', '0.8', '--enforce-eager']
    >>> check_server_args(["--mod", "other/model"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: '--mod': abbreviations are refused (argparse would read it as --model); ...
    """
    allowed_code = custom_code_allowed()
    i = 0
    while i < len(args):
        arg = args[i]
        if not isinstance(arg, str) or not arg.startswith("--") or arg == "--":
            raise ValueError(
                f"{arg!r} is not a --flag: extra_args are flags with their values (a bare word would "
                "be read as another model or forwarded to vllm serve)"
            )
        flag, eq, inline = arg[2:].partition("=")
        name = flag.replace("-", "_")
        following = args[i + 1] if i + 1 < len(args) else None
        takes_next = (
            not eq
            and isinstance(following, str)
            and (not following.startswith("-") or bool(_NUMBER.match(following)))
        )
        if name not in _TRL_SERVE_OPTIONS:
            expands = sorted(o for o in _TRL_SERVE_OPTIONS if o.startswith(name))
            if expands:
                raise ValueError(
                    f"{arg!r}: abbreviations are refused (argparse would read it as --{expands[0]}); "
                    "write the flag in full"
                )
        if name in OWNED_SERVER_FLAGS:
            raise ValueError(f"--{flag} is set by posttrain ({OWNED_SERVER_FLAGS[name]}); remove it")
        if name not in VLLM_SERVE_FLAGS:
            if not allowed_code:
                shown = ", ".join(f"--{f}" for f in VLLM_SERVE_FLAGS)
                raise ValueError(
                    f"--{flag} is not among the server flags a config may pass ({shown}): it reaches "
                    f"vLLM unchecked; {opt_in_hint()}"
                )
            i += 2 if takes_next else 1
            continue
        rule = VLLM_SERVE_FLAGS[name]
        if rule is None:  # a boolean: alone, =value, or the next word when it is not a flag
            value = inline if eq else (following if takes_next else "true")
            if str(value).lower() not in _BOOL_WORDS:
                raise ValueError(f"--{flag}: {value!r} is not a boolean (true or false)")
        else:
            if not eq and not takes_next:
                raise ValueError(f"--{flag} needs a value")
            value = inline if eq else following
            check, need = rule
            if not check(value):
                raise ValueError(f"--{flag}: {value!r} is not {need}")
        i += 2 if takes_next else 1
    return list(args)
