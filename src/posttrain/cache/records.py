"""Cache records: one small JSON file per cache key under the store's ``results/``, never a pickle.

A record says which step produced which result under a key::

    {"posttrain_record": 1, "key": "<24 hex>", "step": "sft", "kind": "sft",
     "result": {...the step's result dataclass as JSON...}, "lineage": "...", "code": {...}}

Prefect's result store is not used for these on purpose: its records name their own serializer
(a record that says ``pickle`` is unpickled whatever the task was configured with) and its JSON
decoder imports any class a record names. A store may be copied or shared, and cache keys are
deterministic, so anyone who can write ``results/<key>`` could otherwise run code in the next run,
even in ``--dry-run``. Here a record is parsed with :func:`json.loads` and rebuilt field by field
into the result dataclass of its step's kind (:data:`RESULT_TYPES`), with its types checked; anything
else is an unreadable record, which is a cache miss.

Every output directory also carries its own result (``.result.json``, see
:mod:`posttrain.core.atomic`), read back with :func:`read_output_result` the same way: the planner
adopts a complete output whose record a kill prevented (after checking it like a cached one).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from posttrain.cache.store import Store
from posttrain.core.atomic import RESULT_FILE
from posttrain.core.errors import PosttrainError
from posttrain.core.results import DataResult, EvalResult, ScoreResult, StageResult
from posttrain.core.untrusted import UntrustedContentError, read_json_bounded

__all__ = [
    "RECORD_VERSION",
    "RESULT_TYPES",
    "RecordError",
    "StoreRecords",
    "decode_result",
    "encode_result",
    "path_outside",
    "read_output_result",
]

RECORD_VERSION = 1
RESULT_TYPES: dict[str, type] = {
    "data": DataResult,
    "eval": EvalResult,
    "sft": StageResult,
    "dpo": StageResult,
    "grpo": StageResult,
    "rft": StageResult,
    "score": ScoreResult,
}
"""The result dataclass each step kind returns (``Step.kind``)."""
_KEY = re.compile(r"^[0-9a-f]{24}$")
_MAX_RECORD_BYTES = 16 << 20  # results are small summaries; anything bigger is not ours


class RecordError(PosttrainError, ValueError):
    """A cache record that is missing, malformed or not a posttrain record (a cache miss)."""


def encode_result(kind: str, result: Any) -> dict[str, Any]:
    """The JSON form of a step's result (its dataclass fields)."""
    expected = RESULT_TYPES[kind]
    if not isinstance(result, expected):
        raise TypeError(f"a {kind} step returns {expected.__name__}, got {type(result).__name__}")
    return json.loads(json.dumps(asdict(result)))


def decode_result(kind: str, data: Any) -> Any:
    """Rebuild the result dataclass of step kind ``kind`` from its JSON form, checking every field."""
    if kind not in RESULT_TYPES:
        raise RecordError(f"unknown step kind {kind!r}")
    try:
        return TypeAdapter(RESULT_TYPES[kind]).validate_python(data, strict=False)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise RecordError(f"not a {kind} result: {where}: {err['msg']}") from None


def read_output_result(kind: str, directory: str | Path) -> Any:
    """The result an output directory carries (``.result.json``), rebuilt as ``kind``'s dataclass.

    Raises :class:`RecordError` when there is none or it does not parse as such a result.
    """
    path = Path(directory) / RESULT_FILE
    return decode_result(kind, _read_json(path, "result", f"no result in {directory}"))


def _read_json(path: Path, what: str, missing: str) -> Any:
    """``path`` parsed as JSON, bounded (:func:`~posttrain.core.untrusted.read_json_bounded`); any
    failure a :class:`RecordError` (``missing`` when there is no file, else naming the file)."""
    try:
        return read_json_bounded(path, max_bytes=_MAX_RECORD_BYTES)
    except FileNotFoundError:
        raise RecordError(missing) from None
    except UntrustedContentError as exc:
        raise RecordError(f"{exc}: not a JSON {what}") from None


