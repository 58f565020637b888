"""Content hashes and JSON-safe records: what cache keys, fingerprints and run records are built from.

One place for each: a config hash, a streamed file hash, the JSON form of a record, and the package
versions stamped on every output, so ``stage.json``, the cache keys and MLflow all say the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

__all__ = [
    "VERSIONED_PACKAGES",
    "fingerprint_tree",
    "jsonable",
    "package_versions",
    "sha256_file",
    "stable_hash",
]

VERSIONED_PACKAGES = ("posttrain", "torch", "transformers", "trl", "peft", "accelerate", "datasets")


def stable_hash(value: BaseModel | dict | list | None) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace): equal configs hash equal everywhere.

    >>> stable_hash({"b": 1, "a": [1, 2]}) == stable_hash({"a": [1, 2], "b": 1})
    True
    """
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    """Streamed sha256 of a file (models are hundreds of MB)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint_tree(path: str | Path) -> str:
    """Content hash of every file under ``path`` (relative name, size, sha256; 16 hex characters).

    Skips hidden files and the ``cache-*.arrow`` files ``datasets`` adds next to a dataset loaded
    from disk when it is filtered or mapped: they are derived, not content.
    """
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or (
            rel.name.startswith("cache-") and rel.suffix == ".arrow"
        ):
            continue
        digest.update(f"{rel.as_posix()}\0{file.stat().st_size}\0".encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()[:16]


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types; anything JSON cannot hold becomes its ``str``.

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
