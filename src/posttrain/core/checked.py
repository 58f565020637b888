"""Remembered passes of the config checks that import TRL or peft (seconds of CPU each).

Checking a stage's ``trainer:`` options builds the real TRL config class, and ``model.lora`` the
real ``peft.LoraConfig``: importing TRL and peft costs more CPU than everything else a fully cached
rerun does. A check that passed is remembered in ``$POSTTRAIN_CACHE/checked-options/`` (default
``~/.cache/posttrain/checked-options/``), one file per key made of the check's name, the options as
canonical JSON, the installed versions of the libraries the check runs on and the source of the
module that defines it: a change to any of them checks again. Only passes are remembered (an
error is found anew each time), and only a result of plain JSON types that reads back identical, so
a remembered result is what the check returned. ``POSTTRAIN_CHECK_MEMO=0`` turns remembering off.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from posttrain.core.hashing import package_versions, sha256_file, stable_hash

__all__ = ["memo_dir", "remembered_check"]

T = TypeVar("T")
_PLAIN = (str, int, float, bool, type(None))


def memo_dir() -> Path:
    env = os.environ.get("POSTTRAIN_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "posttrain"
    return root / "checked-options"


def _plain(value: Any) -> bool:
    """Only JSON's own types (a tuple or an enum would not read back as itself).

    >>> _plain({"a": [1, 2.5, None, True]}), _plain({"a": (1, 2)})
    (True, False)
    """
    if isinstance(value, dict):
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN


_versions = functools.cache(package_versions)  # once per process: versions do not change under it


@functools.cache
def _source_digest(source: str) -> str:
    return sha256_file(Path(source))


def _key(name: str, options: Any, packages: Sequence[str], source: str) -> str | None:
    if not _plain(options):
        return None
    return stable_hash([name, options, _versions(tuple(packages)), _source_digest(source)])


def remembered_check(
    name: str, options: Any, check: Callable[[], T], *, packages: Sequence[str], source: str
) -> T:
    """``check()``, or the result it returned before for the same ``name``, ``options``, versions of
    ``packages`` and content of the module file ``source``."""
    if (
        os.environ.get("POSTTRAIN_CHECK_MEMO", "1") == "0"
        or (key := _key(name, options, packages, source)) is None
    ):
        return check()
    path = memo_dir() / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
        if saved["name"] == name and saved["options"] == options and _plain(saved["result"]):
            return saved["result"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = check()
    if _plain(result):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
            tmp.write_text(json.dumps({"name": name, "options": options, "result": result}))
            os.replace(tmp, path)
        except OSError:  # a read-only home: checked every time, as before
            pass
    return result
