"""``grpo.defaults``: keys every GRPO stage gets unless it sets them itself, and where a key was written.

A curriculum repeats most of a stage (rewards, LoRA, sampling, the in-training evaluation) in every
stage; ``grpo.defaults`` says it once. The merge is a plain mapping merge on the YAML as written,
before the stage is validated, so a merged stage is exactly the stage one would have written out
(same object, same cache key):

* the stage's own keys win;
* mappings of options (:data:`MERGED_KEY_BY_KEY`: ``trainer``, ``monitor``, ``data_filter``,
  ``launch``) merge key by key, so a stage sets only the options it changes;
* everything else is replaced whole: lists (``rewards``, ``tools``), and ``lora``, which is one
  choice of adapter (a stage's ``lora: null`` trains the full model whatever the default).

Because a stage is validated after the merge, an error in a default would surface under the stage
that inherited it; :func:`inherited_keys` and :func:`written_location` name the key where the user
wrote it (``grpo.defaults.trainer``) instead.

>>> merge_stage({"trainer": {"learning_rate": 1e-4, "max_steps": 8}, "rewards": [1]},
...             {"name": "b", "trainer": {"learning_rate": 5e-5}, "rewards": [2]})
{'trainer': {'learning_rate': 5e-05, 'max_steps': 8}, 'rewards': [2], 'name': 'b'}
>>> sorted(inherited_keys({"trainer": {"learning_rate": 1e-4, "max_steps": 8}, "lora": None},
...                       {"trainer": {"learning_rate": 5e-5}}))
['lora', 'trainer.max_steps']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MERGED_KEY_BY_KEY", "inherited_keys", "merge_stage", "written_location"]

MERGED_KEY_BY_KEY = ("trainer", "monitor", "data_filter", "launch")
"""Stage keys holding a mapping of options, merged key by key under the stage's own."""


def merge_stage(defaults: Mapping[str, Any], stage: Mapping[str, Any]) -> dict[str, Any]:
    """One stage as written, with the defaults under it."""
    merged = {**defaults, **stage}
    for key in MERGED_KEY_BY_KEY:
        if isinstance(defaults.get(key), Mapping) and isinstance(stage.get(key), Mapping):
            merged[key] = {**defaults[key], **stage[key]}
    return merged


def inherited_keys(defaults: Mapping[str, Any], stage: Mapping[str, Any]) -> frozenset[str]:
    """The dotted keys of a merged stage that came from the defaults (``rewards``, ``trainer.beta``)."""
    found: set[str] = set()
    for key, value in defaults.items():
        if key not in stage:
            found.add(key)
        elif key in MERGED_KEY_BY_KEY and isinstance(value, Mapping) and isinstance(stage[key], Mapping):
            found |= {f"{key}.{inner}" for inner in value if inner not in stage[key]}
    return frozenset(found)


def from_defaults(inherited: frozenset[str], path: Sequence[str]) -> bool:
    """True when the key at ``path`` (in a merged stage) is one the stage inherited."""
    return any(".".join(path[:n]) in inherited for n in (1, 2) if len(path) >= n)


# A trainer option's error names the option first (posttrain.core.trainer_options, library_policy):
# "option 'learning_rate' must be > 0", "unknown GRPOConfig option 'kl_coef'", "'seed' is managed".
_NAMED_OPTION = re.compile(r"^(?:unknown \w+ option |option )?'(\w+)")
# A stage-wide check names the key it is about first: "tools: unknown inline tool 'x'".
_NAMED_KEY = re.compile(r"^(\w+): ")


def written_location(loc: Sequence[str | int], message: str, raw: Any) -> tuple[str | int, ...]:
    """The location of a validation error as the user wrote it: an error in a key a GRPO stage took
    from ``grpo.defaults`` is located there (``grpo.stages.1.trainer`` -> ``grpo.defaults.trainer``).
    ``raw`` is the config mapping as written; other locations are returned as they are."""
    loc = tuple(loc)
    if len(loc) < 3 or loc[:2] != ("grpo", "stages") or not isinstance(loc[2], int):
        return loc
    grpo = raw.get("grpo") if isinstance(raw, Mapping) else None
    defaults = grpo.get("defaults") if isinstance(grpo, Mapping) else None
    stages = grpo.get("stages") if isinstance(grpo, Mapping) else None
    if not isinstance(defaults, Mapping) or not isinstance(stages, list) or loc[2] >= len(stages):
        return loc
    stage = stages[loc[2]] if isinstance(stages[loc[2]], Mapping) else {}
    path = [str(part) for part in loc[3:]]
    if not path and (key := _NAMED_KEY.match(message)):
        path = [key.group(1)]
    elif path == ["trainer"] and (option := _NAMED_OPTION.match(message)):
        path = ["trainer", option.group(1)]
    if path and from_defaults(inherited_keys(defaults, stage), path):
        return ("grpo", "defaults", *loc[3:])
    return loc
