"""TRL options passed through from YAML, checked against the real TRL config classes.

A stage's ``trainer:`` mapping goes to ``trl.SFTConfig`` / ``DPOConfig`` / ``GRPOConfig`` unchanged,
so posttrain never re-declares TRL's options. What posttrain adds is checking them at load time:
unknown keys (with suggestions and notes on options renamed across versions), value types, TRL's own
cross-field checks, and what :mod:`posttrain.core.library_policy` refuses (keys posttrain manages
itself, options that would make a library run code).
"""

from __future__ import annotations

import difflib
import math
import tempfile
import typing
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from posttrain.core.checked import remembered_check
from posttrain.core.errors import refused_option
from posttrain.core.library_policy import check_trainer_options

# Values TRL accepts (or crashes on later, e.g. num_generations: 0 divides by zero) that cannot train.
_POSITIVE = ("learning_rate",)
_AT_LEAST_ONE = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "max_completion_length",
    "max_prompt_length",
    "logging_steps",
    "steps_per_generation",
    "generation_batch_size",
)
_NON_NEGATIVE = ("beta", "weight_decay", "warmup_steps", "warmup_ratio", "max_grad_norm")
# Values beyond what any run can use (a batch of 10^5 completions allocates before it fails).
_AT_MOST = {
    "learning_rate": 10.0,
    "per_device_train_batch_size": 65_536,
    "gradient_accumulation_steps": 65_536,
    "num_generations": 4096,
    "generation_batch_size": 1 << 20,
    "steps_per_generation": 65_536,
    "num_iterations": 1024,
    "max_completion_length": 1 << 20,
    "max_length": 1 << 20,
    "num_train_epochs": 10_000,
    "max_steps": 100_000_000,
}
# String options TRL types as plain `str` and checks only when the first step runs (an unknown
# `scale_rewards` raises after the model has loaded and the first rollouts are generated): the values
# TRL 1.16 handles, from its field help, so a typo fails at load time. tests/unit/test_config.py
# pins each list against that help.
_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "grpo": {
        "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
        "scale_rewards": ("group", "batch", "none"),
        "importance_sampling_level": ("token", "sequence"),
        "vllm_mode": ("server", "colocate"),
    },
}
# Options people carry over from other libraries or older TRL versions.
_RENAMED_TRAINER_KEYS = {
    "kl_coef": "the KL coefficient is `beta` in TRL 1.16 (default 0.0)",
    "max_new_tokens": "use `max_completion_length`",
    "max_prompt_length": "TRL 1.16 never truncates prompts; use data.max_prompt_tokens",
}

# Checkpoints, so a killed stage resumes (posttrain.training.stage_run): every tenth of the stage
# (a ratio suits a 20-step CPU stage and a 2,000-step GPU stage alike: at most a tenth of the work is
# lost, and a stage writes about ten checkpoints whatever its length), only the newest kept. The
# trainer deletes the previous checkpoint only after the new one is complete.
CHECKPOINT_DEFAULTS: dict[str, Any] = {"save_strategy": "steps", "save_steps": 0.1, "save_total_limit": 1}
CHECKPOINT_OPTIONS = frozenset({"save_strategy", "save_steps", "save_total_limit"})
"""Options that say when checkpoints are written, not what a stage produces (kept out of cache keys)."""

# posttrain's defaults under each TRL config; YAML values win. They favour small CPU runs:
# log every step (short runs otherwise show nothing).
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {
        "learning_rate": 5e-5,
        "num_train_epochs": 1,
        "per_device_train_batch_size": 8,
        "logging_steps": 1,
        **CHECKPOINT_DEFAULTS,
        "activation_checkpointing": False,
        "max_length": 512,
    },
    "dpo": {
        "learning_rate": 5e-6,
        "num_train_epochs": 1,
        "per_device_train_batch_size": 8,
        "logging_steps": 1,
        **CHECKPOINT_DEFAULTS,
        "activation_checkpointing": False,
        "max_length": 768,
    },
    "grpo": {
        "learning_rate": 5e-6,
        "per_device_train_batch_size": 8,
        "num_generations": 8,
        "max_completion_length": 256,
        "logging_steps": 1,
        **CHECKPOINT_DEFAULTS,
        "activation_checkpointing": False,
        "log_completions": True,
        "disable_dropout": True,
        "num_completions_to_print": 2,
    },
}


