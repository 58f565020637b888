"""A shared cache of finished step outputs on any fsspec filesystem (a shared mount, an object store).

Training reads and writes local paths, so every worker keeps its own local store
(:class:`~posttrain.cache.store.Store`); ``orchestration.shared_store`` names a second level that
every worker reads and fills. A step whose key has no local record is looked up there first: its
output folder is downloaded into the local store (through :func:`~posttrain.core.atomic.staging_dir`,
so a half-finished download is never in place), the result it carries is re-pointed at the local
folder, and the planner then *adopts* it exactly as it adopts a local output without a record:
content fingerprint, inputs and path are checked, and an output that fails is recomputed. A step that
ran (or was cached only locally) is uploaded once finished.

Layout under the URL::

    outputs/<local name>.<hex>/     one complete upload of an output folder (a fresh name per upload)
    records/<key>.json              {"posttrain_shared": 1, "key", "kind", "output": "outputs/..."}

Everything read from the shared store is untrusted input: a record is bounded (size, depth) and
must name an upload under ``outputs/`` that lies inside the shared store's own prefix (on a mounted
filesystem: once symlinks are resolved, and an upload holding a symlink is refused); anything else
is a miss, logged once. The URL is only ever shown redacted (it may hold credentials).

The record is written last, as one small object (on a local or mounted filesystem: a temporary file
renamed into place), so it is the commit: a reader never sees an upload that has no record, and two
workers uploading the same key at once each upload a whole folder of their own; the last record
wins. Records are plain JSON read field by field; nothing read from the shared store is unpickled or
imported (see :mod:`posttrain.cache.records`).

Adapter-only stage outputs (``adapter_policy: adapter``) name their base model by a local path, so
they are not shared; merged and full outputs are.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from posttrain.cache.records import RecordError, read_output_result
from posttrain.core.atomic import RESULT_FILE, staging_dir, write_result
from posttrain.core.errors import PosttrainError
from posttrain.core.redact import redact_text
from posttrain.core.results import DataResult, EvalResult, ScoreResult, StageResult
from posttrain.core.untrusted import UntrustedContentError, loads_bounded, note_unreadable

logger = logging.getLogger(__name__)

__all__ = ["SHARED_VERSION", "SharedStore", "SharedStoreError", "open_shared", "relocate_result", "shareable"]

SHARED_VERSION = 1
_MAX_RECORD_BYTES = 1 << 20


class SharedStoreError(PosttrainError, RuntimeError):
    """The shared store's URL cannot be opened (unknown protocol, missing filesystem package)."""


def relocate_result(result: Any, output_dir: str | Path) -> Any:
    """``result`` with the path of its own output replaced by ``output_dir`` (resolved).

    >>> relocate_result(DataResult("/a/data/x", "t", "e"), "/b/data/x").data_dir
    '/b/data/x'
    """
    where = str(Path(output_dir).resolve())
    if isinstance(result, DataResult):
        return replace(result, data_dir=where)
    if isinstance(result, EvalResult):
        return replace(result, report_dir=where)
    if isinstance(result, StageResult | ScoreResult):
        return replace(result, output_dir=where)
    raise TypeError(f"not a step result: {type(result).__name__}")


def shareable(result: Any) -> bool:
    """Whether an output can be used from another store (an adapter names its base by local path)."""
    return not (isinstance(result, StageResult) and result.artifact == "adapter")


