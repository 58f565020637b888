"""The errors posttrain expects and reports as one line (the CLI exits 2 on any of them).

They live in the lowest layer so every layer raises the same classes and the CLI catches them by
one base class, :class:`PosttrainError`, instead of importing one error from each package.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "HardwareError",
    "ModelError",
    "PosttrainError",
    "StageError",
    "TrackingError",
    "refused_option",
    "yaml_boolean_hint",
]


class PosttrainError(Exception):
    """Base of every expected failure; the message is one line that says what to change."""


class ConfigError(PosttrainError, ValueError):
    """A config that cannot be loaded; the message names the file and the key."""


class DataError(PosttrainError, ValueError):
    """Data that cannot be used; the message names where (file:line, hub split) and what is wrong."""


class ModelError(PosttrainError, RuntimeError):
    """A model that cannot be resolved, fetched or loaded; the message says which and why."""


class HardwareError(ModelError):
    """The config asks for hardware this machine lacks (bf16 GPU, CUDA for 4-bit, vLLM...)."""


class StageError(PosttrainError, RuntimeError):
    """A stage that cannot run or whose output cannot be read; the message says what to change."""


class TrackingError(PosttrainError, ValueError):
    """A tracking store, experiment or run that cannot be used; the message says which and where."""


def yaml_boolean_hint(value: object) -> str:
    """A hint to append when a config value that was refused is a boolean, else ``""``.

    YAML 1.1 (PyYAML, so every config and ``--set``) reads unquoted ``yes``/``no``/``on``/``off`` as
    booleans, so ``save_strategy: no`` arrives as ``False`` and the refusal alone reads like nonsense.

    >>> yaml_boolean_hint(False)
    " (YAML reads unquoted yes/no/on/off/true/false as a boolean: quote the word, e.g. 'no')"
    >>> yaml_boolean_hint("no")
    ''
    """
    if not isinstance(value, bool):
        return ""
    return " (YAML reads unquoted yes/no/on/off/true/false as a boolean: quote the word, e.g. 'no')"


def refused_option(key: str, problem: str, value: object) -> ValueError:
    """The error for a trainer or LoRA option whose value its library's type refuses.

    >>> str(refused_option("bias", "Input should be 'none', 'all' or 'lora_only'", False))[:60]
    "option 'bias': Input should be 'none', 'all' or 'lora_only' "
    """
    return ValueError(f"option '{key}': {problem} (got {value!r}){yaml_boolean_hint(value)}")