def generation_blockers(options: Any) -> list[str]:
    """The GRPO options (a mapping, or TRL's ``GRPOConfig``) that posttrain's generation engine does
    not reproduce, so TRL (or vLLM) must generate: temperature-only sampling is what the engine does.

    >>> generation_blockers({"temperature": 1.0, "top_p": 1.0}), generation_blockers({"top_p": 0.9, "use_vllm": True})
    ([], ['top_p=0.9', 'use_vllm'])
    """
    get = (
        options.get if isinstance(options, dict) else lambda key, default=None: getattr(options, key, default)
    )
    temperature, top_p, top_k = get("temperature", 1.0), get("top_p", 1.0), get("top_k", 0)
    min_p, penalty = get("min_p"), get("repetition_penalty", 1.0)
    checks = [
        (temperature is not None and temperature <= 0, f"temperature={temperature}"),
        (top_p not in (None, 1.0), f"top_p={top_p}"),
        (top_k not in (None, 0), f"top_k={top_k}"),
        (min_p is not None, f"min_p={min_p}"),
        (penalty not in (None, 1.0), f"repetition_penalty={penalty}"),
        (get("cache_implementation") is not None, "cache_implementation"),
        (bool(get("generation_kwargs")), "generation_kwargs"),
        (bool(get("use_vllm", False)), "use_vllm"),
        (bool(get("use_transformers_continuous_batching", False)), "use_transformers_continuous_batching"),
    ]
    return [reason for blocked, reason in checks if blocked]


@cache
def _trl_config_class(kind: str) -> type:
    import trl  # heavy: deferred until needed

    return {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig}[kind]


@cache
def _trl_field_types(kind: str) -> dict[str, Any]:
    return typing.get_type_hints(_trl_config_class(kind))


# What a check's outcome depends on besides the options and this module (see core/checked.py).
_CHECK_PACKAGES = ("trl", "transformers", "accelerate", "torch", "pydantic")


def validate_trainer_options(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """Check ``options`` against TRL's config class for ``kind`` and return them type-coerced.

    Unknown keys, wrong types and TRL's own cross-field checks (e.g. ``generation_batch_size``
    divisible by ``num_generations``) all fail here. The real config object is built on the CPU
    with fp32 so that GPU-only settings still validate on any machine. A pass is remembered
    (:mod:`posttrain.core.checked`), so loading an unchanged config does not import TRL again; what
    the options may make TRL do is decided first, every time (it depends on the opt-in).
    """
    check_trainer_options(options)
    return remembered_check(
        f"trainer.{kind}",
        options,
        lambda: _validate_trainer_options(kind, options),
        packages=_CHECK_PACKAGES,
        source=__file__,
    )


def _validate_trainer_options(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    cls = _trl_config_class(kind)
    types = _trl_field_types(kind)
    coerced: dict[str, Any] = {}
    for key, value in options.items():
        if key in _RENAMED_TRAINER_KEYS and key not in types:
            raise ValueError(f"unknown {cls.__name__} option '{key}': {_RENAMED_TRAINER_KEYS[key]}")
        if key not in types:
            close = difflib.get_close_matches(key, list(types), n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise ValueError(f"unknown {cls.__name__} option '{key}'{hint}")
        try:
            coerced[key] = TypeAdapter(types[key]).validate_python(value)
        except ValidationError as exc:
            raise refused_option(key, exc.errors()[0]["msg"], value) from None
    merged = {**TRAINER_DEFAULTS[kind], **coerced}
    _check_ranges(kind, merged, set(coerced))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cls(output_dir=tmp, use_cpu=True, bf16=False, fp16=False, report_to="none", **merged)
        except Exception as exc:  # TRL raises ValueError/TypeError, and worse (ZeroDivisionError) on nonsense
            raise ValueError(f"{cls.__name__} rejects these options: {exc}") from None
    return coerced


def _check_ranges(kind: str, options: dict[str, Any], given: set[str]) -> None:
    """Values no stage can train with, named by option (``given`` = the keys the YAML set)."""

    def bad(key: str, need: str) -> ValueError:
        where = "" if key in given else " (posttrain's default; set it in trainer:)"
        return ValueError(f"option '{key}' must be {need}, got {options[key]!r}{where}")

    for key in _POSITIVE:
        if isinstance(options.get(key), int | float) and not options[key] > 0:
            raise bad(key, "> 0")
    for key in _AT_LEAST_ONE:
        if isinstance(options.get(key), int | float) and options[key] < 1:
            raise bad(key, ">= 1")
    for key in _NON_NEGATIVE:
        if isinstance(options.get(key), int | float) and options[key] < 0:
            raise bad(key, ">= 0")
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(key, "a finite number")
    for key, most in _AT_MOST.items():
        if isinstance(options.get(key), int | float) and options[key] > most:
            raise bad(key, f"at most {most:,}")
    max_steps = options.get("max_steps", -1)
    if isinstance(max_steps, int) and max_steps != -1 and max_steps < 1:
        raise bad("max_steps", ">= 1 (or -1 to train num_train_epochs epochs)")
    epochs = options.get("num_train_epochs")
    if max_steps == -1 and isinstance(epochs, int | float) and not epochs > 0:
        raise bad("num_train_epochs", "> 0 when max_steps is -1")
    if kind == "grpo" and isinstance(options.get("num_generations"), int) and options["num_generations"] < 2:
        raise bad("num_generations", ">= 2 (GRPO compares completions of one prompt)")
    temperature = options.get("temperature")
    if isinstance(temperature, int | float) and not temperature > 0:
        raise bad("temperature", "> 0")
    for key, choices in _CHOICES.get(kind, {}).items():
        if isinstance(options.get(key), str) and options[key] not in choices:
            raise bad(key, "one of " + ", ".join(repr(c) for c in choices))
