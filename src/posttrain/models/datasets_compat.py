"""Every place posttrain reaches into the datasets library's internals: a dataset's ``_fingerprint``.

Pinned to ``DATASETS_VERSIONS`` (pyproject's pin); ``tests/integration/test_compat.py`` fails when the installed
version leaves that range or when ``Dataset._fingerprint`` stops being the transform-tracking hash,
so lifting the pin means re-checking this file.

Why the private attribute: ``datasets`` computes a fingerprint for every dataset and updates it with
every transform (it names its cache files after it), but exposes no public accessor. posttrain uses
it as the data lineage id in cache keys and ``stage.json``, and sets it back on datasets reloaded
from disk so a reloaded split keeps the id it was prepared with. It lives in ``models/`` because
``models.artifacts`` reads it and every layer above may import from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DATASETS_VERSIONS", "dataset_fingerprint", "set_dataset_fingerprint"]

DATASETS_VERSIONS = ">=5,<6"
"""The datasets versions this module was checked against (pyproject's pin)."""


def dataset_fingerprint(dataset: Any) -> str | None:
    """The library's own fingerprint of ``dataset`` (None for objects that are not ``datasets`` datasets)."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    return str(fingerprint) if fingerprint else None


def set_dataset_fingerprint(dataset: Any, fingerprint: str) -> None:
    """Record ``fingerprint`` as ``dataset``'s own, e.g. the one a split was saved with."""
    dataset._fingerprint = fingerprint