def _paths_of(result: Any) -> list[Path]:
    """Every path a step result names: its output folder and what lies inside it (GRPO samples,
    extra evaluation sets' report folders)."""
    if isinstance(result, DataResult):
        return [Path(result.data_dir)]
    if isinstance(result, EvalResult):
        return [Path(result.report_dir), *(Path(result.report_dir, name) for name in result.sets)]
    if isinstance(result, StageResult):
        return [Path(result.output_dir), *(Path(result.output_dir, s) for s in result.samples)]
    if isinstance(result, ScoreResult):
        return [Path(result.output_dir)]
    return []


def path_outside(result: Any, root: str | Path) -> str | None:
    """The first path ``result`` names that does not lie inside ``root`` once resolved (symlinks
    followed, ``..`` collapsed), or None when all do.

    >>> path_outside(DataResult("/store/data/k", "t", "e"), "/store"), path_outside(DataResult("/etc", "t", "e"), "/store")
    (None, '/etc')
    """
    top = Path(root).resolve()
    for path in _paths_of(result):
        where = path.resolve()
        if not path.is_absolute() or not where.is_relative_to(top):
            return str(path)
    return None


class StoreRecords:
    """:class:`~posttrain.cache.planner.CacheRecords` as JSON files in ``<store>/results/``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.folder = store.results_dir

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise RecordError(f"{key!r} is not a cache key")
        return self.folder / key

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    @property
    def digests_path(self) -> Path:
        """The file digests remembered for checking outputs (:func:`~posttrain.cache.digests.remembered_digests`)."""
        return self.folder / "digests" / "files.json"

    def raw(self, key: str) -> dict[str, Any]:
        """The record under ``key`` as parsed JSON, checked to be a posttrain record for that key."""
        path = self.path(key)
        record = _read_json(path, "cache record", f"no cache record {path}")
        if not isinstance(record, dict) or record.get("posttrain_record") != RECORD_VERSION:
            raise RecordError(f"{path} is not a posttrain cache record (version {RECORD_VERSION})")
        if record.get("key") != key:
            raise RecordError(f"{path} holds the record of another key")
        return record

    def read(self, key: str, kind: str | None = None) -> Any:
        """The result under ``key``, rebuilt as its kind's dataclass; ``kind`` must match if given."""
        record = self.raw(key)
        if kind is not None and record.get("kind") != kind:
            raise RecordError(f"record {key} is a {record.get('kind')!r} result, not {kind!r}")
        return decode_result(str(record.get("kind")), record.get("result"))

    def write(
        self,
        key: str,
        *,
        step: str,
        kind: str,
        result: Any,
        lineage: str | None = None,
        code: Mapping[str, str] | None = None,
    ) -> Path:
        """Write the record atomically (a reader sees the old record or the new one, never half).

        With ``lineage`` (the key without the code, :class:`~posttrain.cache.keys.StepIdentity`)
        the record also becomes that lineage's latest, so a later key of the same lineage can tell
        what changed in ``code``.
        """
        path = self.path(key)
        record = {
            "posttrain_record": RECORD_VERSION,
            "key": key,
            "step": step,
            "kind": kind,
            "result": encode_result(kind, result),
            "lineage": lineage,
            "code": _plain(dict(code or {})),
        }
        _write_json(path, record)
        if lineage is not None:
            _write_json(self._lineage_path(lineage), {"posttrain_record": RECORD_VERSION, "key": key})
        return path

    def _lineage_path(self, lineage: str) -> Path:
        return self.path(lineage).parent / "lineage" / lineage

    def code_of_lineage(self, lineage: str) -> dict[str, str] | None:
        """The ``code`` of the latest record written for ``lineage``; None if there is none (or unreadable)."""
        try:
            pointer = read_json_bounded(self._lineage_path(lineage), max_bytes=4096, expect=dict)
            record = self.raw(str(pointer["key"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        code = record.get("code")
        if not isinstance(code, dict) or not all(isinstance(v, str) for v in code.values()):
            return None
        return {str(k): v for k, v in code.items()}


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return json.loads(json.dumps(value, default=str))
