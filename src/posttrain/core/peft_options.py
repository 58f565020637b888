"""peft's ``LoraConfig`` passed through from ``model.lora``, checked against the real class.

``model.lora`` keeps posttrain's short names for the four settings every config sets (``r``,
``alpha``, ``dropout``, ``target_modules``; peft's ``lora_alpha`` / ``lora_dropout`` are accepted
too) and passes every other key to ``peft.LoraConfig`` unchanged: ``use_rslora``, ``use_dora``,
``modules_to_save``, ``init_lora_weights``, ``layers_to_transform``, ``rank_pattern``, ... Like the
``trainer:`` options (:mod:`posttrain.core.trainer_options`), they are checked at load time: unknown
keys with suggestions, value types from peft's own annotations, keys posttrain manages itself, and
peft's own ``__post_init__`` checks, by building the real ``LoraConfig``.
"""

from __future__ import annotations

import difflib
import typing
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from posttrain.core.checked import remembered_check
from posttrain.core.errors import refused_option
from posttrain.core.library_policy import MANAGED_LORA_KEYS, check_lora_options

__all__ = [
    "LORA_ALIASES",
    "POSTTRAIN_LORA_KEYS",
    "build_lora_config",
    "check_lora_config",
    "validate_lora_options",
]

POSTTRAIN_LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "target_modules",
}
"""posttrain's name of each setting it declares itself → peft's name."""
LORA_ALIASES = {"lora_alpha": "alpha", "lora_dropout": "dropout"}
"""peft's names accepted for posttrain's short ones."""


@cache
def _lora_field_types() -> dict[str, Any]:
    from peft import LoraConfig  # heavy: deferred until needed

    return typing.get_type_hints(LoraConfig)


# What a check's outcome depends on besides the options and this module (see core/checked.py).
_CHECK_PACKAGES = ("peft", "transformers", "torch", "pydantic")


def validate_lora_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check peft-only ``options`` (not posttrain's four keys) against ``LoraConfig``; return them
    coerced. A pass is remembered (:mod:`posttrain.core.checked`); what the options may make peft
    do (:mod:`posttrain.core.library_policy`) is decided first, every time."""
    check_lora_options(options)
    return remembered_check(
        "lora.options",
        options,
        lambda: _validate_lora_options(options),
        packages=_CHECK_PACKAGES,
        source=__file__,
    )


def check_lora_config(options: dict[str, Any]) -> None:
    """:func:`build_lora_config` succeeds on ``options`` (a pass is remembered, as above)."""

    def check() -> None:
        build_lora_config(options)

    remembered_check("lora.config", options, check, packages=_CHECK_PACKAGES, source=__file__)


def _validate_lora_options(options: dict[str, Any]) -> dict[str, Any]:
    types = _lora_field_types()
    coerced: dict[str, Any] = {}
    for key, value in options.items():
        if key not in types:
            known = [*POSTTRAIN_LORA_KEYS, *(k for k in types if k not in MANAGED_LORA_KEYS)]
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise ValueError(f"unknown LoraConfig option '{key}'{hint}")
        try:
            coerced[key] = TypeAdapter(types[key]).validate_python(value)
        except ValidationError as exc:
            raise refused_option(key, exc.errors()[0]["msg"], value) from None
    return coerced


def build_lora_config(options: dict[str, Any]) -> Any:
    """The real ``peft.LoraConfig`` for causal LMs from peft-named ``options``; peft's own errors as ValueError."""
    from peft import LoraConfig  # heavy: deferred until needed

    try:
        return LoraConfig(task_type="CAUSAL_LM", **options)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"LoraConfig rejects these options: {exc}") from None
