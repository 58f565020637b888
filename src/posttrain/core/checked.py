"""Remembered passes of the config checks that import TRL or peft (seconds of CPU each).

Checking a stage's ``trainer:`` options builds the real TRL config class, and ``model.lora`` the
real ``peft.LoraConfig``: importing TRL and peft costs more CPU than everything else a fully cached
rerun does. A check that passed is remembered in ``$POSTTRAIN_CACHE/checked-options/`` (default
``~/.cache/posttrain/checked-options/``), one file per key: a digest of the check's name, the
options as canonical JSON, the installed versions of the libraries the check runs on and the source
of the module that defines it. A change to any of them checks again. Only passes are remembered (an
error is found anew each time).

The file holds the digest and what the check changed, never the options: the result of a check is
its options type-coerced (``"1e-4"`` becomes ``0.0001``), so only the coerced values are kept and the
result is rebuilt from the options the caller holds. Options with anything secret-looking in them
(:func:`posttrain.core.redact.redact` would change them) are never remembered, nor a result larger
than :data:`_MAX_ENTRY_BYTES`; files are private to the user (0600 in a 0700 folder), read bounded,
and anything malformed in one is a miss. ``POSTTRAIN_CHECK_MEMO=0`` turns remembering off.

Inside :func:`deferred_memos` (the CLI, around each command) passes are remembered only when
:func:`flush_memos` is called, once the whole input is known to be good: a command refused for bad
input writes nothing, not even this cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from posttrain.core.hashing import package_versions, stable_hash
from posttrain.core.redact import redact
from posttrain.core.untrusted import UntrustedContentError, read_json_bounded

__all__ = ["deferred_memos", "flush_memos", "memo_dir", "remembered_check"]

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
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()


def _key(name: str, options: Any, packages: Sequence[str], source: str) -> str | None:
    if not _plain(options):
        return None
    return stable_hash([name, options, _versions(tuple(packages)), _source_digest(source)])


_MEMO_VERSION = 2
_MAX_ENTRY_BYTES = 64 << 10


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same JSON types (``2`` and ``2.0`` differ: coercion changed them).

    >>> _same({"a": [1, 2.0]}, {"a": [1, 2.0]}), _same(2, 2.0)
    (True, False)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _entry(name: str, key: str, options: Any, result: Any) -> dict[str, Any] | None:
    """What is written for a pass: the digest and the values coercion changed (None: not remembered)."""
    if result is None:
        return {"posttrain_checked": _MEMO_VERSION, "name": name, "key": key, "result": "none"}
    if isinstance(options, dict) and isinstance(result, dict) and result.keys() == options.keys():
        changed = {k: v for k, v in result.items() if not _same(v, options[k])}
        if _plain(changed):
            return {"posttrain_checked": _MEMO_VERSION, "name": name, "key": key, "changed": changed}
    return None


def _rebuild(name: str, key: str, options: Any, saved: Any) -> tuple[bool, Any]:
    """(True, the remembered result) from a memo entry, or (False, None) for anything else."""
    if not isinstance(saved, dict) or saved.get("posttrain_checked") != _MEMO_VERSION:
        return False, None
    if saved.get("name") != name or saved.get("key") != key:
        return False, None
    if saved.get("result") == "none":
        return True, None
    changed = saved.get("changed")
    if isinstance(options, dict) and isinstance(changed, dict) and set(changed) <= set(options):
        return True, {**options, **changed}
    return False, None


def _read_entry(path: Path) -> Any:
    try:
        return read_json_bounded(path, max_bytes=_MAX_ENTRY_BYTES)
    except (OSError, UntrustedContentError):
        return None


_PENDING: contextvars.ContextVar[list[tuple[Path, dict[str, Any]]] | None] = contextvars.ContextVar(
    "posttrain_pending_memos", default=None
)


@contextlib.contextmanager
def deferred_memos() -> Iterator[None]:
    """Within the block, passes are kept in memory until :func:`flush_memos` (dropped at the end)."""
    token = _PENDING.set([])
    try:
        yield
    finally:
        _PENDING.reset(token)


def flush_memos() -> None:
    """Write the passes remembered so far in :func:`deferred_memos` (a no-op outside one)."""
    pending = _PENDING.get()
    while pending:
        _write_entry(*pending.pop(0), defer=False)


def _write_entry(path: Path, entry: dict[str, Any], *, defer: bool = True) -> None:
    pending = _PENDING.get()
    if defer and pending is not None:
        pending.append((path, entry))
        return
    data = json.dumps(entry).encode()
    if len(data) > _MAX_ENTRY_BYTES:
        return
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:  # a read-only home: checked every time, as before
        with contextlib.suppress(OSError):
            tmp.unlink()


def remembered_check(
    name: str, options: Any, check: Callable[[], T], *, packages: Sequence[str], source: str
) -> T:
    """``check()``, or the result it returned before for the same ``name``, ``options``, versions of
    ``packages`` and content of the module file ``source`` (module docstring)."""
    if (
        os.environ.get("POSTTRAIN_CHECK_MEMO", "1") == "0"
        or (key := _key(name, options, packages, source)) is None
        or redact(options) != options
    ):
        return check()
    path = memo_dir() / f"{key}.json"
    found, result = _rebuild(name, key, options, _read_entry(path))
    if found:
        return result
    result = check()
    entry = _entry(name, key, options, result)
    if entry is not None and redact(entry) == entry:
        _write_entry(path, entry)
    return result