class SharedStore:
    """Finished step outputs under one fsspec URL (``file:///mnt/posttrain``, ``s3://bucket/posttrain``)."""

    def __init__(self, url: str) -> None:
        import fsspec  # deferred: only runs with a shared store import it

        self.url = redact_text(url)
        """The URL as shown in logs and errors: without its credentials."""
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise SharedStoreError(
                f"orchestration.shared_store {self.url!r}: {redact_text(str(exc))}"
            ) from None
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _record_path(self, key: str) -> str:
        return self._path("records", f"{key}.json")

    def record(self, key: str) -> dict[str, Any] | None:
        """The commit record of ``key``, or None when there is none or it is not ours."""
        path = self._record_path(key)
        try:
            if not self.fs.exists(path):
                return None
            if self.fs.size(path) > _MAX_RECORD_BYTES:
                raise UntrustedContentError(f"{path}: larger than {_MAX_RECORD_BYTES} bytes")
            record = loads_bounded(self.fs.cat_file(path), path, max_depth=4)
        except (OSError, UntrustedContentError) as exc:
            note_unreadable(f"shared record {redact_text(str(exc))}", "ignored")
            return None
        if not isinstance(record, dict) or record.get("posttrain_shared") != SHARED_VERSION:
            return None
        if record.get("key") != key or not self._confined(record.get("output")):
            note_unreadable(f"shared record {path}: names an upload outside {self.url}/outputs", "ignored")
            return None
        return record

    def _confined(self, output: Any) -> bool:
        """``output`` names one upload folder under ``outputs/`` of this shared store: no ``..``,
        and on a mounted filesystem no symlink, the folder or anything in it, leading elsewhere."""
        if not isinstance(output, str) or not output.startswith("outputs/"):
            return False
        parts = output.split("/")
        if len(parts) != 2 or parts[1] in ("", ".", ".."):
            return False
        if not self._local():
            return True
        folder = self._path(output)
        if os.path.islink(folder):
            return False
        for top, dirs, files in os.walk(folder):
            if any(os.path.islink(os.path.join(top, name)) for name in (*dirs, *files)):
                return False
        outputs = os.path.realpath(self._path("outputs"))
        return os.path.realpath(folder).startswith(outputs + os.sep)

    def _local(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return "file" in protocols or "local" in protocols

    def has(self, key: str) -> bool:
        return self.record(key) is not None

    def pull(self, kind: str, key: str, output_dir: str | Path) -> bool:
        """Download ``key``'s output into ``output_dir`` (absent locally), its result re-pointed there.

        Returns True when an output was put in place; the caller verifies it (the planner's
        adoption check) before using it. Nothing is written when the shared store has no such key.
        """
        record = self.record(key)
        if record is None or record.get("kind") != kind:
            return False
        source = self._path(record["output"])
        try:
            with staging_dir(output_dir) as tmp:
                self.fs.get(source + "/", str(tmp), recursive=True)
                result = read_output_result(kind, tmp)
                (tmp / RESULT_FILE).unlink()
                write_result(tmp, relocate_result(result, output_dir))
        except (OSError, RecordError, ValueError, TypeError) as exc:  # a miss, never a crash: recomputed
            note_unreadable(f"shared upload {record['output']} in {self.url}: {redact_text(str(exc))}")
            return False
        logger.info("pulled %s from the shared store %s", Path(output_dir).name, self.url)
        return True

    def push(
        self, kind: str, key: str, output_dir: str | Path, result: Any, *, replace: bool = False
    ) -> bool:
        """Upload a finished local output under ``key`` unless the shared store already has it.

        The folder goes to a fresh name, then the record that names it is written: see the module
        docstring. ``replace`` uploads even then (the step was recomputed, e.g. because the shared
        copy failed verification). Returns True when it uploaded.
        """
        if not shareable(result) or (not replace and self.has(key)):
            return False
        try:
            return self._upload(kind, key, Path(output_dir))
        except OSError as exc:  # the run itself succeeded; other workers will recompute this step
            logger.warning(
                "cannot push %s to the shared store %s: %s",
                Path(output_dir).name,
                self.url,
                redact_text(str(exc)),
            )
            return False

    def _upload(self, kind: str, key: str, local: Path) -> bool:
        name = f"{local.name}.{secrets.token_hex(4)}"
        target = self._path("outputs", name)
        self.fs.makedirs(self._path("outputs"), exist_ok=True)
        self.fs.put(str(local) + "/", target, recursive=True)
        record = {"posttrain_shared": SHARED_VERSION, "key": key, "kind": kind, "output": f"outputs/{name}"}
        self._write_record(key, record)
        logger.info("pushed %s to the shared store %s", local.name, self.url)
        return True

    def _write_record(self, key: str, record: dict[str, Any]) -> None:
        path = self._record_path(key)
        self.fs.makedirs(self._path("records"), exist_ok=True)
        data = json.dumps(record, indent=1, sort_keys=True).encode()
        if self._local():
            # A mounted filesystem: rename is atomic; an object store's single PUT already is.
            tmp = self._path("records", f".{key}.json.tmp-{secrets.token_hex(4)}")
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        else:
            self.fs.pipe_file(path, data)


def open_shared(url: str | None) -> SharedStore | None:
    """The shared store of ``orchestration.shared_store`` (None when unset)."""
    return SharedStore(url) if url else None
