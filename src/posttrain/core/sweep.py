"""Sweep points: the cartesian product of ``--set KEY=V1,V2`` overrides, and seeds as an axis.

A comma at the top level of a value separates sweep values; commas inside ``[...]`` or ``{...}``
(YAML flow lists and mappings) do not, so ``--set x=[1,2]`` stays one value. ``--seeds 0,1,2`` is
``--set seed=0,1,2``; the runs of one config that differ only in ``seed`` share a
:func:`seed_group`, which tracking stamps on each run so they are compared as one measurement.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from posttrain.core.config import cache_form
from posttrain.core.errors import ConfigError
from posttrain.core.hashing import stable_hash
from posttrain.core.redact import redact_override

__all__ = ["parse_seeds", "point_labels", "seed_group", "split_values", "sweep_points"]


def split_values(value: str) -> list[str]:
    """Split ``value`` at commas outside brackets and braces.

    >>> split_values("1e-3,1e-4")
    ['1e-3', '1e-4']
    >>> split_values("[1,2],{a: 1, b: 2}")
    ['[1,2]', '{a: 1, b: 2}']
    """
    parts, depth, start = [], 0, 0
    for i, char in enumerate(value):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return [p.strip() for p in parts]


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """One override list per point: every combination of the swept keys' values, in order, with
    the single-valued overrides in each.

    >>> sweep_points(["seed=0,1", "sft.trainer.learning_rate=1e-3,1e-4", "x=[1,2]"])[1]
    ['seed=0', 'sft.trainer.learning_rate=1e-4', 'x=[1,2]']
    >>> len(sweep_points(["seed=0,1", "sft.trainer.learning_rate=1e-3,1e-4"]))
    4
    """
    choices = []
    for override in overrides:
        key, sep, value = override.partition("=")
        values = split_values(value) if sep else [value]
        if sep and any(v == "" for v in values):
            raise ConfigError(f"--set {override}: an empty sweep value")
        choices.append([f"{key}={v}" for v in values] if sep else [override])
    return [list(point) for point in itertools.product(*choices)]


def point_labels(points: Sequence[Sequence[str]], overrides: Sequence[str]) -> list[str]:
    """Each point's name: what it sets that not every point sets, secrets redacted, since it names
    the point's Prefect task run and MLflow run.

    >>> points = sweep_points(["seed=0,1", "x.api_key=k1,k2", "eval.limit=8"])
    >>> point_labels(points, ["seed=0,1", "x.api_key=k1,k2", "eval.limit=8"])[:2]
    ['seed=0 x.api_key=***', 'seed=0 x.api_key=***']
    """
    return [" ".join(redact_override(p) for p in point if p not in overrides) for point in points]


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` as distinct integers, in order.

    >>> parse_seeds("0, 1,2")
    [0, 1, 2]
    """
    try:
        seeds = [int(part) for part in split_values(text)]
    except ValueError:
        raise ConfigError(f"--seeds {text}: give integers separated by commas, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text}: a seed is repeated")
    return seeds


def seed_group(config: BaseModel | Mapping[str, Any]) -> str:
    """The same for configs that differ only in their top-level ``seed`` (12 hex characters).

    >>> seed_group({"name": "x", "seed": 0}) == seed_group({"name": "x", "seed": 3})
    True
    >>> seed_group({"name": "x", "seed": 0}) == seed_group({"name": "y", "seed": 0})
    False
    """
    data = cache_form(config) if isinstance(config, BaseModel) else dict(config)
    data.pop("seed", None)
    return stable_hash(data)[:12]
