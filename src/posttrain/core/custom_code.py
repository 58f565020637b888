"""Code a config names (``package.module:attribute``): imported only with an opt-in from outside the config.

Custom rewards, custom tools and environment factories are code chosen by whoever wrote the config.
A config, or a deployment's parameters, must never be able to grant itself the right to run code, so
the opt-in is the environment: ``POSTTRAIN_ALLOW_CUSTOM_CODE=1`` (the CLI's ``--allow-custom-code``
sets it for the command and the processes it starts). Without it a name is refused before anything
is imported.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from posttrain.core.errors import ConfigError

__all__ = [
    "CUSTOM_CODE_ENV",
    "CustomCodeRefused",
    "allow_custom_code",
    "custom_code_allowed",
    "import_named",
    "is_custom",
]

CUSTOM_CODE_ENV = "POSTTRAIN_ALLOW_CUSTOM_CODE"


class CustomCodeRefused(ConfigError):
    """A config names code (``module:function``) and the opt-in is absent."""


def custom_code_allowed() -> bool:
    """Whether code named by a config may be imported: ``$POSTTRAIN_ALLOW_CUSTOM_CODE``."""
    return os.environ.get(CUSTOM_CODE_ENV, "").strip().lower() in {"1", "true", "yes"}


def allow_custom_code() -> None:
    """Opt in for this process and the processes it starts (what ``--allow-custom-code`` does)."""
    os.environ[CUSTOM_CODE_ENV] = "1"


def is_custom(name: str) -> bool:
    """Whether ``name`` names code, ``package.module:attribute``.

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
            f"{what} {name!r} would import and run code named by the config; "
            f"allow it with --allow-custom-code (or {CUSTOM_CODE_ENV}=1) if you trust this config"
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
