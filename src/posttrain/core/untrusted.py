"""Reading JSON that posttrain did not necessarily write: store records, digests, ``stage.json``,
reports, shared-store uploads, remembered checks.

A store can be copied, shared or damaged (a full disk, a kill, a hand edit, a planted file), so what
it holds is input like any other: every read is bounded in size and nesting depth, and whatever does
not parse as expected is an :class:`UntrustedContentError` naming the file. Callers turn that into
"recompute" (a cache miss), never a crash; :func:`note_unreadable` logs it once per file and reason,
so a damaged file does not flood a run's log.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from posttrain.core.errors import PosttrainError

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_DEPTH",
    "UntrustedContentError",
    "check_depth",
    "loads_bounded",
    "note_unreadable",
    "read_json_bounded",
    "read_jsonl_bounded",
]

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists accepted in a file posttrain reads back (its own are < 10)."""
DEFAULT_MAX_BYTES = 16 << 20


class UntrustedContentError(PosttrainError, ValueError):
    """A file read back from a store (or a report) that is missing, too large, too deep or malformed."""


def check_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of ``value`` (mappings and lists), or ValueError past ``limit``; iterative,
    so a hostile structure cannot exhaust the stack.

    >>> check_depth({"a": [1, {"b": 2}]})
    3
    >>> check_depth([[[[0]]]], limit=3)
    Traceback (most recent call last):
    ValueError: nested deeper than 3 levels
    """
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                raise ValueError(f"nested deeper than {limit} levels")
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads_bounded(text: str | bytes, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` with its depth checked; any failure an :class:`UntrustedContentError`.

    >>> loads_bounded("[" * 5000 + "]" * 5000, "x.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    posttrain.core.untrusted.UntrustedContentError: x.json: nested ...
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text)
        check_depth(value, max_depth)
    except RecursionError:
        raise UntrustedContentError(f"{where}: nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as exc:
        raise UntrustedContentError(f"{where}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise UntrustedContentError(f"{where}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:
        raise UntrustedContentError(f"{where}: {exc}") from None
    return value


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file, at most ``max_bytes`` (FileNotFoundError when there is none)."""
    try:
        if not path.is_file():
            if not path.exists():
                raise FileNotFoundError(2, "No such file", str(path))
            raise UntrustedContentError(f"{path}: not a regular file")
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UntrustedContentError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise UntrustedContentError(f"{path}: larger than {max_bytes} bytes")
    return data


def read_json_bounded(
    path: str | Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    expect: type | None = None,
) -> Any:
    """The JSON in ``path``: at most ``max_bytes``, ``max_depth`` deep, a regular file, of type
    ``expect`` when given. Raises :class:`UntrustedContentError` naming the file (FileNotFoundError
    for a missing one, so callers can tell "not there" from "damaged")."""
    path = Path(path)
    data = _read_bounded(path, max_bytes)
    value = loads_bounded(data, str(path), max_depth=max_depth)
    if expect is not None and not isinstance(value, expect):
        kind = {dict: "a JSON object", list: "a JSON list"}.get(expect, expect.__name__)
        raise UntrustedContentError(f"{path}: not {kind}")
    return value


def read_jsonl_bounded(
    path: str | Path, *, max_bytes: int = 256 << 20, max_depth: int = MAX_DEPTH
) -> list[Any]:
    """Every non-blank line of a JSON-lines file, parsed as :func:`read_json_bounded` parses a file
    (errors name ``file:line``)."""
    path = Path(path)
    data = _read_bounded(path, max_bytes)
    return [
        loads_bounded(line, f"{path}:{number}", max_depth=max_depth)
        for number, line in enumerate(data.splitlines(), start=1)
        if line.strip()
    ]


_NOTED: set[tuple[str, str]] = set()


def note_unreadable(problem: object, consequence: str = "recomputing") -> None:
    """Log ``problem`` (``file: what is wrong``) and what follows, once per process for each."""
    key = (str(problem), consequence)
    if key in _NOTED:
        return
    _NOTED.add(key)
    logger.warning("%s; %s", problem, consequence)
