"""Config hashes, JSON-safe records and package versions: what cache keys and run records are built from.

One place for each, so ``stage.json``, the cache keys and MLflow all say the same. File digests live
with the cache (:mod:`posttrain.cache.digests`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from pydantic import BaseModel

__all__ = ["VERSIONED_PACKAGES", "jsonable", "package_versions", "stable_hash"]

VERSIONED_PACKAGES = ("posttrain", "torch", "transformers", "trl", "peft", "accelerate", "datasets")


def stable_hash(value: BaseModel | dict | list | None) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace): equal configs hash equal everywhere.

    >>> stable_hash({"b": 1, "a": [1, 2]}) == stable_hash({"a": [1, 2], "b": 1})
    True
    """
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types; anything JSON cannot hold becomes its ``str``.

    >>> from pathlib import Path
    >>> jsonable({"path": Path("/tmp"), "n": (1, 2)})
    {'path': '/tmp', 'n': [1, 2]}
    """
    return json.loads(json.dumps(value, default=str))


def package_versions(
    packages: Sequence[str] = VERSIONED_PACKAGES, *, include_missing: bool = True
) -> dict[str, str]:
    """Installed version of each package; one that is absent is ``not installed``, or left out
    with ``include_missing=False`` (for pip requirements, which must name installed packages)."""
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if include_missing:
                versions[name] = "not installed"
    return versions
